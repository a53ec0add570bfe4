"""A real S3-compatible server for tests and benchmarks: moto's, on 127.0.0.1, in a subprocess.

``running_s3_server()`` starts ``python -m moto.server`` on a port the operating system picks,
waits for the line in which the server announces its address (no polling, no sleeps), and
stops the process at the end. ``tests/conftest.py`` wraps it in the ``s3`` fixture;
``benchmarks/bench_remote.py`` uses it directly. ``running_s3_server_with_user`` starts one
that enforces IAM, with a bucket of objects and a user allowed only some actions.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["S3Server", "running_s3_server", "running_s3_server_with_user"]

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


@contextlib.contextmanager
def running_s3_server_with_user(
    bucket: str, objects: Mapping[str, bytes], allowed_actions: Sequence[str]
) -> Iterator[tuple[S3Server, dict[str, Any]]]:
    """Starts moto's S3 server that enforces IAM once ``bucket`` holds ``objects`` and a user
    allowed only ``allowed_actions`` (e.g. ``"s3:Get*"``) exists; yields the server and that
    user's storage options. (moto authorises HeadObject as ``s3:HeadObject``, where AWS asks
    for ``s3:GetObject``.)"""
    import botocore.session  # optional dependency

    # moto lets this many requests through unauthenticated: the bucket, its objects, the
    # user, its policy and its access key.
    unauthenticated = 4 + len(objects)
    with running_s3_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": str(unauthenticated)}) as server:
        session = botocore.session.get_session()
        root = {
            "endpoint_url": server.endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "eu-west-1",
        }
        s3 = session.create_client("s3", **root)
        s3.create_bucket(
            Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"}
        )
        for key, body in objects.items():
            s3.put_object(Bucket=bucket, Key=key, Body=body)
        iam = session.create_client("iam", **root)
        iam.create_user(UserName="limited")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": list(allowed_actions), "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="limited", PolicyName="limited", PolicyDocument=json.dumps(policy)
        )
        access = iam.create_access_key(UserName="limited")["AccessKey"]
        yield (
            server,
            server.storage_options(key=access["AccessKeyId"], secret=access["SecretAccessKey"]),
        )

"""Object storage (issue 23), against moto's S3 server on 127.0.0.1 started for the run.

Needs moto[server] and s3fs (``nox -s bench`` installs them); skipped without them. The
server runs in a subprocess (``tests/s3_server.py``) from the first workload that needs it
until the end of the run. Loopback S3 measures what the client side costs (requests, copies,
parsing, overlap of transfer with work), not a network.

* ``tfrecord_s3_full_pass``: ``TFRecordIterDataset`` over 4 files of 16 MiB in the bucket,
  both CRCs checked; elements are bytes (so elements/s is bytes/s). Baseline: a plain GET of
  the same objects (``cat_file``, one request each) — target: grain_core >= 0.8x.
* ``checkpoint_s3_save`` / ``checkpoint_s3_restore``: ``CheckpointHandler`` save / restore of a
  ``DataLoader`` iterator's state (2 workers) into the bucket; one element = one save or
  restore, so the median seconds column is the time of one — target: < 100 ms each.
  Baseline: the same on local disk.

Other format modules add their remote workloads with :func:`bucket` and :func:`upload`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _harness import workload

if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
    raise ImportError("bench_remote needs moto[server] and s3fs (nox -s bench installs them)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3_server import S3Server, running_s3_server  # noqa: E402

import grain_core as grain  # noqa: E402
from grain_core import storage  # noqa: E402
from grain_core.checkpoint import CheckpointHandler  # noqa: E402

TFRECORD_FILES = 4
TFRECORD_FILE_BYTES = 16 << 20
RECORD_BYTES = 1024
_HAVE_TFRECORD = importlib.util.find_spec("grain_tfrecord") is not None


@functools.cache
def server() -> S3Server:
    """moto's S3 server, started on first use and stopped when the run ends."""
    stack = contextlib.ExitStack()
    atexit.register(stack.close)
    return stack.enter_context(running_s3_server())


def bucket() -> tuple[str, dict[str, Any]]:
    """A fresh bucket: its URL (``s3://<name>``) and the storage options reaching it."""
    return server().make_bucket(), server().storage_options()


def upload(url: str, data: bytes) -> None:
    """Puts ``data`` at ``url`` on the benchmark server."""
    storage.write_bytes(url, data, server().storage_options())


@functools.cache
def _tfrecord_files() -> tuple[list[str], dict[str, Any]]:
    from grain_tfrecord import TFRecordWriter

    url, options = bucket()
    rng = np.random.default_rng(0)
    per_file = TFRECORD_FILE_BYTES // (RECORD_BYTES + 16)
    paths = []
    for k in range(TFRECORD_FILES):
        path = f"{url}/tfrecord/train-{k:05d}-of-{TFRECORD_FILES:05d}.tfrecord"
        payload = rng.bytes(per_file * RECORD_BYTES)
        with TFRecordWriter(path, storage_options=options) as writer:
            for i in range(per_file):
                writer.write(payload[i * RECORD_BYTES : (i + 1) * RECORD_BYTES])
        paths.append(path)
    return paths, options


def _tfrecord_bytes() -> int:
    per_file = TFRECORD_FILE_BYTES // (RECORD_BYTES + 16)
    return TFRECORD_FILES * per_file * (RECORD_BYTES + 16)


if _HAVE_TFRECORD:

    @workload(
        "tfrecord_s3_full_pass",
        elements=_tfrecord_bytes(),
        description="TFRecordIterDataset over 4 x 16 MiB objects on loopback S3 (elements = bytes)",
        alternate=True,
    )
    def tfrecord_s3_full_pass() -> Callable[[], object]:
        from grain_tfrecord import TFRecordIterDataset

        paths, options = _tfrecord_files()
        ds = TFRecordIterDataset(paths, storage_options=options)
        return lambda: sum(1 for _ in ds)

    @tfrecord_s3_full_pass.baseline("plain GET")
    def _() -> Callable[[], object]:
        paths, options = _tfrecord_files()
        fs, _ = storage.filesystem(paths[0], options)
        return lambda: sum(len(fs.cat_file(storage.filesystem(p, options)[1])) for p in paths)


def _loader_iterator() -> Any:
    loader = grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 1_000_000, 1),
        sampler=grain.samplers.IndexSampler(1_000_000, shuffle=True, seed=0, num_epochs=1),
        operations=[grain.transforms.Batch(32)],
        worker_count=2,
    )
    iterator = iter(loader)
    for _ in range(10):
        next(iterator)
    return iterator


class _CheckpointPass:
    """One save (or restore) of a DataLoader iterator's checkpoint per call."""

    def __init__(self, directory: str, restore: bool) -> None:
        self._directory = directory
        self._iterator = _loader_iterator()
        self._handler = CheckpointHandler()
        self._handler.save(directory, self._iterator)
        self._restore = restore

    def __call__(self) -> None:
        if self._restore:
            self._handler.restore(self._directory, self._iterator)
        else:
            self._handler.save(self._directory, self._iterator)

    def close(self) -> None:
        self._iterator.close()


def _local_directory() -> str:
    directory = tempfile.mkdtemp(prefix="grain_core-bench-ckpt-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _s3_directory() -> str:
    url, options = bucket()
    # Code that checkpoints names a URL only; the endpoint comes from fsspec's configuration.
    import fsspec  # optional dependency

    fsspec.config.conf["s3"] = options
    return f"{url}/ckpt/step_10"


for _restore in (False, True):
    _name = "checkpoint_s3_restore" if _restore else "checkpoint_s3_save"

    @workload(
        _name,
        elements=1,
        description=f"CheckpointHandler {'restore' if _restore else 'save'} of a 2-worker "
        "DataLoader state on loopback S3 (median s = one operation)",
        alternate=True,
    )
    def _s3(restore: bool = _restore) -> Callable[[], object]:
        return _CheckpointPass(_s3_directory(), restore)

    @_s3.baseline("local disk")
    def _local(restore: bool = _restore) -> Callable[[], object]:
        return _CheckpointPass(_local_directory(), restore)

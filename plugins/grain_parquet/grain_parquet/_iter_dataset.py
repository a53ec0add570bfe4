"""``ParquetIterDataset``: streams the rows (or column batches) of Parquet files.

Row groups are decoded in Arrow record batches (``ParquetFile.iter_batches``) and every column
of a record batch is converted to NumPy once; row dicts are then built lazily from those arrays
by C-level ``map``/``zip``, so the per-row cost is one ``dict`` and nothing touches Arrow per
row. The column-batch mode skips the dicts altogether and hands out array slices.

The position is ``(row_group, index_within_row_group)`` of the next row to produce; restoring
it re-reads that row group from the record batch that holds the row.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from grain_core import DatasetIterator, IterDataset
from grain_core.experimental import ElementBlock, InterleaveIterDataset
from grain_parquet._files import (
    TRANSFER_ERRORS,
    FooterCache,
    ParquetPath,
    PathLike,
    check_columns,
    check_same_schema,
    column_to_numpy,
    concatenate_column,
    iter_rows,
    open_parquet,
    project_schema,
    read_error,
    resolve_paths,
)
from grain_parquet._prefetch import DEFAULT_PREFETCH_BYTES, RowGroupPrefetcher

__all__ = ["ParquetIterDataset"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return value


class ParquetIterDataset(IterDataset[dict[str, Any]]):
    """Streams the rows of one or more Parquet files as dicts ``{column: value}``.

    Values are NumPy scalars (numbers), Python objects (strings, bytes, structs) or arrays
    (fixed-size lists, as read-only rows of a 2-D array; variable-length lists). With
    ``column_batch_size`` the elements are instead dicts of NumPy arrays holding that many
    consecutive rows (the last batch may be shorter), zero-copy where Arrow allows; with
    several files each batch holds rows of one file.

    One file is read row group by row group; its state is
    ``{"row_group", "index_within_row_group"}``. Several files are read by an
    ``InterleaveIterDataset`` over one dataset per file (``cycle_length`` files at a time),
    whose state is the interleave state. For ``mp_prefetch`` (and sharding with
    :meth:`with_slice`) several files are split by file, one file by row group.

    Args:
      path: A path or URI, or a sequence of them.
      columns: Columns to read (in this order); None reads all. Other columns are not read
        from storage.
      column_batch_size: Yield column batches of this many rows instead of rows.
      read_batch_size: Rows decoded per Arrow record batch; bounds the memory of one
        iterator to about that many decoded rows.
      cycle_length: Files read at the same time, for several files.
      prefetch_bytes: For a remote file (any ``filesystem`` but the local disk), the bytes of
        row groups fetched ahead of decoding, several ranged reads at once; per open file
        (``cycle_length`` files are open at a time). 0 fetches each row group when reached.
      filesystem: A ``pyarrow.fs.FileSystem`` or fsspec filesystem the paths are on.
      storage_options: For URLs (``s3://``, ``gs://``, ...), passed to the fsspec file system
        (credentials, endpoint, retries), as for every reader; see ``docs/storage.md``.
      **read_kwargs: Passed to ``pyarrow.parquet.ParquetFile`` (``memory_map=True``,
        ``pre_buffer=True``, ``buffer_size``, ...). Page checksums are verified where the
        file has them unless ``page_checksum_verification=False``.

    Raises:
      FileNotFoundError: If the first file does not exist (later files: when opened).
      ValueError: If the first file is not Parquet, a column does not exist (the message lists
        the available ones) or an argument is out of range. A later file with another schema
        raises ``ValueError`` naming it and the field when iteration reaches it.
    """

    def __init__(
        self,
        path: PathLike | Sequence[PathLike],
        columns: Sequence[str] | None = None,
        *,
        column_batch_size: int | None = None,
        read_batch_size: int = 65_536,
        cycle_length: int = 16,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        filesystem: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        **read_kwargs: Any,
    ) -> None:
        super().__init__()
        self._files = resolve_paths(
            path, filesystem, what="ParquetIterDataset", storage_options=storage_options
        )
        self._columns = check_columns(columns)
        self._column_batch_size = (
            None if column_batch_size is None else _positive("column_batch_size", column_batch_size)
        )
        self._read_batch_size = _positive("read_batch_size", read_batch_size)
        self._cycle_length = _positive("cycle_length", cycle_length)
        if isinstance(prefetch_bytes, bool) or not isinstance(prefetch_bytes, int):
            raise ValueError(f"prefetch_bytes must be a non-negative int, got {prefetch_bytes!r}.")
        if prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes must be a non-negative int, got {prefetch_bytes!r}.")
        self._prefetch_bytes = prefetch_bytes
        self._read_kwargs = dict(read_kwargs)
        self._schema_file = self._files[0]
        self._footers = FooterCache()
        metadata, schema = self._footer(self._schema_file)
        self._schema = project_schema(schema, self._columns, self._schema_file)
        # Row groups read from a single file (all of them unless sliced for a worker), and
        # how many the file had then: a file rewritten since is refused, not read in part.
        self._num_row_groups = metadata.num_row_groups
        self._row_groups: tuple[int, ...] | None = (
            tuple(range(metadata.num_row_groups)) if len(self._files) == 1 else None
        )

    def _footer(self, file: ParquetPath) -> tuple[pq.FileMetaData, pa.Schema]:
        """The footer and the Arrow schema of ``file`` (whose row groups will be fetched
        ahead: from the footer cache; otherwise read by opening the file)."""
        if self._fetches_ahead(file):
            metadata = self._footers.footer(file, self._read_kwargs)[0]
            return metadata, metadata.schema.to_arrow_schema()
        with open_parquet(file, self._read_kwargs) as handle:
            return handle.metadata, handle.schema_arrow

    def _fetches_ahead(self, file: ParquetPath) -> bool:
        """Whether ``file``'s row groups are fetched ahead (remote, with a byte budget)."""
        return file.is_remote and self._prefetch_bytes > 0

    @property
    def paths(self) -> tuple[str, ...]:
        """The files, as given."""
        return tuple(f.display for f in self._files)

    @property
    def columns(self) -> tuple[str, ...]:
        """The names of the columns produced, in order."""
        return tuple(self._schema.names)

    @property
    def schema(self) -> pa.Schema:
        """The Arrow schema of the columns produced."""
        return self._schema

    def with_slice(self, sl: slice) -> ParquetIterDataset:
        """Returns the dataset reading the share ``sl`` of this one; ``self`` is unchanged.

        Several files are sliced by file (``files[sl]``), one file by row group, so
        ``ds.with_slice(slice(i, None, n))`` for ``i < n`` split the rows between ``n``
        workers or hosts without overlap.
        """
        clone = copy.copy(self)
        clone.set_slice(sl)
        return clone

    def set_slice(self, sl: slice) -> None:
        """Slices this dataset in place (Grain's API; prefer :meth:`with_slice`)."""
        if self._row_groups is not None:
            self._row_groups = self._row_groups[sl]
        else:
            self._files = self._files[sl]

    def _file_dataset(self, file: ParquetPath) -> ParquetIterDataset:
        clone = copy.copy(self)
        clone._files = (file,)
        clone._row_groups = None
        return clone

    def __iter__(self) -> DatasetIterator[dict[str, Any]]:
        if len(self._files) == 1:
            return _ParquetFileIterator(self)
        # The per-file iterators decode on the consumer thread: a read-ahead thread per file
        # would cost a hand-off per row, more than decoding the row's share of a batch.
        datasets = [self._file_dataset(f) for f in self._files]
        return iter(
            InterleaveIterDataset(datasets, cycle_length=self._cycle_length, iter_buffer_size=0)
        )

    def __repr__(self) -> str:
        files = self.paths[0] if len(self._files) == 1 else f"{len(self._files)} files"
        return (
            f"ParquetIterDataset({files}, columns={list(self.columns)}, "
            f"column_batch_size={self._column_batch_size})"
        )


class _ParquetFileIterator(DatasetIterator[dict[str, Any]]):
    """Reads one file; state ``{"row_group", "index_within_row_group"}`` of the next row.

    ``_pos`` indexes the row groups read, ``_batch_start`` is the row (within its row group)
    where the current record batch starts and ``_offset`` the rows of that batch handed to
    ``_rows`` (row mode, lazily built: ``length_hint(_unbuilt)`` of them are still to come)
    or already returned in column batches.
    """

    def __init__(self, ds: ParquetIterDataset) -> None:
        super().__init__()
        self._file = ds._files[0]
        self._pf: pq.ParquetFile | None = None
        # Row groups fetched ahead come from the prefetcher: the file is not opened, and its
        # footer is read once per dataset (see FooterCache).
        footer = (
            ds._footers.footer(self._file, ds._read_kwargs)
            if ds._fetches_ahead(self._file)
            else None
        )
        if footer is not None:
            metadata = footer[0]
            schema = metadata.schema.to_arrow_schema()
        else:
            pf = open_parquet(self._file, ds._read_kwargs)
            self._pf = pf
            metadata, schema = pf.metadata, pf.schema_arrow
        if self._file != ds._schema_file:
            check_same_schema(ds._schema, ds._schema_file, schema, self._file, ds._columns)
        self._num_row_groups = metadata.num_row_groups
        if ds._row_groups is not None and ds._num_row_groups != self._num_row_groups:
            raise ValueError(
                f"Parquet file {self._file.display} has {self._num_row_groups} row groups, "
                f"where it had {ds._num_row_groups} when this dataset was made: the file was "
                "rewritten. Make the dataset again to read the new file."
            )
        self._row_groups = (
            ds._row_groups if ds._row_groups is not None else tuple(range(self._num_row_groups))
        )
        self._index_of = {g: k for k, g in enumerate(self._row_groups)}
        sizes = [metadata.row_group(g).num_rows for g in self._row_groups]
        self._sizes = sizes
        self._starts = [0, *itertools.accumulate(sizes)]  # rows before each row group read
        self._names = ds._schema.names
        self._columns = None if ds._columns is None else list(ds._columns)
        self._column_batch_size = ds._column_batch_size
        self._read_batch_size = ds._read_batch_size
        self._read_kwargs = ds._read_kwargs
        self._prefetcher = (
            RowGroupPrefetcher(
                self._file,
                metadata,
                self._row_groups,
                self._columns,
                ds._prefetch_bytes,
                self._read_kwargs,
                footer[1],
            )
            if footer is not None
            else None
        )
        self._reading = 0  # the position (into _row_groups) of the row group being decoded
        self._stream: Iterator[tuple[int, int, list[np.ndarray]]] | None = None
        self._seek(0, 0)

    # ------------------------------------------------------------------ reading
    def _seek(self, pos: int, index: int) -> None:
        if self._stream is not None:
            self._stream.close()  # type: ignore[attr-defined]
        self._stream = None
        self._pos = pos
        self._batch_start = index
        self._offset = 0
        self._batch_len = 0
        self._cols: list[np.ndarray] = []
        self._rows: Iterator[dict[str, Any]] = iter(())
        self._unbuilt: Iterator[Any] = iter(())

    def _record_batches(self, pos: int, skip: int) -> Iterator[tuple[int, int, list[np.ndarray]]]:
        """Yields ``(pos, first row, columns)`` per record batch from row ``skip`` of ``pos``."""
        for p in range(pos, len(self._row_groups)):
            self._reading = p
            start = 0
            handle = self._pf or self._prefetcher.parquet_file(p)  # type: ignore[union-attr]
            batches = handle.iter_batches(
                batch_size=self._read_batch_size,
                row_groups=[self._row_groups[p]],
                columns=self._columns,
            )
            for batch in batches:
                n = batch.num_rows
                if start + n <= skip:  # before the restored position: decoded, not converted
                    start += n
                    continue
                if start < skip:
                    batch = batch.slice(skip - start)
                    start = skip
                yield p, start, [column_to_numpy(c) for c in batch.columns]
                start += batch.num_rows
            skip = 0

    def _advance(self) -> bool:
        """Loads the next record batch; False at the end of the file."""
        if self._stream is None:
            self._stream = self._record_batches(self._pos, self._batch_start)
        try:
            item = next(self._stream, None)
        except TRANSFER_ERRORS:
            raise
        except (pa.ArrowException, OSError) as err:
            row_group = self._row_groups[self._reading]
            raise read_error(self._file, row_group, err, self._read_kwargs, self._columns) from err
        if item is None:
            self._pos, self._batch_start = len(self._row_groups), 0
            self._offset = self._batch_len = 0
            return False
        self._pos, self._batch_start, self._cols = item
        self._batch_len = len(self._cols[0])
        self._offset = 0
        return True

    def __next__(self) -> dict[str, Any]:
        row = next(self._rows, None)
        if row is not None:
            return row
        self._check_open()
        if self._column_batch_size is not None:
            return self._next_column_batch(self._column_batch_size)
        while self._offset >= self._batch_len:
            if not self._advance():
                raise StopIteration
        self._rows, self._unbuilt = iter_rows(self._names, self._cols)
        self._offset = self._batch_len
        return next(self._rows)

    def next_block(self, max_size: int) -> ElementBlock[dict[str, Any]]:
        """Takes up to ``max_size`` next rows of the current record batch, or the next column
        batch (see ``grain_core.experimental.SupportsNextBlock``).

        Raises:
          OSError: If the file cannot be read, naming it and the row group.
        """
        if self._column_batch_size is not None or not operator.length_hint(self._unbuilt):
            before = self.get_state()
            first = next(self, None)  # rows and column batches are dicts, never None
            if first is None:
                return ElementBlock([], lambda _: before)
            if self._column_batch_size is not None:
                after = self.get_state()
                return ElementBlock([first], lambda k: after if k else before)
            pos = self._pos
            index = self._batch_start + self._offset - operator.length_hint(self._unbuilt) - 1
            rows = [first, *itertools.islice(self._rows, max_size - 1)]
        else:
            pos, index = self._position()
            rows = list(itertools.islice(self._rows, max_size))
        return ElementBlock(rows, lambda k: self._state_at(pos, index + k))

    def _next_column_batch(self, size: int) -> dict[str, Any]:
        pieces: list[list[np.ndarray]] = []
        needed = size
        while needed:
            if self._offset >= self._batch_len and not self._advance():
                break
            start = self._offset
            stop = min(start + needed, self._batch_len)
            if stop > start:
                pieces.append([c[start:stop] for c in self._cols])
                needed -= stop - start
                self._offset = stop
        if not pieces:
            raise StopIteration
        if len(pieces) == 1:
            columns = pieces[0]
        else:  # the batch spans record batches or row groups: one copy, here only
            columns = [concatenate_column(parts) for parts in zip(*pieces, strict=True)]
        return dict(zip(self._names, columns, strict=True))

    # -------------------------------------------------------------------- state
    def _position(self) -> tuple[int, int]:
        """``(pos, row)`` of the next row to produce, moved past finished row groups."""
        return self._moved_past_finished(
            self._pos, self._batch_start + self._offset - operator.length_hint(self._unbuilt)
        )

    def _moved_past_finished(self, pos: int, index: int) -> tuple[int, int]:
        while pos < len(self._sizes) and index >= self._sizes[pos]:
            pos += 1
            index = 0
        return pos, index

    def _state_at(self, pos: int, index: int) -> dict[str, Any]:
        """The state of the row ``index`` of the ``pos``-th row group read."""
        pos, index = self._moved_past_finished(pos, index)
        row_group = self._row_groups[pos] if pos < len(self._row_groups) else self._num_row_groups
        return {"row_group": row_group, "index_within_row_group": index}

    def get_state(self) -> dict[str, Any]:
        return self._state_at(*self._position())

    def set_state(self, state: dict[str, Any]) -> None:
        row_group = self._state_int(state, "row_group")
        index = self._state_int(state, "index_within_row_group")
        if row_group == self._num_row_groups and index == 0:
            self._seek(len(self._row_groups), 0)
            return
        pos = self._index_of.get(row_group)
        if pos is None:
            raise ValueError(
                f"Checkpoint of Parquet file {self._file.display} points at row group "
                f"{row_group}, which this dataset does not read (it reads row groups "
                f"{list(self._row_groups)} of {self._num_row_groups}). The checkpoint belongs "
                "to another file or slicing."
            )
        if not 0 <= index <= self._sizes[pos]:
            raise ValueError(
                f"Checkpoint of Parquet file {self._file.display} points at row {index} of row "
                f"group {row_group}, which has {self._sizes[pos]} rows."
            )
        self._seek(pos, index)

    def _get_next_index(self) -> int:
        pos, index = self._position()
        rows = self._starts[pos] + index
        size = self._column_batch_size
        return rows if size is None else -(-rows // size)

    def _set_next_index(self, index: int) -> None:
        size = self._column_batch_size
        rows = min(index if size is None else index * size, self._starts[-1])
        if rows < 0:
            raise ValueError(f"Next index must be non-negative, got {index}.")
        pos = bisect.bisect_right(self._starts, rows) - 1
        self._seek(min(pos, len(self._row_groups)), rows - self._starts[pos])

    def close(self) -> None:
        if self._closed:
            return
        self._seek(len(self._row_groups), 0)
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._pf is not None:
            self._pf.close()
            self._pf = None
        super().close()

    def __repr__(self) -> str:
        return f"_ParquetFileIterator({self._file.display!r})"

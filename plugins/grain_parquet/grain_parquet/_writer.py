"""``ParquetWriter``: records (dicts) or column dicts to a Parquet file.

Rows are buffered and written in row groups of exactly ``row_group_size`` rows (the last may be
shorter), whatever mix of ``write`` and ``write_columns`` calls produced them. A reader never
sees a partial file: a local path or URL is written through ``grain_core.storage.AtomicWriter``
(an exclusively created temporary file renamed into place by ``close``, or one whole-object
upload for a URL); to an explicitly given remote ``filesystem`` the file is spooled locally
and written in one output stream by ``close`` (atomic on object stores).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from grain_core import storage
from grain_parquet._files import PathLike, resolve_paths

__all__ = ["DEFAULT_ROW_GROUP_SIZE", "ParquetWriter"]

#: Rows per row group unless chosen otherwise.
DEFAULT_ROW_GROUP_SIZE = 65_536
# Bytes per write when copying a finished file to an explicitly given filesystem.
_COPY_CHUNK = 16 << 20


def _to_arrow(values: Any, field_type: pa.DataType | None) -> pa.Array:
    """One column as an Arrow array (of ``field_type`` when given, else inferred).

    Numeric arrays of equal shape (a stacked N-D array, or one array per row) become
    fixed-size lists, which the readers return as N-D arrays again.
    """
    if isinstance(values, list) and values and all(isinstance(v, np.ndarray) for v in values):
        first = values[0]
        if first.dtype.kind in "biuf" and all(v.shape == first.shape for v in values):
            values = np.stack(values)
    if isinstance(values, np.ndarray) and values.ndim > 1 and values.dtype.kind in "biuf":
        array: pa.Array = pa.array(np.ascontiguousarray(values).reshape(-1))
        for size in reversed(values.shape[1:]):
            array = pa.FixedSizeListArray.from_arrays(array, size)
        return array if field_type is None else array.cast(field_type)
    return pa.array(values, type=field_type)


class ParquetWriter:
    """Writes records to a Parquet file, in row groups of ``row_group_size`` rows.

    ``write(record)`` appends one row (a mapping ``{column: value}``); ``write_columns``
    appends many rows given as ``{column: array}``. Column types come from ``schema`` or are
    inferred from the first rows; NumPy arrays of one shape per row become fixed-size lists.

    Args:
      path: Destination path or URI.
      row_group_size: Rows per row group: the unit of reading (and of random-access decoding).
      schema: The Arrow schema; inferred from the first rows when None.
      compression: Parquet compression codec (``"snappy"``, ``"zstd"``, ``"none"``, ...).
      filesystem: A ``pyarrow.fs.FileSystem`` or fsspec filesystem ``path`` is on.
      storage_options: For a URL (and no ``filesystem``), passed to its fsspec file system.
      **writer_kwargs: Passed to ``pyarrow.parquet.ParquetWriter`` (``use_dictionary``,
        ``write_statistics``, ...). Page checksums are written unless
        ``write_page_checksum=False``.

    Raises:
      ValueError: If ``row_group_size`` is not positive; from ``write``, if a row does not fit
        the schema (naming the file and row).
      TypeError: From ``write``, if a record is not a mapping.
    """

    def __init__(
        self,
        path: PathLike,
        *,
        row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
        schema: pa.Schema | None = None,
        compression: str = "snappy",
        filesystem: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        **writer_kwargs: Any,
    ) -> None:
        if isinstance(row_group_size, bool) or not isinstance(row_group_size, int):
            raise ValueError(f"row_group_size must be a positive int, got {row_group_size!r}.")
        if row_group_size <= 0:
            raise ValueError(f"row_group_size must be a positive int, got {row_group_size!r}.")
        # pyarrow writes a local temporary file by name: the storage seam's (for a local path
        # or a URL, which fsspec opens), or a spool that close() copies to the given filesystem.
        self._target: storage.AtomicWriter | None = None
        self._upload_to: pafs.FileSystem | None = None
        file = (
            None if filesystem is None else resolve_paths(path, filesystem, what="ParquetWriter")[0]
        )
        if file is None or file.filesystem is None:
            self._display = storage.path_string(path)
            self._target = storage.AtomicWriter(
                self._display if file is None else file.path, storage_options
            )
            self._target.file.close()
            self._tmp_path = self._target.temp_path
        else:
            self._display, self._upload_path = file.display, file.path
            self._upload_to = file.filesystem
            fd, self._tmp_path = tempfile.mkstemp(prefix="grain-parquet-", suffix=".parquet")
            os.close(fd)
        self._row_group_size = row_group_size
        self._schema = schema
        # Page checksums let every reader detect pages that changed on disk or in transit.
        self._options = {"compression": compression, "write_page_checksum": True, **writer_kwargs}
        self._writer: pq.ParquetWriter | None = None
        self._rows: list[Mapping[str, Any]] = []
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._written = 0
        self._closed = False

    @property
    def path(self) -> str:
        """The destination, as given."""
        return self._display

    def write(self, record: Mapping[str, Any]) -> None:
        """Appends one row.

        Raises:
          TypeError: If ``record`` is not a mapping.
          ValueError: If the writer is closed or the row does not fit the schema.
        """
        self._check_open()
        if not isinstance(record, Mapping):
            raise TypeError(
                f"{self.path}: record {self._count} is {type(record).__name__}; Parquet "
                "records are mappings {column: value}."
            )
        self._rows.append(record)
        if len(self._rows) >= self._row_group_size:
            self._flush_rows()

    def write_columns(self, columns: Mapping[str, Any]) -> None:
        """Appends ``len(column)`` rows given column-wise (arrays or lists of equal length).

        Raises:
          ValueError: If the columns differ in length or do not fit the schema.
        """
        self._check_open()
        self._flush_rows()
        lengths = {name: len(values) for name, values in columns.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{self.path}: columns differ in length: {lengths}.")
        self._push(self._table({name: columns[name] for name in columns}, self._count))

    @property
    def _count(self) -> int:
        return self._written + self._pending_rows + len(self._rows)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"ParquetWriter for {self.path} is closed.")

    def _table(self, columns: Mapping[str, Any], first_row: int) -> pa.Table:
        schema = self._schema
        try:
            arrays = {
                name: _to_arrow(values, None if schema is None else schema.field(name).type)
                for name, values in columns.items()
            }
            table = pa.table(arrays)
            if schema is None:
                self._schema = table.schema
                return table
            return table.select(schema.names).cast(schema)
        except (pa.ArrowException, KeyError, TypeError) as err:
            raise ValueError(
                f"{self.path}: rows from {first_row} do not fit the schema {schema}: {err}"
            ) from None

    def _flush_rows(self) -> None:
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        first = self._written + self._pending_rows
        names = list(self._schema.names) if self._schema is not None else list(rows[0])
        for k, row in enumerate(rows):
            if len(row) != len(names) or any(n not in row for n in names):
                missing = [n for n in names if n not in row]
                extra = [n for n in row if n not in names]
                what = (
                    f"has no column {missing[0]!r}" if missing else f"has extra column {extra[0]!r}"
                )
                raise ValueError(
                    f"{self.path}: record {first + k} {what}; the columns are {names}."
                )
        self._push(self._table({n: [r[n] for r in rows] for n in names}, first))

    def _push(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_rows += table.num_rows
        full = self._pending_rows - self._pending_rows % self._row_group_size
        if full:
            combined = pa.concat_tables(self._pending)
            self._write(combined.slice(0, full))
            rest = combined.slice(full)
            self._pending = [rest] if rest.num_rows else []
            self._pending_rows = rest.num_rows

    def _write(self, table: pa.Table) -> None:
        writer = self._writer
        if writer is None:
            writer = self._writer = pq.ParquetWriter(self._tmp_path, table.schema, **self._options)
        writer.write_table(table, row_group_size=self._row_group_size)
        self._written += table.num_rows

    def close(self) -> None:
        """Writes the last row group and moves the finished file into place."""
        if self._closed:
            return
        self._flush_rows()
        if self._pending:
            self._write(pa.concat_tables(self._pending))
            self._pending, self._pending_rows = [], 0
        if self._writer is None:  # no rows: an empty file with the schema (or no columns)
            self._write(pa.table({}) if self._schema is None else self._schema.empty_table())
        assert self._writer is not None
        self._writer.close()
        self._closed = True
        if self._target is not None:
            self._target.commit()
            return
        assert self._upload_to is not None
        try:
            with open(self._tmp_path, "rb") as spool:
                with self._upload_to.open_output_stream(self._upload_path) as out:
                    shutil.copyfileobj(spool, out, _COPY_CHUNK)
        finally:
            os.unlink(self._tmp_path)

    def abort(self) -> None:
        """Discards everything written; the destination is left untouched."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._target is not None:
            self._target.abort()
        else:
            os.unlink(self._tmp_path)

    def __enter__(self) -> ParquetWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self.abort()

"""Finding and opening Parquet files, and turning Arrow columns into NumPy.

Paths may be local paths, ``file://`` URIs or URLs (``s3://``, ``gs://``, any fsspec
protocol), which are read through ``grain_core.storage`` like every other reader's: the
``storage_options`` and fsspec's configuration apply, the file system retries, and a read that
still fails is a ``StorageError`` naming the URL and the byte range (a refused one a
``PermissionError`` naming the URL), never advice that the file is corrupt. A ``filesystem``
argument (a ``pyarrow.fs.FileSystem`` or an fsspec filesystem) overrides URL resolution.
Every error raised here names the file.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from grain_core import shard_names, storage

__all__ = [
    "TRANSFER_ERRORS",
    "FooterCache",
    "ParquetPath",
    "PathLike",
    "RangeFile",
    "check_columns",
    "check_same_schema",
    "column_to_numpy",
    "concatenate_column",
    "iter_rows",
    "open_parquet",
    "project_schema",
    "read_error",
    "resolve_paths",
    "rows_from_columns",
]

PathLike = str | os.PathLike[str]

_MAGIC = b"PAR1"

#: Failures to get a file's bytes (after the file system's retries), as opposed to bytes that
#: do not decode: passed on as they are, never reported as a corrupt file.
TRANSFER_ERRORS = (storage.StorageError, PermissionError, FileNotFoundError)


class RangeFile(io.RawIOBase):
    """A read-only file of ``size`` bytes whose reads are ``read_range(start, end)`` calls, for
    pyarrow (which reads it by ``seek`` and ``read``).

    Args:
      read_range: Returns bytes ``[start, end)``.
      size: The file's size in bytes.
    """

    def __init__(self, read_range: Callable[[int, int], Any], size: int) -> None:
        super().__init__()
        self._read_range = read_range
        self._size = size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._position = offset
        elif whence == io.SEEK_CUR:
            self._position += offset
        else:
            self._position = self._size + offset
        return self._position

    def read(self, size: int = -1) -> Any:
        """``size`` bytes from the position (all the rest for a negative ``size``)."""
        start = self._position
        end = self._size if size < 0 else min(start + size, self._size)
        data = self._read_range(start, end) if end > start else b""
        self._position += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)


@dataclasses.dataclass(frozen=True)
class ParquetPath:
    """One Parquet file.

    Attributes:
      display: The path as the user gave it (used in messages and ``repr``).
      filesystem: The pyarrow filesystem given for it; None for a local file, which pyarrow
        opens itself (so ``memory_map=True`` works), or a URL, read through
        ``grain_core.storage``.
      path: The path on ``filesystem``, the URL, or the absolute path of a local file.
      storage_options: For a URL, passed to its fsspec file system.
    """

    display: str
    filesystem: pafs.FileSystem | None
    path: str
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def is_url(self) -> bool:
        """Whether the file is a URL read through ``grain_core.storage``."""
        return self.filesystem is None and storage.is_url(self.path)

    def open_input(self, size: int | None = None) -> Any:
        """Opens the file for reading raw bytes (``size``: the file's size, when known).

        Raises:
          StorageError / PermissionError / FileNotFoundError: For a URL that cannot be read.
        """
        if self.is_url:
            reader = storage.RangeReader(self.path, self.storage_options)
            return RangeFile(reader.read, self.size() if size is None else size)
        if self.filesystem is None:
            return open(self.path, "rb")
        return self.filesystem.open_input_file(self.path)

    def size(self) -> int:
        """The file size in bytes."""
        if self.is_url:
            return storage.size(self.path, self.storage_options)
        if self.filesystem is None:
            return os.path.getsize(self.path)
        return int(self.filesystem.get_file_info(self.path).size)

    @property
    def is_remote(self) -> bool:
        """Whether the file is read through a filesystem other than the local disk."""
        return self.filesystem is not None or self.is_url

    def version(self) -> tuple[int, str]:
        """``(size, version)`` of the file; the version changes whenever its content does
        (an fsspec file system's full ``info``: ETag, generation, ...; otherwise the
        modification time).

        Raises:
          FileNotFoundError: If the file does not exist.
        """
        fs = self.filesystem
        if fs is None:
            return storage.version(self.path, self.storage_options)
        if isinstance(fs, pafs.PyFileSystem) and isinstance(fs.handler, pafs.FSSpecHandler):
            return storage.version_of(fs.handler.fs.info(self.path))
        info = fs.get_file_info(self.path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"Parquet file not found: {self.display}")
        return int(info.size), str(info.mtime_ns)

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of ``ranges`` (``[start, end)`` pairs), each one ranged read; an fsspec
        filesystem issues them concurrently.

        Raises:
          StorageError: If a read of a URL fails after retries, naming it and the range.
          OSError: If a read fails.
        """
        if self.is_url:
            reader = storage.RangeReader(self.path, self.storage_options)
            return reader.read_many([start for start, _ in ranges], [end for _, end in ranges])
        fs = self.filesystem
        if (
            fs is not None
            and isinstance(fs, pafs.PyFileSystem)
            and isinstance(fs.handler, pafs.FSSpecHandler)
        ):
            paths = [self.path] * len(ranges)
            starts = [start for start, _ in ranges]
            ends = [end for _, end in ranges]
            return list(fs.handler.fs.cat_ranges(paths, starts, ends, on_error="raise"))
        with self.open_input() as handle:
            if fs is None:
                return [os.pread(handle.fileno(), end - start, start) for start, end in ranges]
            return [handle.read_at(end - start, start) for start, end in ranges]


def resolve_paths(
    paths: PathLike | Sequence[PathLike],
    filesystem: Any = None,
    *,
    what: str = "Parquet",
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[ParquetPath, ...]:
    """Resolves one path or a sequence of paths to :class:`ParquetPath`.

    Args:
      paths: Local paths or URLs, or shard patterns (``x@N``, ``x-*-of-N``, ``x-*``, globs:
        ``grain_core.shard_names``), expanded in order.
      filesystem: Optional ``pyarrow.fs.FileSystem`` or fsspec ``AbstractFileSystem``; the
        paths are then paths on it (and not globs).
      what: The reader's name, for messages.
      storage_options: For URLs, passed to their fsspec file system.

    Raises:
      ValueError: If no path is given, or a URL's scheme has no file system.
      ImportError: If a URL needs fsspec or its file system's package, naming it.
      TypeError: If ``paths`` or ``filesystem`` has the wrong type.
      FileNotFoundError: If a glob matches nothing, naming it.
    """
    if isinstance(paths, str | os.PathLike):
        items = [paths]
    elif isinstance(paths, Sequence):
        items = list(paths)
    else:
        raise TypeError(f"{what} paths must be a path or a sequence of paths, got {paths!r}.")
    if not items:
        raise ValueError(f"{what} needs at least one path.")
    for item in items:
        if not isinstance(item, str | os.PathLike):
            raise TypeError(f"{what} paths must be str or os.PathLike, got {item!r}.")
    fs = _arrow_filesystem(filesystem)
    texts = [os.fspath(item) for item in items]
    options = dict(storage_options or {})
    if fs is None:
        texts = shard_names.expand(texts, options, what=what)
    return tuple(_resolve(text, fs, options) for text in texts)


def _arrow_filesystem(filesystem: Any) -> pafs.FileSystem | None:
    if filesystem is None or isinstance(filesystem, pafs.FileSystem):
        return filesystem
    try:
        import fsspec  # optional dependency
    except ImportError:
        fsspec = None
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    raise TypeError(
        "filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, got "
        f"{type(filesystem).__name__}."
    )


def _resolve(
    path: str, filesystem: pafs.FileSystem | None, storage_options: Mapping[str, Any]
) -> ParquetPath:
    if filesystem is not None:
        if isinstance(filesystem, pafs.LocalFileSystem):
            return ParquetPath(path, None, os.path.abspath(path))
        return ParquetPath(path, filesystem, path)
    text = storage.path_string(path)  # file:// URLs are local paths
    if not storage.is_url(text):
        return ParquetPath(path, None, os.path.abspath(text))
    storage.filesystem(text, storage_options)  # an unknown scheme or a missing package: now
    return ParquetPath(path, None, text, storage_options)


def _exists(file: ParquetPath) -> bool:
    if file.filesystem is None:
        return storage.exists(file.path, file.storage_options)
    return bool(file.filesystem.get_file_info(file.path).type != pafs.FileType.NotFound)


def _diagnose(file: ParquetPath) -> str:
    """Why pyarrow could not read the footer: not Parquet at all, or cut short."""
    try:
        with file.open_input() as handle:
            head = handle.read(len(_MAGIC))
    except TRANSFER_ERRORS:
        raise
    except OSError as err:
        return f"cannot be read ({err})"
    if head == _MAGIC:
        return (
            "is truncated or corrupted: it starts like a Parquet file but its footer is "
            "missing or damaged. Re-create or re-download it"
        )
    if not head:
        return "is empty, not a Parquet file"
    return "is not a Parquet file (it does not start with 'PAR1'). Check the path and format"


def open_parquet(
    file: ParquetPath,
    read_kwargs: Mapping[str, Any],
    metadata: pq.FileMetaData | None = None,
    size: int | None = None,
) -> pq.ParquetFile:
    """Opens ``file`` with ``pyarrow.parquet.ParquetFile(**read_kwargs)``.

    Args:
      file: The file.
      read_kwargs: Keyword arguments for ``ParquetFile`` (``memory_map``, ``pre_buffer``, ...).
      metadata: The file's footer, when already read (saves reading it again).
      size: The file's size, when known (saves asking a remote store for it).

    Raises:
      FileNotFoundError: If the file does not exist.
      ValueError: If it is not a readable Parquet file; the message says why.
      TypeError: On an unknown keyword argument.
      StorageError / PermissionError: If a URL cannot be read (see ``TRANSFER_ERRORS``).
    """
    kwargs = {"page_checksum_verification": True, **read_kwargs}
    source: Any = file.path
    if file.is_url:
        source = file.open_input(size)
    elif file.filesystem is not None:
        kwargs["filesystem"] = file.filesystem
    try:
        return pq.ParquetFile(source, metadata=metadata, **kwargs)
    except TypeError as err:
        raise TypeError(f"Invalid Parquet read option for {file.display}: {err}") from None
    except (storage.StorageError, PermissionError):
        raise
    except (pa.ArrowException, OSError) as err:
        if isinstance(err, FileNotFoundError) or not _exists(file):
            raise FileNotFoundError(f"Parquet file not found: {file.display}") from None
        raise ValueError(f"Cannot read Parquet file {file.display}: it {_diagnose(file)}.") from err


class FooterCache:
    """Footers of remote files, read once and kept while the file is unchanged.

    A remote file's footer costs a request for its tail (and on some stores, as moto's, a copy
    of the whole object on the server); every pass over the file needs it. Here each pass asks
    only for the file's size and version (one metadata request, which the data reads need
    anyway for the size) and reads the footer again only when they changed.
    Shared by a dataset and its per-file and sliced copies; safe to use from several threads.
    """

    def __init__(self) -> None:
        self._footers: dict[str, tuple[tuple[int, str], pq.FileMetaData]] = {}

    def footer(
        self, file: ParquetPath, read_kwargs: Mapping[str, Any]
    ) -> tuple[pq.FileMetaData, int]:
        """Returns the footer of the remote ``file`` and its size in bytes.

        Raises:
          FileNotFoundError: If the file does not exist.
          ValueError: If it is not a readable Parquet file (see :func:`open_parquet`).
        """
        try:
            version = file.version()
        except FileNotFoundError:
            raise FileNotFoundError(f"Parquet file not found: {file.display}") from None
        cached = self._footers.get(file.path)
        if cached is not None and cached[0] == version:
            return cached[1], version[0]
        with open_parquet(file, read_kwargs, size=version[0]) as handle:
            metadata = handle.metadata
        self._footers[file.path] = (version, metadata)
        return metadata, version[0]


def read_error(
    file: ParquetPath,
    row_group: int,
    err: Exception,
    read_kwargs: Mapping[str, Any],
    columns: Sequence[str] | None,
) -> ValueError:
    """The error for a row group that fails to decode.

    A page checksum mismatch names the column too: pyarrow's error names only the page, so
    the row group's columns are read again one at a time to find the damaged one.

    Args:
      file: The file.
      row_group: The row group that failed.
      err: pyarrow's error.
      read_kwargs: The ``ParquetFile`` options it was opened with.
      columns: The columns being read (None: all).
    """
    if _CHECKSUM_ERROR not in str(err):
        return ValueError(
            f"Cannot read row group {row_group} of Parquet file {file.display}: "
            f"{str(err).rstrip('.')}. The "
            "file is probably corrupted; re-create or re-download it."
        )
    column = _column_failing_checksum(file, row_group, read_kwargs, columns)
    where = f"row group {row_group}" + ("" if column is None else f", column {column!r}")
    return ValueError(
        f"Parquet file {file.display}: a page of {where} does not match its checksum ({err}). "
        "The file changed after it was written (bit rot, an interrupted copy or an "
        "overwrite); re-create or re-download it."
    )


# The text of pyarrow's error for a page whose CRC does not match.
_CHECKSUM_ERROR = "CRC checksum verification failed"


def _column_failing_checksum(
    file: ParquetPath,
    row_group: int,
    read_kwargs: Mapping[str, Any],
    columns: Sequence[str] | None,
) -> str | None:
    """The first of ``columns`` whose pages in ``row_group`` fail their checksum, if any."""
    try:
        handle = open_parquet(file, read_kwargs)
    except TRANSFER_ERRORS:
        raise
    except (OSError, ValueError):
        return None
    with handle:
        for name in columns if columns is not None else handle.schema_arrow.names:
            try:
                handle.read_row_group(row_group, columns=[name])
            except TRANSFER_ERRORS:
                raise
            except (pa.ArrowException, OSError) as err:
                if _CHECKSUM_ERROR in str(err):
                    return str(name)
    return None


def check_columns(columns: Sequence[str] | None) -> tuple[str, ...] | None:
    """Validates a ``columns`` argument.

    Raises:
      TypeError / ValueError: If it is not a non-empty sequence of distinct names.
    """
    if columns is None:
        return None
    if isinstance(columns, str) or not isinstance(columns, Sequence):
        raise TypeError(f"columns must be a sequence of column names, got {columns!r}.")
    names = tuple(columns)
    if not names:
        raise ValueError("columns must name at least one column (None reads all columns).")
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"columns must be names (str), got {columns!r}.")
    if len(set(names)) != len(names):
        raise ValueError(f"columns names a column twice: {list(names)}.")
    return names


def project_schema(
    schema: pa.Schema, columns: tuple[str, ...] | None, file: ParquetPath
) -> pa.Schema:
    """The fields of ``schema`` that will be read: all, or ``columns`` in that order.

    Raises:
      ValueError: If a column does not exist; the message lists the available ones.
    """
    if columns is None:
        return schema.remove_metadata()
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ValueError(
            f"Parquet file {file.display} has no column {', '.join(map(repr, missing))}. "
            f"Available columns: {schema.names}."
        )
    return pa.schema([schema.field(c) for c in columns])


def check_same_schema(
    expected: pa.Schema,
    expected_file: ParquetPath,
    actual: pa.Schema,
    file: ParquetPath,
    columns: tuple[str, ...] | None,
) -> None:
    """Checks that ``file`` has the fields (names and types) of ``expected_file``.

    Args:
      expected: The projected schema every file must have.
      expected_file: The file ``expected`` comes from.
      actual: ``file``'s full schema.
      file: The file being checked.
      columns: The projection; without one, ``file`` may not have extra fields either.

    Raises:
      ValueError: Naming both files and the first field that differs.
    """
    hint = (
        "All files of one dataset must have the same columns and types; pass columns=[...] "
        "to read only the columns they share."
    )
    for field in expected:
        index = actual.get_field_index(field.name)
        if index < 0:
            raise ValueError(
                f"Parquet file {file.display} has no field {field.name!r} ({field.type}), "
                f"which {expected_file.display} has. {hint}"
            )
        other = actual.field(index)
        if not other.type.equals(field.type):
            raise ValueError(
                f"Parquet file {file.display}: field {field.name!r} has type {other.type}, but "
                f"{field.type} in {expected_file.display}. {hint}"
            )
    if columns is None:
        extra = [name for name in actual.names if name not in expected.names]
        if extra:
            raise ValueError(
                f"Parquet file {file.display} has field {extra[0]!r}, which "
                f"{expected_file.display} lacks. {hint}"
            )


def column_to_numpy(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """One Arrow column as a NumPy array, without copying where Arrow's layout allows.

    Numbers without nulls are zero-copy (read-only) views. A fixed-size list column becomes
    one array with a trailing dimension per list level (zero-copy for numbers), so each row is
    an array and a batch of rows is a plain 2-D array. Strings, binaries, variable-length
    lists, structs and columns with nulls are converted by ``to_numpy(zero_copy_only=False)``
    (object arrays; nulls become NaN or None).
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    column_type = column.type
    if pa.types.is_fixed_size_list(column_type) and column.null_count == 0:
        values = column_to_numpy(column.flatten())
        return values.reshape(len(column), column_type.list_size, *values.shape[1:])
    return column.to_numpy(zero_copy_only=False)


def concatenate_column(parts: Sequence[np.ndarray]) -> np.ndarray:
    """One column from its pieces in several row groups (``column_to_numpy`` of each).

    NumPy promotes where the pieces' types differ (an int column with nulls in one row group
    is float there). Pieces it cannot join, such as a fixed-size list column that is a 2-D
    array in a row group without nulls and an object array of rows in one with them, become
    one object array of rows.
    """
    try:
        return np.concatenate(parts)
    except ValueError:
        column = np.empty(sum(len(part) for part in parts), dtype=object)
        for i, row in enumerate(itertools.chain.from_iterable(parts)):
            column[i] = row  # one by one: a list of equal arrays would be read as 2-D
        return column


def rows_from_columns(names: Sequence[str], columns: Sequence[np.ndarray]) -> list[dict[str, Any]]:
    """One dict per row, ``{name: value}``, from equally long columns."""
    return list(iter_rows(names, columns)[0])


def iter_rows(
    names: Sequence[str], columns: Sequence[np.ndarray]
) -> tuple[Iterator[dict[str, Any]], Iterator[Any]]:
    """Row dicts built lazily, one per ``next``, and a progress marker.

    The rows come from C-level ``map``/``zip`` (no Python frame per row) and are built only
    when asked for, so consumed rows are freed at once instead of piling up for the garbage
    collector. The second iterator is the first column's, which the rows advance:
    ``operator.length_hint`` of it is the number of rows not yet built.
    """
    first = iter(columns[0])
    rows = map(dict, map(zip, itertools.repeat(names), zip(first, *columns[1:], strict=False)))
    return rows, first

"""Reading and writing JSON Lines files.

The source indexes every file once (the byte span of each non-empty line, found with one
vectorised scan of a memory map) and then reads any record with a single ``os.pread``, so
random access costs one system call and one ``json.loads`` per record.
"""

from __future__ import annotations

import json
import mmap
import operator
import os
from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np

from grain_core.plugins import FormatInfo

__all__ = ["JsonlDataSource", "JsonlWriter", "inspect_jsonl"]

PathLike = str | os.PathLike[str]


class JsonlDataSource:
    """Random access to the records of one or more JSON Lines files.

    Records are the non-empty lines, in file order, then line order. The source pickles
    without open files, so it can be shipped to worker processes.

    Args:
      paths: One path or a sequence of paths.

    Raises:
      FileNotFoundError: If a file does not exist.
      ValueError: If no path is given.
    """

    def __init__(self, paths: PathLike | Sequence[PathLike]) -> None:
        if isinstance(paths, str | os.PathLike):
            paths = [paths]
        self._paths = tuple(os.fspath(p) for p in paths)
        if not self._paths:
            raise ValueError("JsonlDataSource needs at least one path.")
        spans = [_line_spans(p) for p in self._paths]
        self._starts = [s for s, _ in spans]
        self._ends = [e for _, e in spans]
        # _file_offsets[k] = index of the first record of file k; the last entry is len(self).
        self._file_offsets = np.cumsum([0] + [len(s) for s in self._starts])
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return int(self._file_offsets[-1])

    def __getitem__(self, record_key: SupportsIndex) -> Any:
        index = operator.index(record_key)
        if not 0 <= index < len(self):
            raise IndexError(f"Record index {index} out of range for {len(self)} records.")
        file_index = int(np.searchsorted(self._file_offsets, index, side="right")) - 1
        line = index - int(self._file_offsets[file_index])
        start = int(self._starts[file_index][line])
        end = int(self._ends[file_index][line])
        data = os.pread(self._fd(file_index), end - start, start)
        try:
            return json.loads(data)
        except ValueError as err:
            raise ValueError(
                f"{self._paths[file_index]}: record {index} (byte offset {start}) is not "
                f"valid JSON: {err}. Fix or remove that line."
            ) from None

    def __getitems__(self, record_keys: Sequence[SupportsIndex]) -> list[Any]:
        return [self[k] for k in record_keys]

    def __repr__(self) -> str:
        return f"JsonlDataSource(paths={self._paths!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}}

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)

    def _fd(self, file_index: int) -> int:
        fd = self._fds.get(file_index)
        if fd is None:
            # Reader threads may race here; the loser closes its descriptor.
            opened = os.open(self._paths[file_index], os.O_RDONLY)
            fd = self._fds.setdefault(file_index, opened)
            if fd != opened:
                os.close(opened)
        return fd


class JsonlWriter:
    """Writes records as JSON Lines; the file appears complete on ``close`` or not at all.

    NumPy arrays and scalars are written as JSON lists and numbers.

    Args:
      path: Destination file.

    Raises:
      TypeError: From ``write``, for a record JSON cannot represent.
    """

    def __init__(self, path: PathLike) -> None:
        self._path = os.fspath(path)
        self._tmp_path = f"{self._path}.tmp-{os.getpid()}"
        self._file = open(self._tmp_path, "w", encoding="utf-8")
        self._count = 0

    def write(self, record: Any) -> None:
        """Appends one record as one line."""
        try:
            line = json.dumps(record, default=_to_json, ensure_ascii=False, separators=(",", ":"))
        except TypeError as err:
            raise TypeError(
                f"{self._path}: record {self._count} cannot be written: {err}"
            ) from None
        self._file.write(line + "\n")
        self._count += 1

    def close(self) -> None:
        """Flushes, syncs and moves the finished file into place."""
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp_path, self._path)

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
            os.unlink(self._tmp_path)


def inspect_jsonl(path: str, sample_size: int) -> FormatInfo:
    """Describes a JSON Lines file: record count, field types of the first record, a sample.

    Raises:
      FileNotFoundError / ValueError: As for :class:`JsonlDataSource`.
    """
    source = JsonlDataSource(path)
    sample = tuple(source[i] for i in range(min(sample_size, len(source))))
    schema: Any = None
    if len(source):
        first = source[0]
        if isinstance(first, dict):
            schema = {key: type(value).__name__ for key, value in first.items()}
        else:
            schema = type(first).__name__
    return FormatInfo(
        num_records=len(source),
        schema=schema,
        sample=sample,
        details={"bytes": os.path.getsize(path)},
    )


def _line_spans(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns the start and end byte offsets of the non-empty lines of ``path``."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            data = np.frombuffer(mapped, dtype=np.uint8)
            newlines = np.flatnonzero(data == ord("\n"))
            del data  # The map cannot close while an array still views it.
    starts = np.concatenate(([0], newlines + 1))
    ends = np.concatenate((newlines, [size]))
    keep = ends > starts
    return starts[keep], ends[keep]


def _to_json(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")

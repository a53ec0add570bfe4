"""``ArrayRecordWriter``: records (bytes) to an ArrayRecord file.

ArrayRecord compresses records in groups of ``group_size`` and indexes the groups. Reading
one record decompresses its whole group, so random access (shuffled training) wants
``group_size=1``: each read touches exactly one small chunk. Larger groups compress better
and suit files that are only read sequentially.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from array_record.python import array_record_module  # type: ignore[import-untyped]

from grain_core import storage

__all__ = ["ArrayRecordWriter"]


class ArrayRecordWriter:
    """Writes records to an ArrayRecord file; the file appears complete on ``close`` or not at all.

    The file is written atomically through ``grain_core.storage.AtomicWriter``: ArrayRecord
    writes an exclusively created temporary file, which ``close`` syncs and renames into place
    (or uploads as one object, for a URL).

    Args:
      path: Destination file, local or a URL (``s3://bucket/out.array_record``).
      group_size: Records compressed together; 1 (the default) makes random access fast.
      options: Further ArrayRecord writer options, comma-separated (e.g. ``"zstd:1"`` or
        ``"uncompressed"``).
      storage_options: For a URL, passed to its fsspec file system.

    Raises:
      ValueError: If ``group_size`` is not a positive int or ``options`` is invalid.
      OSError: If the file cannot be created.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        group_size: int = 1,
        options: str = "",
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}.")
        self._path = storage.path_string(path)
        writer_options = ",".join(o for o in (f"group_size:{group_size}", options) if o)
        self._target = storage.AtomicWriter(self._path, storage_options)
        self._target.file.close()  # ArrayRecord opens the temporary file by name
        try:
            self._writer: Any = array_record_module.ArrayRecordWriter(
                self._target.temp_path, writer_options
            )
        except ValueError as err:
            self._target.abort()
            raise ValueError(
                f"Invalid ArrayRecord writer options {writer_options!r}: {err}"
            ) from None
        except RuntimeError as err:
            self._target.abort()
            raise OSError(f"Cannot create ArrayRecord file {self._path!r}: {err}") from None
        if not self._writer.ok():
            self._target.abort()
            raise OSError(f"Cannot create ArrayRecord file {self._path!r}.")
        self._count = 0
        self._closed = False

    @property
    def path(self) -> str:
        """The destination file."""
        return self._path

    def write(self, record: Any) -> None:
        """Appends one record.

        Raises:
          TypeError: If ``record`` is not bytes-like.
          ValueError: If the writer is closed.
        """
        if self._closed:
            raise ValueError(f"The ArrayRecordWriter for {self._path!r} is closed.")
        if isinstance(record, bytearray | memoryview):
            record = bytes(record)
        elif not isinstance(record, bytes):
            hint = " (encode text first, e.g. record.encode())" if isinstance(record, str) else ""
            raise TypeError(
                f"{self._path}: record {self._count} must be bytes, got "
                f"{type(record).__name__}{hint}."
            )
        self._writer.write(record)
        self._count += 1

    def close(self) -> None:
        """Finishes the file, syncs it and moves it into place (uploads it, for a URL)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close()
        except BaseException:
            self._target.abort()
            raise
        self._target.commit()

    def __enter__(self) -> ArrayRecordWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
            return
        self._closed = True
        self._writer.close()
        self._target.abort()

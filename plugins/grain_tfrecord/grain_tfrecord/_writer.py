"""``TFRecordWriter``: records to a TFRecord file, optionally GZIP/ZLIB-compressed."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

from grain_core import storage
from grain_tfrecord._example import encode_example
from grain_tfrecord._framing import (
    U32,
    U64,
    WBITS,
    PathLike,
    compression_for,
    masked_crc,
)
from grain_tfrecord._stream import CHUNK_SIZE

__all__ = ["TFRecordWriter"]


class TFRecordWriter:
    """Writes records as TFRecord frames; the file appears complete on ``close`` or not at all.

    ``write`` takes ``bytes``-like records as they are, and mappings of feature name to
    value, which it encodes as ``tf.train.Example`` (see :func:`encode_example`).

    The file is written atomically through ``grain_core.storage.AtomicWriter``: locally to an
    exclusively created temporary file renamed into place on ``close``, to a URL as one
    whole-object upload on ``close``.

    Args:
      path: Destination file, local or a URL (``s3://bucket/out.tfrecord``).
      compression: ``"GZIP"``, ``"ZLIB"`` or None to decide from the suffix (``.gz``: GZIP).
      storage_options: For a URL, passed to its fsspec file system.

    Raises:
      ValueError: If ``compression`` is unknown.
      TypeError: From ``write``, for a record that is neither bytes-like nor a mapping.
    """

    def __init__(
        self,
        path: PathLike,
        *,
        compression: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._path = storage.path_string(path)
        self._compression = compression_for(self._path, compression)
        self._target = storage.AtomicWriter(self._path, storage_options)
        self._file = self._target.file
        self._deflater = (
            zlib.compressobj(6, zlib.DEFLATED, WBITS[self._compression])
            if self._compression
            else None
        )
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._count = 0

    def write(self, record: Any) -> None:
        """Appends one record."""
        if isinstance(record, Mapping):
            record = encode_example(record)
        elif not isinstance(record, bytes | bytearray | memoryview):
            raise TypeError(
                f"{self._path}: record {self._count} is a {type(record).__name__}; "
                "TFRecordWriter writes bytes, or mappings of features encoded as tf.train.Example."
            )
        length = U64.pack(len(record))
        self._pending += (
            length,
            U32.pack(masked_crc(length)),
            bytes(record),
            U32.pack(masked_crc(record)),
        )
        self._pending_size += len(record) + 16
        self._count += 1
        if self._pending_size >= CHUNK_SIZE:
            self._flush_pending()

    def _flush_pending(self) -> None:
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_size = 0
        self._file.write(self._deflater.compress(data) if self._deflater else data)

    def close(self) -> None:
        """Flushes, syncs and moves the finished file into place (uploads it, for a URL)."""
        if self._file.closed:
            return
        try:
            self._flush_pending()
            if self._deflater:
                self._file.write(self._deflater.flush())
        except BaseException:
            self._target.abort()
            raise
        self._target.commit()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not exc_info or exc_info[0] is None:
            self.close()
        else:
            self._target.abort()

    def __repr__(self) -> str:
        return f"TFRecordWriter({self._path!r}, compression={self._compression!r})"

"""A record-at-a-time TFRecord reader over any open binary file, and its dataset iterator.

``TFRecordIterDataset`` parses files a block of records at a time; these two classes read
one frame per call from a file object the caller may supply, which is what code written
against Grain's private TFRecord reader subclasses (MaxText opens ``gs://`` blobs with its own
client and hands the stream over). ``grain_core.install_as_grain()`` serves them as
``grain._src.python.dataset.sources.tfrecord_dataset._TFRecordReader`` and
``_TFRecordDatasetIterator``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, BinaryIO

from grain_core import DatasetIterator, storage
from grain_tfrecord._framing import (
    FOOTER_SIZE,
    HEADER,
    HEADER_SIZE,
    U32,
    U64,
    PathLike,
    crc_error,
    masked_crc,
    truncated_error,
)

__all__ = ["TFRecordReader", "TFRecordReaderIterator"]


class TFRecordReader:
    """Reads the records (``bytes``) of one uncompressed TFRecord file, one per ``next``.

    The open file is the attribute ``_reader`` (anything with ``read``, ``seek`` and
    ``tell``): a subclass may set it to a stream it opened itself instead of calling
    ``__init__``, as subclasses of Grain's reader do; both CRCs are then still checked.

    Args:
      path: A local path or URL (``s3://``, ``gs://``: through fsspec).
      verify_crc: Check the length CRC and data CRC of every record.
      storage_options: For a URL, passed to its fsspec file system.

    Raises:
      FileNotFoundError: If the file does not exist.
    """

    # A class attribute, so that subclasses that skip __init__ verify too.
    verify_crc: bool = True

    def __init__(
        self,
        path: PathLike,
        *,
        verify_crc: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.verify_crc = verify_crc
        file = storage.open_read(path, storage_options)
        # A local file opens unbuffered; records are small reads, so buffer them.
        self._reader: BinaryIO = (
            io.BufferedReader(file) if isinstance(file, io.RawIOBase) else file  # type: ignore[arg-type]
        )

    def __iter__(self) -> TFRecordReader:
        return self

    def __next__(self) -> bytes:
        """Returns the next record.

        Raises:
          StopIteration: At the end of the file.
          CorruptRecordError: For a checksum mismatch or a truncated record, naming the file
            and the record's byte offset.
        """
        offset = self._reader.tell()
        header = self._reader.read(HEADER_SIZE)
        if not header:
            raise StopIteration
        if len(header) != HEADER_SIZE:
            raise truncated_error(self._name(), offset, HEADER_SIZE, len(header), "header")
        length, length_crc = HEADER.unpack(header)
        if self.verify_crc and masked_crc(U64.pack(length)) != length_crc:
            raise crc_error(self._name(), offset, "length CRC", header[:2])
        body = self._reader.read(length + FOOTER_SIZE)
        if len(body) != length + FOOTER_SIZE:
            raise truncated_error(self._name(), offset, length + FOOTER_SIZE, len(body), "payload")
        data = body[:length]
        if self.verify_crc and masked_crc(data) != U32.unpack_from(body, length)[0]:
            raise crc_error(self._name(), offset, "data CRC", b"")
        return data

    def _name(self) -> str:
        return str(getattr(self._reader, "name", None) or type(self._reader).__name__)

    def seek(self, offset: int) -> None:
        """Makes the record at byte ``offset`` the next one."""
        self._reader.seek(offset)

    def tell(self) -> int:
        """Returns the byte offset of the next record."""
        return self._reader.tell()

    def close(self) -> None:
        """Closes the file."""
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.close()

    def __del__(self) -> None:
        self.close()


class TFRecordReaderIterator(DatasetIterator[bytes]):
    """A ``DatasetIterator`` over a :class:`TFRecordReader` (the attribute ``_reader``), with
    the state ``{"reader_offset": byte offset of the next record}``.

    Args:
      path: The file (local path or URL).

    Raises:
      FileNotFoundError: If the file does not exist.
    """

    def __init__(self, path: PathLike) -> None:
        super().__init__()
        self._reader = TFRecordReader(path)

    def __next__(self) -> bytes:
        return next(self._reader)

    def get_state(self) -> dict[str, Any]:
        return {"reader_offset": self._reader.tell()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._reader.seek(self._state_int(state, "reader_offset"))

    def close(self) -> None:
        if self._closed:
            return
        self._reader.close()
        super().close()

"""``TFRecordIterDataset``: streams the records of TFRecord files, verifying both checksums."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from grain_core import DatasetIterator, IterDataset
from grain_core.experimental import ElementBlock, InterleaveIterDataset
from grain_tfrecord._framing import PathLike, compression_for, expand_paths
from grain_tfrecord._stream import Block, FrameReader

__all__ = ["TFRecordIterDataset"]


class TFRecordIterDataset(IterDataset[bytes]):
    """Yields the records (``bytes``) of one or more TFRecord files, in order.

    Every record's length CRC and data CRC are checked before it is returned. One file has
    the state ``{"reader_offset": byte offset of the next record}`` (for compressed files, an
    offset in the decompressed stream; restoring it re-reads the file up to there). Several
    files are read through an ``InterleaveIterDataset`` of one dataset per file (state: the
    interleave state), which ``mp_prefetch`` slices by file. A file's iterator hands out its
    records a block at a time (``next_block``), so the interleave moves them without a call
    through the file iterator per record.

    Args:
      path: A path, a sequence of paths, or a pattern (``train.tfrecord-*-of-00016``,
        ``train.tfrecord@16``). Named as in Grain, whose dataset reads one file.
      verify_crc: Check both CRCs of every record. ``False`` is unsafe: a corrupt payload is
        returned as is, and a corrupt length reads as a truncated file.
      compression: ``"GZIP"``, ``"ZLIB"`` or None to decide per file from its suffix
        (``.gz``: GZIP, ``.zlib``/``.zz``: ZLIB, otherwise uncompressed).
      cycle_length: Files read at the same time, taking records round-robin; the default
        1 reads the files one after the other.
      storage_options: For URLs (``s3://``, ``gs://``, ...), passed to the fsspec file system
        (endpoint, credentials, retries); worker processes open the files with the same.

    Raises:
      ValueError: If no file is given or ``compression`` is unknown.
      FileNotFoundError: When an iterator opens a file that does not exist.
      CorruptRecordError: While iterating, for a damaged or truncated file.
    """

    def __init__(
        self,
        path: PathLike | Sequence[PathLike],
        *,
        verify_crc: bool = True,
        compression: str | None = None,
        cycle_length: int = 1,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        files = expand_paths(path, "TFRecordIterDataset", storage_options)
        self._storage_options = dict(storage_options or {})
        self._init(files, verify_crc, compression, cycle_length, per_file=len(files) > 1)

    def _init(
        self,
        files: Sequence[str],
        verify_crc: bool,
        compression: str | None,
        cycle_length: int,
        per_file: bool,
    ) -> None:
        self._paths = tuple(files)
        self._verify_crc = bool(verify_crc)
        self._compression = compression
        self._cycle_length = cycle_length
        if not per_file:
            # Grain's name for the file, which subclasses written for Grain's dataset read.
            self._path = files[0]
            self._file_compression = compression_for(files[0], compression)
            super().__init__()
            return
        one_per_file = [
            TFRecordIterDataset(
                p,
                verify_crc=verify_crc,
                compression=compression,
                storage_options=self._storage_options,
            )
            for p in files
        ]
        # iter_buffer_size=0: a reader thread per file would only add a hand-off per record;
        # the reader already amortises I/O over megabyte reads.
        interleave = InterleaveIterDataset(
            one_per_file, cycle_length=cycle_length, iter_buffer_size=0
        )
        super().__init__(interleave)

    @property
    def paths(self) -> tuple[str, ...]:
        """The files, in reading order."""
        return self._paths

    def with_slice(self, sl: slice) -> TFRecordIterDataset:
        """Returns the dataset over ``paths[sl]`` (how ``mp_prefetch`` gives workers files).

        Raises:
          ValueError: If this dataset reads a single file, which cannot be split by file.
        """
        if not self._parents:
            raise ValueError(
                f"Cannot slice TFRecordIterDataset of the single file {self._paths[0]} by file "
                "for several workers; pass several files (shards), or use one worker."
            )
        sliced = TFRecordIterDataset.__new__(TFRecordIterDataset)
        sliced._storage_options = self._storage_options
        sliced._init(self._paths[sl], self._verify_crc, self._compression, self._cycle_length, True)
        return sliced

    def __iter__(self) -> DatasetIterator[bytes]:
        if not self._parents:
            return TFRecordFileIterator(
                self._paths[0], self._file_compression, self._verify_crc, self._storage_options
            )
        return self._parents[0].__iter__()

    def __repr__(self) -> str:
        return f"TFRecordIterDataset(path={list(self._paths)!r}, verify_crc={self._verify_crc})"


class TFRecordFileIterator(DatasetIterator[bytes]):
    """Hands out the records of one file from blocks parsed by a :class:`FrameReader`, one at
    a time (``next``) or the rest of a parsed block at once (``next_block``).

    Args:
      path: The file.
      compression: ``"GZIP"``, ``"ZLIB"`` or None.
      verify_crc: Check both CRCs of every record.
      storage_options: For a URL, passed to its fsspec file system.

    Raises:
      FileNotFoundError: If the file does not exist.
    """

    def __init__(
        self,
        path: str,
        compression: str | None,
        verify_crc: bool,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._path = path
        self._compression = compression
        self._verify = verify_crc
        self._storage_options = storage_options
        self._reader: FrameReader | None = None
        self._open_at(0)

    def _open_at(self, offset: int) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = FrameReader(
            self._path, self._compression, self._verify, offset, self._storage_options
        )
        self._start_block_at(offset)

    def _start_block_at(self, offset: int) -> None:
        """Makes the next record the one at ``offset``, where the reader now is."""
        self._block = Block([], offset, None)
        # An iterator over the block's records: its length hint tells how many are left.
        self._records = iter(self._block.records)

    def __next__(self) -> bytes:
        record = next(self._records, None)
        if record is None:
            if not self._read_block():
                raise StopIteration
            return next(self._records)
        return record

    def next_block(self, max_size: int) -> ElementBlock[bytes]:
        """Takes up to ``max_size`` next records: the rest of the parsed block (see
        ``grain_core.experimental.SupportsNextBlock``).

        Raises:
          CorruptRecordError: For a damaged or truncated file, once the records before the
            damage are taken.
        """
        if not operator.length_hint(self._records) and not self._read_block():
            end_state = self.get_state()
            return ElementBlock([], lambda _: end_state)
        block = self._block
        records = block.records
        taken = len(records) - operator.length_hint(self._records)
        end = min(taken + max_size, len(records))
        self._records.__setstate__(end)  # type: ignore[attr-defined]
        return ElementBlock(
            records if taken == 0 and end == len(records) else records[taken:end],
            # block.ends is computed on first use: most blocks are never checkpointed.
            lambda k: {"reader_offset": block.ends[taken + k - 1] if taken + k else block.start},
        )

    def _read_block(self) -> bool:
        """Parses the next block of records; False at the end of the file.

        Raises:
          CorruptRecordError: If the block before ended at damage.
        """
        self._check_open()
        if self._block.error is not None:
            raise self._block.error
        assert self._reader is not None
        self._block = self._reader.read_block()
        self._records = iter(self._block.records)
        if not self._block.records:
            if self._block.error is not None:
                raise self._block.error
            return False
        return True

    def get_state(self) -> dict[str, Any]:
        return {"reader_offset": self._offset()}

    def _offset(self) -> int:
        block = self._block
        taken = len(block.records) - operator.length_hint(self._records)
        return block.ends[taken - 1] if taken else block.start

    def set_state(self, state: dict[str, Any]) -> None:
        offset = self._state_int(state, "reader_offset")
        self._check_open()
        block = self._block
        taken = bisect.bisect_left(block.ends, offset) + 1 if offset != block.start else 0
        if taken == 0 or taken <= len(block.ends) and block.ends[taken - 1] == offset:
            self._records = iter(block.records)
            self._records.__setstate__(taken)  # type: ignore[attr-defined]
        elif self._reader is not None and self._reader.seek(offset):
            self._start_block_at(offset)
        else:
            self._open_at(offset)

    def close(self) -> None:
        if self._closed:
            return
        if self._reader is not None:
            self._reader.close()
        self._records = iter(())
        super().close()

    def __repr__(self) -> str:
        return f"TFRecordFileIterator({self._path!r})"

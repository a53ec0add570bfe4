"""``TFRecordIterDataset``: streams the records of TFRecord files, verifying both checksums."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from grain_core.dataset.base import DatasetIterator, IterDataset
from grain_core.dataset.interleave import InterleaveDatasetIterator, InterleaveIterDataset
from grain_tfrecord._framing import PathLike, compression_for, expand_paths
from grain_tfrecord._stream import Block, FrameReader

__all__ = ["TFRecordIterDataset"]


class TFRecordIterDataset(IterDataset[bytes]):
    """Yields the records (``bytes``) of one or more TFRecord files, in order.

    Every record's length CRC and data CRC are checked before it is returned. One file has
    the state ``{"reader_offset": byte offset of the next record}`` (for compressed files, an
    offset in the decompressed stream; restoring it re-reads the file up to there). Several
    files are read through an ``InterleaveIterDataset`` of one dataset per file (state: the
    interleave state), which ``mp_prefetch`` slices by file; files read one after the other
    (``cycle_length=1``) hand out their records without a hop through the interleave.

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
        interleave = self._parents[0]
        if interleave.cycle_length == 1:
            return TFRecordChainIterator(interleave)
        return interleave.__iter__()

    def __repr__(self) -> str:
        return f"TFRecordIterDataset(path={list(self._paths)!r}, verify_crc={self._verify_crc})"


class TFRecordFileIterator(DatasetIterator[bytes]):
    """Hands out the records of one file from blocks parsed by a :class:`FrameReader`.

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
        self._block = Block([], offset, None)
        # An iterator over the block's records: its length hint tells how many are left.
        self._records = iter(self._block.records)

    @property
    def block_records(self) -> Iterator[bytes]:
        """The rest of the current block: taking a record from it advances this iterator."""
        return self._records

    def __next__(self) -> bytes:
        record = next(self._records, None)
        if record is None:
            return self._next_block()
        return record

    def _next_block(self) -> bytes:
        self._check_open()
        if self._block.error is not None:
            raise self._block.error
        assert self._reader is not None
        self._block = self._reader.read_block()
        self._records = iter(self._block.records)
        if not self._block.records:
            if self._block.error is not None:
                raise self._block.error
            raise StopIteration
        return next(self._records)

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


class TFRecordChainIterator(InterleaveDatasetIterator):
    """The interleave iterator over one dataset per file, read one after the other.

    Records are taken straight from the current file iterator's block (its
    :attr:`~TFRecordFileIterator.block_records`), which advances that iterator exactly as its
    own ``__next__`` would: the state stays the interleave state and every check
    is unchanged, while the per-record hop through the interleave and the file iterator is
    skipped. At the end of a block, the record comes through the interleave as usual.

    Args:
      ds: An interleave with ``cycle_length=1`` over ``TFRecordIterDataset`` s of one file.
    """

    def __init__(self, ds: InterleaveIterDataset) -> None:
        super().__init__(ds)
        self._records: Iterator[bytes] = iter(())

    def __next__(self) -> bytes:
        record = next(self._records, None)
        if record is None:
            return self._next_through_interleave()
        return record

    def _next_through_interleave(self) -> bytes:
        record = super().__next__()
        current = self._iters[0]  # the only slot, which has just produced the record
        if isinstance(current, TFRecordFileIterator):
            self._records = current.block_records
        return record

    def set_state(self, state: dict[str, Any]) -> None:
        self._records = iter(())  # the file iterators may be repositioned or replaced
        super().set_state(state)

    def _set_next_index(self, index: int) -> None:
        self._records = iter(())
        super()._set_next_index(index)

    def close(self) -> None:
        self._records = iter(())
        super().close()

    def __repr__(self) -> str:
        return f"TFRecordChainIterator(num_files={self._num_datasets})"

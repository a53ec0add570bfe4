"""Sequential reading of TFRecord frames: large reads, a block of frames parsed per read.

``FrameReader`` reads a megabyte at a time and ``read_block`` slices up to 256 KiB of
complete frames out of the buffer. A run of frames of one length (fixed-size records) is
handled as a whole: its headers are compared in one ``struct`` unpack, and the per-record
Python work is a slice. Other frames go through one tight loop that checks each length CRC
(a damaged length must not be followed) and collects the stored data CRCs. Either way the
data CRCs of a block are computed with ``crc32c`` (one call per record) and compared with the
stored ones all at once (NumPy unmasks them), and a length CRC is computed once per distinct
length (most files repeat few lengths). The iterator
hands out the records of a block through a list iterator, so its ``__next__`` does almost
nothing.
"""

from __future__ import annotations

import itertools
import os
import struct
import zlib
from collections.abc import Mapping
from typing import Any, BinaryIO, Final, Protocol, cast

import crc32c
import numpy as np

from grain_core import storage
from grain_tfrecord._framing import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    HEADER,
    HEADER_SIZE,
    MASK_DELTA,
    U32,
    U64,
    WBITS,
    CorruptRecordError,
    crc_error,
    masked_crc,
    truncated_error,
)

__all__ = ["CHUNK_SIZE", "Block", "ByteStream", "FrameReader", "InflatingReader", "open_stream"]

# Large reads amortise the cost of a system call and of the decompressor's setup.
CHUNK_SIZE: Final = 1 << 20
# Largest single read when a (possibly garbage) length asks for more: memory then grows only
# as far as the file really goes.
_MAX_READ: Final = 1 << 26
# Payload bytes per block: large enough to spread the fixed cost of the vectorised checks of
# a run over a few hundred small records, small enough that the records of a block (alive
# together) stay well below the allocator's trim threshold (glibc raises it to twice the
# chunk size once the first chunk is freed), so their memory is reused, not faulted in anew.
_BLOCK_BYTES: Final = 1 << 18
# A frame's data CRC followed by the next frame's header.
_FOOTER_AND_HEADER: Final = struct.Struct("<IQI")
# Header CRCs cached per length; cleared when full (files with very many distinct lengths).
_HEADER_CACHE_SIZE: Final = 1 << 16
# Shortest run of equal-length frames checked with NumPy: below it, NumPy's fixed cost per
# call outweighs what the vectorised checks save over the per-frame loop.
_MIN_RUN: Final = 16
_MASK_DELTA_U32: Final = np.uint32(MASK_DELTA)
# Header layouts cached per (length, run size): one per record size, plus the shorter runs at
# the ends of buffers.
_RUN_LAYOUT_CACHE_SIZE: Final = 16


class ByteStream(Protocol):
    """What the reader needs of a file: ``read(n)`` (fewer bytes only at the end) and close."""

    def read(self, size: int, /) -> bytes | None: ...

    def close(self) -> None: ...


class InflatingReader:
    """``read(n)`` over the decompressed bytes of a GZIP or ZLIB file (several members allowed).

    Args:
      path: The compressed file.
      compression: ``"GZIP"`` or ``"ZLIB"``.

    Raises:
      CorruptRecordError: From ``read``, if the compressed stream is damaged.
    """

    def __init__(
        self, path: str, compression: str, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        self._path = path
        self._compression = compression
        self._wbits = WBITS[compression]
        self._raw = storage.open_read(path, storage_options)
        self._inflater = zlib.decompressobj(self._wbits)
        self._position = 0

    def read(self, size: int) -> bytes:
        """Returns up to ``size`` decompressed bytes; fewer only at the end of the stream."""
        parts = []
        have = 0
        while have < size:
            piece = self._inflate(size - have)
            if not piece:
                break
            parts.append(piece)
            have += len(piece)
        self._position += have
        return b"".join(parts)

    def _inflate(self, limit: int) -> bytes:
        inflater = self._inflater
        while True:
            if inflater.unconsumed_tail:
                compressed = inflater.unconsumed_tail
            elif inflater.eof and inflater.unused_data:
                # Concatenated members (``cat a.gz b.gz``) form one stream.
                compressed = inflater.unused_data
                inflater = self._inflater = zlib.decompressobj(self._wbits)
            else:
                compressed = self._raw.read(CHUNK_SIZE)
                if not compressed:
                    if not inflater.eof and (self._position or inflater.unconsumed_tail):
                        raise self._damaged("the compressed stream ends early")
                    return b""
            try:
                piece = inflater.decompress(compressed, limit)
            except zlib.error as err:
                raise self._damaged(str(err)) from None
            if piece:
                return piece

    def _damaged(self, why: str) -> CorruptRecordError:
        return CorruptRecordError(
            f"{self._path}: the {self._compression} data is damaged after {self._position} "
            f"decompressed bytes ({why}). Re-create or re-download the file.",
            path=self._path,
            offset=self._position,
            reason="compressed stream",
        )

    def close(self) -> None:
        self._raw.close()


def open_stream(
    path: str,
    compression: str | None,
    offset: int,
    storage_options: Mapping[str, Any] | None = None,
) -> ByteStream:
    """Opens ``path`` (local or URL) positioned at (decompressed) byte ``offset``.

    Remote files are read with large sequential read-ahead (see ``grain_core.storage``).

    Raises:
      FileNotFoundError: If the file does not exist.
    """
    if compression is None:
        return storage.open_read(path, storage_options, offset=offset)
    reader = InflatingReader(path, compression, storage_options)
    while offset > 0:  # a compressed stream can only be skipped by inflating it
        skipped = len(reader.read(min(offset, _MAX_READ)))
        if not skipped:
            break
        offset -= skipped
    return reader


def _first_crc_failure(records: list[bytes], masked: list[int] | np.ndarray) -> int | None:
    """Returns the index of the first record whose data CRC is not ``masked[k]``, or None."""
    computed = list(map(crc32c.crc32c, records))
    # Unmasked stored CRCs: rotate_left(masked - MASK_DELTA, 15), all at once.
    unmasked = np.asarray(masked, dtype=np.uint32) - _MASK_DELTA_U32
    expected = ((unmasked << 15) | (unmasked >> 17)).tolist()
    if computed == expected:
        return None
    return next(k for k, (a, b) in enumerate(zip(computed, expected, strict=True)) if a != b)


class Block:
    """Records parsed from one read, and what to raise after the last of them.

    Attributes:
      records: Payloads, in file order.
      start: Stream offset of the first record's frame.
      error: Raised when the consumer passes the last record (a damaged or truncated frame
        follows it); None when the file simply continues or ends.
    """

    __slots__ = ("records", "start", "error", "_ends")

    def __init__(self, records: list[bytes], start: int, error: CorruptRecordError | None) -> None:
        self.records = records
        self.start = start
        self.error = error
        self._ends: list[int] | None = None

    @property
    def ends(self) -> list[int]:
        """``ends[k]``: stream offset just after record ``k``'s frame (computed on first use)."""
        if self._ends is None:
            self._ends = [
                self.start + total + FRAME_OVERHEAD * (k + 1)
                for k, total in enumerate(itertools.accumulate(map(len, self.records)))
            ]
        return self._ends


class FrameReader:
    """Reads TFRecord frames from ``offset`` on, a block of complete frames at a time.

    Args:
      path: The file (local path or URL).
      compression: ``"GZIP"``, ``"ZLIB"`` or None.
      verify_crc: Check both CRCs of every frame.
      offset: Stream offset of a frame to start at.
      storage_options: For a URL, passed to its fsspec file system.

    Raises:
      FileNotFoundError: If the file does not exist.
    """

    def __init__(
        self,
        path: str,
        compression: str | None,
        verify_crc: bool,
        offset: int,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._path = path
        self._verify = verify_crc
        self._stream = open_stream(path, compression, offset, storage_options)
        # Bounds what a garbage length may make us read (unknown for compressed files).
        self._size = None if compression else self._stream_size(path)
        self._unread = None if self._size is None else max(self._size - offset, 0)
        self._at_end = False
        self._buf = b""  # the bytes read and not yet parsed start at self._buf[self._pos]
        self._pos = 0
        self._offset = offset  # stream offset of self._buf[self._pos]
        self._header_crcs: dict[int, int] = {}
        self._run_layouts: dict[tuple[int, int], struct.Struct] = {}
        # The first chunk is read now, not on the first ``read_block``: a reader created ahead
        # of its turn (the interleave over several files creates the next file's iterator on a
        # thread) then downloads its first block (``storage.READ_AHEAD_BYTES`` of a remote
        # file) while the file before it is parsed.
        self._fill(CHUNK_SIZE)

    def seek(self, offset: int) -> bool:
        """Moves to the frame at stream ``offset`` without opening the file again: within the
        bytes read when they hold it, otherwise by seeking the stream (a remote file's blocks
        already fetched are not fetched again).

        Returns:
          False for a compressed stream, which cannot seek: open a new reader at ``offset``.
        """
        if self._size is None:
            return False
        if self._offset <= offset <= self._offset + len(self._buf) - self._pos:
            self._pos += offset - self._offset
        else:
            # Uncompressed: the stream is the file itself (see open_stream).
            cast(BinaryIO, self._stream).seek(offset)
            self._buf = b""
            self._pos = 0
            self._unread = max(self._size - offset, 0)
            self._at_end = False
        self._offset = offset
        return True

    def _stream_size(self, path: str) -> int:
        # An fsspec file knows its size from opening; a local file is asked.
        known = getattr(self._stream, "size", None)
        return int(known) if isinstance(known, int) else os.path.getsize(path)

    def read_block(self) -> Block:
        """Returns the next block; its ``records`` are empty only at the end or on an error.

        Raises:
          CorruptRecordError: If a compressed stream is damaged.
        """
        while True:
            block = self._parse()
            if block.records or block.error:
                return block
            left = len(self._buf) - self._pos
            if self._at_end:
                if left:
                    block.error = self._truncated()
                return block
            # A frame cut by the end of the buffer is completed on its own (its header first),
            # so that the next read starts a new buffer on a frame boundary instead of copying
            # a whole chunk to join it to the cut frame's bytes.
            need = CHUNK_SIZE if not left else HEADER_SIZE
            if left >= HEADER_SIZE:
                need = HEADER.unpack_from(self._buf, self._pos)[0] + FRAME_OVERHEAD
                if self._unread is not None and need - left > self._unread:
                    block.error = self._truncated()
                    return block
            self._fill(need)

    def _fill(self, need: int) -> None:
        """Reads until ``need`` unparsed bytes are buffered or the stream ends."""
        left = self._buf[self._pos :]
        parts = [left] if left else []
        want = need - len(left)
        if self._unread is not None:
            want = min(want, self._unread)
        read = self._stream.read
        while want > 0:
            chunk = read(min(want, _MAX_READ))
            if not chunk:
                self._at_end = True
                break
            parts.append(chunk)
            want -= len(chunk)
            if self._unread is not None:
                self._unread -= len(chunk)
        if self._unread == 0:
            self._at_end = True
        self._buf = b"".join(parts)  # a single part is taken as is, without a copy
        self._pos = 0

    def _truncated(self) -> CorruptRecordError:
        left = len(self._buf) - self._pos
        available = left + (self._unread or 0)
        if left < HEADER_SIZE:
            return truncated_error(self._path, self._offset, HEADER_SIZE, available, "header")
        length = HEADER.unpack_from(self._buf, self._pos)[0]
        return truncated_error(
            self._path, self._offset, length + FRAME_OVERHEAD, available, "payload"
        )

    def _parse(self) -> Block:
        """Slices up to _BLOCK_BYTES of complete frames out of the buffer."""
        return self._parse_run() or self._parse_frames()

    def _parse_run(self) -> Block | None:
        """Takes a run of complete frames with the first frame's header, or returns None.

        The run stops before the first frame whose header differs or whose data CRC fails:
        a damaged frame is left to :meth:`_parse_frames`, which raises the error naming it.
        Returns None for runs shorter than _MIN_RUN.
        """
        buf = self._buf
        pos = self._pos
        if pos + HEADER_SIZE > len(buf):
            return None
        length, length_crc = HEADER.unpack_from(buf, pos)
        stride = length + FRAME_OVERHEAD
        count = min((len(buf) - pos) // stride, _BLOCK_BYTES // stride)
        if count < _MIN_RUN or (self._verify and self._check_header(buf, pos, length, length_crc)):
            return None
        last_of_shortest = pos + (_MIN_RUN - 1) * stride
        if buf[last_of_shortest : last_of_shortest + HEADER_SIZE] != buf[pos : pos + HEADER_SIZE]:
            return None  # most likely frames of varying lengths: no layout is built for them
        headers = self._run_headers(length, count).unpack_from(buf, pos)
        if headers.count(headers[0]) != count:
            count = next(k for k, header in enumerate(headers) if header != headers[0])
        first = pos + HEADER_SIZE
        end = pos + count * stride
        records = [buf[start : start + length] for start in range(first, end, stride)]
        if self._verify:
            masked = np.ndarray((count,), "<u4", buf, first + length, (stride,))
            failed = _first_crc_failure(records, masked)
            if failed is not None:
                count = failed
                del records[count:]
        if count < _MIN_RUN:
            return None
        self._offset += count * stride
        self._pos = pos + count * stride
        return Block(records, self._offset - count * stride, None)

    def _run_headers(self, length: int, count: int) -> struct.Struct:
        """The layout unpacking the headers (as 12-byte strings) of ``count`` frames."""
        layout = self._run_layouts.get((length, count))
        if layout is None:
            if len(self._run_layouts) >= _RUN_LAYOUT_CACHE_SIZE:
                self._run_layouts.clear()
            skip = length + FOOTER_SIZE
            layout = struct.Struct("<" + f"12s{skip}x" * (count - 1) + "12s")
            self._run_layouts[(length, count)] = layout
        return layout

    def _parse_frames(self) -> Block:
        """Slices frames one by one (any lengths), stopping at the first damaged one.

        Length CRCs are checked in the loop (a damaged length must not be followed); the
        data CRCs of the frames sliced are checked together afterwards.
        """
        buf = self._buf
        pos = first = self._pos
        size = len(buf)
        records: list[bytes] = []
        stored: list[int] = []  # the masked data CRCs of the records
        error = None
        if pos + HEADER_SIZE <= size:
            append = records.append
            append_stored = stored.append
            verify = self._verify
            unpack_footer_and_header = _FOOTER_AND_HEADER.unpack_from
            block_end = pos + _BLOCK_BYTES
            header_crcs = self._header_crcs
            length, length_crc = HEADER.unpack_from(buf, pos)
            # Literal sizes in this loop: 12-byte header, payload, 4-byte footer.
            while True:
                if verify and header_crcs.get(length) != length_crc:
                    error = self._check_header(buf, pos, length, length_crc)
                    if error:
                        break
                stop = pos + 12 + length
                # One unpack reads this frame's data CRC and the next frame's header.
                if stop + 16 <= size:
                    data_crc, next_length, next_length_crc = unpack_footer_and_header(buf, stop)
                elif stop + 4 <= size:
                    data_crc, next_length, next_length_crc = U32.unpack_from(buf, stop)[0], -1, 0
                else:
                    break
                append(buf[pos + 12 : stop])
                append_stored(data_crc)
                pos = stop + 4
                if next_length < 0 or pos >= block_end:
                    break
                length, length_crc = next_length, next_length_crc
        if self._verify and records:
            failed = _first_crc_failure(records, stored)
            if failed is not None:
                pos = first + sum(map(len, records[:failed])) + failed * FRAME_OVERHEAD
                del records[failed:]
                error = crc_error(self._path, self._offset + pos - first, "data CRC", b"")
        block = Block(records, self._offset, error)
        self._offset += pos - first
        self._pos = pos
        return block

    def _check_header(
        self, buf: bytes, pos: int, length: int, length_crc: int
    ) -> CorruptRecordError | None:
        """Checks a length CRC (cached per length); returns the error if it is wrong."""
        if self._header_crcs.get(length) == length_crc:
            return None
        expected = masked_crc(U64.pack(length))
        if expected != length_crc:
            offset = self._offset + pos - self._pos
            return crc_error(self._path, offset, "length CRC", buf[pos : pos + 2])
        if len(self._header_crcs) >= _HEADER_CACHE_SIZE:
            self._header_crcs.clear()
        self._header_crcs[length] = length_crc
        return None

    def close(self) -> None:
        self._stream.close()

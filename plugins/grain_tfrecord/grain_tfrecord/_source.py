"""``TFRecordDataSource``: random access to the records of uncompressed TFRecord files.

The first open of a file scans its frame headers (checking every length CRC, never reading
a payload it can skip) and stores the frame offsets in a sidecar index file next to it
(``.<name>.tfrindex``, hidden so that globs over the data files do not pick it up). Later
opens load the sidecar after checking it against the data file's size and modification time
and its own checksum; a stale or damaged sidecar is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import operator
import os
import struct
import tempfile
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Final, SupportsIndex

import crc32c
import numpy as np

from grain_core.sources import record_keys_array
from grain_tfrecord._framing import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    HEADER,
    HEADER_SIZE,
    U32,
    U64,
    CorruptRecordError,
    PathLike,
    compression_for,
    crc_error,
    expand_paths,
    masked_crc,
    truncated_error,
)

__all__ = ["INDEX_SUFFIX", "TFRecordDataSource", "index_path_for", "load_or_build_index"]

INDEX_SUFFIX: Final = ".tfrindex"
# magic, data file size, data file mtime_ns, record count, CRC32C of the rest of the file.
_INDEX_HEADER: Final = struct.Struct("<8sQqQI")
_INDEX_MAGIC: Final = b"GRTFIDX1"
_SCAN_CHUNK: Final = 1 << 20
# Records of one batch that are at most this far apart are read with one pread: a system
# call costs more than reading a few pages that are not needed.
_COALESCE_GAP: Final = 1 << 13


class TFRecordDataSource:
    """Random access to the records (``bytes``) of uncompressed TFRecord files.

    Records are numbered in file order, then frame order. Both CRCs of a record are checked
    on every read unless ``verify_crc=False`` (unsafe: corrupt data is returned as is).
    ``__getitems__`` reads a batch in file and offset order, one ``os.pread`` per run of
    nearby records. The source pickles without open files, for worker processes.

    Args:
      paths: A path, a sequence of paths, or a pattern (``x.tfrecord-*``, ``x.tfrecord@16``).
      verify_crc: Check both CRCs of each record read.
      index_dir: Directory for the sidecar index files (default: next to each data file,
        as ``.<name>.tfrindex``). When it cannot be written the index is kept in memory.

    Raises:
      ValueError: If a file is GZIP/ZLIB-compressed (no random access into a compressed
        stream) or no file is given.
      FileNotFoundError: If a file does not exist.
      CorruptRecordError: If a file is truncated or its headers are corrupt.
    """

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        *,
        verify_crc: bool = True,
        index_dir: PathLike | None = None,
    ) -> None:
        self._paths = tuple(expand_paths(paths, "TFRecordDataSource"))
        self._verify = bool(verify_crc)
        self._index_dir = None if index_dir is None else os.fspath(index_dir)
        for path in self._paths:
            compression = compression_for(path, None)
            if compression:
                raise ValueError(
                    f"TFRecordDataSource needs uncompressed files for random access, but {path} "
                    f"is {compression}-compressed. Stream it with TFRecordIterDataset, or "
                    "rewrite it uncompressed (TFRecordWriter, or `grain-core convert`)."
                )
        self._offsets = [load_or_build_index(p, self._index_dir) for p in self._paths]
        self._sizes = [os.path.getsize(p) for p in self._paths]
        # _first[k]: global index of file k's first record; the last entry is len(self).
        self._first = np.cumsum([0] + [len(o) for o in self._offsets])
        # Frame end of every record of every file (the next frame's start, or the file size;
        # an empty file has none).
        self._ends = [
            np.append(o[1:], np.int64(size)) if len(o) else o
            for o, size in zip(self._offsets, self._sizes, strict=True)
        ]
        self._all_offsets = np.concatenate([*self._offsets, np.zeros(0, np.int64)])
        self._all_ends = np.concatenate([*self._ends, np.zeros(0, np.int64)])
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, record_key: SupportsIndex) -> bytes:
        index = operator.index(record_key)
        if not 0 <= index < len(self):
            raise IndexError(f"Record index {index} out of range for {len(self)} records.")
        file_index = int(np.searchsorted(self._first, index, side="right")) - 1
        start = int(self._all_offsets[index])
        frame = os.pread(self._fd(file_index), int(self._all_ends[index]) - start, start)
        return self._payload(frame, 0, len(frame), file_index, index, start)

    def __getitems__(self, record_keys: Sequence[SupportsIndex]) -> list[bytes]:
        """Reads many records: sorted by position, nearby ones with a single pread."""
        indices = record_keys_array(record_keys)
        if indices.size == 0:
            return []
        if int(indices.min()) < 0 or int(indices.max()) >= len(self):
            bad = int(indices[(indices < 0) | (indices >= len(self))][0])
            raise IndexError(f"Record index {bad} out of range for {len(self)} records.")
        order = np.argsort(indices, kind="stable")
        wanted = indices[order]
        starts = self._all_offsets[wanted]
        ends = self._all_ends[wanted]
        files = np.searchsorted(self._first, wanted, side="right") - 1
        # A new run starts at a file change or where the gap to the previous frame is large.
        new_run = np.empty(wanted.size, dtype=bool)
        new_run[0] = True
        new_run[1:] = (files[1:] != files[:-1]) | (starts[1:] - ends[:-1] > _COALESCE_GAP)
        run_ids = np.cumsum(new_run) - 1
        run_heads = np.flatnonzero(new_run)
        run_starts = starts[run_heads]
        run_ends = np.maximum.reduceat(ends, run_heads)
        out: list[bytes] = [b""] * indices.size
        buffers = [
            os.pread(self._fd(int(f)), int(e - s), int(s))
            for f, s, e in zip(files[run_heads], run_starts, run_ends, strict=True)
        ]
        relative = (starts - run_starts[run_ids]).tolist()
        sizes = (ends - starts).tolist()
        for k, (run, rel, size) in enumerate(zip(run_ids.tolist(), relative, sizes, strict=True)):
            position = int(order[k])
            out[position] = self._payload(
                buffers[run],
                rel,
                rel + size,
                int(files[run_heads[run]]),
                int(wanted[k]),
                int(starts[k]),
            )
        return out

    def _payload(
        self, buf: bytes, begin: int, end: int, file_index: int, index: int, offset: int
    ) -> bytes:
        """Returns the payload of the frame ``buf[begin:end]``, checking both CRCs."""
        path = self._paths[file_index]
        if end - begin < FRAME_OVERHEAD or end > len(buf):
            raise truncated_error(path, offset, FRAME_OVERHEAD, len(buf) - begin, "payload")
        length, length_crc = HEADER.unpack_from(buf, begin)
        stop = begin + HEADER_SIZE + length
        if stop + FOOTER_SIZE != end:
            raise CorruptRecordError(
                f"{path} changed since it was indexed: record {index} at byte offset {offset} "
                f"now has length {length}. Open a new TFRecordDataSource (the index is rebuilt).",
                path=path,
                offset=offset,
                reason="stale index",
            )
        if self._verify:
            if masked_crc(buf[begin : begin + 8]) != length_crc:
                raise crc_error(path, offset, "length CRC", b"")
            data = buf[begin + HEADER_SIZE : stop]
            if masked_crc(data) != U32.unpack_from(buf, stop)[0]:
                raise crc_error(path, offset, "data CRC", b"")
            return data
        return buf[begin + HEADER_SIZE : stop]

    def _fd(self, file_index: int) -> int:
        fd = self._fds.get(file_index)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file_index)
                if fd is None:
                    fd = self._fds[file_index] = os.open(self._paths[file_index], os.O_RDONLY)
        return fd

    def __repr__(self) -> str:
        return f"TFRecordDataSource(paths={list(self._paths)!r}, verify_crc={self._verify})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Closes the open files (they are reopened on the next read)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)


# ----------------------------------------------------------------------------- the index
def index_path_for(path: str, index_dir: str | None = None) -> str:
    """Returns where the sidecar index of ``path`` lives."""
    directory, name = os.path.split(os.path.abspath(path))
    if index_dir is None:
        return os.path.join(directory, f".{name}{INDEX_SUFFIX}")
    digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    return os.path.join(index_dir, f"{name}.{digest}{INDEX_SUFFIX}")


def load_or_build_index(path: str, index_dir: str | None = None) -> np.ndarray:
    """Returns the frame offsets of ``path`` from its valid sidecar, or scans and saves them.

    Raises:
      FileNotFoundError: If ``path`` does not exist.
      CorruptRecordError: If the file is truncated or a header is corrupt.
    """
    stat = os.stat(path)
    sidecar = index_path_for(path, index_dir)
    offsets = _read_index(sidecar, stat)
    if offsets is None:
        offsets = scan_offsets(path)
        _write_index(sidecar, stat, offsets)
    return offsets


def _read_index(sidecar: str, stat: os.stat_result) -> np.ndarray | None:
    """The offsets stored in ``sidecar`` if it is intact and describes the file as it is now."""
    try:
        with open(sidecar, "rb") as file:
            data = file.read()
    except OSError:
        return None
    if len(data) < _INDEX_HEADER.size:
        return None
    magic, size, mtime_ns, count, checksum = _INDEX_HEADER.unpack_from(data)
    body = data[_INDEX_HEADER.size :]
    if (
        magic != _INDEX_MAGIC
        or size != stat.st_size
        or mtime_ns != stat.st_mtime_ns
        or len(body) != 8 * count
        or crc32c.crc32c(body, crc32c.crc32c(data[: _INDEX_HEADER.size - 4])) != checksum
    ):
        return None
    return np.frombuffer(body, dtype="<i8").astype(np.int64)


def _write_index(sidecar: str, stat: os.stat_result, offsets: np.ndarray) -> None:
    body = offsets.astype("<i8").tobytes()
    head = _INDEX_HEADER.pack(_INDEX_MAGIC, stat.st_size, stat.st_mtime_ns, len(offsets), 0)
    checksum = crc32c.crc32c(body, crc32c.crc32c(head[:-4]))
    head = head[:-4] + U32.pack(checksum)
    directory = os.path.dirname(sidecar)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=INDEX_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(head + body)
            os.replace(tmp, sidecar)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        warnings.warn(
            f"Could not save the TFRecord index {sidecar} ({err}); it is kept in memory and "
            "rebuilt next time. Pass index_dir= to store indexes in a writable directory.",
            stacklevel=3,
        )


def scan_offsets(path: str) -> np.ndarray:
    """Returns the start offset of every frame of ``path``, checking each length CRC.

    Payloads are not read where the next header lies beyond the current read buffer.

    Raises:
      CorruptRecordError: If the file is truncated or a header is corrupt (or it is not a
        TFRecord file).
    """
    offsets: list[int] = []
    append = offsets.append
    header_crcs: dict[int, int] = {}
    unpack_header = HEADER.unpack_from
    size = os.path.getsize(path)
    with open(path, "rb", buffering=0) as file:
        fd = file.fileno()
        buf = b""
        buf_start = 0  # file offset of buf[0]
        offset = 0
        while offset < size:
            pos = offset - buf_start
            if pos < 0 or pos + HEADER_SIZE > len(buf):
                buf_start, buf = offset, os.pread(fd, _SCAN_CHUNK, offset)
                pos = 0
                if len(buf) < HEADER_SIZE:
                    raise truncated_error(path, offset, HEADER_SIZE, len(buf), "header")
            length, length_crc = unpack_header(buf, pos)
            if header_crcs.get(length) != length_crc:
                expected = masked_crc(U64.pack(length))
                if expected != length_crc:
                    raise crc_error(path, offset, "length CRC", buf[pos : pos + 2])
                header_crcs[length] = expected
            append(offset)
            offset += length + FRAME_OVERHEAD
        if offset > size:
            last = offsets[-1]
            raise truncated_error(path, last, offset - last, size - last, "payload")
    return np.array(offsets, dtype=np.int64)

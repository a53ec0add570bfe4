"""``TFRecordDataSource``: random access to the records of uncompressed TFRecord files.

The first open of a file scans its frame headers (checking every length CRC, never reading
a payload it can skip) and stores the frame offsets in a sidecar index file. The sidecar lives
next to a local file in a writable directory (``.<name>.tfrindex``, hidden so that globs over
the data files do not pick it up); for a remote file (``s3://``, ``gs://``, ...) or one in a
read-only directory it lives in the local cache directory (``grain_core.storage.cache_dir``,
``$GRAIN_CORE_CACHE_DIR``), never beside the data. Later opens load the sidecar after checking
it against the data file's size and version (modification time, or the store's ETag) and its
own checksum; a stale or damaged sidecar is rebuilt, never trusted.

Records are read with ``os.pread`` locally and with ranged requests remotely, the runs of one
batch requested concurrently (``grain_core.storage.RangeReader``).
"""

from __future__ import annotations

import hashlib
import operator
import os
import struct
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Final, SupportsIndex

import crc32c
import numpy as np

from grain_core import storage
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
# magic, data file size, digest of the data file's version, record count, CRC32C of the rest.
_INDEX_HEADER: Final = struct.Struct("<8sQ8sQI")
_INDEX_MAGIC: Final = b"GRTFIDX2"
_SCAN_CHUNK: Final = 1 << 20
# Records of one batch that are at most this far apart are read with one pread: a system
# call costs more than reading a few pages that are not needed.
_COALESCE_GAP: Final = 1 << 13


class TFRecordDataSource:
    """Random access to the records (``bytes``) of uncompressed TFRecord files.

    Records are numbered in file order, then frame order. Both CRCs of a record are checked
    on every read unless ``verify_crc=False`` (unsafe: corrupt data is returned as is).
    ``__getitems__`` reads a batch in file and offset order, one read per run of nearby
    records (``os.pread`` locally; ranged requests, issued concurrently, for URLs). The source
    pickles without open files, for worker processes.

    Args:
      paths: A path, a sequence of paths, or a pattern (``x.tfrecord-*``, ``x.tfrecord@16``),
        local or URLs (``s3://bucket/x.tfrecord-*``).
      verify_crc: Check both CRCs of each record read.
      index_dir: Local directory for the sidecar index files (default: next to a local data
        file in a writable directory, as ``.<name>.tfrindex``, else the cache directory).
        When it cannot be written the index is kept in memory, with a warning.
      storage_options: For URLs, passed to the fsspec file system (endpoint, credentials,
        retries); worker processes open the files with the same.

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
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        options = dict(storage_options or {})
        self._paths = tuple(expand_paths(paths, "TFRecordDataSource", options))
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
        versions = [storage.version(p, options) for p in self._paths]
        self._offsets = [
            load_or_build_index(p, self._index_dir, options, version)
            for p, version in zip(self._paths, versions, strict=True)
        ]
        self._sizes = [size for size, _ in versions]
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
        self._readers = [storage.RangeReader(p, options) for p in self._paths]

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, record_key: SupportsIndex) -> bytes:
        index = operator.index(record_key)
        if not 0 <= index < len(self):
            raise IndexError(f"Record index {index} out of range for {len(self)} records.")
        file_index = int(np.searchsorted(self._first, index, side="right")) - 1
        start = int(self._all_offsets[index])
        frame = self._readers[file_index].read(start, int(self._all_ends[index]))
        return self._payload(frame, 0, len(frame), file_index, index, start)

    def __getitems__(self, record_keys: Sequence[SupportsIndex]) -> list[bytes]:
        """Reads many records: sorted by position, nearby ones with a single read."""
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
        run_files = files[run_heads]
        buffers: list[bytes] = [b""] * len(run_heads)
        for file_index in np.unique(run_files).tolist():
            runs = np.flatnonzero(run_files == file_index)
            parts = self._readers[file_index].read_many(
                run_starts[runs].tolist(), run_ends[runs].tolist()
            )
            for run, part in zip(runs.tolist(), parts, strict=True):
                buffers[run] = part
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

    def __repr__(self) -> str:
        return f"TFRecordDataSource(paths={list(self._paths)!r}, verify_crc={self._verify})"

    def close(self) -> None:
        """Closes the open files (they are reopened on the next read)."""
        for reader in self._readers:
            reader.close()


# ----------------------------------------------------------------------------- the index
def index_path_for(path: str, index_dir: str | None = None) -> str:
    """Returns where the sidecar index of ``path`` is written: in ``index_dir`` when given,
    next to a local file (hidden), else (a URL) in the cache directory."""
    if index_dir is None and not storage.is_url(path):
        directory, name = os.path.split(os.path.abspath(path))
        return os.path.join(directory, f".{name}{INDEX_SUFFIX}")
    return _cached_index_path(path, index_dir)


def _cached_index_path(path: str, index_dir: str | None) -> str:
    key = path if storage.is_url(path) else os.path.abspath(path)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = key.rstrip("/").rsplit("/", 1)[-1]
    directory = storage.cache_dir("tfrecord-index") if index_dir is None else index_dir
    return os.path.join(directory, f"{name}.{digest}{INDEX_SUFFIX}")


def load_or_build_index(
    path: str,
    index_dir: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    version: tuple[int, str] | None = None,
) -> np.ndarray:
    """Returns the frame offsets of ``path`` from its valid sidecar, or scans and saves them.

    A local file's sidecar is written next to it, or in the cache directory when its
    directory cannot be written (read-only data: no warning); a URL's in the cache directory.

    Args:
      path: The data file, local or a URL.
      index_dir: Where to keep the sidecar instead (see :func:`index_path_for`).
      storage_options: For a URL, passed to its fsspec file system.
      version: ``storage.version(path)`` if the caller has it already.

    Raises:
      FileNotFoundError: If ``path`` does not exist.
      CorruptRecordError: If the file is truncated or a header is corrupt.
    """
    size, identity = version or storage.version(path, storage_options)
    stamp = (size, hashlib.blake2b(identity.encode(), digest_size=8).digest())
    places = [index_path_for(path, index_dir)]
    if index_dir is None and not storage.is_url(path):
        places.append(_cached_index_path(path, None))  # where read-only data's index goes
    for sidecar in places:
        offsets = _read_index(sidecar, stamp)
        if offsets is not None:
            return offsets
    offsets = scan_offsets(path, storage_options, size)
    errors = []
    for sidecar in places:
        try:
            _write_index(sidecar, stamp, offsets)
            return offsets
        except OSError as err:
            errors.append(f"{sidecar} ({err})")
    warnings.warn(
        f"Could not save the TFRecord index of {path} to {' or '.join(errors)}; it is kept "
        "in memory and rebuilt next time. Pass index_dir= (or set GRAIN_CORE_CACHE_DIR) to "
        "store indexes in a writable directory.",
        stacklevel=3,
    )
    return offsets


def _read_index(sidecar: str, stamp: tuple[int, bytes]) -> np.ndarray | None:
    """The offsets stored in ``sidecar`` if it is intact and describes the file as it is now."""
    try:
        with open(sidecar, "rb") as file:
            data = file.read()
    except OSError:
        return None
    if len(data) < _INDEX_HEADER.size:
        return None
    magic, size, digest, count, checksum = _INDEX_HEADER.unpack_from(data)
    body = data[_INDEX_HEADER.size :]
    if (
        magic != _INDEX_MAGIC
        or (size, digest) != stamp
        or len(body) != 8 * count
        or crc32c.crc32c(body, crc32c.crc32c(data[: _INDEX_HEADER.size - 4])) != checksum
    ):
        return None
    return np.frombuffer(body, dtype="<i8").astype(np.int64)


def _write_index(sidecar: str, stamp: tuple[int, bytes], offsets: np.ndarray) -> None:
    body = offsets.astype("<i8").tobytes()
    head = _INDEX_HEADER.pack(_INDEX_MAGIC, *stamp, len(offsets), 0)
    checksum = crc32c.crc32c(body, crc32c.crc32c(head[:-4]))
    storage.write_bytes(sidecar, head[:-4] + U32.pack(checksum) + body)


def scan_offsets(
    path: str, storage_options: Mapping[str, Any] | None = None, size: int | None = None
) -> np.ndarray:
    """Returns the start offset of every frame of ``path``, checking each length CRC.

    Payloads are not read where the next header lies beyond the current read buffer.

    Args:
      path: The file, local or a URL.
      storage_options: For a URL, passed to its fsspec file system.
      size: The file's size, if the caller has it already.

    Raises:
      CorruptRecordError: If the file is truncated or a header is corrupt (or it is not a
        TFRecord file).
    """
    offsets: list[int] = []
    append = offsets.append
    header_crcs: dict[int, int] = {}
    unpack_header = HEADER.unpack_from
    if size is None:
        size = storage.size(path, storage_options)
    with storage.open_read(path, storage_options) as file:
        buf = b""
        buf_start = 0  # file offset of buf[0]
        offset = 0
        while offset < size:
            pos = offset - buf_start
            if pos < 0 or pos + HEADER_SIZE > len(buf):
                file.seek(offset)
                buf_start, buf = offset, file.read(_SCAN_CHUNK)
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

"""``ArrayRecordDataSource``: random access to the records of ArrayRecord files.

How reads are planned (measured with array_record 0.8.6, 1 KiB records, zstd, 50,000 records
per file, page cache warm, 2 cores; the per-read figures with a 32 KiB file buffer, which
makes range reads about 25% dearer than array_record's own buffer, used now):

* A block of indices is split by file with one numpy sort, and the records are put back in
  request order.
* A file's share is read record by record with one-record range reads ``read(p, p + 1)``:
  about 6 µs of CPU per record whatever the share (group_size 1; ~10 µs with group_size 16,
  which decompresses the record's group every time).
* Only a share of at least ``records_in_file / 16`` positions is read with ONE indexed
  ``read(positions)``, which decompresses in parallel on array_record's thread pool with the
  GIL released. That read sets up per-chunk bookkeeping for the whole file on every call and
  its pool threads spin while they wait for work, so below that share it costs more CPU (and
  below about 1/200 of the file more time too): per record at shares of 64 / 1,024 / 4,096 /
  16,384, group_size 1, indexed 15.8 / 4.9 / 3.2 / 2.8 µs wall and 27 / 8.3 / 5.8 / 5.0 µs
  CPU against 6.6 / 5.8 / 4.5 / 5.3 µs of both record by record (group_size 16: indexed
  12.4 / 6.1 / 3.8 / 1.9 µs wall, record by record ~10.5). With worker processes every core
  is busy and CPU time is the throughput: a DataLoader with 2 workers reading shuffled
  batches of 256 over 4 such files went from 43–48 k to 96–118 k records/s when shares of 64
  stopped using the indexed read. A share of consecutive positions is one range read.
* Readers are shared by all threads without a lock: both reads are const in C++ and release
  the GIL. Measured on 2 cores, 8 threads reading batches of 256: shared readers 30,200
  records/s, one reader per thread 23,900 (the per-thread readers only add file handles and
  index copies), so readers are shared.

Remote files. A URL array_record opens itself (``gs://``) is passed to its reader as it is; a
read there waits on the network, so a block's share of such a file is always one indexed
read (array_record fetches its chunks in parallel) and the shares of several files are read
on a thread pool at once. A URL of another scheme (``s3://``, ``memory://``, ...) is read
from a local copy in a ``grain_core.shard_cache.ShardCache`` (the default one under the
user's cache directory unless one is passed); opening a shard there starts downloading the
next ``read_ahead`` shards of the source in the background, so a pass over the shards in order
overlaps the downloads with reading. The source pins the copies it has open, so the cache
never evicts them. It keeps open copies within half the cache, whatever its threads do at
once (a thread closes the least recently used idle copies first, or waits for reads in
progress on them), and when the cache has no room for the next shard it closes more and asks
again: so a cache smaller than the data set serves every shard, two processes (DataLoader
workers) sharing it each find room, and the full-cache error comes only when the pins of this
source and others alone fill it.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import hashlib
import json
import operator
import os
import re
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, SupportsIndex

import numpy as np
from array_record.python import array_record_module  # type: ignore[import-untyped]

from grain_arrayrecord._paths import PathsArg, parse_paths
from grain_core import storage
from grain_core.shard_cache import PinnedShard, ShardCache, ShardCacheFullError
from grain_core.sources import record_keys_array

__all__ = ["ArrayRecordDataSource", "RecordIndexError"]


class RecordIndexError(IndexError, ValueError):
    """A record key outside ``[0, len)``: the ``IndexError`` of any Python sequence, and the
    ``ValueError`` that array_record's own data source (which Grain's wraps) raises, so code
    written against either catches it."""


# A file's share of a block is read with one indexed read only when it holds at least
# records_in_file / _INDEXED_READ_MIN_FRACTION positions (see the module docstring).
_INDEXED_READ_MIN_FRACTION = 16
# Random access reads one chunk at a time: no readahead. The file buffer stays array_record's
# own: a fixed 32 KiB one cost 6.96 us of CPU per 1 KiB record read at random against 5.33
# (medians of 5 passes of 30,000 reads; 16 KiB and 256 KiB records no slower).
_READER_DEFAULTS = {"readahead_buffer_size": "0"}
_GROUP_SIZE_RE = re.compile(r"(?:^|,)group_size:(\d+)(?:,|$)")
# URL schemes array_record's own reader opens (its build includes a GCS client).
_NATIVE_SCHEMES = ("gs://",)
# Files of one block read at the same time when they are remote.
_REMOTE_READ_THREADS = 16


class ArrayRecordDataSource:
    """Random access to the records (``bytes``) of one or more ArrayRecord files.

    Records are numbered across the read instructions in order. ``__getitems__`` reads a block
    of records with one parallel C++ read per file. The source pickles without open files:
    worker processes reopen the files on their first read.

    Args:
      paths: A path, a glob, ``"file[start:end]"`` (records ``start`` to ``end - 1`` of
        ``file``), a FileInstruction-like object (``filename``, ``skip``, ``take``,
        ``examples_in_shard``), or a sequence of those. Plain paths and globs are opened
        right away to count their records (in parallel); ranges are opened on first read.
      reader_options: ArrayRecord reader options, e.g. ``{"index_storage_option":
        "offloaded"}``; ``readahead_buffer_size`` defaults to ``"0"`` (random access).
      shard_cache: Where URLs array_record cannot open itself (``s3://``, ...) are
        downloaded to and read from; default ``ShardCache()`` (``$GRAIN_CORE_CACHE_DIR``
        or the user's cache directory, bounded by ``$GRAIN_CORE_CACHE_MAX_BYTES`` or 32 GiB;
        see ``grain_core.shard_cache``). Plain paths and globs are downloaded when the
        source is created (to count their records), one after another, and opened again
        when read; ranges and FileInstructions when first read.
      storage_options: For URLs, passed to their fsspec file system (globs, downloads).

    Raises:
      ValueError: On empty ``paths``, a wrong element type, a bad range, bad
        ``reader_options`` or a file that is not a readable ArrayRecord file.
      FileNotFoundError: If a file does not exist or a glob matches nothing.
    """

    def __init__(
        self,
        paths: PathsArg,
        reader_options: Mapping[str, str] | None = None,
        *,
        shard_cache: ShardCache | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._storage_options = dict(storage_options or {})
        self._instructions = parse_paths(paths, self._storage_options)
        self._cached_paths = list(
            dict.fromkeys(i.path for i in self._instructions if _needs_cache(i.path))
        )
        self._cached = frozenset(self._cached_paths)
        self._shard_cache = (
            shard_cache if shard_cache is not None or not self._cached else ShardCache()
        )
        self._reader_options = _options_string(reader_options)
        self._init_runtime()
        plain = sorted({i.path for i in self._instructions if i.end is None})
        counts: dict[str, int] = {}
        opened_here = [p for p in plain if p not in self._cached]
        if opened_here:
            with concurrent.futures.ThreadPoolExecutor(min(16, len(opened_here))) as pool:
                counts = dict(
                    zip(
                        opened_here,
                        pool.map(lambda p: self._reader(p).num_records(), opened_here),
                        strict=True,
                    )
                )
        # Cached shards one after another (their downloads overlap through read-ahead), so
        # that a cache smaller than the data set is not asked for all of them at once.
        for path in (p for p in self._cached_paths if p in plain):
            with self._cached_reader(path) as reader:
                counts[path] = reader.num_records()
        # Read lazily: the copies stay cached but unpinned, so that worker processes (or a
        # second source) sharing the cache have the room this one does not use.
        while self._close_idle_copy():
            pass
        counts_per_instruction = [
            (i.end if i.end is not None else counts[i.path]) - i.start for i in self._instructions
        ]
        self._paths = [i.path for i in self._instructions]
        self._starts = np.array([i.start for i in self._instructions], dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(counts_per_instruction, dtype=np.int64)))
        self._offsets = offsets
        self._offsets_list = offsets.tolist()
        self._len = int(offsets[-1])
        # URLs are identified by name and record counts: their sizes would cost a request each.
        sizes = {
            path: -1 if storage.is_url(path) else os.path.getsize(path) for path in set(self._paths)
        }
        self._fingerprint = _fingerprint(
            (i.path, sizes[i.path], i.start, n)
            for i, n in zip(self._instructions, counts_per_instruction, strict=True)
        )

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()  # guards opening readers, never reading
        self._readers: dict[str, Any] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # remote reads
        # Cached shards: the pin of each open copy, the reads in progress on it (a copy is
        # closed only when none is) and the copies threads are opening; _idle is notified
        # when a count drops to 0 or an opening ends.
        self._pins: dict[str, PinnedShard] = {}
        self._reads: dict[str, int] = {}
        self._opening: set[str] = set()
        self._idle = threading.Condition(self._lock)

    @property
    def paths(self) -> list[str]:
        """The file of each read instruction, in record order."""
        return list(self._paths)

    def checkpoint_reprs(self) -> list[str]:
        """The name Google Grain's DataLoader gives this source in its checkpoints (a SHA-1 of
        the file names alone), so that checkpoints Grain wrote restore here."""
        digest = hashlib.sha1("".join(self._paths).encode()).hexdigest()
        return [f"ArrayRecordDataSource(hash_of_paths={digest})"]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, record_key: SupportsIndex) -> bytes:
        """Returns record ``record_key`` (0 <= record_key < len).

        Raises:
          RecordIndexError: If the key is out of range.
          ValueError: If the file cannot be read there (corrupt data).
        """
        key = operator.index(record_key)
        if not 0 <= key < self._len:
            raise RecordIndexError(self._out_of_range_message(key))
        instruction = bisect.bisect_right(self._offsets_list, key) - 1
        position = key - self._offsets_list[instruction] + int(self._starts[instruction])
        return self._read(instruction, np.array([position], dtype=np.int64))[0]

    def __getitems__(self, record_keys: Sequence[SupportsIndex]) -> list[bytes]:
        """Returns the records ``record_keys`` in the requested order, duplicates included.

        Raises:
          RecordIndexError: If a key is out of range.
          ValueError: If a file cannot be read (corrupt data).
        """
        keys = record_keys_array(record_keys)
        if keys.size == 0:
            return []
        bad = np.flatnonzero((keys < 0) | (keys >= self._len))
        if bad.size:
            raise RecordIndexError(self._out_of_range_message(int(keys[bad[0]])))
        instructions = np.searchsorted(self._offsets, keys, side="right") - 1
        positions = keys - self._offsets[instructions] + self._starts[instructions]
        first = instructions[0]
        if (instructions == first).all():
            return self._read(int(first), positions)
        order = np.argsort(instructions, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(instructions[order])) + 1)
        out: list[Any] = [None] * keys.size
        for group, records in zip(
            groups, self._read_groups(instructions, positions, groups), strict=True
        ):
            for slot, record in zip(group.tolist(), records, strict=True):
                out[slot] = record
        return out

    def _read_groups(
        self, instructions: np.ndarray, positions: np.ndarray, groups: list[np.ndarray]
    ) -> list[list[bytes]]:
        """The records of each group (indices of one instruction's keys). The groups of files
        array_record reads remotely are read on a thread pool at once (their reads wait on the
        network); the others in turn (their reads use the CPU)."""
        owners = [int(instructions[g[0]]) for g in groups]
        remote = [_is_native_url(self._paths[i]) for i in owners]
        if sum(remote) < 2:
            return [self._read(i, positions[g]) for i, g in zip(owners, groups, strict=True)]
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _REMOTE_READ_THREADS, thread_name_prefix="grain-arrayrecord-read"
                )
            pool = self._pool
        futures = [
            pool.submit(self._read, i, positions[g]) if r else None
            for i, g, r in zip(owners, groups, remote, strict=True)
        ]
        return [
            self._read(i, positions[g]) if f is None else f.result()
            for i, g, f in zip(owners, groups, futures, strict=True)
        ]

    def _read(self, instruction: int, positions: np.ndarray) -> list[bytes]:
        """Reads ``positions`` (record numbers within the file) of one instruction's file."""
        path = self._paths[instruction]
        if path in self._cached:
            with self._cached_reader(path) as reader:
                return self._read_records(path, reader, positions)
        return self._read_records(path, self._reader(path), positions)

    def _read_records(self, path: str, reader: Any, positions: np.ndarray) -> list[bytes]:
        count = positions.size
        first = int(positions[0])
        try:
            if count == 1 or (
                int(positions[-1]) - first == count - 1 and (np.diff(positions) == 1).all()
            ):
                return reader.read(first, first + count)  # type: ignore[no-any-return]
            if count * _INDEXED_READ_MIN_FRACTION < reader.num_records() and not _is_native_url(
                path
            ):
                return [reader.read(p, p + 1)[0] for p in positions.tolist()]
            return reader.read(positions.tolist())  # type: ignore[no-any-return]
        except (RuntimeError, IndexError) as err:
            shown = ", ".join(map(str, positions[:8].tolist())) + (", ..." if count > 8 else "")
            raise ValueError(
                f"Reading records [{shown}] of ArrayRecord file {path!r} failed: {err}. The "
                "file is damaged; re-create it or leave it out."
            ) from None

    def _reader(self, path: str) -> Any:
        """The open reader of a file (a cached shard's stays open until the cache needs its
        room)."""
        if path in self._cached:
            with self._cached_reader(path) as reader:
                return reader
        reader = self._readers.get(path)
        if reader is None:
            with self._lock:
                reader = self._readers.get(path)
                if reader is None:
                    reader = self._readers[path] = self._open(path, path)
        return reader

    @contextlib.contextmanager
    def _cached_reader(self, path: str) -> Iterator[Any]:
        """The reader of a cached shard's pinned copy, kept open while the block runs."""
        reader = self._take_cached_reader(path)
        try:
            yield reader
        finally:
            with self._lock:
                self._reads[path] -= 1
                if not self._reads[path]:
                    self._idle.notify_all()

    def _take_cached_reader(self, path: str) -> Any:
        """The open reader of ``path``'s copy, with one more read counted. A thread opens it
        (pinning the copy) only within this source's share of the cache, checked and taken
        under the lock so that threads opening copies at once cannot exceed it together: it
        closes idle copies first, and waits while another thread opens the same copy or every
        copy that keeps it from the room is being read or opened."""
        with self._lock:
            while True:
                reader = self._readers.pop(path, None)
                if reader is not None:
                    self._readers[path] = reader  # the most recently used last
                    self._reads[path] += 1
                    return reader
                if path not in self._opening:
                    if self._room_for_another_copy():
                        self._opening.add(path)
                        break
                    if self._close_idle_copy_locked():
                        continue
                self._idle.wait()
        # Downloads happen outside the lock, so that shards arrive in parallel; the cache lets
        # one thread (or process) download a shard and the others wait for it.
        try:
            pinned = self._pin(path)
            self._prefetch_after(path)
            try:
                reader = self._open(path, pinned.path)
            except BaseException:
                pinned.close()
                raise
            with self._lock:
                self._readers[path] = reader
                self._pins[path] = pinned
                self._reads[path] = 1
        finally:
            with self._lock:
                self._opening.discard(path)
                self._idle.notify_all()
        return reader

    def _room_for_another_copy(self) -> bool:
        """Whether this source's open copies, those being opened and one more (each sized as
        the largest open one) take at most half the cache, so that other processes reading
        the same cache (DataLoader workers) always find room for theirs; one copy always
        has room. Called under the lock."""
        assert self._shard_cache is not None
        if not self._pins:
            return not self._opening  # the size of a copy being opened is not known yet
        sizes = [p.size for p in self._pins.values()]
        copies = sum(sizes) + max(sizes) * (len(self._opening) + 1)
        return copies <= self._shard_cache.max_bytes // 2

    def _pin(self, path: str) -> PinnedShard:
        """Pins ``path``'s copy, closing this source's least recently used idle copies while
        the cache has no room for it.

        Raises:
          ShardCacheFullError: If the cache is full with none of this source's copies open.
        """
        assert self._shard_cache is not None
        while True:
            try:
                return self._shard_cache.pin(path, self._storage_options)
            except ShardCacheFullError:
                if not self._close_idle_copy():
                    raise

    def _close_idle_copy(self) -> bool:
        """Closes the least recently used open copy no read uses (waiting for one if all
        are read); False if this source has none open."""
        with self._lock:
            while self._pins:
                if self._close_idle_copy_locked():
                    return True
                self._idle.wait()
            return False

    def _close_idle_copy_locked(self) -> bool:
        """Closes the least recently used open copy no read uses, if any (under the lock)."""
        idle = next((p for p in self._readers if p in self._pins and not self._reads[p]), None)
        if idle is None:
            return False
        del self._reads[idle]
        self._readers.pop(idle).close()
        self._pins.pop(idle).close()
        return True

    def _open(self, path: str, local: str) -> Any:
        reason: str | None
        reader: Any = None  # set unless the reader failed to open (then reason says why)
        try:
            reader = array_record_module.ArrayRecordReader(local, self._reader_options)
        except ValueError as err:
            raise ValueError(
                f"Invalid ArrayRecord reader_options {self._reader_options!r} for {path!r}: {err}"
            ) from None
        except RuntimeError as err:
            reason = str(err)
        else:
            reason = _open_failure(reader)
        if reason is not None:
            if storage.is_url(local):
                raise ValueError(
                    f"ArrayRecord file {path!r} cannot be opened: {reason}. Check that it exists "
                    "and that this host can read it (credentials)."
                )
            if not os.path.exists(local):
                raise FileNotFoundError(f"ArrayRecord file {path!r} does not exist ({reason}).")
            raise ValueError(
                f"{path!r} is not a readable ArrayRecord file ({os.path.getsize(local)} bytes): "
                f"{reason}. It may be truncated (an interrupted write or copy) or in another "
                "format; re-create it with grain_arrayrecord.ArrayRecordWriter."
            )
        num_records = reader.num_records()
        for instruction in self._instructions:
            if instruction.path == path and (instruction.end or 0) > num_records:
                raise ValueError(
                    f"Read instruction {instruction.text!r} asks for records up to "
                    f"{instruction.end}, but {path!r} has only {num_records} records."
                )
        group_size = writer_group_size(reader)
        if group_size is not None and group_size != 1:
            warnings.warn(
                f"{path!r} was written with group_size={group_size}: every random read "
                f"decompresses a whole group of {group_size} records. Re-write it with "
                "group_size=1 for fast random access.",
                stacklevel=4,
            )
        return reader

    def _prefetch_after(self, path: str) -> None:
        """Starts downloading the shards that follow ``path`` (the cache's ``read_ahead``)."""
        assert self._shard_cache is not None
        index = self._cached_paths.index(path)
        following = self._cached_paths[index + 1 : index + 1 + self._shard_cache.read_ahead]
        with self._lock:
            following = [p for p in following if p not in self._readers]
        if following:
            self._shard_cache.prefetch(following, self._storage_options)

    def _out_of_range_message(self, key: int) -> str:
        files = sorted(set(self._paths))
        named = repr(files[0]) + (f" and {len(files) - 1} more files" if len(files) > 1 else "")
        return (
            f"Record index {key} is out of range: the ArrayRecordDataSource over {named} has "
            f"{self._len} records (valid indices 0 to {self._len - 1})."
        )

    def close(self) -> None:
        """Closes the open files; a later read reopens them."""
        with self._lock:
            readers, self._readers = self._readers, {}
            pins, self._pins = self._pins, {}
            self._reads = {}
            pool, self._pool = self._pool, None
        for reader in readers.values():
            reader.close()
        for pinned in pins.values():
            pinned.close()
        if pool is not None:
            pool.shutdown()

    def __enter__(self) -> ArrayRecordDataSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for runtime in ("_lock", "_readers", "_pool", "_pins", "_reads", "_opening", "_idle"):
            del state[runtime]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        # Identifies the data for DataLoader checkpoint validation: paths, file sizes, ranges
        # and record counts, never record contents.
        return (
            f"ArrayRecordDataSource(num_records={self._len}, "
            f"num_files={len(set(self._paths))}, fingerprint={self._fingerprint!r})"
        )


def _is_native_url(path: str) -> bool:
    """Whether ``path`` is a URL array_record's reader opens itself."""
    return path.startswith(_NATIVE_SCHEMES)


def _needs_cache(path: str) -> bool:
    """Whether ``path`` is a URL array_record cannot open: read from a shard cache."""
    return storage.is_url(path) and not _is_native_url(path)


def writer_group_size(reader: Any) -> int | None:
    """Returns the ``group_size`` the file was written with, or None if it is not recorded."""
    options = reader.writer_options_string()
    match = _GROUP_SIZE_RE.search(options or "")
    return int(match[1]) if match else None


def _open_failure(reader: Any) -> str | None:
    """Returns why ``reader`` failed to open, or None if it is fine."""
    if reader.ok():
        return None
    try:
        reader.read([])  # a failed reader reports its status on any read
    except (RuntimeError, IndexError) as err:
        return str(err)
    return "the reader is not ok"


def _options_string(reader_options: Mapping[str, str] | None) -> str:
    options = dict(_READER_DEFAULTS)
    if reader_options is not None:
        if not isinstance(reader_options, Mapping):
            raise ValueError(
                "reader_options must be a dict of str to str, e.g. "
                f"{{'index_storage_option': 'offloaded'}}; got {reader_options!r}."
            )
        options.update({str(k): str(v) for k, v in reader_options.items()})
        # array_record rejects its own default footer prefetch with an offloaded index.
        if options.get("index_storage_option") == "offloaded":
            options.setdefault("footer_prefetch_bytes", "0")
    return ",".join(f"{key}:{value}" for key, value in options.items())


def _fingerprint(entries: Iterable[tuple[str, int, int, int]]) -> str:
    text = json.dumps([list(e) for e in entries], separators=(",", ":"))
    return hashlib.sha1(text.encode("utf-8")).hexdigest()

"""A local cache of remote shards: downloaded on first use, bounded in bytes, shared by processes.

A format library that opens only local files (array_record for ``s3://``, and any other
scheme it has no client for) reads a remote shard from a local copy kept here, as MosaicML
Streaming does. Every process on a host (DataLoader workers, several DataLoaders, later runs)
may use one directory: a shard is downloaded once and never again while its copy is valid.

Layout of the directory (all files are created by the cache, owner-only; nothing else belongs
there):

* ``<key>.shard``: the shard's bytes (``key``: a hash of the URL and the object's version); its modification time is its last use (LRU order).
* ``<key>.json``: ``{"url", "size", "version", "sha256"}``, written after the shard. A copy
  is valid when both exist, the shard has ``size`` bytes and the remote object still has
  ``size`` and ``version`` (its ETag/generation, looked up once per process); the first use
  in a process also re-hashes the copy (``verify=True``) and compares ``sha256``.
* ``<key>.lock``: the pin lock, shared by every reader that checks or pins the entry
  (:meth:`ShardCache.pin`) and taken exclusively, without waiting, to evict it: a pinned
  entry is never evicted.
* ``<key>.download.lock``: ``flock``-ed exclusively by whoever re-checks a copy it found
  invalid and downloads it, so that a second process waits for the first download instead of
  starting its own. Nobody ever waits for a pin: a reader waits for a download, a download for
  room that other downloads hold or for their end, and where pinned shards leave no room the
  reader gets :class:`ShardCacheFullError` at once; processes sharing the directory never
  wait for each other in a circle.
* ``<key>.<size>.<random>.tmp``: a download in progress, ``flock``-ed by its downloader and
  renamed into place when complete (readers never see a partial shard); its ``size`` counts
  against the limit. One whose lock is free was left by a killed process: the next
  reservation, and the next use of the same entry, remove it. A download ahead's is
  ``<key>.<size>.<random>.ahead.tmp``: a read that needs its room removes it, and the download
  stops at its next block and lets go (the read waits for that, never for the whole download).
* ``.cache.lock``: held while space is reserved, so that two processes never both count the
  same free bytes.

Eviction: before a download, least recently used shards are removed until the new one fits
``max_bytes``; pinned shards and downloads in progress are never removed, and background
downloads (:meth:`ShardCache.prefetch`) never remove a shard another one of this process
fetched and nobody has used yet. A background download pins nothing: what it leaves may be
evicted at once by a reader that needs the room.

Shared directories: every name is opened relative to a descriptor of the directory without
following symbolic links. A link planted at a lock's name is replaced by the lock, one at an
entry's name makes the entry invalid (the download replaces it); temporary files are created
exclusively.

Forks: the lock descriptors of a process are closed in a child forked from it (at-fork
handlers), so the child holds no entry the parent locked, and it forgets the parent's
background downloads: a child that uses the cache locks and downloads for itself.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

from grain_core import storage

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MAX_BYTES_ENV",
    "PinnedShard",
    "ShardCache",
    "ShardCacheError",
    "ShardCacheFullError",
]

#: Default bound of the bytes of shards one cache directory holds.
DEFAULT_MAX_BYTES: Final = 32 << 30
#: Environment variable overriding :data:`DEFAULT_MAX_BYTES` (a number of bytes).
MAX_BYTES_ENV: Final = "GRAIN_CORE_CACHE_MAX_BYTES"

# Downloads are streamed to disk in blocks of this size (hashed on the way).
_BLOCK: Final = 8 << 20
_TEMP_NAME = re.compile(
    r"^(?P<key>[0-9a-f]{40})\.(?P<size>\d+)\.[0-9a-f]+(?P<ahead>\.ahead)?\.tmp$"
)
_DIRECTORY_LOCK: Final = ".cache.lock"
# An entry's two locks: readers share its pin lock (an eviction takes it exclusively, without
# waiting); its download lock is held by whoever checks a copy found invalid and downloads it.
# Nobody waits for a pin: a reader waits for a download, a download for room or another
# download, so processes sharing the directory never wait for each other in a circle.
_PIN_LOCK: Final = ".lock"
_DOWNLOAD_LOCK: Final = ".download.lock"
# How the cache opens names in its directory: never through a symbolic link, never a FIFO's
# blocking open, never inherited by an exec'd program.
_NO_FOLLOW: Final = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_OWNER_ONLY: Final = 0o600
# How many pinned shards a full-cache error names.
_NAMED_PINNED: Final = 3


class ShardCacheError(OSError):
    """The cache directory cannot take a shard: full, read-only or out of disk space."""


class ShardCacheFullError(ShardCacheError):
    """The shards pinned by readers and the downloads in progress leave no room for a shard."""


# ------------------------------------------------------------------- locks and forks
# The lock descriptors this process holds, closed in a forked child: a lock held on a
# descriptor the child inherited would be held for the child's whole life. Opening and
# closing one happen under _REGISTRY_LOCK, which a fork waits for, so a child never inherits
# a descriptor missing from the registry.
_REGISTRY_LOCK = threading.Lock()
_held: dict[int, _Lock] = {}
_caches: weakref.WeakSet[ShardCache] = weakref.WeakSet()


class _Lock:
    """A ``flock``-able descriptor of one file in a cache directory, closed in forked
    children."""

    def __init__(self, directory_fd: int, name: str, mode: str) -> None:
        """Opens ``name``: ``"existing"`` read-only, ``"lock"`` read-write and created if
        missing (a link or non-file planted there is replaced), ``"new"`` created exclusively.

        Raises:
          FileNotFoundError: If an ``"existing"`` file is missing or not a regular file.
          OSError: If it cannot be opened or created.
        """
        flags = (
            _NO_FOLLOW
            | {
                "existing": os.O_RDONLY,
                "lock": os.O_RDWR | os.O_CREAT,
                "new": os.O_RDWR | os.O_CREAT | os.O_EXCL,
            }[mode]
        )
        while True:
            with _REGISTRY_LOCK:
                try:
                    fd = os.open(name, flags, _OWNER_ONLY, dir_fd=directory_fd)
                except OSError as err:
                    if mode != "lock" or err.errno not in (errno.ELOOP, errno.ENXIO):
                        raise
                    fd = -1
                if fd >= 0 and stat.S_ISREG(os.fstat(fd).st_mode):
                    self.fd = fd
                    _held[fd] = self
                    return
            if fd >= 0:
                os.close(fd)
            if mode != "lock":
                raise FileNotFoundError(errno.ENOENT, "not a regular file", name)
            with contextlib.suppress(FileNotFoundError):  # a link or other non-file: replaced
                os.unlink(name, dir_fd=directory_fd)

    def acquire(self, *, shared: bool = False, wait: bool = True) -> bool:
        """Takes (or converts to) the exclusive or shared lock; whether it was taken."""
        operation = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(self.fd, operation)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Closes the descriptor (releasing its lock); nothing in a forked child, where the
        at-fork handler closed it already."""
        with _REGISTRY_LOCK:
            if _held.get(self.fd) is self:
                del _held[self.fd]
                os.close(self.fd)


def _before_fork() -> None:
    _REGISTRY_LOCK.acquire()


def _after_fork_in_parent() -> None:
    _REGISTRY_LOCK.release()


def _after_fork_in_child() -> None:
    global _REGISTRY_LOCK
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    _REGISTRY_LOCK = threading.Lock()
    for cache in list(_caches):
        cache._init_runtime()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)


class PinnedShard:
    """A valid local copy of a shard that the cache does not evict until :meth:`close`.

    Attributes:
      path: The local file (open it before closing the pin; an open file stays readable).
      url: The shard's URL.
      size: Its bytes.
    """

    def __init__(self, path: str, url: str, size: int, lock: _Lock) -> None:
        self.path = path
        self.url = url
        self.size = size
        self._lock = lock

    def close(self) -> None:
        """Lets the cache evict the shard again."""
        self._lock.close()

    def __enter__(self) -> PinnedShard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PinnedShard({self.url!r} at {self.path!r})"


class ShardCache:
    """A size-bounded local directory of downloaded shards, safe to share between processes.

    Pickles without threads or open files (for worker processes), which then share the
    directory through its locks.

    Args:
      directory: The cache directory; default ``grain_core.storage.cache_dir("shards")``
        (``$GRAIN_CORE_CACHE_DIR/shards``, else ``$XDG_CACHE_HOME/grain_core/shards``, else
        ``~/.cache/grain_core/shards``).
      max_bytes: Bound of the bytes of shards kept; default ``$GRAIN_CORE_CACHE_MAX_BYTES``,
        else 32 GiB.
      read_ahead: Shards a reader may download in the background ahead of the one it reads.
      verify: Re-hash a cached shard the first time a process uses it (reads it once; a copy
        that changed on disk is downloaded again). With False only its size is checked.

    Raises:
      ValueError: If ``max_bytes`` (or ``$GRAIN_CORE_CACHE_MAX_BYTES``) or ``read_ahead`` is
        out of range.
    """

    def __init__(
        self,
        directory: storage.PathArg | None = None,
        *,
        max_bytes: int | None = None,
        read_ahead: int = 2,
        verify: bool = True,
    ) -> None:
        if max_bytes is None:
            max_bytes = _max_bytes_from_environment()
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}.")
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"read_ahead must be a non-negative int, got {read_ahead!r}.")
        path = storage.cache_dir("shards") if directory is None else storage.path_string(directory)
        if storage.is_url(path):
            raise ValueError(f"The shard cache directory must be local, got {path!r}.")
        self._directory = os.path.abspath(path)
        self._max_bytes = max_bytes
        self._read_ahead = read_ahead
        self._verify = verify
        self._init_runtime()

    def _init_runtime(self) -> None:
        """The per-process state: also what a forked child starts from (the parent's threads
        and the downloads they ran are not in it)."""
        self._lock = threading.Lock()
        self._versions: dict[str, tuple[int, str]] = {}
        self._adopted: set[str] = set()  # keys whose copy this process has checked
        self._downloads: dict[str, concurrent.futures.Future[None]] = {}
        self._fetched_ahead: set[str] = set()  # keys prefetched here and not used since
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        _caches.add(self)

    @property
    def directory(self) -> str:
        """The cache directory (absolute)."""
        return self._directory

    @property
    def max_bytes(self) -> int:
        """The bound of the bytes of shards kept."""
        return self._max_bytes

    @property
    def read_ahead(self) -> int:
        """How many shards a reader downloads ahead of the one it reads."""
        return self._read_ahead

    # ------------------------------------------------------------------ using shards
    def pin(self, url: str, storage_options: Mapping[str, Any] | None = None) -> PinnedShard:
        """A valid local copy of ``url`` (downloaded first if needed), kept until the pin is
        closed.

        Waits for a download of the same shard in progress in this or another process.

        Raises:
          FileNotFoundError: If ``url`` does not exist.
          ShardCacheFullError: If the pinned shards and downloads in progress leave no room,
            naming ``max_bytes`` and what holds the space.
          ShardCacheError: If the directory is read-only, the shard is larger than
            ``max_bytes`` or the disk runs out of space.
          grain_core.storage.StorageError: If the download fails after retries.
        """
        with self._lock:
            pending = self._downloads.pop(url, None)
        if pending is not None:
            pending.result()  # a background download of it: its outcome, then check again
        pinned = self._pin(url, storage_options, ahead=False)
        assert pinned is not None  # only a download ahead pins nothing
        return pinned

    def local_path(self, url: str, storage_options: Mapping[str, Any] | None = None) -> str:
        """The path of a valid local copy of ``url``, downloaded first if needed. Unlike
        :meth:`pin`, nothing keeps another reservation from evicting it before it is opened.

        Raises:
          As :meth:`pin`.
        """
        with self.pin(url, storage_options) as pinned:
            return pinned.path

    def prefetch(
        self, urls: Iterable[str], storage_options: Mapping[str, Any] | None = None
    ) -> None:
        """Starts downloading ``urls`` in the background (at most ``read_ahead`` at once);
        a later :meth:`pin` waits for them, and failures surface there. A shard that does
        not fit without evicting a pinned one or one fetched ahead is left for :meth:`pin`,
        and so is one whose room a read needs while it downloads (it stops at its next
        block)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max(1, self._read_ahead), thread_name_prefix="grain-shard-cache"
                )
            for url in urls:
                if url not in self._downloads:
                    self._downloads[url] = self._pool.submit(
                        self._fetch_ahead, url, storage_options
                    )

    def _fetch_ahead(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        self._pin(url, storage_options, ahead=True)

    def _pin(
        self, url: str, storage_options: Mapping[str, Any] | None, *, ahead: bool
    ) -> PinnedShard | None:
        """Pins the entry of ``url``, downloading it first if needed; a download ahead
        (``ahead``) only downloads it where it finds room, and returns None."""
        with self._lock:
            version = self._versions.get(url)
        if version is None:
            version = _current_version(url, storage_options)
            with self._lock:
                self._versions[url] = version
        key = _key(url, version)
        with self._open_directory() as directory_fd:
            # A download ahead takes no pin: the shard it leaves may be evicted at once, and
            # a reader that waited for its room never finds it held.
            lock = None if ahead else self._open_lock(directory_fd, key)
            try:
                if lock is not None:
                    lock.acquire(shared=True)  # waits only for an eviction in progress
                if not self._valid(directory_fd, key, url, version):
                    if not self._fill(directory_fd, key, url, version, storage_options, ahead):
                        return None
                if lock is not None:
                    with self._disk_errors(url, version[0]):
                        os.utime(key + ".shard", dir_fd=directory_fd, follow_symlinks=False)
                        self._remove_stale_downloads(directory_fd, key)
            except BaseException:
                if lock is not None:
                    lock.close()
                raise
        with self._lock:
            if ahead:
                self._fetched_ahead.add(key)
            else:
                self._fetched_ahead.discard(key)
        if lock is None:
            return None
        return PinnedShard(self._path(key, ".shard"), url, version[0], lock)

    def _fill(
        self,
        directory_fd: int,
        key: str,
        url: str,
        version: tuple[int, str],
        storage_options: Mapping[str, Any] | None,
        ahead: bool,
    ) -> bool:
        """Makes the entry a valid copy under its download lock: waits for another
        download of it (never for a pin: readers keep the entry's other lock), checks again,
        and downloads it if still needed. False when a download ahead finds no room."""
        download_lock = self._open_lock(directory_fd, key, _DOWNLOAD_LOCK)
        try:
            download_lock.acquire()
            if self._valid(directory_fd, key, url, version):
                return True
            return self._download(directory_fd, key, url, version, storage_options, ahead)
        finally:
            download_lock.close()

    def _valid(self, directory_fd: int, key: str, url: str, version: tuple[int, str]) -> bool:
        """Whether the entry is a complete copy of ``url`` at ``version`` (regular files, not
        links); re-hashed on its first use in this process (``verify``)."""
        try:
            meta = json.loads(_read_file(directory_fd, key + ".json"))
            fd = os.open(key + ".shard", os.O_RDONLY | _NO_FOLLOW, dir_fd=directory_fd)
        except (OSError, ValueError):
            return False
        try:
            info = os.fstat(fd)
            if not isinstance(meta, dict) or not stat.S_ISREG(info.st_mode):
                return False
            if [meta.get("url"), meta.get("size"), meta.get("version")] != [url, *version]:
                return False
            if info.st_size != version[0]:
                return False
            with self._lock:
                adopted = key in self._adopted
            if not adopted and self._verify and _sha256(fd) != meta.get("sha256"):
                return False
        finally:
            os.close(fd)
        with self._lock:
            self._adopted.add(key)
        return True

    # -------------------------------------------------------------------- downloading
    def _download(
        self,
        directory_fd: int,
        key: str,
        url: str,
        version: tuple[int, str],
        storage_options: Mapping[str, Any] | None,
        ahead: bool,
    ) -> bool:
        """Downloads ``url`` into the entry (whose download lock the caller holds); False
        when a download ahead finds no room or a read takes it (removes its file)."""
        size = version[0]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(key + ".json", dir_fd=directory_fd)  # the entry is invalid from here on
        try:
            temp_name, temp = self._reserve(directory_fd, key, url, size, ahead)
        except ShardCacheFullError:
            if ahead:
                return False
            raise
        digest = hashlib.sha256()
        try:
            with self._disk_errors(url, size):
                with storage.open_read(url, storage_options) as source:
                    while block := source.read(_BLOCK):
                        if ahead and os.fstat(temp.fd).st_nlink == 0:
                            return False  # a read took the room: give way
                        digest.update(block)
                        _write_all(temp.fd, block)
                os.fsync(temp.fd)
                written = os.fstat(temp.fd).st_size
            if written != size:
                raise storage.StorageError(
                    f"Downloading {url} into the shard cache {self._directory} gave {written} "
                    f"bytes, but the object has {size}; it may have changed meanwhile. Try again.",
                    url=url,
                    byte_range=(0, size),
                )
            with self._disk_errors(url, size):
                try:
                    os.replace(
                        temp_name, key + ".shard", src_dir_fd=directory_fd, dst_dir_fd=directory_fd
                    )
                except FileNotFoundError:
                    if ahead:  # a read took the room after the last block
                        return False
                    raise
                meta = {"url": url, "size": size, "version": version[1]}
                _write_json(directory_fd, key + ".json", {**meta, "sha256": digest.hexdigest()})
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name, dir_fd=directory_fd)
            raise
        finally:
            temp.close()
        with self._lock:
            self._adopted.add(key)
        return True

    def _reserve(
        self, directory_fd: int, key: str, url: str, size: int, ahead: bool
    ) -> tuple[str, _Lock]:
        """Makes room for ``size`` bytes (evicting least recently used unpinned shards; a
        download ahead leaves shards fetched ahead alone) and creates the locked temporary
        file that holds the reservation; returns its name and lock. Where only downloads in
        progress leave no room, a read stops the downloads ahead if their room is enough
        (waiting for them to let go at their next block), else waits for another download to
        end, and tries again; a download ahead gives way instead.

        Raises:
          ShardCacheError: If the shard is larger than ``max_bytes``.
          ShardCacheFullError: If the shards that cannot be evicted (pinned, being checked,
            or for a download ahead, fetched ahead) leave no room, naming the limit and
            what fills it.
        """
        if size > self._max_bytes:
            raise ShardCacheError(
                f"Shard cache {self._directory} cannot hold {url}: it has {size} bytes, more "
                f"than max_bytes={self._max_bytes}. Raise max_bytes "
                f"(or ${MAX_BYTES_ENV})."
            )
        with self._lock:
            kept = set(self._fetched_ahead) if ahead else set()
        while True:
            stopped: list[_Lock] = []
            cache_lock = self._open_lock(directory_fd, None)
            try:
                with self._disk_errors(url, size):
                    cache_lock.acquire()
                    shards, live = self._usage(directory_fd, exclude=key)
                    downloading = sum(reserved for _, reserved, _ in live)
                    used = sum(s for _, _, s in shards) + downloading
                    held: list[tuple[str, int]] = []
                    for _, other, other_size in sorted(shards):
                        if used + size <= self._max_bytes:
                            break
                        if other not in kept and self._evict(directory_fd, other):
                            used -= other_size
                        else:
                            held.append((other, other_size))
                    if used + size <= self._max_bytes:
                        kind = ".ahead" if ahead else ""
                        temp_name = f"{key}.{size}.{secrets.token_hex(6)}{kind}.tmp"
                        temp = _Lock(directory_fd, temp_name, "new")
                        temp.acquire()
                        return temp_name, temp
                    if ahead or used - downloading + size > self._max_bytes:
                        raise ShardCacheFullError(
                            self._full_message(directory_fd, url, size, held, downloading)
                        )
                    ahead_room = sum(reserved for _, reserved, is_ahead in live if is_ahead)
                    if used + size - ahead_room <= self._max_bytes:
                        stopped = _stop_downloads_ahead(directory_fd, live)
            finally:
                cache_lock.close()
            if stopped:
                for temp in stopped:
                    _wait_until_let_go(temp)
            else:
                other = next((name for name, _, is_ahead in live if not is_ahead), live[0][0])
                _wait_for_download(directory_fd, other)

    def _full_message(
        self,
        directory_fd: int,
        url: str,
        size: int,
        held: list[tuple[str, int]],
        downloading: int,
    ) -> str:
        holders = []
        if held:
            names = []
            for key, _ in held[:_NAMED_PINNED]:
                try:
                    names.append(str(json.loads(_read_file(directory_fd, key + ".json"))["url"]))
                except (OSError, ValueError, KeyError, TypeError):
                    names.append(key + ".shard")
            more = f" and {len(held) - _NAMED_PINNED} more" if len(held) > _NAMED_PINNED else ""
            holders.append(
                f"{sum(s for _, s in held)} bytes by {len(held)} shards that open readers (in "
                f"this or other processes) pin or that were fetched ahead ({', '.join(names)}"
                f"{more})"
            )
        if downloading:
            holders.append(f"{downloading} bytes by downloads in progress")
        return (
            f"Shard cache {self._directory} is full: max_bytes={self._max_bytes} leaves no "
            f"room for {url} ({size} bytes); held: {'; '.join(holders)}. Raise max_bytes "
            f"(or ${MAX_BYTES_ENV}), read fewer shards at once, or use another directory."
        )

    def _usage(
        self, directory_fd: int, exclude: str
    ) -> tuple[list[tuple[float, str, int]], list[tuple[str, int, bool]]]:
        """The shards ``(last use, key, size)`` other than ``exclude``, and the downloads in
        progress ``(temporary file, bytes reserved, whether it is a download ahead)``; removes
        temporary files of killed downloads."""
        shards = []
        for name in os.listdir(directory_fd):
            if not name.endswith(".shard") or name == exclude + ".shard":
                continue
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
                shards.append((info.st_mtime, name[: -len(".shard")], info.st_size))
        return shards, self._remove_stale_downloads(directory_fd, None)

    def _remove_stale_downloads(
        self, directory_fd: int, key: str | None
    ) -> list[tuple[str, int, bool]]:
        """Removes the temporary files (of ``key``, or all) whose downloader is gone; returns
        the live ones with the bytes each reserves and whether it is a download ahead."""
        live = []
        for name in os.listdir(directory_fd):
            match = _TEMP_NAME.match(name)
            if match is None or (key is not None and match["key"] != key):
                continue
            try:
                temp = _Lock(directory_fd, name, "existing")
            except OSError:  # gone meanwhile, or not a file: nothing of a live download
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=directory_fd)
                continue
            try:
                if temp.acquire(wait=False):  # its downloader is gone
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=directory_fd)
                else:
                    live.append((name, int(match["size"]), match["ahead"] is not None))
            finally:
                temp.close()
        return live

    def _evict(self, directory_fd: int, key: str) -> bool:
        """Removes an entry unless it is pinned or downloaded; whether it was removed."""
        lock = self._open_lock(directory_fd, key)
        try:
            if not lock.acquire(wait=False):
                return False
            for suffix in (".json", ".shard"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(key + suffix, dir_fd=directory_fd)
            return True
        finally:
            lock.close()

    # --------------------------------------------------------------------- plumbing
    def _path(self, key: str, suffix: str) -> str:
        return os.path.join(self._directory, key + suffix)

    @contextlib.contextmanager
    def _open_directory(self) -> Iterator[int]:
        """A descriptor of the cache directory (created owner-only if missing)."""
        try:
            os.makedirs(self._directory, mode=0o700, exist_ok=True)
            fd = os.open(self._directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise self._directory_error(err) from err
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_lock(self, directory_fd: int, key: str | None, suffix: str = _PIN_LOCK) -> _Lock:
        """The lock of an entry (its pin lock, or the one named by ``suffix``; the
        directory's for None)."""
        try:
            return _Lock(directory_fd, _DIRECTORY_LOCK if key is None else key + suffix, "lock")
        except OSError as err:
            raise self._directory_error(err) from err

    @contextlib.contextmanager
    def _disk_errors(self, url: str, size: int) -> Iterator[None]:
        try:
            yield
        except OSError as err:
            if isinstance(err, storage.StorageError | FileNotFoundError | ShardCacheError):
                raise
            if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise ShardCacheError(
                    f"Shard cache {self._directory}: no space for {url} ({size} bytes): "
                    f"{err.strerror}. Free space there, lower max_bytes or use another "
                    "directory."
                ) from err
            raise self._directory_error(err) from err

    def _directory_error(self, err: OSError) -> OSError:
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return ShardCacheError(
                f"Shard cache {self._directory} is not writable ({err.strerror}). Pass "
                "ShardCache(directory=...) a writable local directory, or set "
                "GRAIN_CORE_CACHE_DIR."
            )
        return err

    def __getstate__(self) -> dict[str, Any]:
        return {
            "_directory": self._directory,
            "_max_bytes": self._max_bytes,
            "_read_ahead": self._read_ahead,
            "_verify": self._verify,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return f"ShardCache({self._directory!r}, max_bytes={self._max_bytes})"


def _max_bytes_from_environment() -> int:
    text = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"${MAX_BYTES_ENV} must be a number of bytes, e.g. {DEFAULT_MAX_BYTES}; got {text!r}."
        ) from None


def _current_version(url: str, storage_options: Mapping[str, Any] | None) -> tuple[int, str]:
    """``url``'s size and version as the store reports them for the object itself: not from
    a listing the file system cached (a glob's), whose fields differ from a lookup's, so that
    every process sharing the directory names the same version."""
    fs, fs_path = storage.filesystem(url, storage_options)
    fs.invalidate_cache(fs_path)
    return storage.version(url, storage_options)


def _key(url: str, version: tuple[int, str]) -> str:
    """The entry name of ``url`` at ``version``: a changed object is another entry, so that a
    process never waits for readers of the old one to let go."""
    return hashlib.sha1(f"{url}\0{version[0]}\0{version[1]}".encode()).hexdigest()


def _wait_for_download(directory_fd: int, temp_name: str) -> None:
    """Returns once the download writing ``temp_name`` has ended."""
    try:
        temp = _Lock(directory_fd, temp_name, "existing")
    except OSError:  # ended already
        return
    _wait_until_let_go(temp)


def _wait_until_let_go(temp: _Lock) -> None:
    """Returns once the downloader of the temporary file ``temp`` was opened on has let go
    of it (it holds the file's lock until then); closes ``temp``."""
    try:
        temp.acquire(shared=True)
    finally:
        temp.close()


def _stop_downloads_ahead(directory_fd: int, live: list[tuple[str, int, bool]]) -> list[_Lock]:
    """Removes the temporary files of the downloads ahead among ``live`` (``_usage``'s), which
    makes each stop at its next block; returns those files opened before the removal, to wait
    until their downloaders let go (until then the bytes they wrote are on the disk)."""
    stopped: list[_Lock] = []
    try:
        for name, _, is_ahead in live:
            if not is_ahead:
                continue
            try:
                temp = _Lock(directory_fd, name, "existing")
            except OSError:  # ended meanwhile
                continue
            stopped.append(temp)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=directory_fd)
    except BaseException:
        for temp in stopped:
            temp.close()
        raise
    return stopped


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, _BLOCK, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def _read_file(directory_fd: int, name: str) -> bytes:
    """The bytes of a regular file in the directory, never through a link.

    Raises:
      OSError: If it is missing, a link or not a regular file.
    """
    fd = os.open(name, os.O_RDONLY | _NO_FOLLOW, dir_fd=directory_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        with os.fdopen(os.dup(fd), "rb") as file:
            return file.read()
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_json(directory_fd: int, name: str, value: Mapping[str, Any]) -> None:
    """Writes ``value`` to ``name`` atomically (an exclusive temporary file renamed into
    place, replacing whatever was there, link or file)."""
    temp = f".meta.{secrets.token_hex(6)}.json-tmp"
    fd = os.open(
        temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, _OWNER_ONLY, dir_fd=directory_fd
    )
    try:
        try:
            _write_all(fd, json.dumps(value).encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=directory_fd)
        raise

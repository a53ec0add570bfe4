"""A local cache of remote shards: downloaded on first use, bounded in bytes, shared by processes.

A format library that opens only local files (array_record for ``s3://``, and any other
scheme it has no client for) reads a remote shard from a local copy kept here, as MosaicML
Streaming does. Every process on a host (DataLoader workers, several DataLoaders, later runs)
may use one directory: a shard is downloaded once and never again while its copy is valid.

Layout of the directory (all files are created by the cache; nothing else belongs there):

* ``<key>.shard``: the shard's bytes; its modification time is its last use (LRU order).
* ``<key>.json``: ``{"url", "size", "version", "sha256"}``, written after the shard. A copy
  is valid when both exist, the shard has ``size`` bytes and the remote object still has
  ``size`` and ``version`` (its ETag/generation, looked up once per process); the first use
  in a process also re-hashes the copy (``verify=True``) and compares ``sha256``.
* ``<key>.lock``: ``flock``-ed exclusively while the entry is downloaded or evicted, so a
  second process waits for the first download instead of starting its own.
* ``<key>.<size>.<random>.tmp``: a download in progress, renamed into place when complete
  (readers never see a partial shard); its reserved ``size`` counts against the limit. A
  temporary file whose entry lock is free was left by a killed process and is removed.
* ``.cache.lock``: held while space is reserved, so that two processes never both count the
  same free bytes.

Eviction: before a download, least recently used shards are removed until the new one fits
``max_bytes``; shards being downloaded are never removed. A reader that has an evicted shard
open keeps reading it (POSIX keeps the data until the file is closed), so the disk use may
exceed ``max_bytes`` by the evicted shards still open.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

from grain_core import storage

__all__ = ["DEFAULT_MAX_BYTES", "ShardCache", "ShardCacheError"]

#: Default bound of the bytes of shards one cache directory holds.
DEFAULT_MAX_BYTES: Final = 32 << 30

# Downloads are streamed to disk in blocks of this size (hashed on the way).
_BLOCK: Final = 8 << 20
_TEMP_NAME = re.compile(r"^(?P<key>[0-9a-f]{40})\.(?P<size>\d+)\.[^.]+\.tmp$")


class ShardCacheError(OSError):
    """The cache directory cannot take a shard: full, read-only or out of disk space."""


class ShardCache:
    """A size-bounded local directory of downloaded shards, safe to share between processes.

    Pickles without threads or open files (for worker processes), which then share the
    directory through its locks.

    Args:
      directory: The cache directory; default ``grain_core.storage.cache_dir("shards")``
        (``$GRAIN_CORE_CACHE_DIR/shards``, else ``~/.cache/grain_core/shards``).
      max_bytes: Bound of the bytes of shards kept (default 32 GiB).
      read_ahead: Shards a reader may download in the background ahead of the one it reads.
      verify: Re-hash a cached shard the first time a process uses it (reads it once; a copy
        that changed on disk is downloaded again). With False only its size is checked.

    Raises:
      ValueError: If ``max_bytes`` or ``read_ahead`` is out of range.
    """

    def __init__(
        self,
        directory: storage.PathArg | None = None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        read_ahead: int = 2,
        verify: bool = True,
    ) -> None:
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
        self._lock = threading.Lock()
        self._versions: dict[str, tuple[int, str]] = {}
        self._adopted: set[str] = set()  # keys whose copy this process has checked
        self._downloads: dict[str, concurrent.futures.Future[str]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

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
    def local_path(self, url: str, storage_options: Mapping[str, Any] | None = None) -> str:
        """The path of a valid local copy of ``url``, downloaded first if needed.

        Waits for a download of the same shard in progress in this or another process.

        Raises:
          FileNotFoundError: If ``url`` does not exist.
          ShardCacheError: If the directory is read-only, full (naming what holds it) or the
            disk runs out of space.
          grain_core.storage.StorageError: If the download fails after retries.
        """
        with self._lock:
            pending = self._downloads.pop(url, None)
        if pending is not None:
            pending.result()  # a background download of it: its outcome, then check again
        return self._fetch(url, storage_options)

    def prefetch(
        self, urls: Iterable[str], storage_options: Mapping[str, Any] | None = None
    ) -> None:
        """Starts downloading ``urls`` in the background (at most ``read_ahead`` at once);
        a later :meth:`local_path` waits for them. Failures surface there."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max(1, self._read_ahead), thread_name_prefix="grain-shard-cache"
                )
            for url in urls:
                if url not in self._downloads:
                    self._downloads[url] = self._pool.submit(self._fetch, url, storage_options)

    def _fetch(self, url: str, storage_options: Mapping[str, Any] | None) -> str:
        key = hashlib.sha1(url.encode("utf-8")).hexdigest()
        shard = self._path(key, ".shard")
        with self._lock:
            version = self._versions.get(url)
        if version is None:
            version = storage.version(url, storage_options)
            with self._lock:
                self._versions[url] = version
        with self._locked(key):
            if self._valid(key, url, version):
                os.utime(shard)  # its last use, for LRU eviction
                return shard
            self._download(key, url, version, storage_options)
            with self._lock:
                self._adopted.add(key)
        return shard

    def _valid(self, key: str, url: str, version: tuple[int, str]) -> bool:
        """Whether the entry is a complete copy of ``url`` at ``version``; re-hashed on its
        first use in this process (``verify``)."""
        try:
            with open(self._path(key, ".json"), encoding="utf-8") as file:
                meta = json.load(file)
            size = os.path.getsize(self._path(key, ".shard"))
        except (OSError, ValueError):
            return False
        if [meta.get("url"), meta.get("size"), meta.get("version")] != [url, *version]:
            return False
        if size != version[0]:
            return False
        with self._lock:
            adopted = key in self._adopted
        if not adopted and self._verify:
            if _sha256(self._path(key, ".shard")) != meta.get("sha256"):
                return False
        with self._lock:
            self._adopted.add(key)
        return True

    # -------------------------------------------------------------------- downloading
    def _download(
        self,
        key: str,
        url: str,
        version: tuple[int, str],
        storage_options: Mapping[str, Any] | None,
    ) -> None:
        """Downloads ``url`` into the entry (whose lock the caller holds)."""
        size = version[0]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key, ".json"))  # the entry is invalid from here on
        temp = self._reserve(key, url, size)
        digest = hashlib.sha256()
        try:
            with self._disk_errors(url, size):
                with open(temp, "wb") as out, storage.open_read(url, storage_options) as source:
                    while block := source.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
                    out.flush()
                    os.fsync(out.fileno())
            written = os.path.getsize(temp)
            if written != size:
                raise storage.StorageError(
                    f"Downloading {url} into the shard cache {self._directory} gave {written} "
                    f"bytes, but the object has {size}; it may have changed meanwhile. Try again.",
                    url=url,
                    byte_range=(0, size),
                )
            with self._disk_errors(url, size):
                os.replace(temp, self._path(key, ".shard"))
                meta = {"url": url, "size": size, "version": version[1]}
                _write_json(self._path(key, ".json"), {**meta, "sha256": digest.hexdigest()})
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise

    def _reserve(self, key: str, url: str, size: int) -> str:
        """Makes room for ``size`` bytes (evicting least recently used shards) and creates the
        temporary file that holds the reservation; returns its path.

        Raises:
          ShardCacheError: If the shard cannot fit, naming the directory and what fills it.
        """
        if size > self._max_bytes:
            raise ShardCacheError(
                f"Shard cache {self._directory} cannot hold {url}: it has {size} bytes, more "
                f"than max_bytes={self._max_bytes}. Raise max_bytes."
            )
        with self._disk_errors(url, size), self._locked(None):
            shards, downloading = self._usage(exclude=key)
            used = sum(s for _, _, s in shards) + downloading
            for _, other, other_size in sorted(shards):
                if used + size <= self._max_bytes:
                    break
                if self._evict(other):
                    used -= other_size
            if used + size > self._max_bytes:
                raise ShardCacheError(
                    f"Shard cache {self._directory} is full: {used} bytes are held by shards "
                    f"being downloaded or written by other readers, and max_bytes="
                    f"{self._max_bytes} leaves no room for {url} ({size} bytes). Raise "
                    "max_bytes or use another directory."
                )
            fd, temp = tempfile.mkstemp(dir=self._directory, prefix=f"{key}.{size}.", suffix=".tmp")
            os.close(fd)
        return temp

    def _usage(self, exclude: str) -> tuple[list[tuple[float, str, int]], int]:
        """The shards ``(last use, key, size)`` other than ``exclude``, and the bytes reserved
        by downloads in progress; removes temporary files of killed downloads."""
        shards = []
        for path in glob.glob(os.path.join(glob.escape(self._directory), "*.shard")):
            key = os.path.basename(path)[: -len(".shard")]
            if key == exclude:
                continue
            with contextlib.suppress(FileNotFoundError):
                stat = os.stat(path)
                shards.append((stat.st_mtime, key, stat.st_size))
        downloading = 0
        for name in os.listdir(self._directory):
            match = _TEMP_NAME.match(name)
            if match is None or match["key"] == exclude:
                continue
            if self._lock_is_free(match["key"]):  # its downloader is gone
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self._directory, name))
            else:
                downloading += int(match["size"])
        return shards, downloading

    def _evict(self, key: str) -> bool:
        """Removes an entry unless another process holds it; whether it was removed."""
        fd = self._open_lock(key)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            for suffix in (".json", ".shard"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path(key, suffix))
            return True
        finally:
            os.close(fd)

    def _lock_is_free(self, key: str) -> bool:
        fd = self._open_lock(key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    # --------------------------------------------------------------------- plumbing
    def _path(self, key: str, suffix: str) -> str:
        return os.path.join(self._directory, key + suffix)

    def _open_lock(self, key: str | None) -> int:
        name = ".cache.lock" if key is None else key + ".lock"
        try:
            os.makedirs(self._directory, exist_ok=True)
            return os.open(os.path.join(self._directory, name), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise self._directory_error(err) from err

    @contextlib.contextmanager
    def _locked(self, key: str | None) -> Iterator[None]:
        """Holds the entry's lock (the directory's for None) exclusively."""
        fd = self._open_lock(key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

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


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: str, value: Mapping[str, Any]) -> None:
    """Writes ``value`` to ``path`` atomically (a temporary file renamed into place)."""
    directory = os.path.dirname(path)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".meta.", suffix=".json-tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(value, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise

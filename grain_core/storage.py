"""The one file-system seam: every reader, writer, checkpoint and the CLI opens files here.

A path is a local path, an ``os.PathLike`` (``pathlib.Path``, ``etils.epath.Path``, Orbax's
path objects: anything whose ``str()`` is a URL or that has ``__fspath__``), or a URL with a
scheme (``s3://``, ``gs://``, ``memory://``, any fsspec protocol), resolved through fsspec
(``pip install fsspec``, plus ``s3fs`` or ``gcsfs`` for the store you use).
``file://`` URLs are local paths. A URL is never taken for a local folder named ``s3:``:
without fsspec, or without an implementation for its scheme, it is an error naming what to
install.

``storage_options`` go to the fsspec file system as they are (endpoint, profile, anonymous,
retries); fsspec's own configuration (``~/.config/fsspec``, ``FSSPEC_<PROTOCOL>_<OPTION>``
environment variables) applies as well. Retries with backoff are the file system's: s3fs
retries transient errors itself and botocore's retry policy is set with
``storage_options={"config_kwargs": {"retries": {"max_attempts": 10, "mode": "adaptive"}}}``;
gcsfs retries transient errors by itself. An error that survives them names the URL and the
byte range.

Writes are atomic: readers see the old file or the complete new one. Locally the data goes
to a temporary file created exclusively in the target directory (owner-only, never through a
planted symlink), is synced and renamed into place; temporary files that a killed writer left
for the same target are removed by the next successful write. On an object store the object
is written with one whole-object upload (atomic there) and its size is read back; its local
spool file is cleaned up the same way (in the temporary directory).

URLs are served by :mod:`grain_core._remote_files` (the fsspec file systems, their errors and
the remote file that ``open_read`` returns); this module keeps paths, local files and the
atomic writes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import glob as _glob
import os
import random
import re
import stat
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO, Final, cast

from grain_core._remote_files import RemoteFile, StorageError, filesystem, remote_errors

__all__ = [
    "READ_AHEAD_BYTES",
    "AtomicWriter",
    "PathArg",
    "RangeReader",
    "StorageError",
    "cache_dir",
    "exists",
    "filesystem",
    "glob",
    "has_magic",
    "is_url",
    "join",
    "open_read",
    "path_string",
    "read_bytes",
    "size",
    "version",
    "version_of",
    "write_bytes",
]

# Any ``os.PathLike``, a ``str``, or an object whose ``str()`` is a URL (``epath.Path``).
PathArg = Any

# Block size of sequential remote reads: one request per block, and the next block is fetched
# in the background while the current one is parsed (fsspec's "background" cache).
READ_AHEAD_BYTES: Final = 16 << 20
# Uploads up to this size are sent from memory in one PUT; larger ones from the spooled file.
_UPLOAD_FROM_MEMORY: Final = 64 << 20
# Temporary files are named ``.tmp.<pid>.<random>.<target name>``; a writer that writes its
# output through another atomic writer (``grain-core convert``'s format writers) names its
# own after that one's: ``.tmp.<pid>.<random>..tmp.<pid>.<random>.<target name>``.
_TEMP_PREFIX: Final = ".tmp."
_TEMP_CHARACTERS: Final = "abcdefghijklmnopqrstuvwxyz0123456789_"
_TEMP_RANDOM: Final = random.SystemRandom()
_CREATE_PRIVATE: Final = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_LAYER: Final = re.escape(_TEMP_PREFIX) + r"(\d+)\.[a-z0-9_]{8}\."
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]+)://")


# ------------------------------------------------------------------------------ paths
def path_string(path: PathArg) -> str:
    """Returns ``path`` as a string: a URL for remote files, a local path otherwise.

    Raises:
      TypeError: If ``path`` is neither a string nor path-like.
    """
    if isinstance(path, str):
        text = path
    elif isinstance(path, bytes):
        text = os.fsdecode(path)
    else:
        as_text = str(path)
        if _URL.match(as_text):  # epath.Path("gs://..."), UPath: their str() is the URL
            text = as_text
        elif isinstance(path, os.PathLike):
            text = os.fspath(path)
        else:
            raise TypeError(
                f"Expected a path (str or os.PathLike) or a URL, got {type(path).__name__}: "
                f"{path!r}."
            )
    if text.startswith("file://"):
        return text[len("file://") :]
    return text


def is_url(path: PathArg) -> bool:
    """Whether ``path`` is a URL with a scheme other than ``file://`` (a remote file)."""
    return _URL.match(path_string(path)) is not None


def join(base: PathArg, *names: str) -> str:
    """Joins names onto a directory path or URL (``/``-separated for URLs)."""
    text = path_string(base)
    if is_url(text):
        return "/".join([text.rstrip("/"), *names])
    return os.path.join(text, *names)


def has_magic(path: PathArg) -> bool:
    """Whether ``path`` holds glob characters (``*``, ``?``, ``[``)."""
    return _glob.has_magic(path_string(path))  # type: ignore[attr-defined]


def cache_dir(kind: str) -> str:
    """Local directory for derived data of ``kind`` (indexes, downloaded shards).

    ``$GRAIN_CORE_CACHE_DIR/<kind>``; by default ``$XDG_CACHE_HOME/grain_core/<kind>``, or
    ``~/.cache/grain_core/<kind>``. Created when first written to.
    """
    root = os.environ.get("GRAIN_CORE_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "grain_core")
    return os.path.join(root, kind)


# --------------------------------------------------------------------------- reading
def open_read(
    path: PathArg,
    storage_options: Mapping[str, Any] | None = None,
    *,
    read_ahead: int = READ_AHEAD_BYTES,
    offset: int = 0,
) -> BinaryIO:
    """Opens a file for reading (binary, unbuffered locally), positioned at ``offset``.

    A remote file read from its start, on a file system that streams (``open_async``: s3fs
    streams one GET), is downloaded as one streamed request on the file system's event loop,
    running ahead of the reader by up to ``read_ahead`` bytes: the transfer continues while
    the reader works, and the reader's thread only takes what arrived. Opened elsewhere, moved
    backwards or far ahead (``seek``), on other file systems, or after the stream failed, it
    is read ``read_ahead`` bytes per ranged request, the next block fetched in the background
    (fsspec's "background" cache, with the file system's retries). A remote file has a
    ``size`` attribute, and its reads that fail after retries raise :class:`StorageError`
    naming the URL and the byte range.

    Raises:
      FileNotFoundError: If the file does not exist (naming it).
    """
    text = path_string(path)
    if not is_url(text):
        file = open(text, "rb", buffering=0)  # noqa: SIM115 - the caller closes it
        if offset:
            file.seek(offset)
        return file
    fs, fs_path = filesystem(text, storage_options)
    return cast(BinaryIO, RemoteFile(text, fs, fs_path, read_ahead, offset))


def read_bytes(path: PathArg, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """Returns the whole content of a file.

    Raises:
      FileNotFoundError: If the file does not exist (naming it).
      StorageError: If a remote read fails after retries.
    """
    text = path_string(path)
    if not is_url(text):
        with open(text, "rb") as file:
            return file.read()
    fs, fs_path = filesystem(text, storage_options)
    with remote_errors(text, "Reading"):
        return fs.cat_file(fs_path)


def size(path: PathArg, storage_options: Mapping[str, Any] | None = None) -> int:
    """Returns the size of a file in bytes.

    Raises:
      FileNotFoundError: If the file does not exist (naming it).
    """
    return version(path, storage_options)[0]


def version(path: PathArg, storage_options: Mapping[str, Any] | None = None) -> tuple[int, str]:
    """Returns ``(size, version)``; the version changes whenever the file's content does.

    Locally the version is the modification time in nanoseconds; remotely the store's own
    identity of the object (what it reports: ETag, generation, modification time).

    Raises:
      FileNotFoundError: If the file does not exist (naming it).
    """
    text = path_string(path)
    if not is_url(text):
        stat = os.stat(text)
        return stat.st_size, str(stat.st_mtime_ns)
    fs, fs_path = filesystem(text, storage_options)
    with remote_errors(text, "Looking up"):
        info = fs.info(fs_path)
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{text} is a directory, not a file.")
        return version_of(info)


def version_of(info: Mapping[str, Any]) -> tuple[int, str]:
    """``(size, version)`` of a remote file from what its fsspec file system's ``info`` says
    (as :func:`version`, for callers holding a file system instead of a URL)."""
    # Everything the store reports (ETag, generation, modification time, ...) except the
    # name: any change to the object changes one of them.
    identity = repr(sorted((k, str(v)) for k, v in info.items() if k != "name"))
    return int(info["size"]), identity


def exists(path: PathArg, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether a file (or directory) exists."""
    text = path_string(path)
    if not is_url(text):
        return os.path.exists(text)
    fs, fs_path = filesystem(text, storage_options)
    with remote_errors(text, "Looking up"):
        return bool(fs.exists(fs_path))


def glob(
    pattern: PathArg,
    storage_options: Mapping[str, Any] | None = None,
    *,
    allow_empty: bool = False,
) -> list[str]:
    """Returns the files matching ``pattern``, sorted (the same list on every host and run).

    Remote matches are full URLs with the pattern's scheme.

    Raises:
      FileNotFoundError: If nothing matches (unless ``allow_empty``), naming the pattern.
    """
    text = path_string(pattern)
    if not is_url(text):
        matches = sorted(_glob.glob(text))
    else:
        fs, fs_path = filesystem(text, storage_options)
        with remote_errors(text, "Listing"):
            found = fs.glob(fs_path, detail=True)
        matches = sorted(
            fs.unstrip_protocol(name)
            for name, info in found.items()
            if info.get("type") != "directory"
        )
    if not matches and not allow_empty:
        raise FileNotFoundError(
            f"The pattern {text!r} matches no file; check the directory and pattern."
        )
    return matches


class RangeReader:
    """Reads byte ranges of one file: ``os.pread`` locally, ranged requests remotely.

    Pickles without an open file (for worker processes), and opens it again on first use.

    Args:
      path: The file.
      storage_options: For a remote file, passed to its fsspec file system.
    """

    def __init__(self, path: PathArg, storage_options: Mapping[str, Any] | None = None) -> None:
        self.path = path_string(path)
        self._options = dict(storage_options or {})
        self._remote = is_url(self.path)
        self._fd: int | None = None
        self._fs: tuple[Any, str] | None = None
        self._lock = threading.Lock()

    def read(self, start: int, end: int) -> bytes:
        """Returns bytes ``[start, end)`` (fewer only at the end of the file).

        Raises:
          StorageError: If a remote read fails after retries, naming the URL and range.
        """
        if not self._remote:
            return os.pread(self._local_fd(), end - start, start)
        fs, fs_path = self._filesystem()
        with remote_errors(self.path, "Reading", (start, end)):
            return fs.cat_file(fs_path, start=start, end=end)

    def read_many(self, starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        """Returns the byte ranges ``[starts[k], ends[k])``; remote ranges are requested
        concurrently where the file system is asynchronous (s3fs, gcsfs).

        Raises:
          StorageError: If a remote read fails after retries, naming the URL and a range.
        """
        if not self._remote or len(starts) == 1:
            return [self.read(s, e) for s, e in zip(starts, ends, strict=True)]
        fs, fs_path = self._filesystem()
        with remote_errors(self.path, "Reading", (min(starts), max(ends))):
            parts = fs.cat_ranges(
                [fs_path] * len(starts), list(starts), list(ends), on_error="return"
            )
        for part, start, end in zip(parts, starts, ends, strict=True):
            if isinstance(part, BaseException):
                with remote_errors(self.path, "Reading", (start, end)):
                    raise part
        return parts

    def _local_fd(self) -> int:
        fd = self._fd
        if fd is None:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY)
                fd = self._fd
        return fd

    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is None:
            self._fs = filesystem(self.path, self._options)
        return self._fs

    def close(self) -> None:
        """Closes the local file (it is opened again on the next read)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None, "_fs": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"RangeReader({self.path!r})"


# --------------------------------------------------------------------------- writing
class AtomicWriter:
    """Writes a whole file so that readers see the old file or the complete new one.

    Write to :attr:`file`, or (for libraries that write by name) to :attr:`temp_path` after
    closing :attr:`file`; then :meth:`commit`, or :meth:`abort` to leave the target untouched.
    As a context manager it commits on success and aborts on an exception.

    Locally the temporary file is created exclusively and owner-only (``O_EXCL | O_NOFOLLOW``,
    mode 0600, so a symlink planted at its name is never followed) in the target's directory,
    synced and renamed over the target (a symlink at the target's name is replaced, not
    followed), which then gets the mode ``open()`` would give it (the umask's). Every open,
    rename, sync and removal is relative to a descriptor of the directory taken at construction;
    before the rename the writer opens the temporary file's name without following it and
    refuses a symlink, a non-regular file or another user's file put there (a library writing
    :attr:`temp_path` by name, or renaming its own temporary file onto it, is fine). Temporary
    files of the same target left by a killed writer are removed after the rename (symlinks and
    other users' files are left). Remotely the data is spooled to a temporary file in the local
    temporary directory and uploaded as one whole object (atomic on object stores), whose size
    is then read back; spool files of a target of the same name left there by a killed writer
    are removed after the upload.

    Args:
      path: The target file.
      storage_options: For a remote target, passed to its fsspec file system.

    Raises:
      OSError: If the temporary file cannot be created, naming the target's directory.
    """

    def __init__(self, path: PathArg, storage_options: Mapping[str, Any] | None = None) -> None:
        self.path = path_string(path)
        self._options = dict(storage_options or {})
        self._remote = is_url(self.path)
        # A remote target's spool file lies in the temporary directory, named like a local
        # temporary file, so that the next write of a target of the same name removes one that
        # a killed writer left there.
        self._name = self.path.rstrip("/").rsplit("/", 1)[-1]
        if self._remote:
            directory = tempfile.gettempdir()
        else:
            directory = os.path.dirname(os.path.abspath(self.path))
            with _naming_directory(self.path):
                os.makedirs(directory, exist_ok=True)
        # Every later open, rename, sync and removal is relative to this descriptor, so that a
        # path component replaced by a link after this point redirects none of them.
        with _naming_directory(self.path):
            self._directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fd, self._temp_name = _create_temp_file(self._directory_fd, self._name)
            except BaseException:
                os.close(self._directory_fd)
                raise
        self.temp_path = os.path.join(directory, self._temp_name)
        # Held until the rename: tells a cleaning writer on another host that this file is live.
        # On a descriptor of its own, so that it stays held when the caller closes ``file`` to
        # let a library write ``temp_path`` by name.
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._lock = os.dup(fd)
        self.file: BinaryIO = os.fdopen(fd, "wb")
        self._done = False

    def commit(self) -> None:
        """Syncs the data and puts it in place of the target.

        Raises:
          OSError: If the disk is full or the target cannot be written, naming the target's
            directory, or if the temporary file was replaced (nothing is left half-written).
          StorageError: If the upload fails after retries, or the object read back has the
            wrong size.
        """
        if self._done:
            return
        try:
            with _naming_directory(self.path):
                if not self.file.closed:
                    self.file.flush()
                written = self._open_written()
                try:
                    os.fsync(written)
                    if self._remote:
                        self._upload(written)
                    else:
                        # The temporary file is owner-only while it is written; the target
                        # gets the mode ``open()`` gives a new file, as if written in place.
                        os.fchmod(written, _default_file_mode())
                        os.replace(
                            self._temp_name,
                            self._name,
                            src_dir_fd=self._directory_fd,
                            dst_dir_fd=self._directory_fd,
                        )
                        os.fsync(self._directory_fd)
                finally:
                    os.close(written)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self.file.close()
        os.close(self._lock)
        if self._remote:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._temp_name, dir_fd=self._directory_fd)
        _remove_stale_temp_files(self._directory_fd, self._name)
        os.close(self._directory_fd)

    def _open_written(self) -> int:
        """Opens the file at ``temp_path`` without following a link: this writer's file, or the
        one a library's own atomic write renamed there. Refuses a symlink, a non-regular file
        or another user's file, so that neither the rename nor the upload takes what another
        user of the directory planted.

        Raises:
          OSError: Naming the temporary file and the target.
        """
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self._temp_name, flags, dir_fd=self._directory_fd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOENT):
                raise
            what = "a symlink" if e.errno == errno.ELOOP else "nothing"
        else:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                return fd
            os.close(fd)
            what = "another user's file" if stat.S_ISREG(info.st_mode) else "a non-regular file"
        raise OSError(
            errno.ELOOP if what == "a symlink" else errno.ESTALE,
            f"The temporary file {self.temp_path} of {self.path} was replaced by {what} "
            "(another user of the directory?); nothing was written to the target. Write to a "
            "directory only you can change.",
        )

    def _upload(self, written: int) -> None:
        """Uploads the spool file open on ``written``."""
        fs, fs_path = filesystem(self.path, self._options)
        length = os.fstat(written).st_size
        with remote_errors(self.path, "Writing"):
            if length <= _UPLOAD_FROM_MEMORY:
                fs.pipe_file(fs_path, _read_all(written, length))
            else:  # by name: checked to be a regular file of this user's just before
                fs.put_file(self.temp_path, fs_path)
            fs.invalidate_cache(fs_path)
            stored = int(fs.info(fs_path)["size"])
        if stored != length:
            raise StorageError(
                f"Writing {self.path}: the store holds {stored} bytes after the upload of "
                f"{length}. Write it again.",
                url=self.path,
                byte_range=None,
            )

    def abort(self) -> None:
        """Discards what was written; the target keeps its old content (or stays absent)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):  # the buffered rest may not fit (disk full)
            self.file.close()
        os.close(self._lock)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._temp_name, dir_fd=self._directory_fd)
        os.close(self._directory_fd)

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __repr__(self) -> str:
        return f"AtomicWriter({self.path!r})"


def write_bytes(
    path: PathArg, data: bytes, storage_options: Mapping[str, Any] | None = None
) -> None:
    """Writes ``data`` as the whole content of ``path``, atomically (see :class:`AtomicWriter`).

    Raises:
      OSError: If the disk is full or the target cannot be written, naming the directory.
      StorageError: If a remote upload fails after retries.
    """
    text = path_string(path)
    if is_url(text):  # small enough to send from memory without spooling it first
        fs, fs_path = filesystem(text, storage_options)
        with remote_errors(text, "Writing"):
            fs.pipe_file(fs_path, data)
            fs.invalidate_cache(fs_path)
            stored = int(fs.info(fs_path)["size"])
        if stored != len(data):
            raise StorageError(
                f"Writing {text}: the store holds {stored} bytes after the upload of "
                f"{len(data)}. Write it again.",
                url=text,
                byte_range=None,
            )
        return
    with AtomicWriter(text) as writer:
        with _naming_directory(text):
            writer.file.write(data)


@contextlib.contextmanager
def _naming_directory(path: str) -> Iterator[None]:
    """Adds the target and its directory to a local ``OSError`` (disk full, read-only, ...)."""
    try:
        yield
    except OSError as e:
        if isinstance(e, StorageError) or e.errno is None or path in str(e):
            raise
        directory = os.path.dirname(os.path.abspath(path))
        raise type(e)(
            e.errno, f"{e.strerror} while writing {path} (directory {directory})", e.filename
        ) from e


def _create_temp_file(directory_fd: int, name: str) -> tuple[int, str]:
    """Creates ``.tmp.<pid>.<random>.<name>`` in the directory, exclusively and owner-only
    (``O_EXCL | O_NOFOLLOW``: a file or symlink already at the name is never opened); returns
    its descriptor and name.

    Raises:
      FileExistsError: If every name tried exists.
    """
    for _ in range(100):
        random_part = "".join(_TEMP_RANDOM.choices(_TEMP_CHARACTERS, k=8))
        temp_name = f"{_TEMP_PREFIX}{os.getpid()}.{random_part}.{name}"
        try:
            fd = os.open(temp_name, _CREATE_PRIVATE, 0o600, dir_fd=directory_fd)
        except FileExistsError:
            continue
        return fd, temp_name
    raise FileExistsError(errno.EEXIST, f"No free temporary file name for {name}")


def _read_all(fd: int, length: int) -> bytes:
    """The first ``length`` bytes of the file open on ``fd``."""
    chunks, offset = [], 0
    while offset < length:
        chunk = os.pread(fd, length - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


@functools.cache
def _default_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the process's umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration):
        umask = 0o022
    return 0o666 & ~umask


def _remove_stale_temp_files(directory_fd: int, name: str) -> None:
    """Removes temporary files of the file ``name`` in the directory open on ``directory_fd``
    whose writers are gone (killed before their rename).

    A candidate is a regular file of ours named ``.tmp.<pid>.<random>.<name>``, or a temporary
    file of such a file (``.tmp.<pid>.<random>..tmp.<pid>.<random>.<name>``), none of whose
    processes still runs and on which no writer holds the lock (a writer on another host sharing
    the directory holds it); anything else is left alone.
    """
    pattern = re.compile(f"(?:{_TEMP_LAYER})+{re.escape(name)}")
    try:
        entries = os.listdir(directory_fd)
    except OSError:
        return
    me = os.getpid()
    for entry in entries:
        if pattern.fullmatch(entry) is None:
            continue
        pids = {int(pid) for pid in re.findall(_TEMP_LAYER, entry[: -len(name)])}
        if me in pids or any(_process_alive(pid) for pid in pids):
            continue
        try:
            fd = os.open(
                entry,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=directory_fd,
            )
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry, dir_fd=directory_fd)
        finally:
            os.close(fd)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

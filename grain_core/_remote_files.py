"""Remote files through fsspec, below :mod:`grain_core.storage` (the one file-system seam,
which calls it for every URL): the file system serving a URL, the translation of a store's
failures into errors naming the URL and byte range (``StorageError`` after the file system's
retries, ``PermissionError`` for missing credentials), and the remote file that
``storage.open_read`` returns (a streamed download, or ranged requests).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Final

__all__ = [
    "RemoteFile",
    "StorageError",
    "StreamedDownload",
    "filesystem",
    "remote_errors",
]

# Bytes a streamed download asks its file for at a time (one item of its queue).
_STREAM_CHUNK: Final = 1 << 20
_REMOTE_PIP = "pip install fsspec"
# Which package serves a scheme, for the error when it is missing.
_SCHEME_PACKAGES: Final = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "hf": "huggingface_hub",
}


class StorageError(OSError):
    """A remote read or write failed after the file system's retries.

    Attributes:
      url: The file.
      byte_range: ``(start, end)`` of the bytes being read, or None for a whole-file operation.
    """

    def __init__(self, message: str, *, url: str, byte_range: tuple[int, int] | None) -> None:
        super().__init__(message)
        self.url = url
        self.byte_range = byte_range

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps the attributes when the error crosses a process boundary.
        return (_rebuild_storage_error, (str(self), self.url, self.byte_range))


def _rebuild_storage_error(
    message: str, url: str, byte_range: tuple[int, int] | None
) -> StorageError:
    return StorageError(message, url=url, byte_range=byte_range)


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """Returns the fsspec file system serving ``url`` and the path within it.

    Instances are cached by fsspec per (protocol, options, process), so calling this for every
    file costs little; worker processes build their own from the same URL and options.

    Raises:
      ImportError: If fsspec, or the package for the URL's scheme, is not installed (the
        message names what to ``pip install``).
      ValueError: If no fsspec implementation is known for the scheme.
    """
    scheme = url.split("://", 1)[0].lower()
    package = _SCHEME_PACKAGES.get(scheme)
    try:
        import fsspec  # optional dependency
    except ImportError as e:
        extra = f" {package}" if package else ""
        raise ImportError(
            f"Opening {url} needs fsspec{' and ' + package if package else ''}: "
            f"{_REMOTE_PIP}{extra}"
        ) from e
    try:
        return fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as e:
        hint = f"pip install {package}" if package else str(e)
        raise ImportError(
            f"Opening {url} needs the fsspec implementation of {scheme}://: {hint}"
        ) from e
    except ValueError as e:
        if scheme in fsspec.available_protocols():
            raise
        raise ValueError(
            f"Cannot open {url}: no file system is known for the scheme {scheme}:// ({e}). "
            "Use a local path, or a URL of an fsspec protocol (s3://, gs://, memory://, ...) "
            "with its package installed (s3fs, gcsfs, ...)."
        ) from e


# gcsfs's number of tries is fixed (6, about 30 s of backoff); a request's timeout is not.
_GCSFS_RETRIES: Final = (
    "gcsfs tries 6 times with backoff; a request's timeout is set through "
    "storage_options={'requests_timeout': seconds}, the endpoint through endpoint_url= or "
    "STORAGE_EMULATOR_HOST"
)
# How a scheme's file system retries, for the error that an unreachable store gives.
_RETRY_HINTS: Final = {
    "s3": "retries are set through storage_options (s3fs: config_kwargs={'retries': "
    "{'max_attempts': N}})",
    "gs": _GCSFS_RETRIES,
    "gcs": _GCSFS_RETRIES,
}


@contextlib.contextmanager
def remote_errors(url: str, what: str, byte_range: tuple[int, int] | None = None) -> Iterator[None]:
    """Turns a remote failure into an error naming the URL (and the byte range being read)."""
    try:
        yield
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url} does not exist (missing bucket or object: {e}).") from e
    except PermissionError as e:
        raise PermissionError(
            f"Access to {url} was denied ({e}); check the credentials in storage_options or "
            "the environment."
        ) from e
    except (StorageError, ImportError, TypeError, AttributeError):
        raise
    except Exception as e:  # botocore, aiohttp and gcsfs raise their own exception types
        if _is_credential_error(e):
            raise PermissionError(
                f"No usable credentials to access {url} ({type(e).__name__}: {e}). Pass them in "
                "storage_options (s3fs: key= and secret=; gcsfs: token=) or set them in the "
                "environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "GOOGLE_APPLICATION_CREDENTIALS)."
            ) from e
        where = "" if byte_range is None else f" bytes {byte_range[0]}-{byte_range[1]} of"
        scheme = url.split("://", 1)[0].lower()
        retries = _RETRY_HINTS.get(scheme, "retries are set through storage_options")
        raise StorageError(
            f"{what}{where} {url} failed after the file system's retries "
            f"({type(e).__name__}: {e}). Check that the store is reachable; {retries}.",
            url=url,
            byte_range=byte_range,
        ) from e


def _is_credential_error(error: BaseException) -> bool:
    """Whether ``error`` says that no credentials could be found or used (botocore's
    ``NoCredentialsError``, ``PartialCredentialsError``, ``CredentialRetrievalError``, SSO
    token errors; google-auth's ``DefaultCredentialsError`` and ``RefreshError``): a store
    that refuses to sign a request, not one that cannot be reached."""
    names = {cls.__name__ for cls in type(error).__mro__}
    return any("Credential" in name for name in names) or bool(
        names & {"RefreshError", "NoAuthTokenError", "TokenRetrievalError", "SSOTokenLoadError"}
    )


def _streams(fs: Any, fs_path: str) -> bool:
    """Whether ``fs`` reads ``fs_path`` as one streamed download (its own ``open_async``)."""
    import fsspec.asyn  # optional dependency (fs comes from fsspec, which is installed)

    if not isinstance(fs, fsspec.asyn.AsyncFileSystem):
        return False
    if type(fs).open_async is fsspec.asyn.AsyncFileSystem.open_async:
        return False
    # A path naming a version (s3fs's ?versionId=, gcsfs's generation) is read by ranges:
    # the streamed file asks for the object's latest version.
    split = getattr(fs, "split_path", None)
    parts = split(fs_path) if split is not None else ()
    return not (isinstance(parts, tuple) and len(parts) == 3 and parts[2])


class RemoteFile:
    """A remote file read through a streamed download or ranged requests (see
    :func:`grain_core.storage.open_read`), whose failed reads name the URL and the byte range."""

    def __init__(self, url: str, fs: Any, fs_path: str, read_ahead: int, offset: int) -> None:
        self._url = url
        self._fs = fs
        self._fs_path = fs_path
        self._read_ahead = read_ahead
        self._position = offset
        self._file: Any = None  # the fsspec file serving ranged reads, opened when needed
        self._download: StreamedDownload | None = None
        # The download's current chunk, which starts at byte self._chunk_start of the file;
        # the reads are at self._chunk[self._chunk_pos].
        self._chunk = b""
        self._chunk_start = 0
        self._chunk_pos = 0
        if offset == 0 and _streams(fs, fs_path):
            self._download = StreamedDownload(fs, fs_path, read_ahead)
            with remote_errors(url, "Opening"):
                self.size = self._download.size()
        else:
            self.size = int(self._ranged().size)

    def _ranged(self) -> Any:
        """The fsspec file serving ranged reads (opened on first use)."""
        if self._file is None:
            with remote_errors(self._url, "Opening"):
                self._file = self._fs.open(
                    self._fs_path, "rb", block_size=self._read_ahead, cache_type="background"
                )
            self._file.seek(self._position)
        return self._file

    def read(self, size: int = -1) -> bytes:
        start = self._position
        end = self.size if size < 0 else min(start + size, self.size)
        if self._download is not None:
            try:
                taken = self._take(end - start)
            except Exception:
                # The download broke: go on with ranged requests, which the file system
                # retries, from where it stopped.
                self._leave_stream()
            else:
                self._position += len(taken)
                return taken
        with remote_errors(self._url, "Reading", (self._position, end)):
            data: bytes = self._ranged().read(end - self._position)
        self._position += len(data)
        return data

    def _take(self, size: int) -> bytes:
        """``size`` bytes (fewer at the end) from the download: a chunk as it arrived when it
        is what is asked, otherwise copied once from the chunks holding them."""
        assert self._download is not None
        pieces: list[bytes | memoryview] = []
        while size > 0:
            if self._chunk_pos >= len(self._chunk):
                self._chunk_start += len(self._chunk)
                self._chunk = self._download.take()
                self._chunk_pos = 0
                if not self._chunk:
                    break
            chunk, pos = self._chunk, self._chunk_pos
            end = min(pos + size, len(chunk))
            pieces.append(chunk if pos == 0 and end == len(chunk) else memoryview(chunk)[pos:end])
            self._chunk_pos = end
            size -= end - pos
        if len(pieces) == 1 and isinstance(pieces[0], bytes):
            return pieces[0]
        return b"".join(pieces)

    def _leave_stream(self) -> None:
        if self._download is not None:
            self._download.cancel()
            self._download = None
        self._chunk = b""
        self._chunk_pos = 0

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self._position
        elif whence == os.SEEK_END:
            offset += self.size
        if self._download is not None:
            if self._chunk_start <= offset <= self._position:  # back within the chunk
                self._chunk_pos = offset - self._chunk_start
                self._position = offset
                return offset
            ahead = offset - self._position
            if 0 <= ahead <= self._read_ahead:  # near ahead: the stream brings it soon
                while ahead > 0:
                    skipped = len(self.read(min(ahead, _STREAM_CHUNK)))
                    if not skipped:
                        break
                    ahead -= skipped
                self._position = offset
                return offset
            self._leave_stream()
        self._position = int(self._ranged().seek(offset))
        return self._position

    def tell(self) -> int:
        return self._position

    def close(self) -> None:
        self._leave_stream()
        if self._file is not None:
            self._file.close()

    def __del__(self) -> None:
        download = getattr(self, "_download", None)  # absent if __init__ failed
        if download is not None:
            download.cancel()

    def __enter__(self) -> RemoteFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class StreamedDownload:
    """One file downloaded from its start by a coroutine on its file system's event loop,
    chunk by chunk into a queue that the reading thread takes from, holding at most about
    ``budget`` bytes that were not taken yet (the coroutine waits while it holds more).

    Args:
      fs: An fsspec file system with ``open_async``.
      fs_path: The file.
      budget: Bytes downloaded ahead of the reader, at most (at least one chunk).
    """

    def __init__(self, fs: Any, fs_path: str, budget: int) -> None:
        import asyncio  # import cost: only streamed remote reads run a coroutine

        self._budget = budget
        self._chunk = max(1, min(budget, _STREAM_CHUNK))
        self._queue: queue.SimpleQueue[bytes | BaseException] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._held = 0  # bytes queued and not yet taken
        self._paused = False
        self._room: Any = None  # the asyncio.Event the paused coroutine waits on
        self._loop = fs.loop
        self._size: int | None = None
        self._started = threading.Event()  # the size is known, or the request failed
        self._future = asyncio.run_coroutine_threadsafe(self._pump(fs, fs_path), fs.loop)

    async def _pump(self, fs: Any, fs_path: str) -> None:
        import asyncio  # import cost: only streamed remote reads run a coroutine

        self._room = asyncio.Event()
        file = None
        try:
            file = await fs.open_async(fs_path, "rb")
            chunk = await file.read(self._chunk)
            # s3fs knows the size from the response; other streamed files from opening.
            size = getattr(file, "size", None)
            self._size = int(size if size is not None else (await fs._info(fs_path))["size"])
            self._started.set()
            while True:
                with self._lock:
                    self._held += len(chunk)
                    self._paused = self._held >= self._budget
                    if self._paused:
                        self._room.clear()
                self._queue.put(chunk)
                if not chunk:
                    return
                if self._paused:
                    await self._room.wait()
                chunk = await file.read(self._chunk)
        except Exception as e:
            self._queue.put(e)
            self._started.set()
        finally:  # ended, failed or cancelled (the reader left the stream)
            if file is not None:
                await file.close()

    def size(self) -> int:
        """The file's size, once the response to the request arrived.

        Raises:
          Exception: The file system's, if the request failed.
        """
        self._started.wait()
        if self._size is None:
            self.take()  # the failure is what was queued: raises it
        assert self._size is not None
        return self._size

    def take(self) -> bytes:
        """The next chunk (``b""`` at the end), waiting for it.

        Raises:
          Exception: The file system's, if the download failed.
        """
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        with self._lock:
            self._held -= len(item)
            wake = self._paused and self._held < self._budget
            if wake:
                self._paused = False
        if wake:
            self._loop.call_soon_threadsafe(self._room.set)
        return item

    def cancel(self) -> None:
        """Stops the download (what is queued is dropped)."""
        self._future.cancel()

"""POSIX shared-memory blocks and the element transport between worker processes and the parent.

A worker replaces every large, contiguous, numeric NumPy leaf of an element by a ``_ShmRef``
(block name, shape, dtype): it copies the leaf into a block, or, for a :class:`SharedMemoryArray`
that a batch was stacked into, sends the block as is.

Workers recycle blocks: allocating and zeroing the pages of a fresh 4 MiB block costs ten times
more than writing 4 MiB, so a worker keeps a pool of blocks (``enable_block_pool``). The parent
maps a block lazily (no page is touched unless the consumer reads it) and, when the returned array
is garbage-collected, tells the worker that the block is free again. Without a pool (outside
workers) the parent unlinks a block's name as soon as it has mapped it, so the memory lives exactly
as long as the returned array.

Every block is registered with ``multiprocessing``'s resource tracker (shared by the parent and
its forkserver workers) when created and unregistered when unlinked, so blocks in flight when the
parent is killed are still removed at exit. Blocks created by a worker carry the worker's name
prefix; after a worker is stopped or dies the parent removes whatever is left under that prefix.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import itertools
import math
import mmap
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Iterable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

# CPython's private module behind multiprocessing.shared_memory (no type information).
_posixshmem: Any
try:
    import _posixshmem  # type: ignore[import-not-found, no-redef]
except ImportError:  # Windows: no POSIX shared memory; arrays travel pickled instead.
    _posixshmem = None

#: Whether this platform has POSIX shared memory.
AVAILABLE = _posixshmem is not None

__all__ = [
    "SharedMemoryArray",
    "SharedMemoryArrayMetadata",
    "SharedMemoryFullError",
    "copy_to_shm",
    "open_from_shm",
    "stacked_array",
    "unlink_shm",
]

#: Arrays smaller than this travel pickled through the pipe unless ``DatasetOptions.min_shm_size``
#: is set explicitly: below it the system calls of a block cost more than copying the bytes.
DEFAULT_MIN_SHM_SIZE = 64 * 1024

SHM_DIR = "/dev/shm"
_RTYPE = "shared_memory"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_name_prefix = f"gc{os.getpid():x}{secrets.token_hex(3)}_"
_counter = itertools.count()


def set_name_prefix(prefix: str) -> None:
    """Names blocks created from now on in this process ``/<prefix><n>`` (set in workers)."""
    global _name_prefix
    _name_prefix = prefix


def _new_name() -> str:
    return f"/{_name_prefix}{next(_counter):x}"


class SharedMemoryFullError(OSError):
    """``/dev/shm`` has no room for a new shared-memory block (``errno`` is ``ENOSPC``)."""


def _no_room(size: int) -> SharedMemoryFullError:
    try:
        stats = os.statvfs(SHM_DIR)
        free = f"{stats.f_bavail * stats.f_frsize} of {stats.f_blocks * stats.f_frsize}"
    except OSError:
        free = "unknown"
    # (errno, message) like any OSError, so the error pickles from a worker to the parent.
    return SharedMemoryFullError(
        errno.ENOSPC,
        f"{SHM_DIR} has no room for a shared-memory block of {size} bytes ({free} bytes "
        "free). Give the machine or container more shared memory (e.g. `docker run "
        "--shm-size=2g`), or lower MultiprocessingOptions.per_worker_buffer_size or "
        "num_workers.",
    )


def create_block(size: int) -> tuple[str, mmap.mmap]:
    """Returns the name and a read-write mapping of a block of ``size`` bytes: a free block of
    the worker's pool when there is one, else a new block (pages populated at once)."""
    if _pool is not None:
        return _pool.take(size)
    return _create_block(size)


def _create_block(size: int) -> tuple[str, mmap.mmap]:
    while True:
        name = _new_name()
        try:
            fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except FileExistsError:
            continue
        break
    try:
        os.ftruncate(fd, size)
        _reserve(fd, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    except BaseException:
        os.close(fd)
        _posixshmem.shm_unlink(name)
        raise
    os.close(fd)
    resource_tracker.register(name, _RTYPE)
    return name, mapping


def _reserve(fd: int, size: int) -> None:
    """Allocates the block's pages now. A full ``/dev/shm`` (Docker gives containers 64 MiB)
    then fails here, with an error that says so, instead of killing the process with SIGBUS
    at its first write into the mapping."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # macOS
        return
    try:
        fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise _no_room(size) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate: map as before
            raise


_warned_full = False


def warn_full(error: SharedMemoryFullError) -> None:
    """Warns, once per process, that arrays travel pickled because ``/dev/shm`` is full."""
    global _warned_full
    if not _warned_full:
        _warned_full = True
        warnings.warn(
            f"{error.strerror} Until then, arrays that do not fit travel pickled through the "
            "worker's pipe (slower).",
            RuntimeWarning,
            stacklevel=2,
        )


def open_block(name: str) -> mmap.mmap:
    """Maps an existing block read-write (the name stays), all pages at once."""
    fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)


class _BlockPool:
    """A worker's blocks: in use (sent to the parent) or free for reuse, by size."""

    def __init__(self, max_free_per_size: int, max_free_bytes: int = 0) -> None:
        self._max_free = max_free_per_size
        self._max_free_bytes = max_free_bytes
        self._free: dict[int, list[tuple[str, mmap.mmap]]] = {}
        self._used: dict[str, mmap.mmap] = {}
        self.dropped: list[str] = []
        # Read threads take blocks (a MapDataset batch stacked into shared memory) while the
        # worker's main thread gives them back.
        self._lock = threading.Lock()

    def take(self, size: int) -> tuple[str, mmap.mmap]:
        with self._lock:
            free = self._free.get(size)
            block = free.pop() if free else None
        name, mapping = block if block is not None else _create_block(size)
        with self._lock:
            self._used[name] = mapping
        return name, mapping

    def give_back(self, names: Iterable[str]) -> None:
        for name in names:
            with self._lock:
                mapping = self._used.pop(name, None)
                if mapping is None:
                    continue
                size = len(mapping)
                free = self._free.setdefault(size, [])
                keep = len(free) < max(self._max_free, self._max_free_bytes // size)
                if keep:
                    free.append((name, mapping))
            if not keep:
                unlink_block(name)
                self.dropped.append(name)

    def unlink_all(self, keep_used: bool = False) -> None:
        with self._lock:
            # A snapshot: reader threads of a closing pipeline may still be taking blocks.
            used = [] if keep_used else [*self._used]
            names = [*used, *(name for free in self._free.values() for name, _ in free)]
            self._used.clear()
            self._free.clear()
        for name in names:
            unlink_block(name)


_pool: _BlockPool | None = None


def enable_block_pool(max_free_per_size: int, max_free_bytes: int = 0) -> None:
    """Makes this process (a worker) recycle blocks released by the parent: it keeps
    ``max_free_per_size`` free blocks of each size, or as many as fit in ``max_free_bytes``."""
    global _pool
    _pool = _BlockPool(max_free_per_size, max_free_bytes)


def release_blocks(names: Iterable[str]) -> None:
    """Returns blocks to this process's pool (or unlinks them when there is no pool)."""
    if _pool is not None:
        _pool.give_back(names)
    else:
        unlink_shm(names)


def take_dropped() -> list[str]:
    """Names this process's pool unlinked since the last call (the parent forgets them)."""
    if _pool is None or not _pool.dropped:
        return []
    dropped, _pool.dropped = _pool.dropped, []
    return dropped


def unlink_pool(keep_sent: bool = False) -> None:
    """Unlinks every block of this process's pool (at worker exit), or only the free ones with
    ``keep_sent`` (the parent still reads the others)."""
    if _pool is not None:
        _pool.unlink_all(keep_used=keep_sent)


def unlink_block(name: str) -> None:
    """Removes a block's name; mappings stay valid until they are closed. Missing is fine."""
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        return
    resource_tracker.unregister(name, _RTYPE)


def unlink_prefix(prefix: str) -> list[str]:
    """Removes every block whose name starts with ``prefix`` (what a stopped or dead worker
    left); returns the names removed. A worker killed between creating a block and
    registering it with the resource tracker leaves a block the tracker does not know, so each
    name is registered before it is unregistered: the tracker's books balance either way."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = [f"/{e}" for e in entries if e.startswith(prefix)]
    for name in removed:
        try:
            _posixshmem.shm_unlink(name)
        except FileNotFoundError:
            continue
        resource_tracker.register(name, _RTYPE)
        resource_tracker.unregister(name, _RTYPE)
    return removed


# ------------------------------------------------------------------------- public array type
@dataclasses.dataclass(frozen=True, slots=True)
class SharedMemoryArrayMetadata:
    """Enough to attach to a :class:`SharedMemoryArray` from another process."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    def close_and_unlink_shm(self) -> None:
        """Frees the block (for metadata that will never be opened)."""
        unlink_block(self.name)


class _AsyncDeleter:
    """Optional thread pool that unlinks blocks off the consumer thread (bounded backlog)."""

    def __init__(self) -> None:
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.limit = 0
        self.pending = 0
        self.lock = threading.Lock()

    def unlink(self, name: str) -> None:
        if self.executor is not None:
            with self.lock:
                if self.pending < self.limit:
                    self.pending += 1
                    self.executor.submit(self._run, name)
                    return
        unlink_block(name)

    def _run(self, name: str) -> None:
        try:
            unlink_block(name)
        finally:
            with self.lock:
                self.pending -= 1


_deleter = _AsyncDeleter()


def _unlink_if_owner(owner_pid: int, name: str) -> None:
    if os.getpid() == owner_pid:
        _deleter.unlink(name)


def _after_fork_in_child() -> None:
    """A forked child owns none of its parent's blocks: it names new ones after itself, and
    neither recycles a worker's pool (the worker's blocks) nor queues deletions to the
    parent's deleting threads (which the child does not have)."""
    global _name_prefix, _pool, _deleter
    _name_prefix = f"gc{os.getpid():x}{secrets.token_hex(3)}_"
    _pool = None
    _deleter = _AsyncDeleter()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


class SharedMemoryArray(np.ndarray):  # type: ignore[type-arg]
    """A NumPy array whose buffer is a POSIX shared-memory block.

    Pickling sends the block's name, not the data. By default collecting the array only unmaps
    the block; after :meth:`unlink_on_del` it also frees it, and pickling sends the data (the
    block may be gone before the receiver maps it). NumPy operations that allocate new
    arrays return plain ``ndarray`` objects.

    Args:
      shape: Array shape.
      dtype: Element type (not ``object``).

    Raises:
      ValueError: For an object dtype.
      SharedMemoryFullError: If ``/dev/shm`` has no room for the block.
    """

    _shm_name: str | None
    _shm_size: int
    #: The process that frees the block with this array (``unlink_on_del``; 0: none).
    _freed_by: int

    def __new__(cls, shape: Any, dtype: Any = float) -> SharedMemoryArray:
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            raise ValueError("SharedMemoryArray cannot hold Python objects (dtype=object).")
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        size = math.prod(shape) * dtype.itemsize
        name, mapping = create_block(max(size, 1))
        return cls._over(mapping, name, shape, dtype)

    @classmethod
    def _over(
        cls, mapping: Any, name: str, shape: tuple[int, ...], dtype: np.dtype[Any]
    ) -> SharedMemoryArray:
        arr: SharedMemoryArray = np.ndarray.__new__(cls, shape, dtype=dtype, buffer=mapping)  # type: ignore[assignment]
        arr._shm_name = name
        arr._shm_size = arr.nbytes
        arr._freed_by = 0
        return arr

    def __array_finalize__(self, obj: Any) -> None:
        # Views share the block; their data pointer tells whether they cover all of it.
        self._shm_name = getattr(obj, "_shm_name", None)
        self._shm_size = getattr(obj, "_shm_size", 0)
        self._freed_by = getattr(obj, "_freed_by", 0)

    def __array_wrap__(self, arr: Any, context: Any = None, return_scalar: bool = False) -> Any:
        out = arr.view(np.ndarray)
        if return_scalar and out.ndim == 0:
            return out[()]
        return out

    def _is_whole_block(self) -> bool:
        base: np.ndarray = self  # type: ignore[type-arg]
        while isinstance(base.base, np.ndarray):
            base = base.base
        return (
            self._shm_name is not None
            and base.base is not None  # a copy owns fresh memory, not the block
            and self.flags.c_contiguous
            and self.nbytes == self._shm_size
            and self.__array_interface__["data"][0] == base.__array_interface__["data"][0]
        )

    @property
    def metadata(self) -> SharedMemoryArrayMetadata:
        """Name, shape and dtype of this array's block.

        Raises:
          ValueError: If this array is a partial view or a copy, which has no block of its own.
        """
        if not self._is_whole_block():
            raise ValueError("Only an array covering a whole shared-memory block has metadata.")
        assert self._shm_name is not None
        return SharedMemoryArrayMetadata(self._shm_name, tuple(self.shape), self.dtype)

    @classmethod
    def from_metadata(cls, metadata: SharedMemoryArrayMetadata) -> SharedMemoryArray:
        """Attaches to an existing block without copying."""
        return cls._over(open_block(metadata.name), metadata.name, metadata.shape, metadata.dtype)

    @classmethod
    def from_shared_memory(
        cls, shm: shared_memory.SharedMemory, shape: Any, dtype: Any
    ) -> SharedMemoryArray:
        """Views a ``multiprocessing.shared_memory.SharedMemory`` block as an array."""
        name = shm._name  # type: ignore[attr-defined]
        return cls._over(shm.buf, name, tuple(shape), np.dtype(dtype))

    def unlink_on_del(self) -> None:
        """Frees the block when this array is garbage-collected (in this process: a forked
        child's copy of the array leaves the block to its parent)."""
        name = self._shm_name
        if name is not None:
            self._freed_by = os.getpid()
            weakref.finalize(self, _unlink_if_owner, self._freed_by, name)

    @classmethod
    def enable_async_del(cls, num_threads: int = 1, max_outstanding_requests: int = 50) -> None:
        """Frees blocks on ``num_threads`` background threads (synchronously past the backlog)."""
        if _deleter.executor is None:
            _deleter.executor = concurrent.futures.ThreadPoolExecutor(
                num_threads, thread_name_prefix="grain_core-shm-del"
            )
            _deleter.limit = max_outstanding_requests

    def __reduce__(self) -> Any:
        # A block freed with its array (``unlink_on_del``) may be gone before the receiver
        # maps it: a batch stacked into shared memory by a worker elsewhere than a local
        # process (a worker backend's) is dropped there once pickled. Its data travels.
        if self._is_whole_block() and not self._freed_by:
            return (SharedMemoryArray.from_metadata, (self.metadata,))
        return np.asarray(self).view(np.ndarray).__reduce__()


# ----------------------------------------------------------------------------- transport
#: Dtypes by their ``str`` code, as they arrive in ``_ShmRef`` messages.
_DTYPES: dict[str, np.dtype[Any]] = {}


def _dtype_from_code(code: str) -> np.dtype[Any]:
    dtype = _DTYPES.get(code)
    if dtype is None:
        dtype = _DTYPES[code] = np.dtype(code)
    return dtype


class _ShmRef:
    """An array leaf in transit: it lives in block ``name``."""

    __slots__ = ("name", "shape", "dtype")

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype[Any] | str) -> None:
        self.name = name
        self.shape = shape
        self.dtype = _dtype_from_code(dtype) if isinstance(dtype, str) else dtype

    def __reduce__(self) -> Any:
        # A plain dtype travels as its code ('<f4'): pickling a dtype object costs ~4 us each
        # way, per leaf and element. Structured dtypes and dtypes with metadata need the object.
        dtype = self.dtype
        if dtype.fields is None and dtype.metadata is None:
            return (_ShmRef, (self.name, self.shape, dtype.str))
        return (_ShmRef, (self.name, self.shape, dtype))


def _qualifies(x: np.ndarray, min_size: int) -> bool:
    return (
        AVAILABLE
        and x.nbytes >= min_size
        and x.nbytes > 0
        and not x.dtype.hasobject
        and x.flags.c_contiguous
    )


def copy_to_shm(tree: Any, min_size: int = 0) -> tuple[Any, list[str]]:
    """Replaces qualifying array leaves by references to shared-memory blocks.

    Whole-block :class:`SharedMemoryArray` leaves are referenced without copying; other
    C-contiguous, non-empty, non-object arrays of at least ``min_size`` bytes are copied into a
    new block, or stay in the tree (to be pickled) with a warning when ``/dev/shm`` is full. Containers (dict, list, tuple, namedtuple) are rebuilt only where a leaf changed,
    keeping their key order.

    Returns:
      The new tree and the names of the blocks it references.
    """
    names: list[str] = []
    return _encode(tree, min_size, names), names


def _encode(x: Any, min_size: int, names: list[str]) -> Any:
    if isinstance(x, np.ndarray):
        if isinstance(x, SharedMemoryArray) and x._is_whole_block():
            assert x._shm_name is not None
            names.append(x._shm_name)
            return _ShmRef(x._shm_name, tuple(x.shape), x.dtype)
        if not _qualifies(x, min_size):
            return x
        try:
            name, mapping = create_block(x.nbytes)
        except SharedMemoryFullError as e:
            warn_full(e)
            return x
        np.ndarray(x.shape, x.dtype, buffer=mapping)[...] = x
        names.append(name)
        return _ShmRef(name, tuple(x.shape), x.dtype)
    kind = type(x)
    if kind is dict:
        return {k: _encode(v, min_size, names) for k, v in x.items()}
    if kind is list:
        return [_encode(v, min_size, names) for v in x]
    if isinstance(x, tuple):
        items = [_encode(v, min_size, names) for v in x]
        if hasattr(kind, "_fields"):
            return kind(*items)
        return kind(items)
    return x


class RecycledBlocks:
    """The parent's side of a worker's block pool: mappings kept for blocks the worker reuses
    (so their pages are mapped once), and the names of blocks the consumer has dropped."""

    def __init__(self) -> None:
        self.mappings: dict[str, mmap.mmap] = {}
        self.released: collections.deque[str] = collections.deque()

    def take_released(self) -> list[str]:
        released = self.released
        return [released.popleft() for _ in range(len(released))]

    def forget(self, names: Iterable[str]) -> None:
        for name in names:
            self.mappings.pop(name, None)


def open_from_shm(tree: Any, recycled: RecycledBlocks | None = None) -> Any:
    """Turns references back into arrays.

    Args:
      tree: An element with ``_ShmRef`` leaves.
      recycled: The sender recycles blocks: keep their mappings and record each block's name in
        ``recycled.released`` once the array over it is garbage-collected. Without it the name
        is unlinked as soon as it is mapped.
    """
    if isinstance(tree, _ShmRef):
        if recycled is None:
            once = open_block(tree.name)
            unlink_block(tree.name)
            return np.ndarray(tree.shape, tree.dtype, buffer=once)
        mapping = recycled.mappings.get(tree.name)
        if mapping is None:
            mapping = recycled.mappings[tree.name] = open_block(tree.name)
        arr = np.ndarray(tree.shape, tree.dtype, buffer=mapping)
        weakref.finalize(arr, recycled.released.append, tree.name)
        return arr
    kind = type(tree)
    if kind is dict:
        return {k: open_from_shm(v, recycled) for k, v in tree.items()}
    if kind is list:
        return [open_from_shm(v, recycled) for v in tree]
    if isinstance(tree, tuple):
        items = [open_from_shm(v, recycled) for v in tree]
        if hasattr(kind, "_fields"):
            return kind(*items)
        return kind(items)
    return tree


def stacked_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> SharedMemoryArray:
    """A :class:`SharedMemoryArray` for a batch to stack into. In a worker (a block pool) the
    block goes to the parent, which hands it back when done with it. In any other process (the
    parent computing a result itself, read-ahead threads included) nothing would free it: the
    block goes when the array is garbage-collected (``unlink_on_del``), from its creation, so a
    batch dropped unread (a read-ahead buffer discarded) frees its block too.

    Raises:
      SharedMemoryFullError: If ``/dev/shm`` has no room for the block.
    """
    out = SharedMemoryArray(shape, dtype)
    if _pool is None:
        out.unlink_on_del()
    return out


def copy_into_block(array: np.ndarray) -> str:
    """Copies ``array`` (C order) into a new block, outside any worker pool, and returns its
    name; the caller unlinks it (``unlink_block``) once no process needs to map it any more.

    Raises:
      SharedMemoryFullError: If ``/dev/shm`` has no room for it.
    """
    name, mapping = _create_block(array.nbytes)
    view = np.ndarray(array.shape, array.dtype, buffer=mapping)
    view[...] = array
    del view
    mapping.close()
    return name


def attach_read_only(name: str, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """A read-only array over block ``name`` (``copy_into_block``); its pages are mapped as
    they are read, so a process that reads a few rows maps a few pages."""
    fd = _posixshmem.shm_open(name, os.O_RDONLY, mode=0o600)
    try:
        mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.ndarray(shape, dtype, buffer=mapping)


def shared_bytes(tree: Any) -> int:
    """The bytes of the blocks that element ``tree`` (with ``_ShmRef`` leaves) references."""
    if isinstance(tree, _ShmRef):
        return math.prod(tree.shape) * tree.dtype.itemsize
    kind = type(tree)
    if kind is dict:
        return sum(shared_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(shared_bytes(v) for v in tree)
    return 0


def unlink_shm(names: Iterable[str]) -> None:
    """Frees blocks of an element that will never be opened."""
    for name in names:
        unlink_block(name)

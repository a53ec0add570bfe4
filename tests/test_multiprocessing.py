"""grain_core.multiprocessing: SharedMemoryArray and the element transport helpers."""

from __future__ import annotations

import collections
import collections.abc
import errno
import gc
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from grain_core._ipc import shm as _shm
from grain_core.multiprocessing import (
    MultiprocessingOptions,
    SharedMemoryArray,
    SharedMemoryArrayMetadata,
    SharedMemoryFullError,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm listing")


def _exists(name: str) -> bool:
    return os.path.exists("/dev/shm/" + name.lstrip("/"))


def test_array_lives_in_a_named_block_and_pickles_by_name() -> None:
    arr = SharedMemoryArray((3, 4), np.float32)
    arr[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
    meta = arr.metadata
    assert isinstance(meta, SharedMemoryArrayMetadata)
    assert meta.shape == (3, 4) and meta.dtype == np.float32 and _exists(meta.name)
    attached = SharedMemoryArray.from_metadata(meta)
    attached[0, 0] = 42  # same memory, no copy
    assert arr[0, 0] == 42
    data = pickle.dumps(arr)
    assert len(data) < 400  # the name travels, not the 48 bytes... nor 48 MB
    again = pickle.loads(data)
    assert np.array_equal(again, arr)
    meta.close_and_unlink_shm()
    assert not _exists(meta.name)


def test_unlink_on_del_frees_the_block() -> None:
    arr = SharedMemoryArray(16, np.int64)
    name = arr.metadata.name
    arr.unlink_on_del()
    view = arr[2:5]
    del arr
    gc.collect()
    assert _exists(name)  # a view keeps the array alive
    del view
    gc.collect()
    assert not _exists(name)


def test_an_array_that_frees_its_block_pickles_its_data() -> None:
    # Its block may be gone before the receiver maps it.
    arr = SharedMemoryArray(16, np.int64)
    arr[:] = np.arange(16)
    arr.unlink_on_del()
    again = pickle.loads(pickle.dumps(arr))
    assert type(again) is np.ndarray and again.tolist() == list(range(16))


_FORK_SCRIPT = """
import gc
import os

import numpy as np

from grain_core.multiprocessing import SharedMemoryArray

arr = SharedMemoryArray(16, np.int64)
path = "/dev/shm/" + arr.metadata.name.lstrip("/")
arr.unlink_on_del()
pid = os.fork()
if pid == 0:
    del arr
    gc.collect()  # the child's finalizer runs here, and must leave the block alone
    os._exit(0 if os.path.exists(path) else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), os.path.exists(path))
del arr
gc.collect()
print(os.path.exists(path))
"""


def test_a_forked_childs_copy_of_an_array_leaves_the_block_to_the_parent() -> None:
    # In a fresh interpreter: forking this one, with JAX's threads, could deadlock the child.
    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "True", "False"]


def test_without_unlink_on_del_only_the_mapping_goes() -> None:
    arr = SharedMemoryArray(8, np.uint8)
    meta = arr.metadata
    del arr
    gc.collect()
    assert _exists(meta.name)
    meta.close_and_unlink_shm()


def test_async_deletion() -> None:
    SharedMemoryArray.enable_async_del(num_threads=1, max_outstanding_requests=2)
    names = []
    for _ in range(5):
        arr = SharedMemoryArray(4)
        names.append(arr.metadata.name)
        arr.unlink_on_del()
        del arr
    gc.collect()
    assert _shm._deleter.executor is not None
    _shm._deleter.executor.submit(lambda: None).result()  # the queue is processed in order
    assert not any(_exists(n) for n in names)


def test_new_arrays_from_numpy_ops_are_plain() -> None:
    arr = SharedMemoryArray((4,), np.float64)
    arr[...] = 1.0
    assert type(arr + 1) is np.ndarray
    assert type(arr.sum()) is np.float64
    copy = arr.copy()
    with pytest.raises(ValueError, match="whole shared-memory block"):
        _ = copy.metadata
    assert type(pickle.loads(pickle.dumps(copy))) is np.ndarray
    with pytest.raises(ValueError, match="object"):
        SharedMemoryArray((2,), object)
    arr.metadata.close_and_unlink_shm()


Point = collections.namedtuple("Point", "x y")


def test_copy_to_shm_round_trip_and_rules() -> None:
    big = np.arange(1000, dtype=np.float64)
    tree = {
        "b": [big, Point(big * 2, "label")],
        "a": np.arange(10),
        "strided": big[::2],
        "objects": np.array([{"k": 1}] * 200, dtype=object),
        "empty": np.zeros((0, 3)),
    }
    encoded, names = _shm.copy_to_shm(tree, min_size=1024)
    assert len(names) == 2  # big and big * 2; small, strided, object, empty stay inline
    assert all(_exists(n) for n in names)
    decoded = _shm.open_from_shm(pickle.loads(pickle.dumps(encoded)))
    assert not any(_exists(n) for n in names)  # unlinked as soon as mapped
    assert list(decoded) == ["b", "a", "strided", "objects", "empty"]
    assert isinstance(decoded["b"][1], Point)
    np.testing.assert_array_equal(decoded["b"][0], big)
    np.testing.assert_array_equal(decoded["b"][1].x, big * 2)
    np.testing.assert_array_equal(decoded["strided"], big[::2])


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype(np.float32),
        np.dtype(">i8"),
        np.dtype("M8[ns]"),
        np.dtype("U3"),
        np.dtype([("a", "<i4"), ("b", "<f8")]),
        np.dtype(np.float64, metadata={"unit": "m"}),
    ],
    ids=str,
)
def test_leaves_keep_their_exact_dtype_through_the_transport(dtype: np.dtype) -> None:
    # Plain dtypes travel as their code, structured ones and those with metadata as objects.
    arr = np.zeros(8, dtype)
    encoded, _ = _shm.copy_to_shm(arr, min_size=0)
    decoded = _shm.open_from_shm(pickle.loads(pickle.dumps(encoded)))
    assert decoded.dtype == dtype and decoded.dtype.metadata == dtype.metadata
    assert decoded.dtype.fields == dtype.fields
    np.testing.assert_array_equal(decoded, arr)


@pytest.fixture
def dev_shm_full(monkeypatch: pytest.MonkeyPatch) -> None:
    def fallocate(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr(_shm, "_warned_full", False)


def test_a_full_dev_shm_is_a_clear_error_and_leaves_no_block(dev_shm_full: None) -> None:
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(SharedMemoryFullError, match=r"no room .* 4096 bytes.*--shm-size") as info:
        SharedMemoryArray((1024,), np.float32)
    assert info.value.errno == errno.ENOSPC
    assert set(os.listdir("/dev/shm")) == before
    # Raised in a worker, it reaches the parent as itself.
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is SharedMemoryFullError and str(copy) == str(info.value)


def test_transport_keeps_arrays_inline_when_dev_shm_is_full(dev_shm_full: None) -> None:
    tree = {"x": np.arange(1000, dtype=np.float64), "y": np.ones(2000)}
    with pytest.warns(RuntimeWarning, match="travel pickled") as record:
        encoded, names = _shm.copy_to_shm(tree, min_size=0)
    assert len(record) == 1  # once per process, not once per array
    assert names == [] and encoded["x"] is tree["x"] and encoded["y"] is tree["y"]


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL])
def test_a_filesystem_without_fallocate_still_gets_blocks(
    code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Some shared-memory filesystems cannot reserve pages ahead: map the block as before.
    def fallocate(fd: int, offset: int, size: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    arr = SharedMemoryArray((1024,), np.float32)
    arr[:] = 3.0
    assert float(arr.sum()) == 3072.0
    arr.metadata.close_and_unlink_shm()


def test_other_fallocate_errors_propagate_and_leave_no_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fallocate(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(OSError, match="Input/output error"):
        SharedMemoryArray((1024,), np.float32)
    assert set(os.listdir("/dev/shm")) == before


@pytest.fixture
def block_pool(monkeypatch: pytest.MonkeyPatch) -> collections.abc.Iterator[None]:
    """This process recycles blocks as a worker does, keeping at most 2 free of a size."""
    monkeypatch.setattr(_shm, "_pool", None)
    _shm.enable_block_pool(2)
    yield
    _shm.unlink_pool()


def test_block_pool_reuses_the_last_block_given_back(block_pool: None) -> None:
    names = [_shm.create_block(4096)[0] for _ in range(4)]
    assert len(set(names)) == 4
    _shm.release_blocks(names[:3])
    # Two are kept (the cap); the third is unlinked and reported once, so the parent forgets it.
    assert _shm.take_dropped() == [names[2]] and _shm.take_dropped() == []
    assert not _exists(names[2]) and _exists(names[0]) and _exists(names[1])
    assert _shm.create_block(4096)[0] == names[1]  # most recently freed: likeliest in cache
    assert _shm.create_block(8192)[0] not in names  # another size: a new block
    _shm.release_blocks(["/never-taken"])  # unknown names are ignored
    _shm.unlink_pool()
    assert not any(_exists(name) for name in names)


def test_block_pool_loses_no_block_to_concurrent_takers(block_pool: None) -> None:
    # Read threads take blocks (batches stacked into shared memory) while the worker's main
    # thread gives blocks back.
    import queue
    import threading

    given: queue.Queue[str] = queue.Queue()
    taken: list[str] = []

    def take() -> None:
        for _ in range(300):
            name = _shm.create_block(4096)[0]
            taken.append(name)
            given.put(name)

    threads = [threading.Thread(target=take) for _ in range(3)]
    for thread in threads:
        thread.start()
    returned = 0
    while returned < 900:
        _shm.release_blocks([given.get()])
        returned += 1
    for thread in threads:
        thread.join()
    free = {name for blocks in _shm._pool._free.values() for name, _ in blocks}
    dropped = set(_shm.take_dropped())
    assert not _shm._pool._used
    assert len(free) <= 2 and free | dropped == set(taken) and not free & dropped
    assert all(_exists(name) for name in free) and not any(_exists(name) for name in dropped)


def test_unlink_shm_frees_unopened_elements() -> None:
    _, names = _shm.copy_to_shm([np.ones(100)], min_size=0)
    _shm.unlink_shm(names)
    assert not any(_exists(n) for n in names)


def test_a_batch_stacked_outside_a_worker_frees_its_block_when_collected() -> None:
    # The parent computing a batch itself (in-process mode, its read-ahead threads included):
    # no worker will take the block back, so it goes with the array, even when the batch is
    # dropped unread from a read-ahead buffer.
    stacked = _shm.stacked_array((4, 8), np.dtype(np.float32))
    name = stacked.metadata.name
    del stacked
    gc.collect()
    assert not _exists(name)


def test_a_batch_stacked_in_a_worker_keeps_its_block_for_the_parent(block_pool: None) -> None:
    # A worker sends the block to the parent, which hands it back to the worker's pool.
    stacked = _shm.stacked_array((4, 8), np.dtype(np.float32))
    name = stacked.metadata.name
    del stacked
    gc.collect()
    assert _exists(name)
    _shm.release_blocks([name])


_DEAD_WORKERS_BLOCKS_SCRIPT = """
import os
from grain_core._ipc import shm

prefix = f"gc{os.getpid():x}dead_"
shm.set_name_prefix(prefix)
registered = shm.SharedMemoryArray(8)  # created and registered with the resource tracker
# A worker killed between creating a block and registering it leaves this:
fd = shm._posixshmem.shm_open(f"/{prefix}unregistered", os.O_CREAT | os.O_RDWR, mode=0o600)
os.close(fd)
print(sorted(shm.unlink_prefix(prefix)))
"""


def test_removing_a_dead_workers_blocks_leaves_the_resource_tracker_balanced() -> None:
    # The parent removes what a stopped or killed worker left under its prefix, whether or
    # not the worker lived to register each block: the resource tracker (which outlives the
    # script and writes to its stderr) neither fails on an unknown name nor warns of a leak.
    # A worker killed by SIGKILL mid-run left such a block about once in three runs.
    with subprocess.Popen(
        [sys.executable, "-c", _DEAD_WORKERS_BLOCKS_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        out, err = proc.communicate(timeout=120)
    prefix = f"gc{proc.pid:x}dead_"
    assert (proc.returncode, out.strip()) == (0, str([f"/{prefix}0", f"/{prefix}unregistered"]))
    assert "resource_tracker" not in err and "KeyError" not in err, err
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]


def test_whole_block_arrays_are_sent_without_copy() -> None:
    arr = SharedMemoryArray((2, 2), np.int32)
    encoded, names = _shm.copy_to_shm({"x": arr}, min_size=10**9)
    assert names == [arr.metadata.name]
    _shm.unlink_shm(names)


def test_options_validation() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        MultiprocessingOptions(num_workers=-1)
    with pytest.raises(ValueError, match="per_worker_buffer_size"):
        MultiprocessingOptions(per_worker_buffer_size=-1)

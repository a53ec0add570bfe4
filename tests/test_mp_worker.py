"""grain_core.dataset.mp.worker: workers kept between iterators (``persistent_workers``), with
real worker processes under both engines: the same processes serve the next epoch and the
next iterator with the same output, and stop when the dataset or loader is closed or
collected, leaving no shared memory."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from typing import Any

import cloudpickle
import numpy as np
import pytest
from conftest import shm_names

import grain_core as grain
from grain_core.testing import assert_trees_equal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX shm + /dev/shm")

# Workers receive this module's functions by value, so they never import pytest.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _with_pid(x: int) -> dict[str, Any]:
    """A 128 KiB array (through shared memory), the position, the computing process."""
    return {"z": np.full((128, 256), x, np.float32), "x": x, "pid": os.getpid()}


def _same(element: Any) -> Any:
    return element


def _pipeline(engine: str, persistent: bool = True) -> grain.IterDataset:
    ds = grain.MapDataset.range(40).map(_with_pid).to_iter_dataset()
    if engine == "rotation":
        ds = ds.map(_same)  # an IterDataset step after the slice point: strict rotation
    options = grain.MultiprocessingOptions(num_workers=2, persistent_workers=persistent)
    return ds.mp_prefetch(options)


def _pids(elements: list[dict[str, Any]]) -> set[int]:
    return {int(e["pid"]) for e in elements}


def _without_pids(elements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "pid"} for e in elements]


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (a stopped pool has reaped its workers)."""
    return os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
def test_next_epoch_and_next_iterator_reuse_the_workers(engine: str) -> None:
    before = shm_names()
    ds = _pipeline(engine)
    first = list(ds)
    second = list(ds)  # the next epoch
    it = iter(ds)  # an iterator closed early, the next one starts from the beginning
    partial = [next(it) for _ in range(5)]
    held = partial[-1]  # an array of it still held: its block goes back later
    it.close()
    third = list(ds)
    expected = _without_pids(list(_pipeline(engine, persistent=False)))
    workers = _pids(first)
    assert len(workers) == 2 and os.getpid() not in workers
    assert _pids(second) == _pids(partial) == _pids(third) == workers
    for epoch in (first, second, third):
        assert_trees_equal(_without_pids(epoch), expected)
    assert_trees_equal(_without_pids(partial), expected[:5])
    del held, partial
    ds.close()  # type: ignore[attr-defined]
    assert not any(_running(pid) for pid in workers)
    gc.collect()
    assert shm_names() - before == set()


@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
def test_a_restored_iterator_on_kept_workers_goes_on_from_its_state(engine: str) -> None:
    ds = _pipeline(engine)
    it = iter(ds)
    head = [next(it) for _ in range(7)]
    state = it.get_state()
    tail = list(it)
    it.close()  # its workers go back to the dataset (as when it is collected)
    restored = iter(ds)
    restored.set_state(state)
    again = list(restored)
    assert _pids(again) == _pids(head)
    assert_trees_equal(_without_pids(again), _without_pids(tail))
    ds.close()  # type: ignore[attr-defined]


def test_workers_stop_when_the_dataset_is_collected() -> None:
    before = shm_names()
    ds = _pipeline("dispatch")
    workers = _pids(list(ds))
    assert all(_running(pid) for pid in workers)
    del ds
    gc.collect()
    assert not any(_running(pid) for pid in workers)
    assert shm_names() - before == set()


def test_without_persistent_workers_each_iterator_starts_its_own() -> None:
    ds = _pipeline("dispatch", persistent=False)
    first, second = list(ds), list(ds)
    assert _pids(first).isdisjoint(_pids(second))
    assert not any(_running(pid) for pid in _pids(first))


def test_a_kept_worker_that_died_is_replaced() -> None:
    ds = _pipeline("dispatch")
    workers = sorted(_pids(list(ds)))
    os.kill(workers[0], signal.SIGKILL)
    while _running(workers[0]):  # until the server that forked it has reaped it
        time.sleep(0.01)
    again = list(ds)
    assert _pids(again).isdisjoint(workers)
    assert_trees_equal(_without_pids(again), _without_pids(list(_pipeline("dispatch", False))))
    assert not _running(workers[1])  # its partner is stopped with it
    ds.close()  # type: ignore[attr-defined]


def test_a_forked_child_starts_workers_of_its_own() -> None:
    ds = _pipeline("dispatch")
    workers = _pids(list(ds))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports the workers that computed its epoch
        try:
            child_workers = _pids(list(ds))
            os.write(write, repr(sorted(child_workers)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child_workers = set(eval(f.read()))  # noqa: S307 - a list of ints we wrote
    os.waitpid(pid, 0)
    assert len(child_workers) == 2 and child_workers.isdisjoint(workers)
    assert _pids(list(ds)) == workers  # the parent's are still its own
    ds.close()  # type: ignore[attr-defined]

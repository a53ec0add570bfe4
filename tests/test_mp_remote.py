"""mp_prefetch on a worker backend (``MultiprocessingOptions.backend``): the engine of
``grain_core/dataset/mp/remote.py`` driven through an in-process backend whose workers compute
their tasks when the parent waits, so lost workers and errors happen exactly where a test says.
Ray's backend is tested against a real Ray instance in tests/test_ray.py."""

from __future__ import annotations

import gc
import itertools
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import grain_core as grain
from grain_core import plugins
from grain_core._ipc.errors import WorkerDiedError
from grain_core.dataset.mp import remote
from grain_core.dataset.options import DatasetOptions
from grain_core.experimental import WithOptionsIterDataset
from grain_core.options import MultiprocessingOptions
from grain_core.plugins import WorkerGroup, WorkerJob, WorkerLostError
from grain_core.testing import check_iterator_conformance


class _InlineGroup:
    """Workers in this process: each task is computed when ``wait`` reports it, one per call,
    oldest first. ``lose(w)`` makes worker ``w`` lost: its unfinished tasks report
    ``WorkerLostError``."""

    def __init__(self, job: WorkerJob, count: int) -> None:
        # The worker factory travels pickled, as to a remote worker.
        make_worker = pickle.loads(pickle.dumps(job.make_worker))
        self.environ = dict(job.environ)
        self.computers = [make_worker(w, count) for w in range(count)]
        self.alive = set(range(count))
        self.pending: list[tuple[int, int, Any]] = []
        self.tickets = itertools.count()
        self.closed = False
        self.tasks_done = 0

    def workers(self) -> list[int]:
        return sorted(self.alive)

    def submit(self, worker: int, task: Any) -> int:
        ticket = next(self.tickets)
        self.pending.append((ticket, worker, task))
        return ticket

    def wait(self, timeout: float | None) -> list[tuple[int, Any]]:
        if not self.pending:
            return []
        ticket, worker, task = self.pending.pop(0)
        if worker not in self.alive:
            return [(ticket, WorkerLostError(f"inline worker {worker} was lost"))]
        self.tasks_done += 1
        return [(ticket, self.computers[worker](task))]

    def lose(self, worker: int) -> None:
        self.alive.discard(worker)

    def describe(self, worker: int) -> str:
        return f"inline worker {worker}"

    def close(self) -> None:
        self.closed = True


class _InlineBackend:
    name = "inline"
    description = "workers in this process (tests)"

    def __init__(self, num_workers: int | None = None) -> None:
        self.num_workers = num_workers
        self.groups: list[_InlineGroup] = []

    def start(self, job: WorkerJob) -> WorkerGroup:
        group = _InlineGroup(job, self.num_workers or job.num_workers)
        self.groups.append(group)
        return group


class _OtherHostGroup(_InlineGroup):
    """Workers on another host: each task is computed by a worker made for it, its results
    travel pickled, and the worker is gone (its memory collected) before the parent unpickles
    them."""

    def __init__(self, job: WorkerJob, count: int) -> None:
        super().__init__(job, count)
        self.make_worker = pickle.loads(pickle.dumps(job.make_worker))
        self.count = count

    def wait(self, timeout: float | None) -> list[tuple[int, Any]]:
        if not self.pending:
            return []
        ticket, worker, task = self.pending.pop(0)
        computer = self.make_worker(worker, self.count)
        data = pickle.dumps(computer(task))
        del computer
        gc.collect()
        return [(ticket, pickle.loads(data))]


class _OtherHostBackend(_InlineBackend):
    def start(self, job: WorkerJob) -> WorkerGroup:
        group = _OtherHostGroup(job, self.num_workers or job.num_workers)
        self.groups.append(group)
        return group


def _opts(n: int, backend: Any = "local") -> MultiprocessingOptions:
    return MultiprocessingOptions(num_workers=n, backend=backend)


def _square(x: int) -> dict[str, Any]:
    return {"x": np.full((3,), x * x, np.int64), "i": x}


def _pipelines() -> dict[str, Callable[[], grain.IterDataset]]:
    return {
        "elements": lambda: grain.MapDataset.range(23).map(_square).to_iter_dataset(),
        "map_batch": lambda: grain.MapDataset.range(23).map(_square).batch(4).to_iter_dataset(),
        "iter_batch": lambda: grain.MapDataset.range(23).to_iter_dataset().map(_square).batch(3),
        "filtered_source": lambda: (
            grain.MapDataset.range(23).filter(lambda x: x % 4 != 1).to_iter_dataset()
        ),
    }


def _flat(elements: list[Any]) -> list[Any]:
    """Elements as plain lists, to compare with ``==``."""
    return [
        {k: np.asarray(v).tolist() for k, v in e.items()} if isinstance(e, dict) else e
        for e in elements
    ]


@pytest.mark.parametrize("name", sorted(_pipelines()))
@pytest.mark.parametrize(("classes", "workers"), [(2, 2), (3, 1), (2, 5)])
def test_output_is_that_of_the_same_number_of_classes_on_any_number_of_workers(
    name: str, classes: int, workers: int
) -> None:
    make = _pipelines()[name]
    # That of `classes` local workers (strided shares), whatever the backend's worker count.
    expected = _flat(list(make().mp_prefetch(_opts(classes))))
    got = _flat(list(make().mp_prefetch(_opts(classes, _InlineBackend(workers)))))
    assert got == expected
    if name in ("elements", "map_batch"):
        assert got == _flat(list(make()))


def test_checkpoints_restore_across_backends_and_worker_counts() -> None:
    make = _pipelines()["iter_batch"]
    backend = _InlineBackend(3)
    check_iterator_conformance(lambda: make().mp_prefetch(_opts(2, backend)))
    it = iter(make().mp_prefetch(_opts(2, backend)))
    for _ in range(3):
        next(it)
    state = it.get_state()
    rest = _flat(list(it))
    local = iter(make().mp_prefetch(_opts(2)))
    for _ in range(3):
        next(local)
    assert local.get_state() == state  # the same parent-side state as local workers
    local.set_state(state)
    assert _flat(list(local)) == rest
    other = iter(make().mp_prefetch(_opts(2, _InlineBackend(1))))
    other.set_state(state)
    assert _flat(list(other)) == rest


def test_a_lost_worker_has_its_tasks_handed_to_the_others() -> None:
    make = _pipelines()["elements"]
    expected = _flat(list(make()))
    backend = _InlineBackend(2)
    it = iter(make().mp_prefetch(_opts(2, backend)))
    got = [next(it) for _ in range(3)]
    group = backend.groups[0]
    assert any(w == 0 for _, w, _ in group.pending)  # worker 0 has unfinished tasks
    group.lose(0)
    got += list(it)
    assert _flat(got) == expected
    assert group.workers() == [1]


def test_every_worker_lost_is_an_error_naming_them_not_a_hang() -> None:
    backend = _InlineBackend(2)
    it = iter(_pipelines()["elements"]().mp_prefetch(_opts(2, backend)))
    first = next(it)
    backend.groups[0].lose(0)
    backend.groups[0].lose(1)
    got = [first]
    with pytest.raises(WorkerDiedError) as info:
        while True:
            got.append(next(it))
    assert "inline worker 0" in str(info.value) and "inline worker 1" in str(info.value)
    assert _flat(got) == _flat(list(_pipelines()["elements"]()))[: len(got)]


def _fails_at_seven(x: int) -> int:
    if x == 7:
        raise KeyError(f"no record {x}")
    return x


def test_an_error_arrives_at_its_position_with_type_and_worker_traceback() -> None:
    ds = grain.MapDataset.range(12).map(_fails_at_seven).to_iter_dataset()
    it = iter(ds.mp_prefetch(_opts(2, _InlineBackend(2))))
    got = []
    with pytest.raises(KeyError, match="no record 7") as info:
        while True:
            got.append(next(it))
    assert got == list(range(7))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "Raised in inline worker" in notes and "_fails_at_seven" in notes
    with pytest.raises(KeyError):  # again, until the iterator is restored elsewhere
        next(it)


def _row(x: int) -> np.ndarray:
    return np.full((64, 64), x, np.float32)


def test_a_batch_in_shared_memory_on_a_backend_worker_travels_and_frees_its_block(
    no_shm_leak: None,
) -> None:
    # A batch told to write into shared memory (enable_shared_memory_output) on a worker
    # with no block pool: the worker frees the block when it drops the batch, and the batch
    # travels by value (the worker is gone before its results are read), not by block name.
    def make() -> grain.IterDataset:
        batched = grain.MapDataset.range(10).map(_row).batch(4)
        batched.enable_shared_memory_output()
        return batched.to_iter_dataset()

    got = list(make().mp_prefetch(_opts(2, _OtherHostBackend(2))))
    expected = list(grain.MapDataset.range(10).map(_row).batch(4).to_iter_dataset())
    assert [b.tolist() for b in got] == [b.tolist() for b in expected]
    del got
    gc.collect()


def test_workers_get_cpu_jax_and_are_released_when_the_iterator_closes() -> None:
    backend = _InlineBackend(2)
    it = iter(_pipelines()["elements"]().mp_prefetch(_opts(2, backend)))
    next(it)
    group = backend.groups[0]
    assert group.environ == {"JAX_PLATFORMS": "cpu"}
    assert not group.closed
    it.close()
    assert group.closed


def _keep_even(x: int) -> bool:
    return x % 2 == 0


def test_pipelines_not_computed_by_position_are_refused_naming_the_node() -> None:
    stream = grain.MapDataset.range(10).to_iter_dataset().filter(_keep_even)
    with pytest.raises(ValueError, match="FilterIterDataset") as info:
        stream.mp_prefetch(_opts(2, _InlineBackend()))
    assert "'inline'" in str(info.value)
    holes = grain.MapDataset.range(10).filter(_keep_even).to_iter_dataset().batch(2)
    with pytest.raises(ValueError, match="FilterMapDataset"):
        holes.mp_prefetch(_opts(2, _InlineBackend()))
    ok = grain.MapDataset.range(10).to_iter_dataset()
    with pytest.raises(ValueError, match="worker_init_fn"):
        ok.mp_prefetch(_opts(2, _InlineBackend()), worker_init_fn=lambda i, n: None)
    with pytest.raises(ValueError, match="sequential_slice"):
        ok.mp_prefetch(_opts(2, _InlineBackend()), sequential_slice=True)


def test_backend_names_resolve_through_the_plugin_registry() -> None:
    assert remote.worker_backend(_opts(2)) is None
    with pytest.raises(plugins.UnknownPluginObjectError, match="no_such_backend"):
        remote.worker_backend(_opts(2, "no_such_backend"))
    with pytest.raises(TypeError, match="WorkerBackend"):
        remote.worker_backend(_opts(2, object()))
    with pytest.raises(ValueError, match="empty name"):
        MultiprocessingOptions(num_workers=1, backend="")
    if "ray" not in {b.name for b in plugins.list_worker_backends()}:
        with pytest.raises(
            plugins.MissingPluginError,
            match=r"pip install \. \./plugins/grain_ray \(in a clone of grain_core\)",
        ):
            remote.worker_backend(_opts(2, "ray"))


@pytest.mark.parametrize("backend", ["local", "inline"])
def test_a_filter_dropping_past_the_raise_threshold_raises_on_either_dispatcher(
    backend: str,
) -> None:
    # Every producer's holes are counted per class (ClassConsumer._filtered_out); each of
    # the two classes drops 3 of every 4 elements.
    chosen: Any = _InlineBackend(2) if backend == "inline" else "local"
    dropping = grain.MapDataset.range(3000).filter(lambda x: x % 8 < 2).to_iter_dataset()
    ds = WithOptionsIterDataset(
        dropping.mp_prefetch(_opts(2, chosen)),
        DatasetOptions(filter_raise_threshold_ratio=0.5),
    )
    with pytest.raises(ValueError, match="skipped"):
        list(ds)
    kept = WithOptionsIterDataset(
        dropping.mp_prefetch(_opts(2, chosen)),
        DatasetOptions(filter_raise_threshold_ratio=0.9),
    )
    assert sorted(kept) == [x for x in range(3000) if x % 8 < 2]

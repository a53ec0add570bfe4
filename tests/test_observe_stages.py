"""Tests for grain_core.observe.stages: STAGE_TIMING stage statistics, installed at no cost
when off, and worker snapshots."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import StageClock, stage_pipeline

import grain_core as grain
from grain_core.dataset.base import MapDataset
from grain_core.dataset.iterator import DatasetIterator, pipeline_observer
from grain_core.experimental import (
    DatasetOptions,
    ExecutionTrackingMode,
    InterleaveIterDataset,
    ThreadPrefetchIterDataset,
    WithOptionsIterDataset,
    get_execution_summary,
)
from grain_core.observe import stages
from grain_core.testing import check_iterator_conformance

TIMING = DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING)
SYNC = grain.ReadOptions(num_threads=0)


def _iterators(it: DatasetIterator[Any]) -> Iterator[DatasetIterator[Any]]:
    yield it
    for parent in it._parents:
        if isinstance(parent, DatasetIterator):
            yield from _iterators(parent)


# ------------------------------------------------------------------------ disabled: no cost
def test_disabled_tracking_leaves_every_stage_untouched() -> None:
    ds = stage_pipeline()
    map_graph = ds._parents[0]._parents[0]._parents[0].map_parent
    it = iter(ds)
    next(it)
    for node in _iterators(it):
        assert "_untimed_class" not in vars(type(node))
        assert "_stage_stats" not in vars(node)
    reader = list(_iterators(it))[-1]
    assert reader._map_ds is map_graph
    assert "_untimed_class" not in vars(type(map_graph))


# ------------------------------------------------------------------------- enabled: results
def test_counts_and_self_times_per_stage(stage_clock: StageClock) -> None:
    it = iter(WithOptionsIterDataset(stage_pipeline(stage_clock), TIMING))
    assert len(list(it)) == 10
    summary = get_execution_summary(it)
    rows = {s.name.split("(")[0]: s for s in summary.stages}
    assert [s.name.split("(")[0] for s in summary.stages] == [
        "Batch",
        "Map",
        "Filter",
        "Prefetch",
        "MapMapDataset",
        "RangeMapDataset",
    ]
    assert rows["Batch"].num_produced_elements == 10
    assert rows["Map"].num_produced_elements == 50
    assert rows["Filter"].num_produced_elements == 50
    assert rows["Prefetch"].num_produced_elements == 100
    assert rows["MapMapDataset"].num_produced_elements == 100
    assert rows["RangeMapDataset"].num_produced_elements == 100
    # Self time excludes inputs exactly: only the transforms advance the clock.
    assert rows["MapMapDataset"].self_time_ns == 100 * 1000
    assert rows["Filter"].self_time_ns == 100 * 10
    assert rows["Map"].self_time_ns == 50 * 100
    assert rows["Batch"].self_time_ns == 0
    assert rows["Prefetch"].self_time_ns == 0
    assert summary.total_self_time_ns == 100_000 + 1000 + 5000
    assert summary.output_wait_ns == summary.total_self_time_ns
    assert summary.slowest().name.startswith("MapMapDataset")
    assert rows["MapMapDataset"].share == pytest.approx(100_000 / 106_000)
    assert sum(s.share for s in summary.stages) == pytest.approx(1.0)
    assert rows["Map"].self_time_per_element_ns == 100
    assert [s.inputs for s in summary.stages] == [(1,), (2,), (3,), (4,), (5,), ()]


def test_options_set_upstream_time_downstream_stages_too() -> None:
    ds = WithOptionsIterDataset(grain.MapDataset.range(20).to_iter_dataset(SYNC), TIMING)
    it = iter(ds.map(lambda x: x).batch(4))
    list(it)
    summary = get_execution_summary(it)
    assert [s.num_produced_elements for s in summary.stages] == [5, 20, 20, 20]


def test_tracking_does_not_change_output_or_checkpoints() -> None:
    plain = list(stage_pipeline())
    tracked = list(WithOptionsIterDataset(stage_pipeline(), TIMING))
    assert [b.tolist() for b in plain] == [b.tolist() for b in tracked]
    check_iterator_conformance(
        lambda: WithOptionsIterDataset(stage_pipeline(), TIMING), positions=[0, 3, 10]
    )


def test_user_datasets_are_not_modified_and_stay_untimed() -> None:
    ds = stage_pipeline()
    tracked = iter(WithOptionsIterDataset(ds, TIMING))
    list(tracked)
    untracked = iter(ds)
    list(untracked)
    for node in _iterators(untracked):
        assert "_stage_stats" not in vars(node)
    reader = list(_iterators(untracked))[-1]
    node: Any = reader._map_ds
    while isinstance(node, MapDataset):
        assert "_untimed_class" not in vars(type(node))
        node = node.parents[0] if node.parents else None


def test_iterator_class_names_and_errors_are_unchanged() -> None:
    it = iter(WithOptionsIterDataset(stage_pipeline(), TIMING))
    assert type(it).__name__ == "_BatchIterator"
    it.close()
    with pytest.raises(ValueError, match=r"closed iterator \(PrefetchDatasetIterator\)"):
        next(it)


def test_stop_iteration_and_errors_are_not_counted() -> None:
    def boom(x: int) -> int:
        if x == 3:
            raise KeyError("bad element")
        return x

    it = iter(
        WithOptionsIterDataset(grain.MapDataset.range(5).to_iter_dataset(SYNC).map(boom), TIMING)
    )
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="bad element"):
        next(it)
    assert get_execution_summary(it).stages[0].num_produced_elements == 3


def test_thread_prefetch_stages_run_on_another_thread() -> None:
    ds = ThreadPrefetchIterDataset(
        grain.MapDataset.range(30).to_iter_dataset(SYNC).map(lambda x: x + 1),
        prefetch_buffer_size=4,
    )
    it = iter(WithOptionsIterDataset(ds, TIMING).batch(3))
    assert len(list(it)) == 10
    summary = get_execution_summary(it)
    assert [s.name.split("(")[0] for s in summary.stages[:3]] == ["Batch", "ThreadPrefetch", "Map"]
    assert [s.num_produced_elements for s in summary.stages] == [10, 30, 30, 30, 30]


class _GatedReceiver(DatasetIterator[int]):
    """A stand-in for a worker-stage receiver, registered as one when built: its elements wait for ``gate`` (``reading`` is
    set once a read has started), and it records whether statistics were asked for while a
    read was in progress (the pipes of real workers would then be used by two threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = threading.Event()
        self.gate = threading.Event()
        self.in_read = False
        self.asked_during_read: list[bool] = []
        self._next = 0
        pipeline_observer().receives_worker_stages(
            self, self.request_worker_stages, self.receive_worker_stages
        )

    def __next__(self) -> int:
        self.in_read = True
        self.reading.set()
        self.gate.wait()
        self.in_read = False
        self._next += 1
        return self._next - 1

    def get_state(self) -> dict[str, Any]:
        return {"next": self._next}

    def set_state(self, state: dict[str, Any]) -> None:
        self._next = state["next"]

    def request_worker_stages(self) -> None:
        self.asked_during_read.append(self.in_read)

    def receive_worker_stages(self) -> None:
        self.asked_during_read.append(self.in_read)


class _GatedDataset(grain.IterDataset[int]):
    def __init__(self) -> None:
        super().__init__()
        self.iterator = _GatedReceiver()

    def __iter__(self) -> DatasetIterator[int]:
        return self.iterator


def _runs_in(thread: threading.Thread, function: str) -> bool:
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def test_summary_waits_for_a_prefetch_thread_to_leave_its_inputs() -> None:
    # device_put(DataLoader) reads the loader on a thread: asking its workers for statistics
    # from the consumer's thread meanwhile used their pipes from two threads at once.
    source = _GatedDataset()
    it = iter(
        WithOptionsIterDataset(ThreadPrefetchIterDataset(source, prefetch_buffer_size=2), TIMING)
    )
    receiver = source.iterator
    it.start_prefetch()
    assert receiver.reading.wait(timeout=60)  # the prefetch thread waits inside a read
    summaries: list[Any] = []
    reporter = threading.Thread(target=lambda: summaries.append(get_execution_summary(it)))
    reporter.start()
    while reporter.is_alive() and not _runs_in(reporter, "_readers_paused"):
        threading.Event().wait(0.001)  # until the report waits for the read to end
    receiver.gate.set()
    reporter.join()
    assert summaries and receiver.asked_during_read == [False, False]
    assert next(it) == 0
    it.close()


def test_threaded_reads_time_map_stages() -> None:
    ds = (
        grain.MapDataset.range(200)
        .map(lambda x: x + 1)
        .to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=32))
    )
    it = iter(WithOptionsIterDataset(ds, TIMING))
    assert list(it) == list(range(1, 201))
    counts = {
        s.name.split("(")[0]: s.num_produced_elements for s in get_execution_summary(it).stages
    }
    assert counts == {"Prefetch": 200, "MapMapDataset": 200, "RangeMapDataset": 200}


# ------------------------------------------------------------------ worker snapshots
def test_worker_snapshots_merge_under_the_receiving_stage(stage_clock: StageClock) -> None:
    """What mp_prefetch does with worker statistics, without processes: each worker's latest
    snapshot replaces its previous one under the parent stage that receives its elements."""
    workers = [
        iter(WithOptionsIterDataset(stage_pipeline(stage_clock).map(abs), TIMING)) for _ in range(2)
    ]
    assert all(stages.is_tracking(w) for w in workers)
    inputs = [grain.MapDataset.range(2).to_iter_dataset(SYNC) for _ in range(2)]
    merge = InterleaveIterDataset(inputs, cycle_length=2, iter_buffer_size=0)
    parent = iter(WithOptionsIterDataset(merge, TIMING))
    assert len(list(parent)) == 4
    receivers = parent._iters
    for worker, receiver in zip(workers, receivers, strict=True):
        next(worker)
        stages.attach_worker_stages(receiver, stages.worker_stage_snapshot(worker))
        list(worker)
        snapshot = json.loads(json.dumps(stages.worker_stage_snapshot(worker)))  # as sent
        stages.attach_worker_stages(receiver, snapshot)
    summary = get_execution_summary(parent)
    in_workers = [s for s in summary.stages if s.in_workers]
    assert [s.name.split("(")[0] for s in in_workers][:2] == ["Map", "Batch"]
    assert all(s.instances == 2 and s.depth >= 2 for s in in_workers)
    assert in_workers[0].num_produced_elements == 20  # 10 batches per worker
    costly = next(s for s in in_workers if "costly" in s.name)
    assert costly.self_time_ns == 2 * 100 * 1000
    assert summary.slowest() == costly
    assert "[worker] MapMapDataset(transform=costly" in str(summary)
    assert "ran in mp_prefetch worker processes" in str(summary).splitlines()[0]


def test_untracked_iterators_are_not_tracking_and_ignore_snapshots() -> None:
    it = iter(stage_pipeline())
    assert not stages.is_tracking(it)
    row = ("Map", "iter", "_MapIterator", 1, 1, 1, 1, 1, None, 0, ())
    stages.attach_worker_stages(it, ([row], 0, 1, {}, []))
    assert "_stage_stats" not in vars(it)

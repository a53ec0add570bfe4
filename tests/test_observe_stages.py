"""Tests for grain_core.observe.stages and grain_core.observe.summary: STAGE_TIMING execution statistics."""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import grain_core as grain
from grain_core.dataset.base import DatasetIterator, MapDataset
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


class FakeClock:
    """Replaces the stats clock; transforms ``advance`` it to cost a known amount of time."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(stages, "_now", fake)
    return fake


def _iterators(it: DatasetIterator[Any]) -> Iterator[DatasetIterator[Any]]:
    yield it
    for parent in it._parents:
        if isinstance(parent, DatasetIterator):
            yield from _iterators(parent)


def _pipeline(clock: FakeClock | None = None) -> Any:
    def costly(x: int) -> int:
        if clock is not None:
            clock.advance(1000)
        return x + 1

    def keep_even(x: int) -> bool:
        if clock is not None:
            clock.advance(10)
        return x % 2 == 0

    def cheap(x: int) -> int:
        if clock is not None:
            clock.advance(100)
        return x * 2

    return (
        grain.MapDataset.range(100)
        .map(costly)
        .to_iter_dataset(SYNC)
        .filter(keep_even)
        .map(cheap)
        .batch(5)
    )


# ------------------------------------------------------------------------ disabled: no cost
def test_disabled_tracking_leaves_every_stage_untouched() -> None:
    ds = _pipeline()
    map_graph = ds._parents[0]._parents[0]._parents[0].map_parent
    it = iter(ds)
    next(it)
    for node in _iterators(it):
        assert "_untimed_class" not in vars(type(node))
        assert "_stage_stats" not in vars(node)
    reader = list(_iterators(it))[-1]
    assert reader._map_ds is map_graph
    assert "_untimed_class" not in vars(type(map_graph))


def test_summary_without_tracking_raises() -> None:
    it = iter(_pipeline())
    # Grain's text (users match on it), then how to turn tracking on in grain_core.
    grains = (
        "Set `grain_py_debug_mode` or set `execution_tracking_mode` in grain options to "
        "`STAGE_TIMING` to enable execution statistics collection"
    )
    with pytest.raises(ValueError, match=re.escape(grains)):
        get_execution_summary(it)


# ------------------------------------------------------------------------- enabled: results
def test_counts_and_self_times_per_stage(clock: FakeClock) -> None:
    it = iter(WithOptionsIterDataset(_pipeline(clock), TIMING))
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


def test_summary_prints_a_table(clock: FakeClock) -> None:
    it = iter(WithOptionsIterDataset(_pipeline(clock), TIMING))
    list(it)
    text = str(get_execution_summary(it))
    lines = text.splitlines()
    assert "execution summary" in lines[0]
    assert lines[1].split("|")[1].strip() == "stage"
    assert "MapMapDataset(transform=costly" in text
    assert "94.3%" in text  # 100_000 of 106_000 ns
    assert "1.00 us" in text  # costly: 1000 ns per element
    assert len(lines) == 3 + 6


def test_summary_is_json_serialisable(clock: FakeClock) -> None:
    it = iter(WithOptionsIterDataset(_pipeline(clock), TIMING))
    next(it)
    data = json.loads(json.dumps(get_execution_summary(it).to_dict()))
    assert data["stages"][0]["num_produced_elements"] == 1


def test_options_set_upstream_time_downstream_stages_too() -> None:
    ds = WithOptionsIterDataset(grain.MapDataset.range(20).to_iter_dataset(SYNC), TIMING)
    it = iter(ds.map(lambda x: x).batch(4))
    list(it)
    summary = get_execution_summary(it)
    assert [s.num_produced_elements for s in summary.stages] == [5, 20, 20, 20]


def test_tracking_does_not_change_output_or_checkpoints() -> None:
    plain = list(_pipeline())
    tracked = list(WithOptionsIterDataset(_pipeline(), TIMING))
    assert [b.tolist() for b in plain] == [b.tolist() for b in tracked]
    check_iterator_conformance(
        lambda: WithOptionsIterDataset(_pipeline(), TIMING), positions=[0, 3, 10]
    )


def test_user_datasets_are_not_modified_and_stay_untimed() -> None:
    ds = _pipeline()
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
    it = iter(WithOptionsIterDataset(_pipeline(), TIMING))
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
    """A stand-in for a worker-stage receiver: its elements wait for ``gate`` (``reading`` is
    set once a read has started), and it records whether statistics were asked for while a
    read was in progress (the pipes of real workers would then be used by two threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = threading.Event()
        self.gate = threading.Event()
        self.in_read = False
        self.asked_during_read: list[bool] = []
        self._next = 0

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


@pytest.mark.parametrize("iter_buffer_size", [0, 2])
def test_interleave_inputs_merge_into_one_row_per_stage(iter_buffer_size: int) -> None:
    inputs = [
        grain.MapDataset.range(i * 10, i * 10 + 5).to_iter_dataset(SYNC).map(abs) for i in range(4)
    ]
    ds = InterleaveIterDataset(inputs, cycle_length=2, iter_buffer_size=iter_buffer_size)
    it = iter(WithOptionsIterDataset(ds, TIMING))
    assert len(list(it)) == 20
    summary = get_execution_summary(it)
    assert summary.stages[0].name == "Interleave"
    assert summary.stages[0].num_produced_elements == 20
    merged = [s for s in summary.stages if s.name.startswith("Map(")]
    assert len(merged) == 1
    # Inputs the interleave finished and dropped still count.
    assert merged[0].instances == 4
    assert merged[0].num_produced_elements == 20


# ------------------------------------------------------------------ worker snapshots
def test_worker_snapshots_merge_under_the_receiving_stage(clock: FakeClock) -> None:
    """What mp_prefetch does with worker statistics, without processes: each worker's latest
    snapshot replaces its previous one under the parent stage that receives its elements."""
    workers = [iter(WithOptionsIterDataset(_pipeline(clock).map(abs), TIMING)) for _ in range(2)]
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
    it = iter(_pipeline())
    assert not stages.is_tracking(it)
    row = ("Map", "iter", "_MapIterator", 1, 1, 1, 1, 1, None, 0, ())
    stages.attach_worker_stages(it, ([row], 0, 1, {}, []))
    assert "_stage_stats" not in vars(it)


def test_a_summary_fits_a_width() -> None:
    def a_transform_with_a_long_descriptive_name(x: int) -> int:
        return x + 1

    ds = grain.MapDataset.range(64).map(a_transform_with_a_long_descriptive_name).batch(4)
    it = iter(WithOptionsIterDataset(ds.to_iter_dataset(), TIMING))
    list(it)
    summary = get_execution_summary(it)
    assert max(len(line) for line in str(summary).splitlines()) > 80
    narrow = summary.to_text(width=80)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert "self time" in narrow and "| min" not in narrow
    assert narrow.splitlines()[0] == str(summary).splitlines()[0][: len(narrow.splitlines()[0])]

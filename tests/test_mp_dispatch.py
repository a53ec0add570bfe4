"""mp_prefetch over ``to_iter_dataset()``: positions dispatched to free workers, the output and
state of strict rotation kept (real worker processes)."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cloudpickle
import numpy as np
import pytest
from conftest import LogProduced, fails_after, mp_options
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_core as grain
from grain_core._ipc import shm as _shm
from grain_core._ipc.pool import WorkerPool
from grain_core.dataset.mp import positions
from grain_core.dataset.mp.consumer import ClassConsumer
from grain_core.dataset.mp.dispatch import LocalWorkers
from grain_core.dataset.mp.dispatch_worker import DispatchWorkerLoop
from grain_core.dataset.mp.positions import (
    AssignedPositionsMapDataset,
    ClassBatchesMapDataset,
    PositionReader,
)
from grain_core.dataset.mp.protocol import (
    ELEMENT,
    ELEMENTS,
    PICKLED_ELEMENTS,
    SHARED_AHEAD_BYTES,
    STATS,
    STATS_GENERATION,
    WANTS_CREDIT,
    assign_message,
    stats_request_message,
)
from grain_core.dataset.mp.rotation import RotationWorkerLoop, credit_message, set_state_message
from grain_core.dataset.mp.worker import WorkerSpec
from grain_core.dataset.transfer_cost import OVERDRAFT_BYTES, SMALL_AHEAD
from grain_core.options import MultiprocessingOptions
from grain_core.testing import check_iterator_conformance

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX shm + /dev/shm")

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _keep_non_multiples_of_three(x: int) -> bool:
    return x % 3 != 0


def _filtered(length: int = 40) -> grain.IterDataset:
    # Classes lose different numbers of elements, so their positions drift apart.
    return grain.MapDataset.range(length).filter(_keep_non_multiples_of_three).to_iter_dataset()


def _run(ds: grain.IterDataset, steps: int) -> tuple[list[Any], list[Any]]:
    """The elements and the state after each of ``steps`` elements."""
    elements, states = [], []
    with iter(ds) as it:
        states.append(it.get_state())
        for _ in range(steps):
            elements.append(next(it))
            states.append(it.get_state())
    return elements, states


# ----------------------------------------------------------------------------- the view
def test_assigned_positions_map_runs_of_strided_classes() -> None:
    view = AssignedPositionsMapDataset(grain.MapDataset.range(100), 3)
    view.add([(1, 0, 2), (0, 5, 3)])  # class 1: 1, 4; class 0: 15, 18, 21
    assert len(view) == 5
    assert [view[k] for k in range(5)] == [1, 4, 15, 18, 21]
    assert view._getitems(range(1, 4)) == [4, 15, 18]
    assert view._getitems([4, 0]) == [21, 1]
    view.drop_before(2)
    assert view.position(2) == 15
    with pytest.raises(IndexError, match="not among the positions"):
        view.position(0)
    timed_copy = copy.copy(view)  # stage timing reads through copies
    view.add([(2, 0, 1)])
    assert len(timed_copy) == 6 and timed_copy[5] == 2


def test_assigned_positions_name_the_parent_index_of_an_error() -> None:
    def fail(x: int) -> int:
        raise ValueError(f"bad {x}")

    view = AssignedPositionsMapDataset(grain.MapDataset.range(10).map(fail), 2)
    view.add([(1, 3, 1)])
    with pytest.raises(ValueError, match="bad 7") as info:
        view[0]
    assert "Raised while reading index 7 of" in "\n".join(info.value.__notes__)


def _fail_on_seven(x: int) -> int:
    if x == 7:
        raise ValueError("bad 7")
    return x


def test_an_error_names_the_pipeline_index_once() -> None:
    # The worker's own reader of its assigned positions must not add its internal index.
    ds = grain.MapDataset.range(20).map(_fail_on_seven).to_iter_dataset().mp_prefetch(mp_options(2))
    with pytest.raises(ValueError, match="bad 7") as info:
        list(ds)
    read_notes = [n for n in info.value.__notes__ if n.startswith("Raised while reading")]
    assert len(read_notes) == 1 and read_notes[0].startswith("Raised while reading index 7 of")


def test_position_reader_goes_on_past_a_failing_position() -> None:
    # Positions of other classes queued behind a failure are still needed by the consumer.
    ds = grain.MapDataset.range(20).map(_fail_on_seven).to_iter_dataset()
    reader = PositionReader(ds, 0, 2, None)
    reader.assign([(1, 3, 1), (0, 4, 2)])  # positions 7, then 8 and 10
    with pytest.raises(ValueError, match="bad 7"):
        reader.next()
    assert [reader.next(), reader.next()] == [8, 10]
    reader.close()


# --------------------------------------------------------------- same output, same state
@pytest.mark.parametrize("workers", [2, 3])
def test_output_and_states_equal_strict_rotation(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = _filtered().mp_prefetch(mp_options(workers))
    dispatched = _run(ds, 26)
    monkeypatch.setattr(positions, "dispatchable", lambda *_: False)
    assert _run(ds, 26) == dispatched
    assert sorted(dispatched[0]) == [x for x in range(40) if x % 3]


def test_checkpoints_move_between_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = _filtered().mp_prefetch(mp_options(3))
    with iter(ds) as it:
        for _ in range(7):
            next(it)
        state = it.get_state()
        rest = list(it)
    with monkeypatch.context() as m:
        m.setattr(positions, "dispatchable", lambda *_: False)
        with iter(ds) as it:
            it.set_state(state)
            assert list(it) == rest
        with iter(ds) as it:
            for _ in range(11):
                next(it)
            rotating_state = it.get_state()
            rotating_rest = list(it)
    with iter(ds) as it:
        it.set_state(rotating_state)
        assert list(it) == rotating_rest


def _row(x: int) -> np.ndarray:
    return np.full(3, x, np.int64)


def _double(x: Any) -> Any:
    return x * 2


def _none_on_ten(x: int) -> int | None:
    return None if x == 10 else x


def _batched(length: int, batch: int, drop: bool) -> grain.IterDataset:
    """A batch after ``to_iter_dataset``: each worker batches its strided share."""
    ds = grain.MapDataset.range(length).map(_row).to_iter_dataset()
    return ds.batch(batch, drop_remainder=drop)


def _batch_firsts(elements: list[Any]) -> list[list[int]]:
    return [batch[:, 0].tolist() for batch in elements]


@pytest.mark.parametrize(
    ("length", "batch", "drop", "workers"),
    [(23, 4, False, 2), (23, 4, True, 2), (23, 4, True, 3), (10, 2, True, 3), (11, 3, False, 3)],
)
def test_batches_after_to_iter_dataset_are_dispatched_as_rotation_makes_them(
    length: int, batch: int, drop: bool, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = _batched(length, batch, drop).mp_prefetch(mp_options(workers))
    assert positions.dispatchable(ds.parents[0], workers, False)
    # Batches are read as far ahead as the elements they hold would be (500 by default).
    view = positions.dispatch_view(ds.parents[0], workers)
    assert view is not None and view.reader.read_options == grain.ReadOptions(
        num_threads=16, prefetch_buffer_size=-(-500 // batch)
    )
    unbuffered = grain.MapDataset.range(length).to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    )
    view = positions.dispatch_view(unbuffered.batch(batch), workers)
    assert view is not None and view.reader.read_options.prefetch_buffer_size == 0
    steps = sum(1 for _ in ds)
    elements, states = _run(ds, steps)
    with iter(ds) as it:  # the state once every worker's share has ended
        assert list(it)
        ended = it.get_state()
    monkeypatch.setattr(positions, "dispatchable", lambda *_: False)
    rotating, rotating_states = _run(ds, steps)
    with iter(ds) as it:
        assert list(it)
        assert it.get_state() == ended
    assert _batch_firsts(elements) == _batch_firsts(rotating) and states == rotating_states
    # Worker w batches its share w, w + N, ...: the first batch of worker 1 starts at 1.
    assert _batch_firsts(elements)[1][:2] == [1, 1 + workers]


def test_batch_checkpoints_move_between_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = _batched(40, 3, True).mp_prefetch(mp_options(3))
    with monkeypatch.context() as m:
        m.setattr(positions, "dispatchable", lambda *_: False)
        with iter(ds) as it:
            for _ in range(5):
                next(it)
            rotating_state = it.get_state()
            rotating_rest = _batch_firsts(list(it))
    with iter(ds) as it:
        it.set_state(rotating_state)
        assert _batch_firsts([next(it), next(it)]) == rotating_rest[:2]
        it.set_state(rotating_state)  # results in flight are dropped
        assert _batch_firsts(list(it)) == rotating_rest


def test_batch_state_not_at_a_batch_start_is_a_clear_error() -> None:
    ds = _batched(20, 4, False).mp_prefetch(mp_options(2))
    with iter(ds) as it:
        state = it.get_state()
        state["iterators_in_use_states"] = [{"next_index": 4}, {"next_index": 3}]
        with pytest.raises(IndexError, match="next_index` 3 is not where a batch of 4 starts"):
            it.set_state(state)


@pytest.mark.parametrize("batch", [None, 2])
def test_maps_after_to_iter_dataset_are_dispatched_as_rotation_makes_them(
    batch: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An IterDataset map's None is an element; a None of the MapDataset would be skipped.
    ds = grain.MapDataset.range(13).to_iter_dataset().map(_double).map(_none_on_ten)
    if batch is not None:
        ds = ds.map(repr).batch(batch)
    assert positions.dispatchable(ds, 3, False)
    dispatched = _run(ds.mp_prefetch(mp_options(3)), 7 if batch else 13)
    monkeypatch.setattr(positions, "dispatchable", lambda *_: False)
    rotating = _run(ds.mp_prefetch(mp_options(3)), 7 if batch else 13)
    if batch is None:
        assert dispatched == rotating and None in dispatched[0]
    else:
        assert [b.tolist() for b in dispatched[0]] == [b.tolist() for b in rotating[0]]
        assert dispatched[1] == rotating[1]


def _sleepy(x: int) -> int:
    time.sleep(0.002)  # sleeping: the stage's time does not depend on CPU contention
    return x


def test_steps_and_their_time_reach_the_execution_summary() -> None:
    from grain_core.observe.summary import get_execution_summary

    timing = grain.experimental.DatasetOptions(
        execution_tracking_mode=grain.experimental.ExecutionTrackingMode.STAGE_TIMING
    )
    # Options set in the pipeline do not stop dispatch: they reach the workers with the
    # parent's. A buffer of 0: no overdraft, the workers wait for each credit.
    ds = grain.MapDataset.range(60).to_iter_dataset().map(_sleepy)
    ds = grain.experimental.WithOptionsIterDataset(ds, timing).mp_prefetch(mp_options(2, 0))
    assert positions.dispatchable(ds.parents[0], 2, False)
    with iter(ds) as it:
        for _ in range(50):
            next(it)
        summary = get_execution_summary(it)
    assert summary.stages[1].name == "DispatchedClass"
    step = next(s for s in summary.stages if s.in_workers and "_sleepy" in s.name)
    # Asked when the summary is taken, the workers report every element handed out.
    assert step.name.startswith("Map(_sleepy") and step.num_produced_elements >= 50
    assert step.self_time_ns >= 50 * 2_000_000


def test_steps_after_filters_or_other_steps_rotate() -> None:
    filtered = _filtered().batch(2)
    assert positions.dispatch_view(filtered, 2) is None
    assert positions.dispatch_view(_filtered().map(_double), 2) is None
    indexed = grain.MapDataset.range(10).to_iter_dataset().map_with_index(lambda i, x: x)
    assert positions.dispatch_view(indexed.batch(2), 2) is None
    mapped_after_batch = grain.MapDataset.range(10).to_iter_dataset().batch(2).map(_double)
    assert positions.dispatch_view(mapped_after_batch, 2) is None
    # The output is what the rotating engine gives (filters make the classes drift).
    with iter(filtered.mp_prefetch(mp_options(2))) as it:
        assert [b.tolist() for b in it][:3] == [[2, 4], [1, 5], [8, 10]]


def test_views_name_the_element_that_fails_and_refuse_nones() -> None:
    batches = ClassBatchesMapDataset(
        grain.MapDataset.range(10).map(_fail_on_seven), 2, 2, drop_remainder=False
    )
    assert len(batches) == 6 and batches[0] == [0, 2] and batches[1] == [1, 3]
    assert batches[4] == [8] and batches[5] == [9]  # shares of 5: a last batch of one
    with pytest.raises(ValueError, match="bad 7") as info:
        batches[3]  # share 1's second batch: elements 5 and 7
    assert "Raised while reading index 7 of MapMapDataset" in "\n".join(info.value.__notes__)
    holes = grain.MapDataset.range(6).map(lambda x: None if x == 2 else x).to_iter_dataset()
    view = positions.dispatch_view(holes.map(_double), 2)
    assert view is not None and view.steps is not None and view.steps(3) == 6
    with pytest.raises(ValueError, match='element of .* is None.*"py_mp_prefetch_dispatch"'):
        view.steps(None)
    # As an IterDataset map, the steps see a None the reader lets through.
    holes = grain.MapDataset.range(6).to_iter_dataset(allow_nones=True)
    view = positions.dispatch_view(holes.map(repr), 2)
    assert view is not None and view.steps is not None and view.steps(None) == "None"


_THREADS_IN_STEP: set[int] = set()


def _record_thread(x: int) -> int:
    _THREADS_IN_STEP.add(threading.get_ident())
    return x


def test_steps_after_to_iter_dataset_run_in_the_workers_main_thread() -> None:
    # As under strict rotation: their functions need not be thread-safe.
    _THREADS_IN_STEP.clear()
    ds = grain.MapDataset.range(40).to_iter_dataset().map(_record_thread)
    reader = PositionReader(ds, 0, 2, None)
    reader.assign([(0, 0, 20)])
    assert [reader.next() for _ in range(20)] == list(range(0, 40, 2))
    reader.close()
    assert _THREADS_IN_STEP == {threading.get_ident()}


def test_checkpoint_conformance_with_filters() -> None:
    check_iterator_conformance(
        lambda: _filtered(20).mp_prefetch(mp_options(3)), positions=[0, 5, 9]
    )


def test_restore_before_the_first_element_starts_there() -> None:
    ds = grain.MapDataset.range(10).to_iter_dataset().mp_prefetch(mp_options(2))
    with iter(ds) as it:
        state = it.get_state()
        state["iterators_in_use_states"] = [{"next_index": 3}, {"next_index": 2}]
        it.set_state(state)
        assert list(it) == [6, 5, 8, 7, 9]


def test_restore_outside_the_class_is_a_clear_error() -> None:
    ds = grain.MapDataset.range(10).to_iter_dataset().mp_prefetch(mp_options(2))
    with iter(ds) as it:
        state = it.get_state()
        state["iterators_in_use_states"] = [{"next_index": 0}, {"next_index": 9}]
        with pytest.raises(IndexError, match=r"next_index` 9 is out of range \[0, 5\]"):
            it.set_state(state)


def test_set_state_mid_stream_discards_results_in_flight() -> None:
    ds = (
        grain.MapDataset.range(30)
        .map(lambda x: x * 2)
        .to_iter_dataset()
        .mp_prefetch(mp_options(2, 4))
    )
    with iter(ds) as it:
        states = [it.get_state()]
        out = []
        for _ in range(12):
            out.append(next(it))
            states.append(it.get_state())
        for k in (9, 2, 11, 0):
            it.set_state(states[k])
            assert [next(it) for _ in range(3)] == [2 * x for x in range(k, k + 3)]


def _worker_id(index: int, count: int) -> None:
    os.environ["TEST_WORKER_ID"] = str(index)


def _read_worker_id(x: int) -> tuple[int, str]:
    return x, os.environ["TEST_WORKER_ID"]


def test_a_worker_init_fn_keeps_each_worker_on_its_share() -> None:
    # What the function set up differs by worker: element k comes from worker k % N on every
    # run, as the config switch makes it for any pipeline.
    ds = grain.MapDataset.range(9).map(_read_worker_id).to_iter_dataset()
    assert list(ds.mp_prefetch(mp_options(3), worker_init_fn=_worker_id)) == [
        (x, str(x % 3)) for x in range(9)
    ]
    grain.config.update("py_mp_prefetch_dispatch", False)
    try:
        assert positions.dispatchable(ds, 3, False) is False
    finally:
        grain.config.update("py_mp_prefetch_dispatch", True)


# ------------------------------------------------------------------------- load balance
_SLOW: list[bool] = []


def _timed_identity(x: int, flag: str) -> tuple[int, str]:
    if not _SLOW:  # the first worker to create the flag file is the slow one
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            _SLOW.append(True)
        except FileExistsError:
            _SLOW.append(False)
    slow = _SLOW[0]
    deadline = time.thread_time() + (0.03 if slow else 0.002)
    while time.thread_time() < deadline:  # CPU work: what a worker on a busy core does slowly
        pass
    return x, "slow" if slow else "fast"


def test_a_slow_worker_does_not_hold_back_the_fast_one(tmp_path: Any) -> None:
    # Strict rotation makes each worker compute exactly its half; dispatch hands most of the
    # positions to the worker that is free, and the output order does not change.
    timed = functools.partial(_timed_identity, flag=str(tmp_path / "slow"))
    ds = grain.MapDataset.range(60).map(timed).to_iter_dataset()
    with iter(ds.mp_prefetch(mp_options(2))) as it:
        out = list(it)
    assert [x for x, _ in out] == list(range(60))
    by_fast = sum(1 for _, who in out if who == "fast")
    assert by_fast >= 40, f"the fast worker computed only {by_fast} of 60 elements"


@pytest.mark.parametrize("with_poll", [True, False], ids=["poll", "connection.wait"])
def test_workers_poller_tells_output_from_ended_workers(
    monkeypatch: pytest.MonkeyPatch, with_poll: bool
) -> None:
    import multiprocessing
    import select

    from grain_core._ipc.pool import _WorkersPoller

    if not with_poll:
        monkeypatch.delattr(select, "poll")
    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(2)]
    # Read ends that become readable when their write end closes, as a process sentinel does
    # when the process ends.
    sentinels = [os.pipe() for _ in range(2)]
    try:
        poller = _WorkersPoller([r for r, _ in pipes], [r for r, _ in sentinels])
        assert poller.poll(0) == ([], [])
        pipes[1][1].send_bytes(b"x")
        assert poller.poll(None) == ([1], [])
        os.close(sentinels[0][1])
        assert poller.poll(0) == ([1], [0])
    finally:
        for r, w in pipes:
            r.close()
            w.close()
        os.close(sentinels[0][0])
        os.close(sentinels[1][0])
        os.close(sentinels[1][1])


@contextlib.contextmanager
def _idle_dispatch_loop() -> Iterator[tuple[DispatchWorkerLoop, Any]]:
    """A worker's dispatch loop that is never run, for tests calling its methods, and the
    parent's end of its output pipe."""
    import multiprocessing

    spec = WorkerSpec(
        index=0,
        count=1,
        init_fn=None,
        dataset=b"",
        sequential_slice=False,
        state=None,
        plugins=None,
        options=None,
        nodes=positions.PIPELINE_NODES,
        shm_prefix="unused",
        pool_size=1,
    )
    control_r, control_w = multiprocessing.Pipe(duplex=False)
    output_r, output_w = multiprocessing.Pipe(duplex=False)
    try:
        yield DispatchWorkerLoop(spec, control_r, output_w), output_r
    finally:
        for conn in (control_r, control_w, output_r, output_w):
            conn.close()


def test_blocks_freed_before_a_message_that_cannot_be_pickled_reach_the_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The parent forgets its mappings of the blocks a worker freed from the names each message
    # carries: those taken for a message that could not be pickled go with its error.
    import pickle

    from grain_core.dataset.mp.protocol import ERROR

    pool = _shm._BlockPool(1)
    pool.dropped.append("freed-block")
    monkeypatch.setattr(_shm, "_pool", pool)
    with _idle_dispatch_loop() as (loop, output_r):
        loop._send_group([1, threading.Lock()], [[], []])
        messages = [pickle.loads(output_r.recv_bytes()) for _ in range(2)]
        assert messages[0][1:3] == (ELEMENT, 1) and messages[0][5] == ["freed-block"]
        assert messages[1][1] == ERROR and "cannot be pickled" in str(messages[1][2])
        pool.dropped.append("freed-later")
        loop._send_group([threading.Lock()], [[]])  # alone: its error carries them
        error = pickle.loads(output_r.recv_bytes())
        assert error[1] == ERROR and error[5] == ["freed-later"]
        assert not output_r.poll()


def test_a_worker_counts_cpu_seconds_per_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    # The parent sizes runs by the CPU seconds per result since the generation began: a
    # worker kept from the last iterator (persistent_workers) that went on counting from its
    # start made the new iterator's first result look as costly as the whole last epoch, and
    # its runs shrank to two positions (a round trip to the parent per result).

    from grain_core.dataset.mp import dispatch_worker

    clock = [100.0]
    monkeypatch.setattr(dispatch_worker.time, "process_time", lambda: clock[0])
    with _idle_dispatch_loop() as (loop, _):
        clock[0] = 160.0  # a minute of work in the last generation
        assert loop._cpu_seconds() == 60.0
        loop._handle(assign_message(2**32, [], 1, []))  # the next iterator's generation
        clock[0] = 160.5
        assert loop._cpu_seconds() == 0.5
        loop._handle(assign_message(2**32, [], 1, []))  # the same generation goes on
        assert loop._cpu_seconds() == 0.5


def test_a_new_generation_learns_from_zero() -> None:
    # Restored (a new generation), the parent counts the workers' CPU seconds from zero, as
    # they do.
    d = _dispatcher()
    d._cpu_mark[0], d._since_learned[0] = 60.0, 3
    d._forget_work()
    assert d._cpu_mark == [0.0, 0.0] and d._since_learned == [0, 0]


def _lock_at_25(x: int) -> Any:
    return threading.Lock() if x == 25 else x


def test_small_elements_read_already_travel_several_to_a_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kinds: list[int] = []
    recv = WorkerPool.recv

    def recording_recv(self: WorkerPool, index: int, ready: bool = False) -> tuple[Any, ...]:
        message = recv(self, index, ready)
        kinds.append(message[1])
        return message

    monkeypatch.setattr(WorkerPool, "recv", recording_recv)
    ds = grain.MapDataset.range(2000).to_iter_dataset()
    assert list(ds.mp_prefetch(mp_options(2, buffer=16))) == list(range(2000))
    assert ELEMENTS in kinds and len(kinds) < 2000
    # One element of a group cannot be pickled: the ones before it arrive, then its error
    # (at its own position, not at the first of its group).
    ds = grain.MapDataset.range(60).map(_lock_at_25).to_iter_dataset()
    with iter(ds.mp_prefetch(mp_options(2, buffer=16))) as it:
        assert [next(it) for _ in range(25)] == list(range(25))
        with pytest.raises(TypeError, match="cannot be pickled"):
            next(it)


# ------------------------------------------------------------------------------ commitments
_CONSUMERS: list[ClassConsumer] = []


def _dispatcher(buffer: int = 2, read_ahead: int = 50) -> LocalWorkers:
    ds = grain.MapDataset.range(100).to_iter_dataset(
        grain.ReadOptions(num_threads=2, prefetch_buffer_size=read_ahead)
    )
    engine = ds.mp_prefetch(mp_options(2, buffer)).engine  # type: ignore[attr-defined]
    consumer = ClassConsumer(engine, LocalWorkers, "never")
    _CONSUMERS.append(consumer)  # a producer holds its consumer weakly
    return LocalWorkers(consumer)


def test_commitments_follow_the_cpu_cost_of_an_element() -> None:
    d = _dispatcher()
    d._learn(0, 0.0)  # waiting costs no CPU: as far as the read-ahead goes
    assert d._limits[0] == 50
    d._learn(1, 0.002)  # ~10 ms of CPU work
    assert d._limits[1] == 5
    d._learn(1, 0.5)  # expensive: the buffer and at least two (one queued)
    assert d._limits[1] == 2
    # A read-ahead of two (batches of 256 by default) bounds results in shared memory; small
    # ones, sent beyond the credits, get runs as long as the overdraft.
    short = _dispatcher(read_ahead=2)
    short._learn(0, 0.0)
    assert short._limits[0] == 2
    short._overdraft_room[1] = SMALL_AHEAD
    short._learn(1, 0.0)
    assert short._limits[1] == SMALL_AHEAD


class _RecordingPool:
    def __init__(self, *received: tuple[tuple[Any, ...], int]) -> None:
        self.sent: list[tuple[int, tuple[Any, ...]]] = []
        self._received = list(received)  # messages from the workers, with their sizes
        self.last_message_bytes = 0

    def send(self, worker: int, message: tuple[Any, ...]) -> None:
        self.sent.append((worker, message))

    def recv(self, worker: int, ready: bool = False) -> tuple[Any, ...]:
        message, self.last_message_bytes = self._received.pop(0)
        return message


def test_a_waiting_consumer_always_gets_its_position_sent() -> None:
    d = _dispatcher(buffer=1)
    d._pool = pool = _RecordingPool()  # type: ignore[assignment]
    d._consumer.frontier[:], d._assigned = [5, 4], [7, 6]
    # Both workers sent all they were allowed; worker 0 computes (0, 5) after (1, 4).
    d._runs[0].extend([[1, 4, 2], [0, 5, 2]])
    d._runs[1].extend([[1, 9, 3]])
    d._outstanding = [4, 3]
    d._granted, d._received = [3, 2], [3, 2]
    d._unblock(0, 5)  # three results to send up to it
    assert pool.sent == [(0, assign_message(0, [], 3, []))]
    d._unblock(0, 5)  # already on its way
    assert len(pool.sent) == 1
    d._consumer.frontier[1] = d._assigned[1] = 12  # no worker has (1, 12): the least busy takes it
    d._unblock(1, 12)
    assert pool.sent[1] == (1, assign_message(0, [(1, 12, 1)], 4, []))
    assert d._assigned[1] == 13 and d._outstanding[1] == 4


def test_the_stall_report_names_the_position_the_worker_is_stuck_on() -> None:
    # Worker 1 computes its runs in order: position 6 (class 0), then 5 (class 1), which the
    # consumer waits for. It is stuck on 6, and the watchdog's report says so.
    d = _dispatcher()
    d._runs[1].extend([[0, 3, 1], [1, 2, 1]])
    worker, what = d._waiting_for(1, 2)
    assert worker == 1
    assert what.startswith("position 6 of ")
    assert what.endswith("(the consumer waits for position 5, which this worker computes after it)")
    assert d._waiting_for(0, 3) == (1, what.split(" (")[0])  # the one it is stuck on


def _in_shared_memory(nbytes: int) -> Any:
    return {"image": _shm._ShmRef("block", (nbytes // 4,), np.dtype(np.float32)), "label": 1}


def test_credits_go_in_batches_while_a_worker_may_overdraw() -> None:
    # While its results are small the overdraft carries a worker between credits, which go
    # half of it at a time (a message per element otherwise); results in shared memory as
    # many ahead as SHARED_AHEAD_BYTES holds, credits half of those at a time; big ones: each
    # credit as soon as it is due.
    d = _dispatcher(buffer=1)
    d._pool = _RecordingPool(  # type: ignore[assignment]
        ((0, ELEMENTS, [0, 1], 0.0, [], []), 100),
        ((0, ELEMENT, b"x" * 500_000, 0.0, [], []), 500_020),
        ((0, ELEMENT, _in_shared_memory(SHARED_AHEAD_BYTES // 8), 0.0, ["block"], []), 100),
        ((0, ELEMENT, _in_shared_memory(SHARED_AHEAD_BYTES), 0.0, ["block"], []), 100),
    )
    d._runs[0].append([0, 0, 5])
    d._outstanding[0] = 5
    for credit_batch, ahead in ((SMALL_AHEAD // 2, 1), (1, 1), (4, 8), (1, 1)):
        d._receive(0)
        d._assign()
        assert (d._credit_batch[0], d._ahead[0]) == (credit_batch, ahead)


def test_results_in_shared_memory_travel_several_to_a_message() -> None:
    # A worker that waited for credits has several results ready when they come: they go in
    # one message (a wake-up of the parent each otherwise), each with its own blocks, which
    # the parent files with its position and hands back when that message is of an old
    # generation.
    import pickle

    first, second = _in_shared_memory(1024), _in_shared_memory(2048)
    with _idle_dispatch_loop() as (loop, output_r):
        loop._send_group([first, 7, second], [["a"], [], ["b", "c"]])
        message = pickle.loads(output_r.recv_bytes())
        assert not output_r.poll()
    assert message[1] == ELEMENTS and message[4] == [["a"], [], ["b", "c"]]
    d = _dispatcher()
    d._pool = _RecordingPool((message, 100), ((1, *message[1:]), 100))  # type: ignore[assignment]
    d._runs[0].append([0, 0, 3])
    d._outstanding[0] = 3
    d._receive(0)
    held = d._consumer.held
    assert {position: (kind, tag) for position, (kind, _, tag) in held.items()} == {
        (0, 0): (ELEMENT, (0, ["a"])),
        (0, 1): (ELEMENT, (0, [])),
        (0, 2): (ELEMENT, (0, ["b", "c"])),
    }
    assert [_shm.shared_bytes(held[0, j][1]) for j in range(3)] == [1024, 0, 2048]
    d._receive(0)  # of another generation: dropped, its blocks go back
    assert list(d._recycled[0].released) == ["a", "b", "c"]


def test_dropped_blocks_go_back_with_the_next_credits() -> None:
    # One message per element: a block the consumer dropped waits for the worker's next
    # credit (a worker writes into a block only once it has one).
    d = _dispatcher(buffer=2)
    d._pool = pool = _RecordingPool()  # type: ignore[assignment]
    d._outstanding = [2, 2]  # both committed: no runs to give
    d._granted = [2, 2]  # and allowed to send as far as the buffer goes
    d._recycled[1].released.append("block")
    d._assign()
    assert pool.sent == []
    d._consumed[1] = 1
    d._assign()
    assert pool.sent == [(1, assign_message(0, [], 1, ["block"]))]
    d._recycled[0].released.append("other")  # credits sent to reach a waiting consumer too
    d._grant_through(0, 3, [])
    assert pool.sent[1] == (0, assign_message(0, [], 1, ["other"]))


def _quarter_mib(x: int) -> np.ndarray:
    return np.full(64 * 1024, x, np.float32)


def test_credits_bound_the_shared_memory_in_flight() -> None:
    # Cheap elements get long runs (the read-ahead, 64 here); what reaches shared memory is
    # still bounded beyond what the consumer took: per_worker_buffer_size results, or as many
    # as SHARED_AHEAD_BYTES holds (16 of these).
    prefix = f"gc{os.getpid():x}"
    read_options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=64)
    ds = grain.MapDataset.range(400).map(_quarter_mib).to_iter_dataset(read_options)
    with iter(ds.mp_prefetch(mp_options(2))) as it:
        for x in range(40):
            assert float(next(it)[0]) == x
        time.sleep(0.5)  # the workers go as far ahead as they are allowed
        blocks = [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]
        # Per worker: its credits, a block being written, the one the consumer holds.
        ahead = SHARED_AHEAD_BYTES // _quarter_mib(0).nbytes
        assert len(blocks) <= 2 * (ahead + 1 + 1), blocks


def test_large_elements_through_dispatched_workers() -> None:
    def big(x: int) -> np.ndarray:
        return np.full((256, 256), x, np.float32)

    ds = grain.MapDataset.range(12).map(big).to_iter_dataset().mp_prefetch(mp_options(3, 2))
    with iter(ds) as it:
        for x, arr in enumerate(it):
            assert arr.shape == (256, 256) and float(arr[0, 0]) == x


def _big_row(x: int) -> np.ndarray:
    return np.full(4096, x, np.float32)  # 16 KiB: batches of 8 go through shared memory


def test_large_batches_made_after_to_iter_dataset_arrive_through_shared_memory() -> None:
    import mmap

    ds = grain.MapDataset.range(30).map(_big_row).to_iter_dataset().batch(8)
    with iter(ds.mp_prefetch(mp_options(2, 2))) as it:
        batches = list(it)
    assert [b[:, 0].tolist() for b in batches[:2]] == [[0, 2, 4, 6, 8, 10, 12, 14]] + [
        [1, 3, 5, 7, 9, 11, 13, 15]
    ]
    assert [len(b) for b in batches] == [8, 8, 7, 7]
    assert all(isinstance(b.base, mmap.mmap) for b in batches)


_IN_FLIGHT = [0, 0]  # per worker process: reads running now, most at once


def _waiting_read(x: int) -> tuple[int, int]:
    _IN_FLIGHT[0] += 1
    _IN_FLIGHT[1] = max(_IN_FLIGHT)
    time.sleep(0.005)  # waiting on storage: no CPU
    _IN_FLIGHT[0] -= 1
    return x, _IN_FLIGHT[1]


def test_reads_that_wait_overlap_in_each_worker() -> None:
    # Elements that cost no CPU get long runs, which the worker's read threads read together
    # (as each worker's read-ahead does under strict rotation).
    read_options = grain.ReadOptions(num_threads=8, prefetch_buffer_size=64)
    ds = grain.MapDataset.range(600).map(_waiting_read).to_iter_dataset(read_options)
    out = list(ds.mp_prefetch(mp_options(2)))
    assert [x for x, _ in out] == list(range(600))
    assert max(most for _, most in out) > 1


@contextlib.contextmanager
def _worker_loop_in_thread(
    ds: grain.IterDataset,
    buffer_size: int,
    monkeypatch: pytest.MonkeyPatch,
    dispatch: bool = True,
    dropped: Sequence[str] = (),
    options: Any = None,
) -> Iterator[tuple[Callable[..., None], Any]]:
    """Runs a worker's loop over ``ds`` (dispatching, or streaming its share for strict
    rotation) in a thread of this process, its block pool having freed blocks ``dropped``,
    with the parent's ``options``; yields a function sending it a control message and its output pipe."""
    import multiprocessing
    import pickle
    import warnings

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # the loop takes it
    # A pool, as in a worker: the loop unlinks its blocks when it ends.
    pool = _shm._BlockPool(1)
    pool.dropped.extend(dropped)
    monkeypatch.setattr(_shm, "_pool", pool)
    spec = WorkerSpec(
        index=0,
        count=1,
        init_fn=None,
        dataset=cloudpickle.dumps(ds),
        sequential_slice=False,
        state=None,
        plugins=None,
        options=options,
        nodes=positions.PIPELINE_NODES,
        shm_prefix=f"gc{os.getpid():x}t",
        pool_size=1,
        buffer_size=buffer_size,
    )
    control_r, control_w = multiprocessing.Pipe(duplex=False)
    output_r, output_w = multiprocessing.Pipe(duplex=False)
    loop = (DispatchWorkerLoop if dispatch else RotationWorkerLoop)(spec, control_r, output_w)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        yield (lambda message: control_w.send_bytes(pickle.dumps(message))), output_r
    finally:
        control_w.close()  # the loop ends, as when its pool stops it
        thread.join(10)
        for conn in (control_r, control_w, output_r, output_w):
            conn.close()
    assert not thread.is_alive()


_FENCES = itertools.count(1)


def _results(control: Callable[..., None], output: Any, count: int) -> list[Any]:
    """The next ``count`` results a worker sends (ints; for other results, their message
    kind), after which it sends none until it has answered two statistics requests: it reads
    control messages between two steps of its loop, so a result it should not send comes
    before the second answer."""
    import pickle

    results: list[Any] = []

    def take(message: tuple[Any, ...]) -> int | None:
        """Files a result; returns the number of the request a statistics message answers."""
        generation, kind, value, extra, *_ = message
        if generation == STATS_GENERATION and kind == STATS:
            return int(extra)
        if kind == WANTS_CREDIT:  # strict rotation, about to wait: not a result
            return None
        if kind == PICKLED_ELEMENTS:  # strict rotation: each with its state
            results.extend(pickle.loads(blob)[0] for blob in value)
        else:
            results.extend(value if kind == ELEMENTS else [value if kind == ELEMENT else kind])
        assert len(results) <= count, f"more results than allowed: {results}"
        return None

    with fails_after(60):
        while len(results) < count:
            take(pickle.loads(output.recv_bytes()))
        for _ in range(2):
            number = next(_FENCES)
            control(stats_request_message(number))
            while take(pickle.loads(output.recv_bytes())) != number:
                pass
    return results


def test_a_worker_computes_its_assigned_positions_while_it_has_no_credit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # Reading in its main thread (CPU-bound reads), the worker still computes what it was
    # assigned, up to the read-ahead, while the parent holds back its credits (as read threads
    # would): the parent then finds results ready. A buffer of 0 sends nothing beyond the
    # credits.
    from grain_core.dataset import read_concurrency

    monkeypatch.setattr(read_concurrency, "_inline_while_cpu_bound", True)
    log = tmp_path / "computed.txt"
    read_options = grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)
    ds = grain.MapDataset.range(100).map(LogProduced(str(log))).to_iter_dataset(read_options)
    with _worker_loop_in_thread(ds, 0, monkeypatch) as (control, output):
        control(assign_message(0, [(0, 0, 20)], 0, []))
        deadline = time.monotonic() + 10
        while not (log.exists() and len(log.read_text().split()) >= 8):
            assert time.monotonic() < deadline, "the worker computed nothing without credits"
            time.sleep(0.01)
        time.sleep(0.1)
        assert log.read_text().split() == [str(x) for x in range(8)]  # the read-ahead only
        assert not output.poll()  # nothing sent without a credit
        control(assign_message(0, [], 3, []))
        assert _results(control, output, 3) == [0, 1, 2]  # computed ahead: it goes out at once


def _answer(output: Any, number: int) -> Any:
    """The snapshot of the statistics message answering request ``number`` (what comes before
    it is skipped)."""
    import pickle

    with fails_after(60):
        while True:
            generation, kind, value, extra, *_ = pickle.loads(output.recv_bytes())
            if generation == STATS_GENERATION and kind == STATS and extra == number:
                return value


@pytest.mark.parametrize("tracked", [False, True], ids=["untracked", "tracked"])
@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatch", "rotation"])
def test_a_worker_answers_every_statistics_request(
    dispatch: bool, tracked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The parent waits for the answer, so every worker gives one: before any work or credit,
    # and again later; one that does not track its stages answers with no snapshot.
    ds = grain.MapDataset.range(8).to_iter_dataset()
    timing = grain.experimental.DatasetOptions(
        execution_tracking_mode=grain.experimental.ExecutionTrackingMode.STAGE_TIMING
    )
    options = timing if tracked else None
    with _worker_loop_in_thread(ds, 1, monkeypatch, dispatch, options=options) as (
        control,
        output,
    ):
        control(stats_request_message(1))
        first = _answer(output, 1)
        control(stats_request_message(2))
        second = _answer(output, 2)
    if not tracked:
        assert first is None and second is None
    else:
        rows, index, *_ = second
        assert index == 0 and rows and rows[0][0]


def _pickled_100_kib(x: int) -> bytes:
    return x.to_bytes(4, "little") * 25_600


@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
@pytest.mark.parametrize("result", ["int", "pickled 100 KiB", "shared memory"])
def test_small_results_go_beyond_the_credits_within_the_overdraft(
    result: str, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With no credit at all, small results go anyway (instead of waiting for the parent's
    # wake-up after each), SMALL_AHEAD of them or OVERDRAFT_BYTES pickled at most; one in
    # shared memory waits for a credit. Each credit covers the oldest result overdrawn, so
    # as many more go. Both engines' workers.
    import pickle

    ds = grain.MapDataset.range(200)
    if result == "int":
        overdraft = SMALL_AHEAD
    elif result == "pickled 100 KiB":
        ds = ds.map(_pickled_100_kib)
        size = len(pickle.dumps(_pickled_100_kib(0), protocol=pickle.HIGHEST_PROTOCOL))
        overdraft = OVERDRAFT_BYTES // size
        assert 5 < overdraft < SMALL_AHEAD
    else:
        ds = ds.map(_quarter_mib)
        overdraft = 0
    dispatch = engine == "dispatch"
    with _worker_loop_in_thread(ds.to_iter_dataset(), 1, monkeypatch, dispatch) as (
        control,
        output,
    ):
        if dispatch:
            control(assign_message(0, [(0, 0, 200)], 0, []))
        sent = _results(control, output, overdraft)
        control(assign_message(0, [], 3, []) if dispatch else credit_message(3, []))
        sent += _results(control, output, 3)
        if result == "int":
            assert sent == list(range(overdraft + 3))


def test_a_rotating_worker_encodes_an_element_waiting_for_a_credit_when_it_sends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An element in shared memory waits for a credit; a set_state drops it. The names of
    # blocks the pool freed go with the next message sent, not with the dropped one (the
    # parent would keep those blocks mapped).
    import pickle

    from grain_core.dataset.worker_slicing import slice_for_worker

    ds = grain.MapDataset.range(10).map(_quarter_mib).to_iter_dataset()
    start = iter(slice_for_worker(ds, 0, 1, False))
    state = start.get_state()
    start.close()
    with _worker_loop_in_thread(ds, 1, monkeypatch, False, ["freed"]) as (control, output):
        assert output.poll(10)
        assert pickle.loads(output.recv_bytes())[1] == WANTS_CREDIT  # element 0 waits
        control(set_state_message(1, state, 1, []))
        generation, kind, _, _, names, dropped = pickle.loads(output.recv_bytes())
        assert (generation, kind, len(names), dropped) == (1, ELEMENT, 1, ["freed"])


class _LoggedPickle:
    """600 KB pickled, no array (no shared memory); each time it is pickled, ``x`` is appended
    to the file ``log``."""

    def __init__(self, x: int, log: str) -> None:
        self.x, self.log = x, log

    def __reduce__(self) -> tuple[Any, ...]:
        with open(self.log, "a") as f:
            f.write(f"{self.x}\n")
        return (bytes, (b"x" * 600_000,))


class _MakeLoggedPickle:
    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, x: int) -> _LoggedPickle:
        return _LoggedPickle(x, self.log)


def test_results_too_big_to_overdraw_a_few_are_pickled_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # A result is pickled to learn its size only while the last ones were small enough to
    # overdraw a few: the first 600 KB result overdraws (pickled twice: measured, sent); the
    # next ones wait for a credit without being measured, so each is pickled once.
    log = tmp_path / "pickled.txt"
    ds = grain.MapDataset.range(20).map(_MakeLoggedPickle(str(log))).to_iter_dataset()
    with _worker_loop_in_thread(ds, 1, monkeypatch) as (control, output):
        control(assign_message(0, [(0, 0, 20)], 0, []))
        _results(control, output, 1)
        control(assign_message(0, [], 3, []))  # the first covers the result overdrawn
        _results(control, output, 2)
    assert log.read_text().split() == ["0", "0", "1", "2"]


def _mixed(x: int) -> Any:
    """Small, pickled-large and shared-memory results in one stream."""
    if x % 3 == 0:
        return x
    if x % 3 == 1:
        return _pickled_100_kib(x)
    return _quarter_mib(x)


def _first_value(result: Any) -> int:
    if isinstance(result, bytes):
        return int.from_bytes(result[:4], "little")
    return int(result if isinstance(result, int) else result[0])


@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
@pytest.mark.parametrize("buffer", [0, 1, 3])
def test_overdrawn_and_waiting_results_keep_the_output_and_checkpoints(
    buffer: int, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Results a worker overdrew and results waiting for a credit (pickled-large, in shared
    # memory) arrive in order; a restore drops a waiting result (and frees its block).
    if engine == "rotation":
        monkeypatch.setattr(positions, "dispatchable", lambda *_: False)

    def make() -> grain.IterDataset:
        return (
            grain.MapDataset.range(90)
            .map(_mixed)
            .to_iter_dataset()
            .mp_prefetch(mp_options(2, buffer))
        )

    with fails_after(120):
        out = check_iterator_conformance(make, positions=[0, 7, 31, 60, 89])
    assert [_first_value(r) for r in out] == list(range(90))


class _KeepOnly:
    def __init__(self, kept: frozenset[int]) -> None:
        self.kept = kept

    def __call__(self, x: int) -> bool:
        return x in self.kept


def _check_restores_like_strict_rotation(
    ds: grain.IterDataset, stop: int, convert: Any = None
) -> None:
    """Runs ``ds`` by strict rotation, then restores its state after ``stop`` elements with
    dispatch: the rest of the stream and the final state are the same. ``convert`` makes
    elements comparable."""
    convert = convert or (lambda x: x)
    original = positions.dispatchable
    positions.dispatchable = lambda *_: False  # hypothesis tests cannot take monkeypatch
    try:
        with iter(ds) as it:
            states = [it.get_state()]
            elements = []
            for x in it:
                elements.append(convert(x))
                states.append(it.get_state())
            states.append(it.get_state())  # exhausted
    finally:
        positions.dispatchable = original
    stop = min(stop, len(elements))
    with iter(ds) as it:
        it.set_state(states[stop])
        assert [convert(x) for x in it] == elements[stop:]
        assert it.get_state() == states[-1]


@settings(max_examples=8, deadline=None)
@given(
    kept=st.frozensets(st.integers(0, 29)),
    workers=st.sampled_from([2, 3]),
    stop=st.integers(0, 30),
)
def test_any_filter_and_restore_point_match_strict_rotation(
    kept: frozenset[int], workers: int, stop: int
) -> None:
    ds = grain.MapDataset.range(30).filter(_KeepOnly(kept)).to_iter_dataset()
    _check_restores_like_strict_rotation(ds.mp_prefetch(mp_options(workers)), stop)


@settings(max_examples=8, deadline=None)
@given(
    length=st.integers(1, 30),
    batch=st.integers(1, 5),
    drop=st.booleans(),
    workers=st.sampled_from([2, 3]),
    stop=st.integers(0, 30),
)
def test_any_batching_and_restore_point_match_strict_rotation(
    length: int, batch: int, drop: bool, workers: int, stop: int
) -> None:
    ds = _batched(length, batch, drop).mp_prefetch(mp_options(workers))
    _check_restores_like_strict_rotation(ds, stop, lambda b: b[:, 0].tolist())


def test_a_class_position_that_is_not_an_integer_is_refused() -> None:
    ds = grain.MapDataset.range(20).to_iter_dataset()
    with iter(ds.mp_prefetch(MultiprocessingOptions(num_workers=2))) as it:
        next(it)
        state = it.get_state()
        state["iterators_in_use_states"][0]["next_index"] = 2.7
        with pytest.raises(TypeError, match=r"DispatchedClassIterator checkpoint `next_index`"):
            it.set_state(state)


def _normalise(element: dict[str, Any]) -> dict[str, Any]:
    return {"image": element["image"].astype(np.float32) / 255.0, "label": element["label"]}


@pytest.mark.parametrize("batched", [True, False], ids=["batched_map", "element_map"])
def test_arrays_in_memory_give_the_batches_of_one_process(batched: bool) -> None:
    # Gathered a batch at a time in the workers, 256 KiB float32 batches through shared memory
    # several ahead of the consumer: the batches and checkpoints of the pipeline in one process.
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (1000, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, 1000)
    ds = grain.MapDataset.source({"image": images, "label": labels}).seed(3).shuffle()
    ds = ds.map(_normalise, batched=batched).batch(64).to_iter_dataset()
    expected = list(ds)
    state = None
    with iter(ds.mp_prefetch(mp_options(2))) as it:
        for k, batch in enumerate(it):
            grain.testing.assert_trees_equal(batch, expected[k])
            if k == 5:
                state = it.get_state()
    with iter(ds.mp_prefetch(mp_options(2))) as restored:
        restored.set_state(state)
        for batch, want in zip(restored, expected[6:], strict=True):
            grain.testing.assert_trees_equal(batch, want)

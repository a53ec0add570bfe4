"""Dispatched mp_prefetch pipelines computed in the parent process
(grain_core.dataset.mp.in_process): the same elements and checkpoints as the workers'."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import shm_names

import grain_core as grain
from grain_core.dataset.mp import consumer as mp_consumer
from grain_core.dataset.mp import in_process
from grain_core.dataset.mp.in_process import START_S, WorkerPayoff


@pytest.fixture
def mode() -> Iterator[Any]:
    def set_mode(value: str) -> None:
        grain.config.update("py_mp_prefetch_in_process", value)

    yield set_mode
    grain.config.update("py_mp_prefetch_in_process", "never")


def _square(x: int) -> dict[str, Any]:
    return {"x": np.full(3, x * x), "i": x}


def _fails_at_7(x: int) -> int:
    if x == 7:
        raise ValueError("element 7")
    return x


def _pipelines() -> list[grain.IterDataset[Any]]:
    return [
        grain.MapDataset.range(23).seed(1).shuffle().map(_square).batch(4).to_iter_dataset(),
        grain.MapDataset.range(23).to_iter_dataset().map(_square).batch(3),
    ]


def _run(ds: grain.IterDataset[Any]) -> tuple[list[Any], list[Any]]:
    it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    elements, states = [], [it.get_state()]
    for element in it:
        elements.append(element)
        states.append(it.get_state())
    it.close()
    return elements, states


def _same(a: Any, b: Any) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_equal(x, y)


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("value", ["always", "auto"])
def test_output_and_states_equal_the_workers(mode: Any, index: int, value: str) -> None:
    expected, expected_states = _run(_pipelines()[index])
    mode(value)
    elements, states = _run(_pipelines()[index])
    _same(elements, expected)
    assert states == expected_states


@pytest.mark.parametrize("restore_in", ["never", "always"])
def test_checkpoints_are_interchangeable(mode: Any, restore_in: str) -> None:
    mode("always" if restore_in == "never" else "never")
    options = grain.MultiprocessingOptions(num_workers=2)
    ds = _pipelines()[0].mp_prefetch(options)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = it.get_state()
    rest = list(it)
    it.close()
    mode(restore_in)
    it = iter(_pipelines()[0].mp_prefetch(options))
    it.set_state(state)
    _same(list(it), rest)
    it.close()


def test_the_dataset_graph_is_logged_once_with_the_nodes_computed_here(
    mode: Any, caplog: pytest.LogCaptureFixture
) -> None:
    mode("always")
    grain.config.update("py_dataset_visualization_output_dir", "")
    try:
        with caplog.at_level(logging.INFO, logger="grain_core"):
            _run(_pipelines()[0])
    finally:
        grain.config.update("py_dataset_visualization_output_dir", None)
    graphs = [r.getMessage() for r in caplog.records if "dataset graph" in r.getMessage()]
    assert len(graphs) == 1
    assert "MultiprocessPrefetch" in graphs[0] and "transform=_square" in graphs[0]


def test_an_error_is_raised_at_its_position_again(mode: Any) -> None:
    mode("always")
    ds = grain.MapDataset.range(10).map(_fails_at_7).to_iter_dataset()
    it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    assert [next(it) for _ in range(7)] == list(range(7))
    for _ in range(2):
        with pytest.raises(ValueError, match="element 7"):
            next(it)
    it.close()


_REPORTED = threading.Event()


def _stuck_until_reported(x: int) -> int:
    """Position 3 waits (in the parent: in-process) until the watchdog has reported it (a
    minute at most: with no report, the test fails on the missing message)."""
    if x == 3:
        _REPORTED.wait(60)
    return x


class _SetOnReport(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))
        _REPORTED.set()


@pytest.mark.parametrize(
    ("thresholds", "level"), [((0.2, None), logging.WARNING), ((None, 0.2), logging.ERROR)]
)
def test_the_watchdog_reports_a_result_stuck_in_the_parent_with_its_stack(
    thresholds: tuple[float | None, float | None], level: int
) -> None:
    # Computed here, the stuck element is no worker's: the parent's watchdog reports it with
    # the stack of the thread computing it (past the timeout too: that thread cannot be
    # interrupted, so the report is an error in the log and the element still comes).
    _REPORTED.clear()
    handler = _SetOnReport()
    logger = logging.getLogger("grain_core")
    logger.addHandler(handler)
    warning_s, timeout_s = thresholds
    options = grain.MultiprocessingOptions(
        num_workers=2, in_process="always", stall_warning_s=warning_s, stall_timeout_s=timeout_s
    )
    ds = grain.MapDataset.range(6).map(_stuck_until_reported).to_iter_dataset()
    try:
        assert list(ds.mp_prefetch(options)) == list(range(6))
    finally:
        logger.removeHandler(handler)
    assert handler.messages, "the watchdog did not report the stuck result"
    level_given, message = handler.messages[0]
    assert level_given == level
    assert "has computed position 3 of" in message
    assert "in _stuck_until_reported" in message and "_REPORTED.wait(60)" in message


def _element_pid(x: int) -> tuple[int, int]:
    return x, os.getpid()


def test_workers_compute_what_they_are_asked_to_by_default() -> None:
    # The default: each result comes from a worker process, however cheap the pipeline.
    ds = grain.MapDataset.range(12).map(_element_pid).to_iter_dataset()
    pids = {pid for _, pid in ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))}
    assert os.getpid() not in pids and len(pids) >= 1


def test_the_options_choose_per_pipeline_over_the_config() -> None:
    ds = grain.MapDataset.range(12).map(_element_pid).to_iter_dataset()
    options = grain.MultiprocessingOptions(num_workers=2, in_process="always")
    assert {pid for _, pid in ds.mp_prefetch(options)} == {os.getpid()}


class FakeClock:
    """``in_process.clock`` for the consumer, which reads it right before and right after
    each result: every result takes ``step`` seconds, all of it CPU (``cpu_seconds``), and
    the consumer none between two."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, step: float) -> None:
        self.step = step
        self.now = 0.0
        self.calls = 0
        monkeypatch.setattr(mp_consumer, "clock", self)
        monkeypatch.setattr(in_process, "cpu_seconds", lambda: self.now)

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.step
        return self.now


def _machine(monkeypatch: pytest.MonkeyPatch, cores: float = 2.0, others: float = 0.0) -> None:
    monkeypatch.setattr(in_process, "usable_cores", lambda: cores)
    monkeypatch.setattr(in_process, "others_running", lambda: others)


def _decide(
    monkeypatch: pytest.MonkeyPatch,
    payoff: WorkerPayoff,
    read: tuple[float, float],
    gap: tuple[float, float],
) -> bool:
    """Feeds ``payoff`` results that each take ``read`` (wall, CPU) seconds after a consumer's
    ``gap`` (wall, CPU) seconds, until it decides."""
    wall = cpu = 0.0
    monkeypatch.setattr(in_process, "cpu_seconds", lambda: cpu)
    while True:
        started = wall + gap[0]
        wall = started + read[0]
        cpu += gap[1] + read[1]
        decision = payoff.record(started, wall, 0)
        if decision is not None:
            return decision


def test_payoff_keeps_cheap_results_here_without_pricing_their_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _machine(monkeypatch)

    def unpriced(result: Any) -> tuple[float, float]:
        raise AssertionError("transport priced for results workers cannot speed up")

    monkeypatch.setattr(in_process, "cheapest_transport_seconds", unpriced)
    # 1 us per result: less than the parent alone spends receiving one from a worker.
    assert (
        _decide(monkeypatch, WorkerPayoff(workers=2, results=100_000), (1e-6, 1e-6), (0.0, 0.0))
        is False
    )


def test_payoff_sends_costly_results_to_idle_cores_only(monkeypatch: pytest.MonkeyPatch) -> None:
    costly = (10e-3, 10e-3)
    _machine(monkeypatch)
    assert _decide(monkeypatch, WorkerPayoff(workers=2, results=10_000), costly, (0.0, 0.0)) is True
    # One worker computes no faster than this process: it could only overlap the consumer.
    assert (
        _decide(monkeypatch, WorkerPayoff(workers=1, results=10_000), costly, (0.0, 0.0)) is False
    )
    # Four other tasks ready to run on the two cores: the workers would get less than one.
    _machine(monkeypatch, others=4.0)
    assert (
        _decide(monkeypatch, WorkerPayoff(workers=2, results=10_000), costly, (0.0, 0.0)) is False
    )
    # Other work at one of the two counts only (when the trial starts): a burst, not what
    # the workers would meet.
    counts = iter([4.0, 0.0])
    monkeypatch.setattr(in_process, "others_running", lambda: next(counts))
    assert _decide(monkeypatch, WorkerPayoff(workers=2, results=10_000), costly, (0.0, 0.0)) is True
    # A CPU quota of one core.
    _machine(monkeypatch, cores=1.0)
    assert (
        _decide(monkeypatch, WorkerPayoff(workers=2, results=10_000), costly, (0.0, 0.0)) is False
    )
    # Too few results left to pay for starting the workers.
    _machine(monkeypatch)
    assert _decide(monkeypatch, WorkerPayoff(workers=2, results=8), costly, (0.0, 0.0)) is False


def test_payoff_counts_the_consumers_own_work(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, cores=4.0)
    # 20 ms per result while the consumer waits 50 ms for a device between results: one
    # worker hides the read behind the wait.
    device_wait = (50e-3, 0.0)
    read = (20e-3, 20e-3)
    assert _decide(monkeypatch, WorkerPayoff(workers=1, results=10_000), read, device_wait) is True
    # The same 50 ms spent computing here: one worker and the consumer share one core.
    _machine(monkeypatch, cores=1.0)
    assert (
        _decide(monkeypatch, WorkerPayoff(workers=1, results=10_000), read, (50e-3, 50e-3)) is False
    )


def test_payoff_hands_back_when_workers_deliver_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch)
    costly = WorkerPayoff(workers=2, results=10_000)
    assert _decide(monkeypatch, costly, (START_S, START_S), (0.0, 0.0)) is True
    assert costly.delivered(1.0) is True  # the first result waited for them to start
    assert costly.delivered(START_S / 10) is True
    assert costly.delivered(START_S) is True  # 0.55 START_S per result: faster than here
    assert costly.delivered(2 * START_S) is False


def _where(x: int) -> tuple[int, int]:
    return x, os.getpid()


def _assert_computed_in_parent(in_parent: bool, pids: list[set[int]]) -> None:
    """``pids``: the processes that computed each result, in order. In the parent: all of
    them; otherwise the first (the trial that decided) and none after it."""
    if in_parent:
        assert set().union(*pids) == {os.getpid()}
    else:
        assert pids[0] == {os.getpid()} and os.getpid() not in set().union(*pids[1:])


@pytest.mark.parametrize(("step", "in_parent"), [(1e-6, True), (1e3, False)])
def test_auto_decides_on_the_measured_cost(
    mode: Any, monkeypatch: pytest.MonkeyPatch, step: float, in_parent: bool
) -> None:
    # The measurements come from a fake clock (each result costs ``step``) and an
    # idle 2-core machine, so that the decision does not depend on this machine's load.
    mode("auto")
    _machine(monkeypatch)
    FakeClock(monkeypatch, step)
    ds = grain.MapDataset.range(40).map(_where).to_iter_dataset()
    it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    elements = list(it)
    it.close()
    assert [x for x, _ in elements] == list(range(40))
    _assert_computed_in_parent(in_parent, [{pid} for _, pid in elements])


class _Where(grain.transforms.Map):
    def map(self, element: int) -> tuple[int, int]:
        return _where(element)


@pytest.mark.parametrize(("step", "in_parent"), [(1e-6, True), (1e3, False)])
def test_the_data_loader_decides_as_mp_prefetch(
    mode: Any, monkeypatch: pytest.MonkeyPatch, step: float, in_parent: bool
) -> None:
    mode("auto")
    _machine(monkeypatch)
    FakeClock(monkeypatch, step)
    loader = grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 24, 1),
        sampler=grain.samplers.SequentialSampler(24),
        operations=[_Where(), grain.transforms.Batch(4)],
        worker_count=2,
    )
    batches = list(loader)
    assert np.concatenate([x for x, _ in batches]).tolist() == list(range(24))
    _assert_computed_in_parent(in_parent, [set(pid.tolist()) for _, pid in batches])


class _Scripted:
    """``WorkerPayoff`` decisions in a fixed order: ``record`` answers from ``trial``,
    ``delivered`` from ``deliveries`` (then True)."""

    def __init__(self, trial: list[bool | None], deliveries: list[bool]) -> None:
        self.trial = trial
        self.deliveries = deliveries

    def __call__(self, workers: int, results: int) -> Any:
        script = self

        class Payoff:
            def record(self, started: Any, ended: Any, result: Any) -> bool | None:
                return script.trial.pop(0) if script.trial else None

            def delivered(self, seconds: float) -> bool:
                return script.deliveries.pop(0) if script.deliveries else True

        return Payoff()


@pytest.mark.parametrize("index", [0, 1])
def test_output_and_states_stay_those_of_the_workers_across_hand_overs(
    mode: Any, monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    expected, expected_states = _run(_pipelines()[index])
    mode("auto")
    # Two results here, the workers take over, and hand back after two more.
    monkeypatch.setattr(mp_consumer, "WorkerPayoff", _Scripted([None, True], [True, False]))
    elements, states = _run(_pipelines()[index])
    _same(elements, expected)
    assert states == expected_states


class _Row(grain.transforms.Map):
    def map(self, element: int) -> np.ndarray:
        return np.full(1024, element, np.float32)


def test_batches_read_ahead_here_and_dropped_unread_free_their_blocks(
    mode: Any, no_shm_leak: None
) -> None:
    # A DataLoader with workers stacks its batches into shared memory; computed in the parent,
    # the read-ahead stacks batches the consumer never takes once the iterator is dropped
    # (an epoch broken off, a hand-over to workers): their blocks go with them.
    mode("always")
    loader = grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 64 * 24, 1),
        sampler=grain.samplers.SequentialSampler(64 * 24),
        operations=[_Row(), grain.transforms.Batch(64)],
        worker_count=2,
    )
    it = iter(loader)
    taken = [next(it), next(it)]
    while len(shm_names()) <= len(taken):  # the read-ahead stacked a batch not taken yet
        time.sleep(0.01)
    it.close()
    del it, taken

"""Tests of grain_core.dataset.read_concurrency: how many blocks a threaded reader keeps in
flight, from the first block's verdict, the load and the delivery rate (the reads themselves
are tested through ``to_iter_dataset`` in test_prefetch)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grain_core.dataset import read_concurrency
from grain_core.dataset.read_concurrency import ReadConcurrency


def _feed(controller, rate, cpu_share, windows, clock):
    """Delivers ``windows`` windows of 4 blocks of 100 elements at ``rate`` elements/s."""
    for _ in range(windows * 4):
        clock[0] += 100 / rate
        controller.block_done(100, cpu_share, clock[0])


def _controller(max_value, first_share=1.0, overlaps_consumer=False):
    """A controller after its first block (``first_share``: that block's CPU share)."""
    controller, clock = ReadConcurrency(max_value, overlaps_consumer=overlaps_consumer), [0.0]
    assert controller.value == 0 and not controller.measured  # the consumer reads the first
    controller.block_done(10, first_share, clock[0])
    return controller, clock


def test_read_concurrency_after_the_first_block():
    assert _controller(8, first_share=0.1)[0].value == 8  # waiting on I/O: full width at once
    assert _controller(8, first_share=0.9)[0].value == 0  # CPU-bound: the consumer reads
    controller = ReadConcurrency(6)
    controller.waits_on_io()  # seen waiting before it finished
    assert controller.measured and controller.value == 6


def test_read_concurrency_keeps_probes_that_raise_the_rate():
    controller, clock = _controller(8)
    controller.value = 1
    _feed(controller, 1000, 0.1, 1, clock)
    assert controller.value == 2  # low load: probing
    _feed(controller, 2000, 0.1, 1, clock)
    assert controller.value == 2  # kept: the rate doubled
    _feed(controller, 2000, 0.1, 1, clock)
    assert controller.value == 4


def test_read_concurrency_undoes_probes_that_do_not_pay_and_backs_off():
    # A GIL-bound read on a busy machine: its thread is descheduled half the time, which looks
    # like I/O, but more threads deliver nothing more.
    controller, clock = _controller(8)
    controller.value = 1
    probes = []
    for _ in range(40):
        before = controller.value
        _feed(controller, 1000, 0.4, 1, clock)
        probes.append(controller.value > before)
    assert controller.value in (1, 2)
    assert sum(probes) < 40 // 4  # waits twice as long after every failed probe


def test_read_concurrency_shrinks_when_reads_load_the_cpu():
    controller, clock = _controller(8)
    controller.value = 1
    for rate in (1000, 2000, 4000, 8000):
        _feed(controller, rate, 0.05, 2, clock)
    grown = controller.value
    assert grown > 2
    _feed(controller, 8000, 1.0, 1, clock)
    assert controller.value == grown // 2


def test_read_concurrency_from_the_consumer_thread_probes_two_threads_and_comes_back():
    controller, clock = _controller(8)
    assert controller.value == 0
    _feed(controller, 1000, 1.0, 4, clock)
    assert controller.value == 0  # CPU-bound reads stay in the consumer's thread
    _feed(controller, 1000, 0.1, 1, clock)
    assert controller.value == 2  # reads waiting: two blocks side by side
    _feed(controller, 1000, 0.1, 1, clock)
    assert controller.value == 0  # no faster: back to the consumer's thread
    _feed(controller, 1000, 0.1, 1, clock)
    assert controller.value == 0  # the next probe waits twice as long
    _feed(controller, 1000, 0.1, 1, clock)
    assert controller.value == 2
    _feed(controller, 2000, 0.1, 1, clock)
    _feed(controller, 2000, 1.0, 1, clock)
    assert controller.value == 1  # kept, then the reads loaded the CPU
    _feed(controller, 2000, 1.0, 1, clock)
    assert controller.value == 0


@pytest.mark.parametrize(
    ("rates", "best"),
    [((1000, 800), 0), ((1000, 1500), 1)],
    ids=["gil_holding", "gil_releasing"],
)
def test_read_concurrency_of_a_parent_measures_one_thread_for_cpu_bound_reads(rates, best):
    # Reads busy on the CPU: whether one read thread pays (reads releasing the GIL overlap the
    # consumer's work) or not (reads holding it) is measured, in both directions, whatever
    # the load says.
    controller, clock = _controller(8, overlaps_consumer=True)
    assert controller.value == 0
    values = []
    for _ in range(200):
        _feed(controller, rates[controller.value], 1.0, 1, clock)
        values.append(controller.value)
    assert set(values) == {0, 1}  # both tried
    assert values[-100:].count(best) > 90  # the faster kept, tried again ever more rarely


def test_read_concurrency_of_a_parent_tries_overlap_only_after_enough_windows():
    # A probe that does not pay slows its window down: a run of fewer windows than
    # _OVERLAP_PROBE_WAIT (one epoch of a small in-memory source) never pays for one.
    controller, clock = _controller(8, overlaps_consumer=True)
    _feed(controller, 1000, 1.0, read_concurrency._OVERLAP_PROBE_WAIT - 1, clock)
    assert controller.value == 0
    _feed(controller, 1000, 1.0, 1, clock)
    assert controller.value == 1  # probing
    _feed(controller, 1000, 1.0, 1, clock)
    assert controller.value == 0  # no faster: undone
    _feed(controller, 1000, 1.0, read_concurrency._OVERLAP_PROBE_WAIT - 1, clock)
    assert controller.value == 0


@given(
    st.lists(
        st.tuples(st.integers(1, 100), st.floats(0.0, 1.0), st.floats(1e-4, 0.1)), max_size=200
    ),
    st.integers(1, 16),
    st.booleans(),
)
def test_read_concurrency_stays_within_bounds(blocks, max_value, overlaps_consumer):
    controller, now = ReadConcurrency(max_value, overlaps_consumer=overlaps_consumer), 0.0
    for elements, share, dt in blocks:
        now += dt
        controller.block_done(elements, share, now)
        assert 0 <= controller.value <= max_value


class _Sleeping:
    """A MapDataset stand-in whose reads take 20 ms off the CPU."""

    def _getitems(self, indices: range) -> list[int]:
        time.sleep(0.02)
        return list(indices)


class _AlwaysBusy:
    """A thread's busy clock that counts every instant as busy (on a CPU or in its run
    queue), as for a thread of a worker on a machine whose cores are all taken."""

    def read(self) -> float:
        return time.perf_counter()


@pytest.mark.parametrize("worker", [False, True])
def test_a_worker_judges_its_reads_by_busy_time(
    monkeypatch: pytest.MonkeyPatch, worker: bool
) -> None:
    # A worker's process uses every core already: a read that waited for a busy CPU must
    # not look like a read waiting on I/O (which makes the reader try read threads).
    # CPU time alone says 'waiting' for both; the busy clock tells them apart in a worker.
    monkeypatch.setattr(read_concurrency, "_inline_while_cpu_bound", worker)
    monkeypatch.setattr(read_concurrency, "_thread_busy_clock", _AlwaysBusy)
    concurrency = ReadConcurrency(4, overlaps_consumer=read_concurrency.overlaps_consumer())
    concurrency.measured = True  # past the first block, which is judged by busy time anyway
    reader = read_concurrency.BlockReader(True, concurrency, 16)
    assert reader.read(_Sleeping(), 0, 4) == [0, 1, 2, 3]  # type: ignore[arg-type]
    if worker:
        assert reader.cpu_share >= 1.0
    else:
        assert reader.cpu_share < 0.5


def test_each_thread_has_its_own_busy_clock() -> None:
    here = read_concurrency._thread_busy_clock()
    assert read_concurrency._thread_busy_clock() is here
    other: list[object] = []
    thread = threading.Thread(target=lambda: other.append(read_concurrency._thread_busy_clock()))
    thread.start()
    thread.join()
    assert other[0] is not here
    assert (here.read() or 0.0) > 0.0

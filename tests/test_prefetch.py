from __future__ import annotations

import gc
import multiprocessing
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

import grain_core as grain
from grain_core.dataset import read_concurrency
from grain_core.dataset.options import DatasetOptions
from grain_core.dataset.prefetch import ThreadPrefetchDatasetIterator, ThreadPrefetchIterDataset
from grain_core.testing import check_iterator_conformance

MD = grain.MapDataset

READ_OPTIONS = [
    grain.ReadOptions(num_threads=0, prefetch_buffer_size=0),
    grain.ReadOptions(num_threads=0),
    grain.ReadOptions(num_threads=4, prefetch_buffer_size=16),
    grain.ReadOptions(),
]


@pytest.mark.parametrize("inline", [False, True], ids=["threads", "inline_while_cpu_bound"])
@pytest.mark.parametrize("options", READ_OPTIONS)
def test_order_and_state_never_depend_on_threads(options, inline, monkeypatch):
    monkeypatch.setattr(read_concurrency, "_inline_while_cpu_bound", inline)

    def slow_for_some(x):
        if x % 7 == 0:
            time.sleep(0.001)
        return x

    ds = MD.range(200).seed(3).shuffle().map(slow_for_some).filter(lambda x: x % 5)
    expected = [x for x in MD.range(200).seed(3).shuffle() if x % 5]
    out = check_iterator_conformance(ds.to_iter_dataset(options), positions=[0, 77, 159, 160])
    assert out == expected


def test_one_epoch_of_a_finite_and_endless_reading_of_infinite():
    assert len(list(MD.range(5).to_iter_dataset())) == 5
    it = iter(MD.range(5).repeat().to_iter_dataset())
    assert [next(it) for _ in range(12)][-2:] == [0, 1]


def test_state_counts_holes():
    it = iter(MD.range(10).filter(lambda x: x >= 5).to_iter_dataset())
    assert next(it) == 5
    assert it.get_state() == {"next_index": 6}


def test_invalid_checkpoint_is_an_index_error():
    it = iter(MD.range(10).to_iter_dataset())
    # Grain's text (users match on it), then which dataset.
    for bad in (11, -1):
        with pytest.raises(
            IndexError,
            match=rf"Checkpoint `next_index` {bad} is out of range for dataset of length 10 "
            r"\(RangeMapDataset",
        ):
            it.set_state({"next_index": bad})


def test_no_over_buffering_beyond_prefetch_buffer():
    read = []
    lock = threading.Lock()

    def record(x):
        with lock:
            read.append(x)
        return x

    it = iter(MD.range(10_000).map(record).to_iter_dataset(grain.ReadOptions(2, 50)))
    next(it)
    time.sleep(0.05)
    with lock:
        assert len(read) <= 50 + 1


def test_first_element_arrives_before_a_large_block_is_read():
    calls = []
    it = iter(
        MD.range(1000)
        .map(lambda x: calls.append(x) or x)
        .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=500))
    )
    assert next(it) == 0
    assert len(calls) == 1


def test_filter_raise_threshold_applies_to_holes():
    ds = MD.range(3000).filter(lambda x: x % 100 == 0).to_iter_dataset()
    from grain_core.dataset.base import DatasetIterator

    it = iter(ds)
    assert isinstance(it, DatasetIterator)
    it._ctx.dataset_options = DatasetOptions(filter_raise_threshold_ratio=0.5)
    # Grain's text (users match on it), then the dataset read.
    with pytest.raises(
        ValueError,
        match=r"Transformation PrefetchDatasetIterator\(read_options=ReadOptions\(num_threads=16, "
        r"prefetch_buffer_size=500\), allow_nones=False\) skipped \d+\.\d\d % of the last seen \d+ "
        r"elements \(reading FilterMapDataset",
    ):
        list(it)
    allowed = iter(MD.range(3000).filter(lambda x: False).to_iter_dataset(allow_nones=True))
    allowed._ctx.dataset_options = DatasetOptions(filter_raise_threshold_ratio=0.5)
    assert len(list(allowed)) == 3000


def test_error_in_a_block_delivers_earlier_elements_first():
    def fail_at_37(x):
        if x == 37:
            raise ZeroDivisionError("element 37")
        return x

    for options in READ_OPTIONS:
        it = iter(MD.range(100).map(fail_at_37).to_iter_dataset(options))
        assert [next(it) for _ in range(37)] == list(range(37))
        with pytest.raises(ZeroDivisionError) as info:
            next(it)
        assert any("index 37" in note for note in info.value.__notes__)


def test_next_index_jumps_without_reading():
    it = iter(MD.range(100).to_iter_dataset())
    it._set_next_index(42)
    assert it._get_next_index() == 42 and next(it) == 42


def test_start_prefetch_fills_without_consuming():
    it = iter(MD.range(100).map(lambda x: x).to_iter_dataset(grain.ReadOptions(2, 10)))
    it.start_prefetch()
    assert it.get_state() == {"next_index": 0}
    assert next(it) == 0


def test_thread_prefetch_keeps_state_exact():
    base = MD.range(50).to_iter_dataset().map(lambda x: x * 2)
    ds = ThreadPrefetchIterDataset(base, prefetch_buffer_size=4)
    out = check_iterator_conformance(ds, positions=[0, 10, 49, 50])
    assert out == [x * 2 for x in range(50)]
    it = iter(ds)
    next(it)
    time.sleep(0.02)  # let the producer run ahead
    assert it.get_state() == {"next_index": 1}
    assert it._get_next_index() == 1
    assert next(it) == 2


def test_thread_prefetch_zero_buffer_is_synchronous_and_negative_is_error():
    base = MD.range(3).to_iter_dataset()
    assert not isinstance(
        iter(ThreadPrefetchIterDataset(base, prefetch_buffer_size=0)), ThreadPrefetchDatasetIterator
    )
    with pytest.raises(
        ValueError, match="`prefetch_buffer_size` must be greater than or equal to 0, got -1"
    ):
        ThreadPrefetchIterDataset(base, prefetch_buffer_size=-1)


def test_thread_prefetch_reraises_and_stops_cleanly():
    def boom(x):
        if x == 2:
            raise OSError("disk gone")
        return x

    it = iter(
        ThreadPrefetchIterDataset(MD.range(5).to_iter_dataset().map(boom), prefetch_buffer_size=2)
    )
    assert [next(it), next(it)] == [0, 1]
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    it.close()
    with pytest.raises(ValueError, match="closed"):
        next(it)


def test_a_dropped_thread_prefetch_iterator_stops_its_thread_and_workers():
    # Training loops drop iterators without close() (a new one per epoch): the producer
    # thread must not keep the iterator, and with it the worker processes, alive.
    ds = MD.range(1000).to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(1))
    earlier = {p.pid for p in multiprocessing.active_children()}  # other tests' workers
    it = iter(ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2))
    assert next(it) == 0
    thread = it._thread
    workers = {p.pid for p in multiprocessing.active_children()} - earlier
    assert thread is not None and workers
    del it
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert not workers & {p.pid for p in multiprocessing.active_children()}


def test_producer_threads_are_stopped_and_joined_before_the_interpreter_exits():
    # A daemon thread still inside a C++ extension (a JAX device copy) when the interpreter
    # finalizes aborts the process ("FATAL: exception not rethrown"). Here the producer waits
    # on its full queue until stopped; atexit handlers run after threading's exit hook.
    program = textwrap.dedent(
        """
        import atexit, threading
        import grain_core as grain
        from grain_core.dataset.prefetch import ThreadPrefetchIterDataset

        ds = grain.MapDataset.range(100).to_iter_dataset()
        it = iter(ThreadPrefetchIterDataset(ds, prefetch_buffer_size=1))
        assert next(it) == 0
        producers = [t for t in threading.enumerate() if t.name == "grain_core-thread-prefetch"]
        assert producers
        atexit.register(lambda: print("alive at exit:", [t.is_alive() for t in producers]))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "alive at exit: [False]"


def test_thread_prefetch_over_foreign_iterators():
    class Counter:
        def __init__(self):
            self.i = 0

        def __next__(self):
            if self.i >= 5:
                raise StopIteration
            self.i += 1
            return self.i

        def get_state(self):
            return {"i": self.i}

        def set_state(self, state):
            self.i = state["i"]

    it = ThreadPrefetchDatasetIterator(Counter(), 2)
    assert [next(it), next(it)] == [1, 2]
    state = it.get_state()
    assert state == {"i": 2}
    assert list(it) == [3, 4, 5]
    it.set_state(state)
    assert list(it) == [3, 4, 5]
    with pytest.raises(StopIteration):
        next(it)


def test_reads_are_batched_through_getitems():
    class Source:
        def __init__(self):
            self.calls = 0

        def __len__(self):
            return 4096

        def __getitem__(self, i):
            raise AssertionError("single reads are not expected")

        def __getitems__(self, keys):
            self.calls += 1
            return [np.int64(k) for k in keys]

    src = Source()
    assert sum(MD.source(src).to_iter_dataset(grain.ReadOptions(num_threads=0))) == sum(range(4096))
    assert src.calls < 4096 // 16


def test_one_block_in_flight_may_take_the_whole_read_ahead():
    # Sources with batched reads (ArrayRecord) pay a fixed cost per call: while the probing
    # keeps a single block in flight, that block grows to the whole read-ahead, not to
    # read-ahead / num_threads.
    sizes = []

    class Source:
        def __len__(self):
            return 4096

        def __getitem__(self, i):
            return i

        def __getitems__(self, keys):
            sizes.append(len(keys))
            return list(keys)

    it = iter(MD.source(Source()).to_iter_dataset(grain.ReadOptions(16, 64)))
    assert list(it) == list(range(4096))
    assert max(sizes) == 64


@pytest.mark.parametrize("options", READ_OPTIONS[1:3])
def test_blocks_of_large_arrays_stay_under_the_block_bytes(options, monkeypatch):
    # Elements of 64 KiB each: blocks of at most 4 (256 KiB) once the first block is read,
    # whatever their cost; the elements and their order are the same.
    monkeypatch.setattr(read_concurrency, "_BLOCK_BYTES", 256 << 10)
    monkeypatch.setattr(
        read_concurrency, "_FAST_BLOCK_S", float("inf")
    )  # blocks grow at every read
    sizes = []

    class Source:
        def __len__(self):
            return 200

        def __getitem__(self, i):
            return {"x": np.full(8192, i, dtype=np.int64)}

        def __getitems__(self, keys):
            sizes.append(len(keys))
            return [self[k] for k in keys]

    out = list(MD.source(Source()).to_iter_dataset(options))
    assert [int(e["x"][0]) for e in out] == list(range(200))
    assert sizes[0] == 1 and max(sizes) == 4 and sum(sizes) == 200


def test_reads_that_release_the_gil_run_in_parallel_threads():
    def io_like(x):
        time.sleep(0.002)
        return x

    it = iter(MD.range(200).map(io_like).to_iter_dataset(grain.ReadOptions(8, 64)))
    assert [next(it) for _ in range(100)] == list(range(100))
    assert it._concurrency.value > 1
    it.close()


@pytest.fixture
def inline_reads(monkeypatch):
    """This process reads as an ``mp_prefetch`` worker does."""
    monkeypatch.setattr(read_concurrency, "_inline_while_cpu_bound", True)


def _reading_thread(x):
    sum(range(300))  # a few microseconds of work holding the GIL
    return threading.current_thread().name


@pytest.mark.parametrize("worker", [False, True], ids=["parent", "worker"])
def test_cpu_bound_reads_stay_in_the_consumer_thread(worker, monkeypatch):
    monkeypatch.setattr(read_concurrency, "_inline_while_cpu_bound", worker)
    # Threads come only with a probe, at the end of a window of blocks (never here: whether a
    # probe stays is ReadConcurrency's, tested above).
    monkeypatch.setattr(read_concurrency, "_WINDOW_S", float("inf"))
    names = list(MD.range(1000).map(_reading_thread).to_iter_dataset(grain.ReadOptions(4, 64)))
    assert set(names) == {threading.current_thread().name}


def _first_wait_for(barrier):
    def read(x):
        if x < barrier.parties:
            barrier.wait(timeout=60)  # broken (an error) unless these reads all wait at once
        return x

    return read


@pytest.mark.parametrize("worker", [False, True], ids=["parent", "worker"])
def test_reads_waiting_on_io_go_full_width_from_the_first(worker, monkeypatch):
    monkeypatch.setattr(read_concurrency, "_inline_while_cpu_bound", worker)
    # The first 6 reads each wait until all 6 wait together: they get past the barrier only
    # if 6 reads are in flight from the start, the first one included.
    barrier = threading.Barrier(6)
    ds = MD.range(60).map(_first_wait_for(barrier)).to_iter_dataset(grain.ReadOptions(6, 60))
    with iter(ds) as it:
        assert list(it) == list(range(60))


def _exit_at_one(x: int) -> int:
    if x == 1:
        raise SystemExit(3)
    return x


def test_reading_ahead_defers_an_exit_in_user_code_to_its_turn():
    # An mp_prefetch worker reads ahead while it waits for credits: user code that exits
    # there must not lose the element read before it, which was not sent yet.
    it = iter(MD.range(4).map(_exit_at_one).to_iter_dataset(grain.ReadOptions(num_threads=0)))
    assert next(it) == 0
    assert it.read_ahead()
    with pytest.raises(SystemExit):
        next(it)


def test_iterating_adds_no_reference_to_the_iterator():
    # A reference held by the readers (the first read's watcher, a read thread's work item)
    # would keep the iterator and every element it buffers alive after the user drops it.
    it = iter(MD.range(1000).map(lambda x: x).to_iter_dataset())
    before = sys.getrefcount(it)
    for _ in range(1000):
        next(it)
        assert sys.getrefcount(it) == before


def test_a_dropped_iterator_is_collected_while_its_reads_are_in_flight():
    reading, release = threading.Event(), threading.Event()

    class BlockingSource:
        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> int:
            if i > 0:
                reading.set()
                release.wait()
            return i

    ds = MD.source(BlockingSource()).to_iter_dataset(
        grain.ReadOptions(num_threads=2, prefetch_buffer_size=10)
    )
    it = iter(ds)
    assert next(it) == 0
    it._concurrency.waits_on_io()  # the next reads go to the read threads, whatever they cost
    it.start_prefetch()
    assert reading.wait(timeout=60)
    collected = threading.Event()
    weakref.finalize(it, collected.set)
    del it
    try:
        assert collected.is_set()
    finally:
        release.set()


def test_read_threads_fill_the_read_ahead_while_the_consumer_is_away():
    # After an early break the read threads read on until prefetch_buffer_size elements wait
    # (Grain's do too), and no read starts once the iterator is closed.
    lock, read, filled = threading.Lock(), set(), threading.Event()
    buffer_size = 8

    class CountingSource:
        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> int:
            with lock:
                read.add(i)
                if len(read) == buffer_size + 1:
                    filled.set()
            return i

    it = iter(
        MD.source(CountingSource()).to_iter_dataset(
            grain.ReadOptions(num_threads=2, prefetch_buffer_size=buffer_size)
        )
    )
    assert next(it) == 0
    it._concurrency.waits_on_io()  # the next reads go to the read threads, whatever they cost
    it.start_prefetch()
    assert filled.wait(timeout=60)
    executor = it._executor
    assert executor is not None
    it.close()
    executor.shutdown(wait=True)
    assert read == set(range(buffer_size + 1))


def test_thread_prefetch_fills_its_buffer_after_an_early_break_and_stops_on_close():
    # The producer thread reads on while the consumer is away, up to the buffer (plus the
    # element it waits to put), and ends when the iterator is closed: no leaked thread.
    lock, read, filled = threading.Lock(), [], threading.Event()
    buffer_size = 5

    def record(x: int) -> int:
        with lock:
            read.append(x)
            if len(read) == 1 + buffer_size + 1:
                filled.set()
        return x

    one_at_a_time = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    source = MD.range(100).map(record).to_iter_dataset(one_at_a_time)
    it = iter(ThreadPrefetchIterDataset(source, prefetch_buffer_size=buffer_size))
    assert next(it) == 0
    assert filled.wait(timeout=60)
    producer = it._thread
    assert producer is not None
    it.close()
    assert not producer.is_alive()
    assert read == list(range(1 + buffer_size + 1))

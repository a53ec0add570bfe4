"""How a threaded ``to_iter_dataset`` reads: the size of each block of indices (by its cost)
and how many blocks are in flight (``ReadConcurrency``, from the load and the delivery rate),
the first read's verdict between waiting on I/O and computing (``FirstReadWatch``), and the
process-wide choice of ``mp_prefetch`` workers to read CPU-bound blocks inline. The reader
itself (``dataset/prefetch.py``) owns the threads, the read-ahead and the state; this policy
knows nothing of datasets beyond ``_getitems``.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from grain_core import _tree

if TYPE_CHECKING:
    from grain_core.dataset.base import MapDataset

__all__ = [
    "MAX_BLOCK",
    "READ_THREAD_PREFIX",
    "BlockReader",
    "FirstReadWatch",
    "ReadConcurrency",
    "overlaps_consumer",
    "read_inline_while_cpu_bound",
]

#: The names of the threads that read elements for an iterator (the watchdog's reports show
#: their stacks beside the consumer's).
READ_THREAD_PREFIX = "grain_core-read"

# Blocks of indices read with one ``_getitems`` call adapt to the cost of an element: they start
# at one element (the first element arrives quickly) and double while a block takes less than
# _FAST_BLOCK_S, so cheap elements amortise per-call overhead; they halve above _SLOW_BLOCK_S so
# that heavy elements (whole batches) are not materialised thousands at a time, which would
# thrash memory. The cost is the block's CPU time on its thread, or its wall time for reads that
# mostly wait (I/O): blocks of slow I/O-bound elements stay small, so they spread over the
# threads instead of waiting one after the other in one. Block sizes never change which
# elements are produced or their order.
#: The largest block.
MAX_BLOCK = 1024
_FAST_BLOCK_S = 0.004
_SLOW_BLOCK_S = 0.016
# A block's arrays also stay under _BLOCK_BYTES (judged by its first element): arrays made and
# dropped a few at a time reuse memory the allocator holds and the CPU caches, where tens of
# megabytes alive at once are fresh pages from the kernel, faulted in one by one (measured: a
# block of 64 batches of 128 28x28 float32 images took twice as long per batch as blocks of 4).
_BLOCK_BYTES = 1 << 20
_IO_BOUND_LOAD = 0.5
_CPU_BOUND_LOAD = 0.8
# A probe of twice the blocks in flight is kept only if the delivery rate over a window of at
# least _WINDOW_BLOCKS blocks and _WINDOW_S seconds rises by _PROBE_GAIN.
_WINDOW_BLOCKS = 4
_WINDOW_S = 0.02
_PROBE_GAIN = 1.2
_MAX_PROBE_WAIT = 64
# Reads busy on the CPU try a read thread beside the consumer (it pays only where they release
# the GIL) no sooner than every _OVERLAP_PROBE_WAIT windows: a probe that does not pay slows
# its window down (measured: by half, GIL hand-offs on 128-image batches), so it may cost at
# most about 1/_OVERLAP_PROBE_WAIT of a run, and a run shorter than that many windows (one
# epoch of a small in-memory dataset) stays in the consumer's thread throughout.
_OVERLAP_PROBE_WAIT = 16
# The consumer's thread reads the first block while a watcher looks at that thread every
# _FIRST_LOOK_S: a read that has run for _IO_VERDICT_SWITCHES GIL switch intervals and spent
# most of that wall time off the CPU waits on I/O, and the next reads start on threads at once
# (full width). A thread waiting for the GIL is off the CPU too, but not for several switch
# intervals in a row; a shorter first read is too cheap to be worth threads anyway.
_FIRST_LOOK_S = 0.002
_IO_VERDICT_SWITCHES = 3


def _io_verdict_s() -> float:
    """How long a first read must have run to be judged waiting on I/O."""
    return max(_FIRST_LOOK_S, _IO_VERDICT_SWITCHES * sys.getswitchinterval())


# Whether threaded readers of this process start reading in the consumer's thread (see
# read_inline_while_cpu_bound).
_inline_while_cpu_bound = False


def read_inline_while_cpu_bound() -> None:
    """Makes the threaded ``to_iter_dataset`` readers of this process never try read threads
    for reads that keep the CPU busy: they use threads only while reads wait on I/O.

    Called by ``mp_prefetch`` workers: their processes already use every core, so a read
    thread gives CPU-bound reads no parallelism, only a hand-off per block (measured: a
    quarter of a worker's CPU on 256-row Parquet batches). A parent also tries one read
    thread for them now and then, kept only where it raises the delivery rate (reads that
    release the GIL overlap with the consumer's own work).
    """
    global _inline_while_cpu_bound
    _inline_while_cpu_bound = True


def overlaps_consumer() -> bool:
    """Whether a read thread of this process may overlap work of the consumer (not an
    ``mp_prefetch`` worker: see ``read_inline_while_cpu_bound``)."""
    return not _inline_while_cpu_bound


def _array_bytes(element: Any) -> int:
    """The bytes held by the NumPy arrays among ``element``'s leaves."""
    return sum(leaf.nbytes for leaf in _tree.flatten(element) if isinstance(leaf, np.ndarray))


class _BusyClock:
    """The time the calling thread spends on a CPU or ready to run on one (waiting in the run
    queue of a busy machine), in seconds, readable from any thread: the rest of its wall time
    it waits on something else (I/O, a sleep, a lock). Linux's per-thread ``schedstat`` has
    both; elsewhere it is the thread's CPU time, where a busy machine makes computing look
    like waiting (reads then widen, and the load brings them back)."""

    def __init__(self) -> None:
        # Opened once and read with pread: opening the file for each read cost 13 us.
        self._schedstat = -1
        self._cpu_clock: int | None = None
        try:
            self._schedstat = os.open(
                f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY | os.O_CLOEXEC
            )
        except OSError:
            pass
        if self._read_schedstat() is None:
            self.close()
            try:
                self._cpu_clock = time.pthread_getcpuclockid(threading.get_ident())
            except (AttributeError, OSError):  # no per-thread CPU clocks either
                pass

    def _read_schedstat(self) -> float | None:
        try:
            on_cpu_ns, run_queue_ns, _ = os.pread(self._schedstat, 128, 0).split()
        except (OSError, ValueError):
            return None
        busy_ns = int(on_cpu_ns) + int(run_queue_ns)
        # A thread that has ended reads as zeros through a file opened before it ended.
        return busy_ns / 1e9 if busy_ns else None

    def close(self, _os_close: Callable[[int], None] = os.close) -> None:
        """Closes the thread's statistics file (idempotent). (``os.close`` is bound early: a
        thread's clock may be collected while the interpreter shuts down.)"""
        if self._schedstat >= 0:
            _os_close(self._schedstat)
            self._schedstat = -1

    def __del__(self) -> None:
        self.close()

    def read(self) -> float | None:
        """The time so far; None where it cannot be known or the thread has ended."""
        if self._schedstat >= 0:
            return self._read_schedstat()
        if self._cpu_clock is None:
            return None
        try:
            return time.clock_gettime(self._cpu_clock)
        except OSError:
            return None


_BUSY_CLOCKS = threading.local()


def _thread_busy_clock() -> _BusyClock:
    """The calling thread's ``_BusyClock``, made once per thread (and again in a forked
    child, whose thread has another id)."""
    native_id = threading.get_native_id()
    held: tuple[int, _BusyClock] | None = getattr(_BUSY_CLOCKS, "clock", None)
    if held is None or held[0] != native_id:
        held = _BUSY_CLOCKS.clock = (native_id, _BusyClock())
    return held[1]


class BlockReader:
    """Reads blocks of a MapDataset's indices and sizes the next blocks by their cost.

    This, not the iterator, is what the read threads hold: an iterator dropped with reads in
    flight is collected at once, and the elements it buffered with it.

    The dataset comes with each read, not kept here: execution statistics swap the iterator's
    MapDataset graph for a timed copy (``stats``), and reads must see that swap.

    Args:
      threaded: Whether blocks may be read on read threads.
      concurrency: The iterator's read concurrency (whether the first block is measured yet).
      chunk_cap: The largest block.
    """

    def __init__(self, threaded: bool, concurrency: ReadConcurrency, chunk_cap: int) -> None:
        self._threaded = threaded
        self._concurrency = concurrency
        self._chunk_cap = chunk_cap
        self.chunk_size = 1
        self.cpu_share = 1.0

    def read(self, ds: MapDataset[Any], start: int, count: int) -> Sequence[Any]:
        """Reads ``ds[start:start + count]`` and adapts the next blocks' size to its cost."""
        # Thread CPU time, not wall time: with several read threads, waiting for the GIL
        # would otherwise look like expensive elements and shrink the blocks.
        first = self._threaded and not self._concurrency.measured
        # The first block decides between waiting on I/O and computing, and so does every
        # block of a process that uses every core already (a worker): a busy machine's run
        # queue is computing too. (Workers judged by CPU time alone saw their share fall
        # under half on a loaded 2-core host, and probed read threads again and again.)
        busy = _thread_busy_clock() if first or not overlaps_consumer() else None
        began_busy = busy.read() if busy is not None else None
        began_cpu, began_wall = time.thread_time(), time.perf_counter()
        values = ds._getitems(range(start, start + count))
        elapsed = time.thread_time() - began_cpu
        wall = time.perf_counter() - began_wall
        share = elapsed / wall if wall > 0 else 1.0
        self.cpu_share = share
        if busy is not None:
            ended_busy = busy.read()
            if began_busy is not None and ended_busy is not None and wall > 0:
                self.cpu_share = (ended_busy - began_busy) / wall
            if first and wall < _io_verdict_s():
                self.cpu_share = 1.0  # a first block too short to tell counts as computing
        cost = elapsed if self.cpu_share >= _IO_BOUND_LOAD else wall
        if cost < _FAST_BLOCK_S:
            self.chunk_size = min(self.chunk_size * 2, self._chunk_cap)
        elif cost > _SLOW_BLOCK_S:
            self.chunk_size = max(self.chunk_size // 2, 1)
        if len(values):
            size = _array_bytes(values[0])
            if size * self.chunk_size > _BLOCK_BYTES:
                self.chunk_size = max(1, _BLOCK_BYTES // size)
        return values


class FirstReadWatch:
    """Looks at the consumer's thread while it reads an iterator's first block: if the read
    waits on I/O (the thread off the CPU most of the time), starts the next reads on threads
    at once instead of after the first read.

    The watching thread is started without waiting for it to run (``_thread``), so a first
    read that ends quickly pays nothing for it.
    """

    def __init__(self, on_io_wait: Callable[[], None]) -> None:
        # Dropped by ``stop``: the watching thread may outlive the read by a look, and must not
        # keep the iterator (and the elements it buffers) alive meanwhile.
        self._on_io_wait: Callable[[], None] | None = on_io_wait
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._reader = _BusyClock()
        self._began = self._reader.read(), time.perf_counter()
        _thread.start_new_thread(self._watch, ())

    def _watch(self) -> None:
        began_busy, began_wall = self._began
        if began_busy is None:  # nothing to look at on this platform
            return
        verdict_s = _io_verdict_s()
        while not self._stop.wait(_FIRST_LOOK_S):
            wall = time.perf_counter() - began_wall
            if wall < verdict_s:
                continue
            busy = self._reader.read()
            if busy is None:  # the reading thread has ended
                return
            if busy - began_busy < _IO_BOUND_LOAD * wall:
                with self._lock:
                    if self._on_io_wait is not None:
                        self._on_io_wait()
                return

    def stop(self) -> None:
        """Ends the watch (the first read is done)."""
        self._stop.set()
        with self._lock:
            self._on_io_wait = None


class ReadConcurrency:
    """How many blocks a threaded ``to_iter_dataset`` reads at once (0: the consumer's thread
    reads).

    The consumer's thread reads the first block, and it is measured (a watcher also looks at
    it while it runs): a read that waits on I/O (its thread off the CPU) puts ``max_value``
    blocks in flight at once, since slow I/O-bound elements gain most from overlapping early;
    after any other read the consumer's thread reads on, which is fastest for reads that hold
    the GIL (no hand-off, no contention), and the first element comes with no delay.

    Later, the signal that more reads might help is the *load*: the CPU the reads in flight use
    together, in cores (the last block's share of its wall time on its thread's CPU, times the
    blocks in flight). It cannot tell a thread waiting for I/O from one waiting for a busy CPU,
    so a low load only triggers a *probe*: twice the blocks in flight, kept if the delivery
    rate rises by ``_PROBE_GAIN`` over the next window, else undone, with the next probe
    waiting twice as many windows. A load above ``_CPU_BOUND_LOAD`` (reads busy on the CPU or
    contending for the GIL) halves the blocks in flight. From the consumer's thread, a low load
    tries two threads (one alone reads no faster than the consumer's thread; reads waiting on
    I/O gain from running side by side); a high load tries one read thread where it may
    overlap the consumer's own work (``overlaps_consumer``: reads that release the GIL gain). With ``overlaps_consumer``, a load alone never
    takes the last thread away: a probe back to the consumer's thread does, kept unless the
    rate falls.

    Args:
      max_value: The most blocks in flight (``ReadOptions.num_threads``).
      overlaps_consumer: Whether a read thread may overlap work of the consumer (a parent
        process), or the process uses every core already (an ``mp_prefetch`` worker).
    """

    def __init__(self, max_value: int, *, overlaps_consumer: bool = True) -> None:
        self.value = 0
        self.measured = False
        self._max = max_value
        self._floor = 1 if overlaps_consumer else 0
        self._probe_cpu_bound = overlaps_consumer
        self._window_start = -1.0
        self._window_elements = 0
        self._window_blocks = 0
        self._rate_before_probe = 0.0  # > 0 while a probe runs
        self._value_before_probe = 0
        self._probe_wait = 1
        self._windows_since_probe = 0

    def waits_on_io(self) -> None:
        """The first read was seen waiting on I/O: puts every block in flight at once."""
        self.measured = True
        self.value = self._max

    def block_done(self, elements: int, cpu_share: float, now: float) -> None:
        """Accounts for one delivered block and adapts :attr:`value` at the end of a window.

        Args:
          elements: Elements in the block.
          cpu_share: The block's CPU time on its thread over its wall time.
          now: ``time.perf_counter()`` when the block was delivered.
        """
        if not self.measured:
            self.measured = True
            self.value = self._max if cpu_share < _IO_BOUND_LOAD else 0
        if self._window_start < 0:
            self._window_start = now
            return
        self._window_elements += elements
        self._window_blocks += 1
        elapsed = now - self._window_start
        if self._window_blocks < _WINDOW_BLOCKS or elapsed < _WINDOW_S:
            return
        rate = self._window_elements / elapsed
        self._window_start, self._window_elements, self._window_blocks = now, 0, 0
        if self._rate_before_probe > 0:
            # A probe up must raise the rate; one down (to the consumer's thread) must not
            # lower it: the consumer's thread is the cheaper way to read.
            upward = self.value > self._value_before_probe
            if rate < self._rate_before_probe * (_PROBE_GAIN if upward else 1.0):
                self.value = self._value_before_probe
                self._probe_wait = min(self._probe_wait * 2, _MAX_PROBE_WAIT)
            elif upward:
                self._probe_wait = 1
            else:  # back to the consumer's thread: the next probe up waits longer
                self._probe_wait = min(self._probe_wait * 2, _MAX_PROBE_WAIT)
            self._rate_before_probe = 0.0
            self._windows_since_probe = 0
            return
        load = cpu_share * max(1, self.value)
        if load > _CPU_BOUND_LOAD and self.value > self._floor:
            self.value = max(self.value // 2, self._floor)
            return
        self._windows_since_probe += 1
        if self._windows_since_probe < self._probe_wait:
            return
        if load < _IO_BOUND_LOAD:  # reads waiting: would twice as many deliver faster?
            if self.value < self._max:
                self._probe(rate, min(max(2, self.value * 2), self._max))
        elif (
            self._probe_cpu_bound
            and self.value == 0
            and self._windows_since_probe >= _OVERLAP_PROBE_WAIT
        ):  # would one thread overlap the consumer?
            self._probe(rate, 1)
        elif self._probe_cpu_bound and self.value == 1:  # ... or is the consumer as fast alone?
            self._probe(rate, 0)

    def _probe(self, rate: float, value: int) -> None:
        self._rate_before_probe, self._value_before_probe = rate, self.value
        self.value = value

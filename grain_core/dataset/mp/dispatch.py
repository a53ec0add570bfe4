"""Dispatch: ``mp_prefetch`` over pipelines whose elements are functions of their position
(``positions.dispatch_view``): positions go to whichever worker is free.

Strict rotation, with worker ``w`` reading ``map_parent[w::N]``, runs every worker at the
slowest one's pace (a core shared with another process, a worker the host deschedules); here
the parent keeps that output and its state, and hands out the positions instead:

* The output is the same rotation over ``N`` strided *classes* (class ``c`` holds the indices
  ``c, c + N, …``), and each class's state is the ``{"next_index": j}`` its worker would report
  (for batches, the elements of its share read), so checkpoints are interchangeable with the
  rotating engine and, for elements, across worker counts.
* Workers get *runs* ``(class, first slice index, count)``, compute them in order
  (``PositionReader``, ahead of their credits) and send the results with the CPU time they
  cost in this generation (results already read several to a message); the parent files
  results by position, no tags needed.
* A worker is committed to about ``_RUN_TARGET_S`` of CPU work, at least
  ``per_worker_buffer_size`` positions and at most the read-ahead
  (``ReadOptions.prefetch_buffer_size``), or ``SMALL_AHEAD`` if that is more and its results
  need no shared memory: elements that wait on storage cost no CPU and get long runs whose
  reads overlap, CPU-heavy ones go a few at a time.
* Results are sent against credits, as many as the consumer has taken plus
  ``per_worker_buffer_size``, so the shared memory in flight is that of strict rotation
  (or ``SHARED_AHEAD_BYTES`` per worker where that holds more results: small batches).
  Small results may overdraw: ``SMALL_AHEAD`` of them, ``OVERDRAFT_BYTES`` pickled at most
  (``protocol``), so a worker need not wait for the parent's wake-up after each,
  and its credits go half its overdraft at a time (``credit_batch``), not one per element
  (a rotating worker asks when it runs out, ``WANTS_CREDIT``; a dispatching one waits for
  the consumer to need its next result, so credits come sooner).
* Cheap elements: each worker takes its own class (contiguous reads, results in the consumer's
  order). Elements that cost more than ``_HELP_MIN_CPU_S`` of CPU: free workers take the
  classes least covered ahead of the consumer, with a wider window and as many credits, so a
  worker that is free while another computes the position the consumer needs computes the
  ones after it.

Parent side, ``LocalWorkers``: the producer on local processes behind ``consumer.ClassConsumer``
(which keeps the frontiers and the results by position): plans runs and credits (``ASSIGN``),
files results by position, re-plans from the consumer's positions on restore (a new
generation).

Worker side, ``dispatch_worker.DispatchWorkerLoop``: computes its runs in assignment order and
sends each result with its CPU seconds so far; an error goes to its position.
"""

from __future__ import annotations

import collections
import functools
import time
import weakref
from typing import Any

from grain_core._ipc import shm
from grain_core._ipc.errors import UnreadableElementError, WorkerDiedError, remote_error
from grain_core._ipc.pool import STOP_TIMEOUT_S, WorkerPool
from grain_core._ipc.watchdog import StallWatch
from grain_core.dataset.iterator import pipeline_observer
from grain_core.dataset.mp.consumer import ClassConsumer
from grain_core.dataset.mp.dispatch_worker import worker_main
from grain_core.dataset.mp.protocol import (
    ELEMENT,
    ELEMENTS,
    ERROR,
    STATS_GENERATION,
    assign_message,
    credit_batch,
    element_block_names,
    receive_side_message,
    shared_ahead_room,
    stats_request_message,
)
from grain_core.dataset.mp.worker import WorkerSpec, lease_workers, release_workers
from grain_core.dataset.options import DatasetOptions
from grain_core.dataset.transfer_cost import overdraft_room
from grain_core.plugins import loaded_plugin_names

__all__ = ["LocalWorkers"]

#: CPU seconds of work a worker is committed to at once (it keeps a worker busy across the
#: parent's round trip without tying positions to a worker that turns out to be slow).
_RUN_TARGET_S = 0.01
#: CPU seconds an element must cost for free workers to help with other classes' positions.
_HELP_MIN_CPU_S = 0.01
#: Results between two updates of a worker's CPU cost (sooner once they cost _RUN_TARGET_S).
_LEARN_EVERY = 8
#: Weight of the newest element time in a worker's running average.
_TIME_WEIGHT = 0.3


# ---------------------------------------------------------------------------- parent side
def _held_blocks(held: dict[tuple[int, int], tuple[int, Any, Any]]) -> list[tuple[int, list[str]]]:
    """The blocks of the results in a consumer's ``held`` filed by ``LocalWorkers`` (tag
    ``(worker, names)``), by worker."""
    return [tag for _, _, tag in held.values() if isinstance(tag, tuple) and tag[1]]


class LocalWorkers:
    """The producer on local worker processes (``consumer.Producer``): the workers, what each
    is computing, credits, and the results they sent filed in the consumer's ``held`` with
    tag ``(worker, shared-memory block names)``. Holds no iterator, so an unclosed one is
    collected and its workers stopped.

    Args:
      consumer: The ``ClassConsumer`` (its pipeline, options, frontiers and held results).
    """

    def __init__(self, consumer: ClassConsumer) -> None:
        # Weakly: the consumer holds its producer, and an iterator dropped unclosed must free
        # both (and stop the workers) without waiting for the cyclic garbage collector.
        self._consumer = weakref.proxy(consumer)
        self._count = n = consumer.count
        options = consumer.engine.options
        self._buffer = max(1, options.per_worker_buffer_size)
        self._overdraft_allowed = options.per_worker_buffer_size > 0  # as its workers do
        # A worker always has its next position: waiting for the parent to hand one out
        # would cost it a round trip, and the parent a core, per element.
        self._min_run = max(2, self._buffer)
        self._max_run = max(self._min_run, consumer.reader.read_options.prefetch_buffer_size)
        self._assigned = [0] * n  # per class: next slice index not yet assigned
        self._runs: list[collections.deque[list[int]]] = [collections.deque() for _ in range(n)]
        self._outstanding = [0] * n  # per worker: positions assigned, results not received
        # Per worker, this generation: credits granted (results it may send), results
        # received, and results of it the consumer has taken.
        self._granted = [0] * n
        self._received = [0] * n
        self._consumed = [0] * n
        # Per worker: credits go in batches of this many (larger while its results may
        # overdraw: the overdraft carries it meanwhile).
        self._credit_batch = [credit_batch(self._buffer)] * n
        # Per worker: results it may send beyond those consumed.
        self._ahead = [self._buffer] * n
        self._cpu_seconds = [0.0] * n  # per worker: average CPU seconds per element (0: unknown)
        # Per worker: its CPU time when its average was last updated, and results since.
        self._cpu_mark = [0.0] * n
        self._since_learned = [0] * n
        self._limits = [self._min_run] * n
        # Per worker: results it may send beyond its credits, judged by its last message; and
        # results in shared memory it may have sent beyond those consumed (0: not in shared
        # memory).
        self._overdraft_room = [0] * n
        self._shared_room = [0] * n
        self._recycled = [shm.RecycledBlocks() for _ in range(n)]
        self._warning_registry: dict[Any, Any] = {}
        # Per worker: statistics requests sent, and the last one it answered.
        self._stats_requests = [0] * n
        self._stats_answered = [0] * n
        self._generation = 0
        self._restarted = False
        self._pool: WorkerPool | None = None
        self._finalizer: weakref.finalize | None = None
        # The position the consumer waits for and since when (``time.monotonic()``).
        self._waiting: tuple[tuple[int, int] | None, float] = (None, 0.0)

    # ------------------------------------------------------------------- the producer
    def start(self, options: DatasetOptions) -> None:
        """Starts the workers (or takes those the last iterator left running) and gives them
        their first runs from the consumer's positions."""
        engine = self._consumer.engine
        plugins = loaded_plugin_names()

        def make_specs() -> list[WorkerSpec]:
            return [
                WorkerSpec.for_engine(
                    engine,
                    w,
                    self._count,
                    options=options,
                    plugins=plugins,
                    results_in_flight=self._buffer,
                    buffer_size=engine.options.per_worker_buffer_size,
                )
                for w in range(self._count)
            ]

        warm = engine.warm_workers
        key = (worker_main, options, plugins)
        lease = lease_workers(warm, key, make_specs, worker_main, engine.options)
        self._pool = lease.pool
        self._recycled = lease.recycled
        held = functools.partial(_held_blocks, self._consumer.held)
        self._finalizer = weakref.finalize(self, release_workers, warm, lease, held)
        self._generation = lease.first_generation
        self._forget_work()
        # Workers of an iterator before this one drop its work on hearing the new generation.
        self._assign(every_worker=lease.reused)

    def stop(self) -> None:
        """Stops the workers (or keeps them for the next iterator) and drops the results
        they sent ahead."""
        if self._finalizer is not None:
            self._receive_last_stats()
            self._finalizer()  # the workers' blocks go with them
            self._finalizer = self._pool = None
            self._recycled = [shm.RecycledBlocks() for _ in range(self._count)]

    def fill(self, cls: int, j: int) -> None:
        assert self._pool is not None
        # Results held ahead of the consumer are the parent's too: a forked child that reads
        # them would go on from the parent's position with no worker behind it.
        self._pool.check_owner()
        self._pump(block=True, needed=(cls, j))

    def take(self, tag: tuple[int, list[str]], value: Any) -> Any:
        assert self._pool is not None
        self._pool.check_owner()
        worker, names = tag
        self._consumed[worker] += 1
        due = self._consumed[worker] + self._ahead[worker] - self._granted[worker]
        if due >= self._credit_batch[worker]:
            # Credits due: the worker may be waiting for them. A worker found ended here is
            # reported by the next call (the consumer's ``error``), after this element.
            try:
                self._pump(block=False)
            except (WorkerDiedError, UnreadableElementError) as e:
                self._consumer.error = e
        return shm.open_from_shm(value, self._recycled[worker]) if names else value

    def restart(self) -> None:
        self._restarted = True  # runs are re-planned on the next pump, once for all classes

    def request_stats(self, worker: int) -> None:
        """Asks ``worker`` for its stage statistics (``observe.stages.refresh_worker_stages``)."""
        if self._pool is not None:
            self._stats_requests[worker] += 1
            self._pool.send(worker, stats_request_message(self._stats_requests[worker]))

    def receive_stats(self, worker: int, deadline: float | None = None) -> None:
        """Receives what the workers send until ``worker`` has answered the last request (or
        a worker ended: its error is raised to the consumer, as by ``next_of``), or until
        ``time.monotonic()`` reaches ``deadline``."""
        pool = self._pool
        consumer = self._consumer
        while (
            pool is not None
            and consumer.error is None
            and self._stats_answered[worker] < self._stats_requests[worker]
        ):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready: list[int] = []
            try:
                ready = pool.ready_workers(timeout)
                for w in ready:
                    self._receive(w)
            except (WorkerDiedError, UnreadableElementError) as e:
                consumer.error = e
            if not ready and deadline is not None:
                return

    def _receive_last_stats(self) -> None:
        """Before the workers stop: those whose statistics are tracked send their last ones
        (and trace spans). A worker busy in a long function gets the time shutting it down
        would give it."""
        tracked = []
        for worker, slot in enumerate(self._consumer.slots):
            iterator = None if slot is None else slot()
            if iterator is not None and pipeline_observer().tracks(iterator):
                tracked.append(worker)
                self.request_stats(worker)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in tracked:
            self.receive_stats(worker, deadline)

    # --------------------------------------------------------------------- scheduling
    def _pump(self, block: bool, needed: tuple[int, int] | None = None) -> None:
        """Receives what the workers sent, then hands out work and credits; with ``block``,
        waits for at least one message first if none is there.

        Args:
          block: Wait for a message.
          needed: The position the consumer waits for, made sure to be on its way before
            waiting (``_unblock``).
        """
        pool = self._pool
        assert pool is not None
        if self._restarted:
            self._restart_runs()
        ready = pool.ready_workers()
        if not ready and block:
            self._assign()
            watch = None
            if needed is not None:
                self._unblock(*needed)
                if self._waiting[0] != needed:
                    self._waiting = (needed, time.monotonic())
                watch = StallWatch(self._waiting[1], functools.partial(self._waiting_for, *needed))
            ready = pool.ready_workers(timeout=None, watch=watch)
        # One message per worker that sent something: what came meanwhile is read by the next
        # pump (a check per message would cost a system call each).
        for w in ready:
            self._receive(w)
        self._assign()

    def _waiting_for(self, cls: int, j: int) -> tuple[int | None, str]:
        """For the watchdog: the worker computing position ``(cls, j)``, and what it is stuck
        on: the first position of its runs (it computes them in order), which may come before
        the one the consumer waits for."""
        consumer = self._consumer
        kind = "batch" if consumer.batches is not None else "position"
        where = f"of {consumer.reader.map_parent!r}"
        needed = f"{kind} {cls + j * self._count} {where}"
        for worker, runs in enumerate(self._runs):
            if any(run_cls == cls and first <= j < first + n for run_cls, first, n in runs):
                stuck = runs[0][0] + runs[0][1] * self._count
                if stuck == cls + j * self._count:
                    return worker, needed
                return worker, (
                    f"{kind} {stuck} {where} (the consumer waits for {kind} "
                    f"{cls + j * self._count}, which this worker computes after it)"
                )
        return None, needed

    def _unblock(self, cls: int, j: int) -> None:
        """Makes sure position ``(cls, j)``, which the consumer waits for, is on its way.

        Workers send in assignment order, against credits: the one computing it may have spent
        its credits on results needed later, and when every worker is committed to positions
        needed later it is not assigned at all. It then goes to the worker with the fewest
        positions to compute, and that worker gets the credits to send through to it.
        """
        for worker, runs in enumerate(self._runs):
            before = 0
            for run_cls, first, count in runs:
                if run_cls == cls and first <= j < first + count:
                    self._grant_through(worker, before + j - first + 1, [])
                    return
                before += count
        worker = min(range(self._count), key=self._outstanding.__getitem__)
        self._runs[worker].append([cls, j, 1])
        self._assigned[cls] = j + 1
        self._outstanding[worker] += 1
        self._grant_through(worker, self._outstanding[worker], [(cls, j, 1)])

    def _grant_through(self, worker: int, sends: int, runs: list[tuple[int, int, int]]) -> None:
        """Lets ``worker`` send its next ``sends`` results (and gives it ``runs``)."""
        credits = max(0, sends - (self._granted[worker] - self._received[worker]))
        if credits or runs:
            assert self._pool is not None
            released = self._recycled[worker].take_released()
            self._pool.send(worker, assign_message(self._generation, runs, credits, released))
            self._granted[worker] += credits

    def _restart_runs(self) -> None:
        # Results of the old generation are discarded when they arrive (their blocks go back
        # to their workers); every worker hears of the new one.
        self._generation += 1
        held = self._consumer.held
        for _, _, (worker, names) in held.values():
            self._recycled[worker].released.extend(names)
        held.clear()
        self._forget_work()
        self._assign(every_worker=True)

    def _forget_work(self) -> None:
        """Nothing is assigned: the work starts again from the consumer's positions."""
        self._restarted = False
        for runs in self._runs:
            runs.clear()
        self._outstanding = [0] * self._count
        self._granted = [0] * self._count
        self._received = [0] * self._count
        self._consumed = [0] * self._count
        # A new generation: the workers' CPU seconds count from zero again.
        self._cpu_mark = [0.0] * self._count
        self._since_learned = [0] * self._count
        self._assigned = list(self._consumer.frontier)

    def _receive(self, worker: int) -> None:
        assert self._pool is not None
        generation, kind, value, cpu_total, names, dropped = self._pool.recv(worker, ready=True)
        recycled = self._recycled[worker]
        recycled.forget(dropped)
        if generation != self._generation:
            if generation == STATS_GENERATION:
                slot = self._consumer.slots[worker]
                iterator = None if slot is None else slot()
                answers = receive_side_message(
                    kind, value, cpu_total, iterator, self._warning_registry
                )
                if answers is not None:
                    self._stats_answered[worker] = answers
            elif kind in (ELEMENT, ELEMENTS):
                count = len(value) if kind == ELEMENTS else 1
                for blocks in element_block_names(kind, count, names):
                    recycled.released.extend(blocks)
            return
        held = self._consumer.held
        if kind == ERROR:
            error = remote_error(value, worker, self._count)
            held[self._next_position(worker)] = (ERROR, error, (worker, []))
            return
        values = value if kind == ELEMENTS else [value]
        count = len(values)
        for element, blocks in zip(values, element_block_names(kind, count, names), strict=True):
            held[self._next_position(worker)] = (ELEMENT, element, (worker, blocks))
        room = (
            0
            if names or not self._overdraft_allowed
            else overdraft_room(self._pool.last_message_bytes // count)
        )
        shared = shared_ahead_room(shm.shared_bytes(value) // count) if names else 0
        self._overdraft_room[worker] = room
        self._shared_room[worker] = shared
        self._credit_batch[worker] = credit_batch(self._buffer, max(room, shared))
        self._since_learned[worker] += count
        spent = cpu_total - self._cpu_mark[worker]
        if spent >= _RUN_TARGET_S or self._since_learned[worker] >= _LEARN_EVERY:
            self._learn(worker, spent / self._since_learned[worker])
            self._cpu_mark[worker] = cpu_total
            self._since_learned[worker] = 0

    def _next_position(self, worker: int) -> tuple[int, int]:
        """The position ``worker``'s next result is for (it computes its runs in order)."""
        run = self._runs[worker][0]
        position = (run[0], run[1])
        run[1] += 1
        run[2] -= 1
        if run[2] == 0:
            self._runs[worker].popleft()
        self._outstanding[worker] -= 1
        self._received[worker] += 1
        return position

    def _learn(self, worker: int, cpu_seconds: float) -> None:
        """Sets ``worker``'s commitment from the CPU time its elements cost (all its threads):
        about ``_RUN_TARGET_S`` of CPU work, within ``[per_worker_buffer_size, read-ahead]``.
        Waiting (I/O) costs no CPU, so elements read from slow storage get long runs that the
        worker's read threads overlap (its reads move to threads when they wait); CPU-heavy
        ones go a few at a time."""
        average = self._cpu_seconds[worker]
        if average == 0.0:
            average = cpu_seconds
        else:
            average += _TIME_WEIGHT * (cpu_seconds - average)
        self._cpu_seconds[worker] = average
        longest = max(self._max_run, self._overdraft_room[worker], self._shared_room[worker])
        fit = longest if average <= 0.0 else int(_RUN_TARGET_S / average)
        self._limits[worker] = max(self._min_run, min(longest, fit))

    def _assign(self, every_worker: bool = False) -> None:
        """Hands out positions and credits.

        A worker gets more positions once half its commitment is free (or it is idle), so
        runs are not handed out one element at a time. Each class is covered at most
        ``window`` positions ahead of the consumer, and a worker may send as many results as
        the consumer has taken from it plus ``ahead``:

        * Cheap elements: the window is the largest commitment and ``ahead`` is
          ``per_worker_buffer_size``, as in strict rotation, or as many results in shared
          memory as ``SHARED_AHEAD_BYTES`` holds if that is more (small batches then go
          several per wake-up of the worker). Workers take their own class,
          which keeps each worker's reads contiguous and its sends in the consumer's order;
          an idle worker takes what fits of the others. Held results cost memory, and moving
          large cheap elements is bound by memory bandwidth, which more blocks in flight
          slow down.
        * Elements costing more CPU than ``_HELP_MIN_CPU_S``: window and ``ahead`` grow to
          twice the largest commitment plus two, and free workers take the classes least
          covered ahead of the consumer, so a worker that is free while another computes the
          position the consumer needs computes the ones after it.
        """
        pool = self._pool
        assert pool is not None
        n = self._count
        lengths, frontier = self._consumer.lengths, self._consumer.frontier
        helping = max(self._cpu_seconds) >= _HELP_MIN_CPU_S
        window = max(self._limits)
        if helping:
            window = 2 * window + 2
            self._ahead = [window] * n
        else:
            self._ahead = [max(self._buffer, shared) for shared in self._shared_room]
        runs: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        due = [self._consumed[w] + self._ahead[w] - self._granted[w] for w in range(n)]
        for worker in sorted(range(n), key=self._outstanding.__getitem__):
            limit = self._limits[worker]
            free = limit - self._outstanding[worker]
            if free <= 0 or (self._outstanding[worker] and 2 * free < limit):
                continue
            if not helping:
                free = self._give(worker, worker, free, window, runs[worker])
                if self._outstanding[worker]:
                    continue  # others' classes only for a worker that would idle
            while free > 0:
                open_classes = [
                    c for c in range(n) if self._assigned[c] < min(lengths[c], frontier[c] + window)
                ]
                if not open_classes:
                    break
                cls = min(
                    open_classes, key=lambda c: (self._assigned[c] - frontier[c], c != worker)
                )
                share = max(1, free // len(open_classes))
                free -= share - self._give(worker, cls, share, window, runs[worker])
        for worker in range(n):
            # Credits due go with runs, else once a batch of them is due: each message costs
            # both processes a wake-up.
            credits = max(0, due[worker])
            if not runs[worker] and credits < self._credit_batch[worker]:
                credits = 0
            # Blocks the consumer dropped go back with the next runs or credits: a worker
            # writes into a block only once it has a credit to send what it wrote.
            if runs[worker] or credits or every_worker:
                released = self._recycled[worker].take_released()
                message = assign_message(self._generation, runs[worker], credits, released)
                pool.send(worker, message)
                self._granted[worker] += credits

    def _give(
        self, worker: int, cls: int, count: int, window: int, runs: list[tuple[int, int, int]]
    ) -> int:
        """Assigns ``worker`` up to ``count`` positions of class ``cls`` at most ``window``
        ahead of the consumer; returns how many of ``count`` are left."""
        consumer = self._consumer
        room = min(consumer.lengths[cls], consumer.frontier[cls] + window) - self._assigned[cls]
        given = min(room, count)
        if given <= 0:
            return count
        first = self._assigned[cls]
        runs.append((cls, first, given))
        self._runs[worker].append([cls, first, given])
        self._assigned[cls] = first + given
        self._outstanding[worker] += given
        return count - given

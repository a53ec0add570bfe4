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
  cost (small results already read several to a message); the parent files results by
  position, no tags needed.
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

Parent side, ``PositionDispatcher`` (shared by the ``N`` ``DispatchedClassIterator`` inputs of
the merge): plans runs and credits (``ASSIGN``), files results by position, restores by
re-planning from the consumer's positions (a new generation).

Worker side, ``DispatchWorkerLoop``: computes its runs in assignment order
(``positions.PositionReader``) and sends each result with its CPU seconds so far, results
already read that need no shared memory several to a message (``ELEMENTS``). An error is sent
for its position and the worker goes on with the next one.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import pickle
import time
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from grain_core._ipc import shm
from grain_core._ipc.errors import UnreadableElementError, WorkerDiedError, remote_error
from grain_core._ipc.pool import STOP_TIMEOUT_S, StallWatch, WorkerPool
from grain_core.config import config
from grain_core.dataset.base import DatasetIterator, IterDataset
from grain_core.dataset.mp.in_process import InProcessReader, WorkerPayoff, clock
from grain_core.dataset.mp.pickling import FIXED_SIZE_TYPES, dumps_message
from grain_core.dataset.mp.positions import ClassBatchesMapDataset, PositionReader, dispatch_view
from grain_core.dataset.mp.protocol import (
    ASSIGN,
    ELEMENT,
    ELEMENTS,
    ERROR,
    OVERDRAFT_BYTES,
    STATS_GENERATION,
    credit_batch,
    overdraft_room,
    receive_side_message,
    shared_ahead_room,
    stats_request_message,
)
from grain_core.dataset.mp.worker import (
    GROUP_S,
    WorkerLoop,
    WorkerSpec,
    lease_workers,
    release_workers,
    run_worker,
)
from grain_core.dataset.options import DatasetOptions, FilterRatioChecker
from grain_core.plugins import loaded_plugin_names

__all__ = [
    "ClassDispatcher",
    "ClassFrontiers",
    "DispatchWorkerLoop",
    "DispatchedClassIterator",
    "PositionDispatcher",
    "assign_message",
    "dispatchable",
    "worker_main",
]

#: CPU seconds of work a worker is committed to at once (it keeps a worker busy across the
#: parent's round trip without tying positions to a worker that turns out to be slow).
_RUN_TARGET_S = 0.01
#: CPU seconds an element must cost for free workers to help with other classes' positions.
_HELP_MIN_CPU_S = 0.01
#: Results between two updates of a worker's CPU cost (sooner once they cost _RUN_TARGET_S).
_LEARN_EVERY = 8
#: Elements between two filter-ratio checks of a class.
_FILTER_CHECK_EVERY = 256
#: Weight of the newest element time in a worker's running average.
_TIME_WEIGHT = 0.3


def dispatchable(ds: IterDataset[Any], count: int, sequential_slice: bool) -> bool:
    """Whether ``mp_prefetch`` over ``ds`` with ``count`` workers (and no ``worker_init_fn``)
    dispatches positions: ``ds`` has a ``dispatch_view``, the workers take strided shares, and
    ``grain_core.config.py_mp_prefetch_dispatch`` is on (off, each worker computes its own
    strided share: for transformations whose result depends on the worker computing it)."""
    return (
        not sequential_slice
        and bool(config.py_mp_prefetch_dispatch)
        and dispatch_view(ds, count) is not None
    )


# ----------------------------------------------------------------------------- messages
def assign_message(
    generation: int, runs: list[tuple[int, int, int]], credits: int, names: list[str]
) -> tuple[Any, ...]:
    """Control: runs ``(class, first slice index, count)`` to compute after those assigned
    before, ``credits`` more results to send, blocks ``names`` free again. A new
    ``generation`` first drops the runs not yet computed and the credits left."""
    return (ASSIGN, generation, runs, credits, names)


def elements_message(
    generation: int, values: list[Any], cpu_seconds: float, dropped: Sequence[str]
) -> tuple[Any, ...]:
    """Output: results of consecutive assigned positions, none in shared memory."""
    return (generation, ELEMENTS, values, cpu_seconds, [], dropped)


# ---------------------------------------------------------------------------- worker side
class DispatchWorkerLoop(WorkerLoop):
    """A worker of the dispatching engine.

    It computes the runs of positions the parent assigns, in assignment order, and sends each
    element with the CPU seconds the worker has used so far instead of a state (the parent knows every position). An
    error is sent for its position and the worker goes on with the next one: another class's
    positions queued behind it are still needed.

    It computes the positions assigned ahead (``PositionReader``: in its main thread while
    reads are CPU-bound, also while it waits for credits; on read threads while they wait on
    I/O); results are sent while it has credits, so the shared memory in flight stays bounded
    however long the runs, and small ones also on overdraft (``per_worker_buffer_size`` 0:
    never).

    Control: ``assign_message(generation, runs, credits, names)`` adds runs ``(class, first slice
    index, count)`` and credits and hands back blocks; a new generation first drops the runs
    not yet computed and the credits left.
    """

    def __init__(self, spec: WorkerSpec, control: Any, output: Any) -> None:
        super().__init__(spec, control, output)
        self._reader: Any = None
        self._pending = 0
        self._cpu_start = time.process_time()
        self._result_bytes = 0  # pickled, per result of the last message without blocks

    def _build_pipeline(self, ds: Any) -> None:
        spec = self._spec
        self._reader = self._it = PositionReader(ds, spec.index, spec.count, spec.options)
        self._cpu_start = time.process_time()  # start-up is not the cost of an element

    def _pipeline(self) -> Any:
        return None if self._reader is None else self._reader.pipeline

    def _has_work(self) -> bool:
        return self._pending > 0

    def _ask_for_credit(self) -> None:
        """The parent sends credits through the positions it waits for (``_unblock``)."""

    def _read_ahead(self) -> bool:
        # Positions assigned, no credit to send them: compute them now, as read threads would.
        return self._pending > 0 and self._reader is not None and self._reader.read_ahead()

    def _handle(self, message: tuple[Any, ...]) -> None:
        _, generation, runs, credits, names = message  # assign_message, the only kind
        shm.release_blocks(names)
        if generation != self._generation:
            self._generation = generation
            self._pending = 0
            self._reset_credits(0)
            if self._reader is not None:
                self._reader.reset()
        self._add_credits(credits)
        if runs:
            self._pending += sum(run[2] for run in runs)
            if self._reader is not None:
                self._reader.assign(runs)

    def _produce(self) -> None:
        if self._build_error is not None:
            self._pending -= 1
            self._take_credit(0)
            self._send_error(self._build_error)
            return
        # Elements read already (ahead, or in the block of the last one), that need no shared
        # memory, go together (for GROUP_S at most): small elements cost the parent a message
        # each.
        group: list[Any] = []
        deadline = time.perf_counter() + GROUP_S
        waiting, self._waiting = self._waiting, None
        while True:
            if waiting is None:
                self._pending -= 1
                try:
                    element = self._reader.next()
                except Exception as e:  # noqa: BLE001 - re-raised in the parent at its position
                    self._take_credit(0)
                    self._send_group(group)
                    self._send_error(e)
                    return
                tree, names = shm.copy_to_shm(element, self._min_shm_size)
                # Its size matters only for an overdraft.
                size = 0 if self._credits > 0 else self._size_for_overdraft(tree, names)
                if not self._take_credit(size):
                    self._waiting = (tree, names, size)
                    self._send_group(group)
                    return
            else:  # _can_produce found it may go now
                (tree, names, size), waiting = waiting, None
                self._take_credit(size)
            if names:
                self._send_group(group)
                self._send_result(tree, self._cpu_seconds(), names)
                return
            group.append(tree)
            if not (
                self._pending > 0
                and (self._credits > 0 or self._may_overdraw())
                and self._reader.ready()
                and time.perf_counter() < deadline
            ):
                self._send_group(group)
                return

    def _cpu_seconds(self) -> float:
        # The process's CPU time so far, read threads included: what the parent sizes this
        # worker's commitments by.
        return time.process_time() - self._cpu_start

    def _send_group(self, group: list[Any]) -> None:
        """Sends the elements of ``group`` (none in shared memory) in one message, or one
        message each when one of them cannot be pickled (that one is sent as its error)."""
        if not group:
            return
        cpu_seconds = self._cpu_seconds()
        dropped: Sequence[str] = shm.take_dropped()
        if len(group) > 1:
            message = elements_message(self._generation, group, cpu_seconds, dropped)
            try:
                data = dumps_message(message)
            except Exception:  # noqa: BLE001 - one of them cannot be pickled: each alone below
                pass
            else:
                self._write(data)
                self._result_bytes = len(data) // len(group)
                return
        for element in group:  # one, or one of them cannot be pickled
            self._send_result(element, cpu_seconds, [], dropped)
            dropped = ()

    def _send_result(
        self, tree: Any, cpu_seconds: float, names: list[str], dropped: Sequence[str] = ()
    ) -> None:
        """Sends one result (see ``_send_element``); one that cannot be pickled is sent as its
        error and the worker goes on with the next position."""
        size = self._send_element(tree, cpu_seconds, names, dropped)
        if size is not None and not names:
            self._result_bytes = size

    def _size_for_overdraft(self, tree: Any, names: list[str]) -> int | None:
        """The pickled size of result ``tree``; None (it waits for a credit) if its arrays
        are in blocks ``names``, it cannot be pickled, or the last results were too big to
        overdraw a few (such results are not pickled twice)."""
        if names or self._result_bytes > OVERDRAFT_BYTES // 4:
            return None
        if type(tree) in FIXED_SIZE_TYPES:
            return 0
        try:
            return len(pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001 - it is sent when a credit comes, and fails there
            return None


def worker_main(spec: WorkerSpec, control: Any, output: Any) -> None:
    """Entry point of a dispatching worker process."""
    run_worker(DispatchWorkerLoop, spec, control, output)


# ---------------------------------------------------------------------------- parent side
class ClassFrontiers:
    """What every dispatcher's parent side keeps of the ``N`` strided classes of the output:
    their lengths, the consumer's slice index in each, and the state each reports (that of
    its worker under strict rotation). ``PositionDispatcher`` (local workers) and
    ``remote.BlockDispatcher`` (a worker backend's) build on it.

    Args:
      mp_ds: The ``MultiprocessPrefetchIterDataset`` over a pipeline with a ``dispatch_view``.
    """

    def __init__(self, mp_ds: Any) -> None:
        self._mp_ds = mp_ds
        self._count = n = mp_ds.num_workers
        view = dispatch_view(mp_ds._parents[0], n)
        assert view is not None, "mp_prefetch dispatches only pipelines with a view"
        self._dispatch_view = view
        self._view = ds = view.reader
        # Batches of each worker's share: states count elements, as under strict rotation.
        self._batches = ds.map_parent if type(ds.map_parent) is ClassBatchesMapDataset else None
        total = len(ds.map_parent)
        self.lengths = [len(range(c, total, n)) for c in range(n)]
        self._allow_nones = ds.allow_nones
        self.frontier = [0] * n  # per class: next slice index for the consumer
        self._ended = [False] * n  # per class: the consumer was told it ended
        self._filter_counts = [[0, 0] for _ in range(n)]  # per class: seen, dropped
        self._checkers = [
            FilterRatioChecker(f"to_iter_dataset over {ds.map_parent!r}") for _ in range(n)
        ]

    def filtered_out(self, cls: int, value: Any, options: Any) -> bool:
        """Whether class ``cls``'s next ``value`` is a hole the consumer skips (None from a
        filter where the pipeline does not allow Nones), counting it for the filter-ratio
        check every ``_FILTER_CHECK_EVERY`` elements."""
        if self._allow_nones:
            return False
        counts = self._filter_counts[cls]
        counts[0] += 1
        if value is None:
            counts[1] += 1
        if counts[0] == _FILTER_CHECK_EVERY:
            self._checkers[cls].record(counts[0], counts[1], options)
            counts[:] = [0, 0]
        return value is None

    def state_index(self, cls: int) -> int:
        """Class ``cls``'s ``next_index`` as its worker reports it under strict rotation."""
        j = self.frontier[cls]
        if self._batches is None:
            return j
        return self._batches.elements_before(cls, j, self._ended[cls])

    def move_frontier(self, cls: int, next_index: int) -> None:
        """The consumer of class ``cls`` continues at ``next_index`` (a state's).

        Raises:
          IndexError: ``next_index`` is outside the class (or, for batches, not where one
            starts).
        """
        self._ended[cls] = False
        if self._batches is not None:
            elements = next_index
            next_index = self._batches.batches_before(cls, elements)
            # Restored where its worker had read every element: the share has ended.
            self._ended[cls] = elements == self._batches.elements_before(cls, next_index, True)
        length = self.lengths[cls]
        if not 0 <= next_index <= length:
            raise IndexError(
                f"Checkpoint `next_index` {next_index} is out of range [0, {length}] for "
                f"worker {cls} of {self._count} of {self._view.map_parent!r}: the "
                "checkpoint belongs to a different pipeline."
            )
        self.frontier[cls] = next_index


class PositionDispatcher(ClassFrontiers):
    """The parent's side: the worker processes, what each is computing, and the results
    waiting for the consumer, by ``(class, slice index)``. Shared by the ``N`` class iterators
    of one ``mp_prefetch`` iterator; holds none of them strongly, so an unclosed iterator is
    collected and its workers stopped.

    Args:
      mp_ds: The ``MultiprocessPrefetchIterDataset`` over a ``to_iter_dataset`` reader.
    """

    def __init__(self, mp_ds: Any) -> None:
        super().__init__(mp_ds)
        n = self._count
        ds = self._view
        self._buffer = max(1, mp_ds.options.per_worker_buffer_size)
        self._overdraft_allowed = mp_ds.options.per_worker_buffer_size > 0  # as its workers do
        # A worker always has its next position: waiting for the parent to hand one out
        # would cost it a round trip, and the parent a core, per element.
        self._min_run = max(2, self._buffer)
        self._max_run = max(self._min_run, ds.read_options.prefetch_buffer_size)
        self._assigned = [0] * n  # per class: next slice index not yet assigned
        self._held: dict[tuple[int, int], tuple[int, int, Any, list[str]]] = {}
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
        self._slots: list[Any] = [None] * n
        # Per worker: statistics requests sent, and the last one it answered.
        self._stats_requests = [0] * n
        self._stats_answered = [0] * n
        self._generation = 0
        self._restarted = False
        self._pool: WorkerPool | None = None
        self._finalizer: weakref.finalize | None = None
        self.error: BaseException | None = None
        self._open_iterators = 0
        # The position the consumer waits for and since when (``time.monotonic()``).
        self._waiting: tuple[tuple[int, int] | None, float] = (None, 0.0)
        # Results computed in this process instead (``in_process``), and while that is on
        # trial, what decides whether workers take over.
        self._in_process: InProcessReader | None = None
        self._payoff: WorkerPayoff | None = None

    # ------------------------------------------------------------------- consumer side
    def register(self, cls: int, iterator: DatasetIterator[Any]) -> None:
        """``iterator`` reads class ``cls`` and receives its worker's stage statistics. The
        workers run while an iterator registered here is open."""
        self._slots[cls] = weakref.ref(iterator)
        self._open_iterators += 1

    def unregister(self) -> None:
        """A registered iterator was closed; the last one stops the workers."""
        self._open_iterators -= 1
        if self._open_iterators > 0:
            return
        self._payoff = None
        if self._in_process is not None:
            self._in_process.close()
            self._in_process = None
        self._stop_workers()

    def _stop_workers(self) -> None:
        """Stops the workers, if they run (or keeps them for the next iterator), and drops the
        results they sent ahead."""
        if self._finalizer is not None:
            self._receive_last_stats()
            self._finalizer()  # the workers' blocks go with them
            self._finalizer = self._pool = None
            self._held.clear()
            self._recycled = [shm.RecycledBlocks() for _ in range(self._count)]

    def start(self, options: DatasetOptions) -> None:
        """Starts computing results: in this process first unless
        ``config.py_mp_prefetch_in_process`` is ``"never"`` (``"auto"``: until what they cost
        shows whether workers pay off, ``in_process.WorkerPayoff``), else in the workers."""
        if self._pool is not None or self._in_process is not None:
            return
        mode = config.py_mp_prefetch_in_process
        if mode == "never":
            self._start_workers(options)
            return
        self._in_process = InProcessReader(self._dispatch_view, options)
        if mode == "auto":
            self._payoff = WorkerPayoff(self._count, sum(self.lengths) - sum(self.frontier))

    def _start_workers(self, options: DatasetOptions) -> None:
        """Starts the workers (or takes those the last iterator left running) and gives them
        their first runs from the consumer's positions."""
        mp_ds = self._mp_ds
        plugins = loaded_plugin_names()

        def make_specs() -> list[WorkerSpec]:
            dataset, init_fn = mp_ds.payload()
            return [
                WorkerSpec(
                    index=w,
                    count=self._count,
                    init_fn=init_fn,
                    dataset=dataset,
                    sequential_slice=False,
                    state=None,
                    plugins=plugins,
                    options=options,
                    shm_prefix=WorkerPool.new_prefix(w),
                    pool_size=2 * self._buffer + 2,
                    buffer_size=mp_ds.options.per_worker_buffer_size,
                )
                for w in range(self._count)
            ]

        warm = mp_ds.warm_workers
        lease = lease_workers(
            warm, (worker_main, options, plugins), make_specs, worker_main, mp_ds.options
        )
        self._pool = lease.pool
        self._recycled = lease.recycled
        self._finalizer = weakref.finalize(
            self, release_workers, warm, lease, functools.partial(_held_blocks, self._held)
        )
        self._cpu_mark = [0.0] * self._count
        self._since_learned = [0] * self._count
        self._stats_requests = [0] * self._count
        self._stats_answered = [0] * self._count
        self._generation = lease.first_generation
        self.error = None
        self._forget_work()
        # Workers of an iterator before this one drop its work on hearing the new generation.
        self._assign(every_worker=lease.reused)

    def next_of(self, cls: int, options: DatasetOptions) -> Any:
        """The next element of class ``cls``.

        Raises:
          StopIteration: The class is exhausted.
          WorkerDiedError: A worker process ended.
          Exception: What computing the element raised in a worker (again on every call until
            the class is restored to another position).
        """
        if self.error is not None:
            raise self.error
        if self._in_process is not None:
            return self._next_in_process(cls, options)
        if self._pool is None:
            self.start(options)
            if self._in_process is not None:
                return self._next_in_process(cls, options)
        else:
            # Results held ahead of the consumer are the parent's too: a forked child that
            # reads them would go on from the parent's position with no worker behind it.
            self._pool.check_owner()
        if self._payoff is None:
            return self._next_from_workers(cls, options)
        start = time.perf_counter()
        value = self._next_from_workers(cls, options)
        if not self._payoff.delivered(time.perf_counter() - start):
            # Workers deliver more slowly than this process computes: it takes over again.
            self._payoff = None
            self._stop_workers()
            self._in_process = InProcessReader(self._dispatch_view, options)
        return value

    def _next_from_workers(self, cls: int, options: DatasetOptions) -> Any:
        """``next_of`` once the workers run."""
        held = self._held
        while True:
            j = self.frontier[cls]
            if j >= self.lengths[cls]:
                self._ended[cls] = True
                raise StopIteration
            result = held.get((cls, j))
            if result is None:
                self._pump(block=True, needed=(cls, j))
                continue
            worker, kind, value, names = result
            if kind == ERROR:
                raise value
            del held[(cls, j)]
            self.frontier[cls] = j + 1
            self._consumed[worker] += 1
            due = self._consumed[worker] + self._ahead[worker] - self._granted[worker]
            if due >= self._credit_batch[worker]:
                # Credits due: the worker may be waiting for them. A worker found ended here
                # is reported by the next call (``self.error``), after this element.
                with contextlib.suppress(WorkerDiedError, UnreadableElementError):
                    self._pump(block=False)
            if self.filtered_out(cls, value, options):
                continue
            return shm.open_from_shm(value, self._recycled[worker]) if names else value

    def _next_in_process(self, cls: int, options: DatasetOptions) -> Any:
        """The next element of class ``cls``, computed in this process; on trial
        (``WorkerPayoff``), the workers take over after it if they pay off.

        Raises:
          StopIteration: The class is exhausted.
          Exception: What computing the element raised (again on every call until the class
            is restored to another position).
        """
        reader = self._in_process
        assert reader is not None
        while True:
            j = self.frontier[cls]
            if j >= self.lengths[cls]:
                self._ended[cls] = True
                raise StopIteration
            payoff = self._payoff
            started = 0.0 if payoff is None else clock()
            value = reader.read(cls + j * self._count)
            self.frontier[cls] = j + 1
            if payoff is not None:
                workers = payoff.record(started, clock(), value)
                if workers is False:
                    self._payoff = None
                elif workers:  # the payoff goes on watching what they deliver
                    reader.close()
                    self._in_process = None
                    self._start_workers(options)
            if not self.filtered_out(cls, value, options):
                return value
            if self._in_process is None:
                return self.next_of(cls, options)

    def request_stats(self, worker: int) -> None:
        """Asks ``worker`` for its stage statistics (``stats.refresh_worker_stages``)."""
        if self._pool is not None and self.error is None:
            self._stats_requests[worker] += 1
            self._pool.send(worker, stats_request_message(self._stats_requests[worker]))

    def receive_stats(self, worker: int, deadline: float | None = None) -> None:
        """Receives what the workers send until ``worker`` has answered the last request (or
        a worker ended: its error is raised to the consumer, as by ``next_of``), or until
        ``time.monotonic()`` reaches ``deadline``."""
        pool = self._pool
        while (
            pool is not None
            and self.error is None
            and self._stats_answered[worker] < self._stats_requests[worker]
        ):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready: list[int] = []
            try:
                ready = pool.ready_workers(timeout)
                for w in ready:
                    self._receive(w)
            except (WorkerDiedError, UnreadableElementError) as e:
                self.error = e
            if not ready and deadline is not None:
                return

    def _receive_last_stats(self) -> None:
        """Before the workers stop: those whose statistics are tracked send their last ones
        (and trace spans). A worker busy in a long function gets the time shutting it down
        would give it."""
        tracked = []
        for worker, slot in enumerate(self._slots):
            iterator = None if slot is None else slot()
            if iterator is not None and "_stage_stats" in vars(iterator):
                tracked.append(worker)
                self.request_stats(worker)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in tracked:
            self.receive_stats(worker, deadline)

    def restore(self, cls: int, next_index: int) -> None:
        """Class ``cls`` continues at ``next_index`` (as ``state_index`` reports it).

        Raises:
          IndexError: ``next_index`` is outside the class (or, for batches, not where one
            starts).
          WorkerDiedError: A worker process ended before.
        """
        if isinstance(self.error, WorkerDiedError):
            raise self.error
        self.error = None  # an unreadable element: the new generation drops the rest of it
        self.move_frontier(cls, next_index)
        self._restarted = True  # runs are re-planned on the next pump, once for all classes

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
        try:
            ready = pool.ready_workers()
            if not ready and block:
                self._assign()
                watch = None
                if needed is not None:
                    self._unblock(*needed)
                    if self._waiting[0] != needed:
                        self._waiting = (needed, time.monotonic())
                    watch = StallWatch(
                        self._waiting[1], functools.partial(self._waiting_for, *needed)
                    )
                ready = pool.ready_workers(timeout=None, watch=watch)
            # One message per worker that sent something: what came meanwhile is read by the
            # next pump (a check per message would cost a system call each).
            for w in ready:
                self._receive(w)
        except (WorkerDiedError, UnreadableElementError) as e:
            self.error = e
            raise
        self._assign()

    def _waiting_for(self, cls: int, j: int) -> tuple[int | None, str]:
        """For the watchdog: the worker computing position ``(cls, j)``, and the position."""
        kind = "batch" if self._batches is not None else "position"
        what = f"{kind} {cls + j * self._count} of {self._view.map_parent!r}"
        for worker, runs in enumerate(self._runs):
            if any(run_cls == cls and first <= j < first + n for run_cls, first, n in runs):
                return worker, what
        return None, what

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
        for worker, _, _, names in self._held.values():
            self._recycled[worker].released.extend(names)
        self._held.clear()
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
        self._assigned = list(self.frontier)

    def _receive(self, worker: int) -> None:
        assert self._pool is not None
        generation, kind, value, cpu_total, names, dropped = self._pool.recv(worker, ready=True)
        recycled = self._recycled[worker]
        recycled.forget(dropped)
        if generation != self._generation:
            if generation == STATS_GENERATION:
                slot = self._slots[worker]
                iterator = None if slot is None else slot()
                answers = receive_side_message(
                    kind, value, cpu_total, iterator, self._warning_registry
                )
                if answers is not None:
                    self._stats_answered[worker] = answers
            else:
                recycled.released.extend(names)
            return
        if kind == ERROR:
            error = remote_error(value, worker, self._count)
            self._held[self._next_position(worker)] = (worker, ERROR, error, [])
            return
        if kind == ELEMENTS:
            for element in value:
                self._held[self._next_position(worker)] = (worker, ELEMENT, element, [])
        else:
            self._held[self._next_position(worker)] = (worker, ELEMENT, value, names)
        count = len(value) if kind == ELEMENTS else 1
        room = (
            0
            if names or not self._overdraft_allowed
            else overdraft_room(self._pool.last_message_bytes // count)
        )
        shared = shared_ahead_room(shm.shared_bytes(value)) if names else 0
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
        helping = max(self._cpu_seconds) >= _HELP_MIN_CPU_S
        window = max(self._limits)
        if helping:
            window = 2 * window + 2
            self._ahead = [window] * n
        else:
            self._ahead = [max(self._buffer, shared) for shared in self._shared_room]
        runs: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
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
                    c
                    for c in range(n)
                    if self._assigned[c] < min(self.lengths[c], self.frontier[c] + window)
                ]
                if not open_classes:
                    break
                cls = min(
                    open_classes, key=lambda c: (self._assigned[c] - self.frontier[c], c != worker)
                )
                share = max(1, free // len(open_classes))
                free -= share - self._give(worker, cls, share, window, runs[worker])
        for worker in range(n):
            credits = self._consumed[worker] + self._ahead[worker] - self._granted[worker]
            if credits < self._credit_batch[worker]:
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
        room = min(self.lengths[cls], self.frontier[cls] + window) - self._assigned[cls]
        given = min(room, count)
        if given <= 0:
            return count
        first = self._assigned[cls]
        runs.append((cls, first, given))
        self._runs[worker].append([cls, first, given])
        self._assigned[cls] = first + given
        self._outstanding[worker] += given
        return count - given


def _held_blocks(
    held: dict[tuple[int, int], tuple[int, int, Any, list[str]]],
) -> list[tuple[int, list[str]]]:
    """The blocks of the results in ``held`` (a dispatcher's, by position), by worker."""
    return [(worker, names) for worker, _, _, names in held.values() if names]


class ClassDispatcher(Protocol):
    """What a ``DispatchedClassIterator`` reads its class from: ``PositionDispatcher`` (local
    workers) or ``remote.BlockDispatcher`` (a worker backend's)."""

    def register(self, cls: int, iterator: DatasetIterator[Any]) -> None: ...

    def unregister(self) -> None: ...

    def start(self, options: DatasetOptions) -> None: ...

    def next_of(self, cls: int, options: DatasetOptions) -> Any: ...

    def state_index(self, cls: int) -> int: ...

    def restore(self, cls: int, next_index: int) -> None: ...

    def request_stats(self, worker: int) -> None: ...

    def receive_stats(self, worker: int) -> None: ...


class DispatchedClassIterator(DatasetIterator[Any]):
    """The elements of class ``index`` in order: one input of the parent-side interleave;
    state ``{"next_index": j}``, as the class's worker reports under strict rotation."""

    def __init__(self, dispatcher: ClassDispatcher, index: int) -> None:
        super().__init__()
        self._dispatcher = dispatcher
        self._index = index
        dispatcher.register(index, self)

    def __next__(self) -> Any:
        self._check_open()
        return self._dispatcher.next_of(self._index, self._ctx.dataset_options)

    def start_prefetch(self) -> None:
        if not self._closed:
            self._dispatcher.start(self._ctx.dataset_options)

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._dispatcher.state_index(self._index)}

    def request_worker_stages(self) -> None:
        """Asks worker ``index``, whose statistics this iterator receives, for them."""
        if not self._closed:
            self._dispatcher.request_stats(self._index)

    def receive_worker_stages(self) -> None:
        """Waits for worker ``index``'s answer."""
        self._dispatcher.receive_stats(self._index)

    def set_state(self, state: dict[str, Any]) -> None:
        self._dispatcher.restore(self._index, self._state_int(state, "next_index"))

    def close(self) -> None:
        if self._closed:
            return
        self._dispatcher.unregister()
        super().close()

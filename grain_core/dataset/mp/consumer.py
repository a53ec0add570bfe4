"""The consumer half of dispatch: the ``N`` strided classes of a dispatched ``mp_prefetch``
output, read in the consumer's order, whoever computes them.

``ClassConsumer`` keeps what every producer shares: each class's length and the consumer's
slice index in it (its frontier), the results filed by position ``(class, slice index)``, the
state each class reports (that of its worker under strict rotation), filter counting, and
restoring. A ``Producer`` fills the held results: the local worker processes
(``dispatch.LocalWorkers``), a worker backend's workers (``remote.BackendWorkers``) or this
process (``in_process.InProcessProducer``). With ``MultiprocessingOptions.in_process``
``"auto"``, the in-process policy (``in_process.WorkerPayoff``) swaps one for the other
between two results: the frontiers stay, so output and checkpoints do not change.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from grain_core._ipc.errors import UnreadableElementError, WorkerDiedError
from grain_core.config import config
from grain_core.dataset.iterator import DatasetIterator, pipeline_observer
from grain_core.dataset.mp.in_process import InProcessProducer, WorkerPayoff, clock
from grain_core.dataset.mp.pickling import EngineInput
from grain_core.dataset.mp.protocol import ERROR
from grain_core.dataset.mp.share_index import share_next_index, share_state_at
from grain_core.dataset.options import DatasetOptions

__all__ = ["ClassConsumer", "DispatchedClassIterator", "Producer"]

#: Elements between two filter-ratio checks of a class.
_FILTER_CHECK_EVERY = 256


class Producer(Protocol):
    """What computes a ``ClassConsumer``'s positions and files the results in its ``held``:
    ``(kind, value, tag)`` by ``(class, slice index)``, kind ``protocol.ELEMENT`` or
    ``protocol.ERROR`` (the exception raised at that position), ``tag`` the producer's."""

    def start(self, options: DatasetOptions) -> None:
        """Starts computing from the consumer's frontiers."""

    def fill(self, cls: int, j: int) -> None:
        """Files at least one more result, making sure ``(cls, j)`` comes (waits for it).

        Raises:
          WorkerDiedError: A worker ended (or every worker of a backend was lost).
          UnreadableElementError: A result cannot be unpickled.
        """

    def take(self, tag: Any, value: Any) -> Any:
        """The consumer took the result held as ``(ELEMENT, value, tag)``: its value."""

    def restart(self) -> None:
        """The frontiers moved (a restored state): results held or on their way are dropped
        and the work starts again from the frontiers."""

    def stop(self) -> None:
        """Stops computing and drops what is held."""

    def request_stats(self, worker: int) -> None:
        """Asks ``worker`` for its stage statistics (none where it sends none)."""

    def receive_stats(self, worker: int) -> None:
        """Waits for ``worker``'s answer to the last request."""


class ClassConsumer:
    """The classes of one ``mp_prefetch`` iterator, shared by its ``N`` class iterators (see
    the module docstring); holds none of them strongly, so an unclosed iterator is collected
    and its producer stopped.

    Args:
      engine: The pipeline (it has a ``dispatch_view``) and options.
      make_workers: Builds the producer that computes on workers (given this consumer).
      in_process: ``"never"``, ``"auto"`` or ``"always"`` (``MultiprocessingOptions.
        in_process``); None: ``config.py_mp_prefetch_in_process``.
    """

    def __init__(
        self,
        engine: EngineInput,
        make_workers: Callable[[ClassConsumer], Producer],
        in_process: str | None,
    ) -> None:
        self.engine = engine
        self.count = n = engine.num_workers
        view = engine.nodes.dispatch_view(engine.pipeline, n)
        assert view is not None, "mp_prefetch dispatches only pipelines with a view"
        self.view = view
        self.reader = ds = view.reader
        # Batches of each worker's share: states count elements, as under strict rotation.
        self.batches = view.class_batches
        total = len(ds.map_parent)
        self.lengths = [len(range(c, total, n)) for c in range(n)]
        self.frontier = [0] * n  # per class: next slice index for the consumer
        self.held: dict[tuple[int, int], tuple[int, Any, Any]] = {}
        self.slots: list[weakref.ref[DatasetIterator[Any]] | None] = [None] * n
        #: The error every later call raises (a worker ended), until a restore clears it.
        self.error: BaseException | None = None
        self._ended = [False] * n  # per class: the consumer was told it ended
        self._filter_counts = [[0, 0] for _ in range(n)]  # per class: seen, dropped
        self._checkers = [ds.holes_checker() for _ in range(n)]
        self._make_workers = make_workers
        self._mode = in_process or config.py_mp_prefetch_in_process
        self._producer: Producer | None = None
        self._on_workers = False
        self._payoff: WorkerPayoff | None = None  # while the in-process decision is open
        self._open_iterators = 0

    # ------------------------------------------------------------------- class iterators
    def register(self, cls: int, iterator: DatasetIterator[Any]) -> None:
        """``iterator`` reads class ``cls`` (and receives its worker's statistics); the
        producer runs while one registered is open."""
        self.slots[cls] = weakref.ref(iterator)
        self._open_iterators += 1

    def unregister(self) -> None:
        """A registered iterator was closed; the last one stops the producer."""
        self._open_iterators -= 1
        if self._open_iterators == 0:
            self._payoff = None
            self._swap(None)

    def start(self, options: DatasetOptions) -> None:
        """Starts computing: on the workers unless the in-process mode says this process
        (``"auto"``: until what results cost shows whether workers pay off)."""
        if self._producer is not None:
            return
        if self._mode == "never":
            self._swap(self._make_workers(self), options)
            return
        if self._mode == "auto":
            self._payoff = WorkerPayoff(self.count, sum(self.lengths) - sum(self.frontier))
        self._swap(InProcessProducer(self), options)

    def _swap(self, producer: Producer | None, options: DatasetOptions | None = None) -> None:
        """Stops the producer and starts ``producer`` from the frontiers."""
        if self._producer is not None:
            self._producer.stop()
        self.held.clear()
        self._producer = producer
        self._on_workers = producer is not None and not isinstance(producer, InProcessProducer)
        if producer is not None:
            assert options is not None
            producer.start(options)

    def next_of(self, cls: int, options: DatasetOptions) -> Any:
        """The next element of class ``cls``.

        Raises:
          StopIteration: The class is exhausted.
          WorkerDiedError: A worker ended.
          Exception: What computing the element raised (again on every call until the class
            is restored to another position).
        """
        if self.error is not None:
            raise self.error
        if self._producer is None:
            self.start(options)
        if self._payoff is None:
            return self._next(cls, options)
        # The trial in this process reads ``in_process.clock`` (tests fake it); what workers
        # deliver is timed on the wall clock.
        timer = time.perf_counter if self._on_workers else clock
        started = timer()
        value = self._next(cls, options)
        self._decide(started, timer(), value, options)
        return value

    def _next(self, cls: int, options: DatasetOptions) -> Any:
        producer = self._producer
        assert producer is not None
        held = self.held
        while True:
            j = self.frontier[cls]
            if j >= self.lengths[cls]:
                self._ended[cls] = True
                raise StopIteration
            entry = held.get((cls, j))
            if entry is None:
                try:
                    producer.fill(cls, j)
                except (WorkerDiedError, UnreadableElementError) as e:
                    self.error = e
                    raise
                continue
            kind, value, tag = entry
            if kind == ERROR:
                raise value
            del held[(cls, j)]
            self.frontier[cls] = j + 1
            value = producer.take(tag, value)
            if not self._filtered_out(cls, value, options):
                return value

    def _decide(self, started: float, ended: float, value: Any, options: DatasetOptions) -> None:
        """The in-process policy: swaps producers when the measurements say so."""
        payoff = self._payoff
        assert payoff is not None
        if self._on_workers:
            if not payoff.delivered(ended - started):
                # Workers deliver more slowly than this process computes: it takes over.
                self._payoff = None
                self._swap(InProcessProducer(self), options)
            return
        workers = payoff.record(started, ended, value)
        if workers is False:
            self._payoff = None
        elif workers:  # the payoff goes on watching what they deliver
            self._swap(self._make_workers(self), options)

    def _filtered_out(self, cls: int, value: Any, options: DatasetOptions) -> bool:
        """Whether class ``cls``'s next ``value`` is a hole the consumer skips (None from a
        filter where the pipeline does not allow Nones), counting it for the filter-ratio
        check every ``_FILTER_CHECK_EVERY`` elements."""
        if self.reader.allow_nones:
            return False
        counts = self._filter_counts[cls]
        counts[0] += 1
        if value is None:
            counts[1] += 1
        if counts[0] == _FILTER_CHECK_EVERY:
            self._checkers[cls].record(counts[0], counts[1], options)
            counts[:] = [0, 0]
        return value is None

    def request_stats(self, worker: int) -> None:
        if self._producer is not None and self.error is None:
            self._producer.request_stats(worker)

    def receive_stats(self, worker: int) -> None:
        if self._producer is not None:
            self._producer.receive_stats(worker)

    # ------------------------------------------------------------------------- states
    def state_index(self, cls: int) -> int:
        """Class ``cls``'s ``next_index`` as its worker reports it under strict rotation."""
        j = self.frontier[cls]
        if self.batches is None:
            return j
        return self.batches.elements_before(cls, j, self._ended[cls])

    def restore(self, cls: int, next_index: int) -> None:
        """Class ``cls`` continues at ``next_index`` (a state's).

        Raises:
          IndexError: ``next_index`` is outside the class (or, for batches, not where one
            starts).
          WorkerDiedError: A worker ended before.
        """
        if isinstance(self.error, WorkerDiedError):
            raise self.error
        self.error = None  # an unreadable element: the new generation drops the rest of it
        self._ended[cls] = False
        if self.batches is not None:
            elements = next_index
            next_index = self.batches.batches_before(cls, elements)
            # Restored where its worker had read every element: the share has ended.
            self._ended[cls] = elements == self.batches.elements_before(cls, next_index, True)
        length = self.lengths[cls]
        if not 0 <= next_index <= length:
            raise IndexError(
                f"Checkpoint `next_index` {next_index} is out of range [0, {length}] for "
                f"worker {cls} of {self.count} of {self.reader.map_parent!r}: the "
                "checkpoint belongs to a different pipeline."
            )
        self.frontier[cls] = next_index
        if self._producer is not None:
            self._producer.restart()


class DispatchedClassIterator(DatasetIterator[Any]):
    """The elements of class ``index`` in order: one input of the parent-side interleave;
    state ``{"next_index": j}``, as the class's worker reports under strict rotation."""

    def __init__(self, consumer: ClassConsumer, index: int) -> None:
        super().__init__()
        self._consumer = consumer
        self._index = index
        consumer.register(index, self)
        pipeline_observer().receives_worker_stages(
            self, self.request_worker_stages, self.receive_worker_stages
        )

    def __next__(self) -> Any:
        self._check_open()
        return self._consumer.next_of(self._index, self._ctx.dataset_options)

    def start_prefetch(self) -> None:
        if not self._closed:
            self._consumer.start(self._ctx.dataset_options)

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._consumer.state_index(self._index)}

    def request_worker_stages(self) -> None:
        """Asks worker ``index``, whose statistics this iterator receives, for them."""
        if not self._closed:
            self._consumer.request_stats(self._index)

    def receive_worker_stages(self) -> None:
        """Waits for worker ``index``'s answer."""
        self._consumer.receive_stats(self._index)

    def set_state(self, state: dict[str, Any]) -> None:
        self._consumer.restore(self._index, self._state_int(state, "next_index"))
        self._start_when_restored()

    def _get_next_index(self) -> int:
        consumer = self._consumer
        return share_next_index(consumer.engine, self._index, consumer.count, self.get_state())

    def _set_next_index(self, index: int) -> None:
        consumer = self._consumer
        self.set_state(share_state_at(consumer.engine, self._index, consumer.count, index))

    def close(self) -> None:
        if self._closed:
            return
        self._consumer.unregister()
        super().close()

"""``mp_prefetch`` over ``to_iter_dataset()``: positions go to whichever worker is free.

When the pipeline given to ``mp_prefetch`` is a MapDataset read by ``to_iter_dataset`` (the
usual ``….map(f).batch(n).to_iter_dataset().mp_prefetch(…)``, and the DataLoader's Map/Batch
pipelines), every element is a function of its index alone, so any worker can compute any
element. So is every element of ``….to_iter_dataset().map(g).batch(n)`` without filters
(IterDataset ``map`` steps, at most one ``batch`` at the end): worker ``w`` maps and batches
its share ``map_parent[w::N]``; ``ClassBatchesMapDataset`` lays the elements of those batches
out by position, and each worker applies the steps to what it read (``dispatch_view``).
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
  ``per_worker_buffer_size``, so the shared memory in flight is that of strict rotation.
  Small results may overdraw: ``SMALL_AHEAD`` of them, ``OVERDRAFT_BYTES`` pickled at most
  (``grain_core._worker``), so a worker need not wait for the parent's wake-up after each,
  and its credits go half its overdraft at a time (``credit_batch``), not one per element
  (a rotating worker asks when it runs out, ``WANTS_CREDIT``; a dispatching one waits for
  the consumer to need its next result, so credits come sooner).
* Cheap elements: each worker takes its own class (contiguous reads, results in the consumer's
  order). Elements that cost more than ``_HELP_MIN_CPU_S`` of CPU: free workers take the
  classes least covered ahead of the consumer, with a wider window and as many credits, so a
  worker that is free while another computes the position the consumer needs computes the
  ones after it.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_core import _shm
from grain_core._worker import (
    ELEMENT,
    ELEMENTS,
    ERROR,
    STATS_GENERATION,
    UnreadableElementError,
    WorkerDiedError,
    WorkerPool,
    WorkerSpec,
    credit_batch,
    overdraft_room,
)
from grain_core.dataset.base import (
    DatasetIterator,
    IterDataset,
    MapDataset,
    MultiprocessingContext,
    _transform_fn,
    stop_iteration_error,
    transform_name,
)
from grain_core.dataset.batch import BatchIterDataset, has_holes_upstream
from grain_core.dataset.map import MapIterDataset
from grain_core.dataset.options import DatasetOptions, FilterRatioChecker
from grain_core.dataset.prefetch import PrefetchIterDataset, read_index
from grain_core.dataset.with_options import WithOptionsIterDataset
from grain_core.options import ReadOptions

__all__ = [
    "AssignedPositionsMapDataset",
    "ClassBatchesMapDataset",
    "DispatchView",
    "DispatchedClassIterator",
    "PositionDispatcher",
    "PositionReader",
    "dispatch_view",
    "dispatchable",
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
    from grain_core.config import config

    return (
        not sequential_slice
        and bool(config.py_mp_prefetch_dispatch)
        and dispatch_view(ds, count) is not None
    )


@dataclasses.dataclass(frozen=True)
class DispatchView:
    """How dispatching workers compute a pipeline by position.

    Attributes:
      reader: A ``to_iter_dataset`` reader: position ``c + j * count`` of its MapDataset is
        what worker ``c`` reads for its ``j``-th element under strict rotation. Read threads
        compute it.
      steps: The IterDataset steps after ``to_iter_dataset``, applied to each value read in the
        worker's main thread, one at a time as strict rotation applies them (their functions
        need not be thread-safe); None when there are none.
    """

    reader: PrefetchIterDataset
    steps: _StepsAfterReading | None


def dispatch_view(ds: IterDataset[Any], count: int) -> DispatchView | None:
    """How workers compute pipeline ``ds`` by position, or None when they cannot.

    * ``….to_iter_dataset()``: its reader.
    * ``….to_iter_dataset()`` followed by IterDataset ``map`` steps and at most one ``batch``
      at the end, over a MapDataset without filters: a reader of each position's element
      (with a batch, of the elements of each share's batch: ``ClassBatchesMapDataset``), then
      the steps. After a filter the k-th element of a share depends on which elements were
      dropped before it, so those pipelines are not dispatched.
    """
    node = _past_options(ds)
    batch = node if type(node) is BatchIterDataset else None
    if batch is not None:
        node = _past_options(batch.parents[0])
    transforms = []
    while type(node) is MapIterDataset:
        transforms.append(node.transform)  # type: ignore[attr-defined]
        node = _past_options(node.parents[0])
    if type(node) is not PrefetchIterDataset:
        return None
    reader: PrefetchIterDataset = node
    if batch is None and not transforms:
        return DispatchView(reader, None)
    source = reader.map_parent
    if has_holes_upstream(source) is not None:
        return None
    steps = _StepsAfterReading(
        source,
        transforms[::-1],
        batch_fn=None if batch is None else batch.batch_fn,
        allow_nones=reader.allow_nones,
    )
    read_options = reader.read_options
    if batch is not None:
        source = ClassBatchesMapDataset(
            source, count, batch.batch_size, drop_remainder=batch.drop_remainder
        )
        read_options = _in_batches(read_options, batch.batch_size)
    # The steps see every value read, None included (they decide what it means).
    return DispatchView(
        PrefetchIterDataset(source, read_options=read_options, allow_nones=True), steps
    )


def _in_batches(options: ReadOptions, batch_size: int) -> ReadOptions:
    """``options`` reading batches of ``batch_size`` elements ahead instead of elements: the
    same memory read ahead as a worker that reads its share element by element."""
    if options.prefetch_buffer_size == 0:
        return options
    batches = -(-options.prefetch_buffer_size // batch_size)
    return ReadOptions(num_threads=min(options.num_threads, batches), prefetch_buffer_size=batches)


def _past_options(ds: IterDataset[Any]) -> IterDataset[Any]:
    """The first node at or above ``ds`` that is not ``WithOptionsIterDataset``: options set in
    the pipeline reach the workers with the parent's (``mp_prefetch`` collects them)."""
    while type(ds) is WithOptionsIterDataset:
        ds = ds.parents[0]
    return ds


class _StepsAfterReading:
    """IterDataset ``map`` steps and a final ``batch`` applied to a value read (an element, or
    the list of a batch's elements), as strict rotation's worker applies them.

    Args:
      source: The MapDataset ``to_iter_dataset`` reads (named in errors).
      transforms: The functions or ``Map`` transformations of the steps, in pipeline order.
      batch_fn: The batch's function, or None without a batch.
      allow_nones: Those of ``to_iter_dataset``: without, a ``None`` of ``source`` (which a
        worker reading its share in order would skip) is an error.
    """

    def __init__(
        self,
        source: MapDataset[Any],
        transforms: Sequence[Any],
        *,
        batch_fn: Callable[[Sequence[Any]], Any] | None,
        allow_nones: bool,
    ) -> None:
        self._source = source
        self._fns = [_transform_fn(t, "map") for t in transforms]
        self._batch_fn = batch_fn
        self._allow_nones = allow_nones
        names = [f"Map({transform_name(t)})" for t in transforms]
        #: The steps as the execution summary names them.
        self.label = " > ".join([*names, "Batch"] if batch_fn is not None else names)

    def __call__(self, value: Any) -> Any:
        if self._batch_fn is None:
            return self._element(value)
        return self._batch_fn([self._element(x) for x in value])

    def _element(self, x: Any) -> Any:
        if x is None and not self._allow_nones:
            raise ValueError(
                f"An element of {self._source!r} is None (filtered), which a worker reading "
                "its share in order skips but one computing the steps after "
                "`to_iter_dataset()` by position cannot. Use grain.config.update("
                '"py_mp_prefetch_dispatch", False), or filter with `filter` before '
                "`to_iter_dataset()`."
            )
        for fn in self._fns:
            try:
                x = fn(x)
            except StopIteration as e:
                raise stop_iteration_error(transform_name(fn)) from e
        return x


class ClassBatchesMapDataset(MapDataset[Any]):
    """The elements of the batches strict rotation makes of ``to_iter_dataset().batch(…)``:
    worker ``c`` of ``count`` batches its share ``parent[c::count]``. Index ``c + j * count``
    is the list of the elements of worker ``c``'s batch ``j``, laid out as the shares of
    elements are, so any worker can read any batch.

    Args:
      parent: The MapDataset ``to_iter_dataset`` reads.
      count: The number of workers (shares).
      batch_size / drop_remainder: Those of the batch.
    """

    def __init__(
        self,
        parent: MapDataset[Any],
        count: int,
        batch_size: int,
        *,
        drop_remainder: bool,
    ) -> None:
        super().__init__(parent)
        self._count = count
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder
        total = len(parent)
        self._share_lengths = [len(range(c, total, count)) for c in range(count)]
        # Shares differ by at most one element, so their batch counts by at most one: the
        # indices c + j * count of all batches are 0 .. len - 1.
        self._length = sum(self._batches_in(n) for n in self._share_lengths)

    def _batches_in(self, elements: int) -> int:
        if self._drop_remainder:
            return elements // self._batch_size
        return -(-elements // self._batch_size)

    def elements_before(self, share: int, batch: int, ended: bool) -> int:
        """Elements of share ``share`` read before its batch ``batch`` (its state under strict
        rotation: ``{"next_index": …}`` counts elements), or all of them once the share
        ``ended`` (a dropped remainder is read before the share ends)."""
        length = self._share_lengths[share]
        return length if ended else min(batch * self._batch_size, length)

    def batches_before(self, share: int, elements: int) -> int:
        """The batch of share ``share`` that starts after its first ``elements`` elements.

        Raises:
          IndexError: No batch starts there (the state belongs to another pipeline).
        """
        length = self._share_lengths[share]
        if elements == length:
            return self._batches_in(length)  # a dropped remainder was read too
        if not 0 <= elements <= length or elements % self._batch_size:
            raise IndexError(
                f"Checkpoint `next_index` {elements} is not where a batch of "
                f"{self._batch_size} starts in worker {share}'s {length} elements: the "
                "checkpoint belongs to a different pipeline."
            )
        return elements // self._batch_size

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        if not 0 <= index < self._length:
            raise IndexError(f"Index {index} is out of range for {self._length} batches.")
        share, batch = index % self._count, index // self._count
        first = batch * self._batch_size
        stop = min(first + self._batch_size, self._share_lengths[share])
        positions = range(share + first * self._count, share + stop * self._count, self._count)
        parent = self._parents[0]
        try:
            return parent._getitems(positions)
        except Exception:  # noqa: BLE001 - read one by one to name the element that fails
            return [read_index(parent, p) for p in positions]

    def __repr__(self) -> str:
        return (
            f"ClassBatchesMapDataset(workers={self._count}, batch_size={self._batch_size}, "
            f"drop_remainder={self._drop_remainder})"
        )


# ------------------------------------------------------------------------------ worker side
class _Runs:
    """Runs of assigned positions: ``(first index, first parent position, length)``."""

    __slots__ = ("runs", "length")

    def __init__(self) -> None:
        self.runs: collections.deque[tuple[int, int, int]] = collections.deque()
        self.length = 0


class AssignedPositionsMapDataset(MapDataset[Any]):
    """The positions of ``parent`` assigned to one worker, in assignment order.

    Index ``k`` is the ``k``-th assigned position. Runs ``(class, first slice index, count)``
    of the ``count``-strided classes are appended as they arrive; runs already read are
    dropped, so the memory stays that of the runs in flight. Copies (stage timing makes them)
    share the runs.
    """

    def __init__(self, parent: MapDataset[Any], count: int) -> None:
        super().__init__(parent)
        self._count = count
        self._assigned = _Runs()

    def add(self, runs: Sequence[tuple[int, int, int]]) -> None:
        assigned = self._assigned
        for cls, first, length in runs:
            assigned.runs.append((assigned.length, cls + first * self._count, length))
            assigned.length += length

    def drop_before(self, index: int) -> None:
        """Forgets the runs that end before ``index`` (already read)."""
        runs = self._assigned.runs
        while runs and runs[0][0] + runs[0][2] <= index:
            runs.popleft()

    def position(self, index: int) -> int:
        """The parent index of index ``index``.

        Raises:
          IndexError: If ``index`` is not assigned (or was dropped).
        """
        for start, first, length in self._assigned.runs:
            if start <= index < start + length:
                return first + (index - start) * self._count
        raise IndexError(f"Index {index} is not among the positions assigned to this worker.")

    def __len__(self) -> int:
        return self._assigned.length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        return read_index(self._parents[0], self.position(index))

    def _getitems(self, indices: Any) -> list[Any]:
        return self._parents[0]._getitems(self._positions(indices))  # type: ignore[no-any-return]

    def _positions(self, indices: Any) -> np.ndarray:
        if not (isinstance(indices, range) and indices.step == 1):
            return np.array([self.position(int(k)) for k in indices], np.int64)
        lo, hi = indices.start, indices.stop
        parts = []
        for start, first, length in self._assigned.runs:
            a, b = max(lo, start), min(hi, start + length)
            if a < b:
                parts.append(np.arange(a - start, b - start, dtype=np.int64) * self._count + first)
        out = np.concatenate(parts) if parts else np.empty(0, np.int64)
        if len(out) != len(indices):
            raise IndexError(f"Indices {indices} are not all assigned to this worker.")
        return out

    def __repr__(self) -> str:
        # One row of the execution summary, above its parent's.
        return f"AssignedPositionsMapDataset(classes={self._count})"


class PositionReader:
    """A worker's reader of its assigned positions of ``ds`` (a ``to_iter_dataset`` reader),
    in order, with that reader's read-ahead (in this thread while reads are CPU-bound, on
    its read threads while they wait on I/O), which stops at the last position assigned.
    ``None`` (filtered) elements are returned: the parent skips them in order.

    Args:
      ds: The pipeline given to ``mp_prefetch``.
      index / count: This worker and the number of workers (= classes).
      options: The parent's ``DatasetOptions``.
    """

    def __init__(
        self,
        ds: IterDataset[Any],
        index: int,
        count: int,
        options: DatasetOptions | None,
    ) -> None:
        from grain_core.dataset.mp_prefetch import with_shared_memory_output

        view = dispatch_view(with_shared_memory_output(ds), count)
        assert view is not None, "the parent dispatches only pipelines with a view"
        self._source = view.reader.map_parent
        self._read_options = view.reader.read_options
        self._steps = view.steps
        self._context = MultiprocessingContext(index, count)
        self._count = count
        self._options = options
        self._open()

    def _open(self) -> None:
        self._positions = AssignedPositionsMapDataset(self._source, self._count)
        reader = PrefetchIterDataset(
            self._positions, read_options=self._read_options, allow_nones=True
        )
        self.iterator = it = iter(reader)
        #: What ``next`` reads from: the reader, then the steps (a stage of their own).
        self.pipeline: DatasetIterator[Any] = (
            it if self._steps is None else _StepsIterator(it, self._steps)
        )
        # One context for the whole pipeline, set once it is built.
        self.pipeline._ctx.mp_context = self._context
        if self._options is not None:
            self.pipeline._merge_dataset_options(self._options)

    def assign(self, runs: Sequence[tuple[int, int, int]]) -> None:
        """Appends runs ``(class, first slice index, count)`` and starts reading them."""
        self._positions.drop_before(self.iterator.get_state()["next_index"])
        self._positions.add(runs)
        self.iterator.source_extended()

    def reset(self) -> None:
        """Drops every position not yet returned (the parent restored a state)."""
        self.pipeline.close()
        self._open()

    def ready(self) -> bool:
        """Whether the next assigned position is read already."""
        return self.iterator.buffered()

    def read_ahead(self) -> bool:
        """Reads assigned positions ahead in this thread when no read thread does (see
        ``PrefetchDatasetIterator.read_ahead``); returns whether it read any."""
        return self.iterator.read_ahead()

    def next(self) -> Any:
        """The element at the next assigned position.

        Raises:
          Exception: What computing it raised; the position is then skipped.
        """
        it = self.iterator
        before = it.get_state()["next_index"]
        try:
            return next(self.pipeline)
        except Exception:
            if it.get_state()["next_index"] == before:  # reading it failed: skip it
                it.set_state({"next_index": before + 1})
            raise

    def close(self) -> None:
        self.pipeline.close()


class _StepsIterator(DatasetIterator[Any]):
    """A dispatching worker's steps after ``to_iter_dataset`` applied to the values its reader
    reads, in its main thread; one stage in the execution summary."""

    def __init__(self, reader: DatasetIterator[Any], steps: _StepsAfterReading) -> None:
        super().__init__(reader)
        self._steps = steps
        self._stage_label = steps.label

    def __next__(self) -> Any:
        return self._steps(next(self._parents[0]))

    def get_state(self) -> dict[str, Any]:
        return self._parents[0].get_state()  # type: ignore[no-any-return]

    def set_state(self, state: dict[str, Any]) -> None:
        self._parents[0].set_state(state)


# ------------------------------------------------------------------------------ parent side
class PositionDispatcher:
    """The parent's side: the worker processes, what each is computing, and the results
    waiting for the consumer, by ``(class, slice index)``. Shared by the ``N`` class iterators
    of one ``mp_prefetch`` iterator; holds none of them strongly, so an unclosed iterator is
    collected and its workers stopped.

    Args:
      mp_ds: The ``MultiprocessPrefetchIterDataset`` over a ``to_iter_dataset`` reader.
    """

    def __init__(self, mp_ds: Any) -> None:
        self._mp_ds = mp_ds
        self._count = n = mp_ds.num_workers
        view = dispatch_view(mp_ds._parents[0], n)
        assert view is not None, "mp_prefetch dispatches only pipelines with a view"
        self._view = ds = view.reader
        # Batches of each worker's share: states count elements, as under strict rotation.
        self._batches = ds.map_parent if type(ds.map_parent) is ClassBatchesMapDataset else None
        total = len(ds.map_parent)
        self.lengths = [len(range(c, total, n)) for c in range(n)]
        self._allow_nones = ds.allow_nones
        self._buffer = max(1, mp_ds.options.per_worker_buffer_size)
        self._overdraft_allowed = mp_ds.options.per_worker_buffer_size > 0  # as its workers do
        # A worker always has its next position: waiting for the parent to hand one out
        # would cost it a round trip, and the parent a core, per element.
        self._min_run = max(2, self._buffer)
        self._max_run = max(self._min_run, ds.read_options.prefetch_buffer_size)
        self.frontier = [0] * n  # per class: next slice index for the consumer
        self._ended = [False] * n  # per class: the consumer was told it ended
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
        self._ahead = self._buffer  # results a worker may send beyond those consumed
        self._cpu_seconds = [0.0] * n  # per worker: average CPU seconds per element (0: unknown)
        # Per worker: its CPU time when its average was last updated, and results since.
        self._cpu_mark = [0.0] * n
        self._since_learned = [0] * n
        self._limits = [self._min_run] * n
        # Per worker: results it may send beyond its credits, judged by its last message.
        self._overdraft_room = [0] * n
        self._filter_counts = [[0, 0] for _ in range(n)]  # per class: seen, dropped
        self._checkers = [
            FilterRatioChecker(f"to_iter_dataset over {ds.map_parent!r}") for _ in range(n)
        ]
        self._recycled = [_shm.RecycledBlocks() for _ in range(n)]
        self._warning_registry: dict[Any, Any] = {}
        self._slots: list[Any] = [None] * n
        self._generation = 0
        self._restarted = False
        self._pool: WorkerPool | None = None
        self._finalizer: weakref.finalize | None = None
        self.error: BaseException | None = None
        self._open_iterators = 0

    # ------------------------------------------------------------------- consumer side
    def register(self, cls: int, iterator: DatasetIterator[Any]) -> None:
        """``iterator`` reads class ``cls`` and receives its worker's stage statistics. The
        workers run while an iterator registered here is open."""
        self._slots[cls] = weakref.ref(iterator)
        self._open_iterators += 1

    def unregister(self) -> None:
        """A registered iterator was closed; the last one stops the workers."""
        self._open_iterators -= 1
        if self._open_iterators == 0 and self._finalizer is not None:
            self._finalizer()  # the workers' blocks go with them
            self._finalizer = self._pool = None
            self._held.clear()
            self._recycled = [_shm.RecycledBlocks() for _ in range(self._count)]

    def start(self, options: DatasetOptions) -> None:
        """Starts the workers, unless they are running, and gives them their first runs."""
        if self._pool is not None:
            return
        mp_ds = self._mp_ds
        dataset, init_fn = mp_ds.payload()
        from grain_core.dataset.mp_prefetch import loaded_plugin_names

        plugins = loaded_plugin_names()
        specs = [
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
                dispatch=True,
                buffer_size=mp_ds.options.per_worker_buffer_size,
            )
            for w in range(self._count)
        ]
        self._pool = pool = WorkerPool(specs)
        self._finalizer = weakref.finalize(self, pool.shutdown)
        self._cpu_mark = [0.0] * self._count
        self._since_learned = [0] * self._count
        self._generation = 0
        self.error = None
        self._forget_work()
        self._assign()

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
        if self._pool is None:
            self.start(options)
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
            due = self._consumed[worker] + self._ahead - self._granted[worker]
            if due >= self._credit_batch[worker]:
                self._pump(block=False)  # credits due: the worker may be waiting for them
            if not self._allow_nones:
                counts = self._filter_counts[cls]
                counts[0] += 1
                if value is None:
                    counts[1] += 1
                if counts[0] == _FILTER_CHECK_EVERY:
                    self._checkers[cls].record(counts[0], counts[1], options)
                    counts[:] = [0, 0]
                if value is None:
                    continue
            return _shm.open_from_shm(value, self._recycled[worker]) if names else value

    def state_index(self, cls: int) -> int:
        """Class ``cls``'s ``next_index`` as its worker reports it under strict rotation."""
        j = self.frontier[cls]
        if self._batches is None:
            return j
        return self._batches.elements_before(cls, j, self._ended[cls])

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
                if needed is not None:
                    self._unblock(*needed)
                ready = pool.ready_workers(timeout=None)
            # One message per worker that sent something: what came meanwhile is read by the
            # next pump (a check per message would cost a system call each).
            for w in ready:
                self._receive(w)
        except (WorkerDiedError, UnreadableElementError) as e:
            self.error = e
            raise
        self._assign()

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
            self._pool.send(worker, ("assign", self._generation, runs, credits, released))
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
                from grain_core.dataset.mp_prefetch import receive_side_message

                slot = self._slots[worker]
                iterator = None if slot is None else slot()
                receive_side_message(kind, value, iterator, self._warning_registry)
            else:
                recycled.released.extend(names)
            return
        if kind == ERROR:
            from grain_core.dataset.mp_prefetch import remote_error

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
        self._overdraft_room[worker] = room
        self._credit_batch[worker] = credit_batch(self._buffer, room)
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
        longest = max(self._max_run, self._overdraft_room[worker])
        fit = longest if average <= 0.0 else int(_RUN_TARGET_S / average)
        self._limits[worker] = max(self._min_run, min(longest, fit))

    def _assign(self, every_worker: bool = False) -> None:
        """Hands out positions and credits.

        A worker gets more positions once half its commitment is free (or it is idle), so
        runs are not handed out one element at a time. Each class is covered at most
        ``window`` positions ahead of the consumer, and a worker may send as many results as
        the consumer has taken from it plus ``ahead``:

        * Cheap elements: the window is the largest commitment and ``ahead`` is
          ``per_worker_buffer_size``, as in strict rotation. Workers take their own class,
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
        self._ahead = ahead = self._buffer
        if helping:
            window = self._ahead = ahead = 2 * window + 2
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
            credits = self._consumed[worker] + ahead - self._granted[worker]
            if credits < self._credit_batch[worker]:
                credits = 0
            # Blocks the consumer dropped go back with the next runs or credits: a worker
            # writes into a block only once it has a credit to send what it wrote.
            if runs[worker] or credits or every_worker:
                released = self._recycled[worker].take_released()
                message = ("assign", self._generation, runs[worker], credits, released)
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


class DispatchedClassIterator(DatasetIterator[Any]):
    """The elements of class ``index`` in order: one input of the parent-side interleave;
    state ``{"next_index": j}``, as the class's worker reports under strict rotation."""

    def __init__(self, dispatcher: PositionDispatcher, index: int) -> None:
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

    def set_state(self, state: dict[str, Any]) -> None:
        self._dispatcher.restore(self._index, int(state["next_index"]))

    def close(self) -> None:
        if self._closed:
            return
        self._dispatcher.unregister()
        super().close()

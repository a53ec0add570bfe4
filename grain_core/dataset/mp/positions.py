"""What dispatching workers compute: a pipeline read by position.

When the pipeline given to ``mp_prefetch`` is a MapDataset read by ``to_iter_dataset`` (the
usual ``….map(f).batch(n).to_iter_dataset().mp_prefetch(…)``, and the DataLoader's Map/Batch
pipelines), every element is a function of its index alone, so any worker can compute any
element. So is every element of ``….to_iter_dataset().map(g).batch(n)`` without filters
(IterDataset ``map`` steps, at most one ``batch`` at the end): worker ``w`` maps and batches
its share ``map_parent[w::N]``; ``ClassBatchesMapDataset`` lays the elements of those batches
out by position, and each worker applies the steps to what it read (``dispatch_view``).

A worker reads the positions assigned to it (``AssignedPositionsMapDataset``, runs appended as
they arrive) in order with the reader's read-ahead (``PositionReader``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_core.dataset.base import (
    DatasetIterator,
    IterDataset,
    MapDataset,
    MultiprocessingContext,
    _transform_fn,
    stop_iteration_error,
    transform_name,
)
from grain_core.dataset.ops.batch import BatchIterDataset, has_holes_upstream
from grain_core.dataset.ops.map import MapIterDataset
from grain_core.dataset.ops.shm_batch import with_shared_memory_output
from grain_core.dataset.options import DatasetOptions
from grain_core.dataset.prefetch import PrefetchIterDataset, read_index
from grain_core.dataset.with_options import WithOptionsIterDataset
from grain_core.options import ReadOptions

__all__ = [
    "AssignedPositionsMapDataset",
    "ClassBatchesMapDataset",
    "DispatchView",
    "PositionReader",
    "dispatch_obstacle",
    "dispatch_view",
    "read_steps",
]


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
    view = _view_or_obstacle(ds, count)
    return view if isinstance(view, DispatchView) else None


def dispatch_obstacle(ds: IterDataset[Any]) -> str | None:
    """What keeps ``ds`` from being computed by position (``dispatch_view``): the node, said
    for a user; None when nothing does."""
    view = _view_or_obstacle(ds, 1)
    return None if isinstance(view, DispatchView) else view


def _view_or_obstacle(ds: IterDataset[Any], count: int) -> DispatchView | str:
    node = _past_options(ds)
    batch = node if type(node) is BatchIterDataset else None
    if batch is not None:
        node = _past_options(batch.parents[0])
    transforms = []
    while type(node) is MapIterDataset:
        transforms.append(node.transform)  # type: ignore[attr-defined]
        node = _past_options(node.parents[0])
    if type(node) is not PrefetchIterDataset:
        return (
            f"{node!r} ({type(node).__name__}): only a MapDataset read by to_iter_dataset(), "
            "then IterDataset map steps and at most one final batch, are computed by position"
        )
    reader: PrefetchIterDataset = node
    if batch is None and not transforms:
        return DispatchView(reader, None)
    source = reader.map_parent
    holes = has_holes_upstream(source)
    if holes is not None:
        return (
            f"{type(holes).__name__} above to_iter_dataset(), followed by IterDataset steps: "
            "which elements it drops decides what each later position holds"
        )
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
      shared_memory: A final batch writes into shared memory (local workers; a remote
        worker's results travel by its backend).
    """

    def __init__(
        self,
        ds: IterDataset[Any],
        index: int,
        count: int,
        options: DatasetOptions | None,
        shared_memory: bool = True,
    ) -> None:
        view = dispatch_view(with_shared_memory_output(ds) if shared_memory else ds, count)
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
        self.pipeline = read_steps(it, self._steps)
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


def read_steps(
    reader: DatasetIterator[Any], steps: _StepsAfterReading | None
) -> DatasetIterator[Any]:
    """What a dispatched pipeline's results are read from: ``reader`` (of a
    ``DispatchView``'s positions), then the view's ``steps`` (a stage of their own)."""
    return reader if steps is None else _StepsIterator(reader, steps)


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

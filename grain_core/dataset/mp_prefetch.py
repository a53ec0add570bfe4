"""``IterDataset.mp_prefetch``: the pipeline runs in worker processes, merged in strict rotation.

Worker ``w`` of ``N`` runs a copy of the pipeline in which, on every path from the output to the
sources, the first sliceable node reads only its share: normally the MapDataset→IterDataset
boundary (``to_iter_dataset``), re-pointed at ``map_parent[w::N]``. The graph is rebuilt for the
worker; nothing the user holds is mutated. The parent takes one element from each worker in turn
(``0, 1, …, N-1, 0, …``), blocking on a slow worker rather than skipping it, and skips workers
that are exhausted, so the output never depends on timing; with only 1:1 transformations after
the slice point it equals the single-process output.

When ``ds`` is a MapDataset read by ``to_iter_dataset`` (every element a function of its index),
the same output and state are produced by handing positions to whichever worker is free
(``grain_core.dataset.mp_dispatch``), so a worker on a slower core does not hold back the others
(``config.py_mp_prefetch_dispatch = False`` keeps each worker on its share).

The merge is an ``InterleaveIterDataset`` with one slot per worker, so the state is the interleave
state (Grain's layout) with one worker pipeline state per slot. Every element arrives together with
its worker's state right after producing it, so ``get_state`` never talks to the workers, and
``set_state`` restores the workers in place, without restarting them.
"""

from __future__ import annotations

import collections
import copy
import functools
import io
import itertools
import pickle
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_core import _shm, _tree
from grain_core._worker import (
    ELEMENT,
    END,
    PICKLED_ELEMENTS,
    STATS,
    STATS_GENERATION,
    WANTS_CREDIT,
    WARNING,
    UnreadableElementError,
    WorkerDiedError,
    WorkerPool,
    WorkerSpec,
    credit_batch,
    overdraft_room,
    unreadable_element_error,
)
from grain_core.dataset.base import (
    DatasetIterator,
    IterDataset,
    MapDataset,
    MultiprocessingContext,
    _WithSeedMapDataset,
)
from grain_core.dataset.batch import (
    STACKS_COLUMN_BLOCKS,
    BatchIterDataset,
    BatchMapDataset,
    make_batch,
)
from grain_core.dataset.interleave import InterleaveIterDataset
from grain_core.dataset.map import (
    FilterMapDataset,
    MapMapDataset,
    MapWithIndexMapDataset,
    RandomMapMapDataset,
)
from grain_core.dataset.options import DatasetOptions
from grain_core.dataset.prefetch import PrefetchIterDataset
from grain_core.dataset.source import ColumnBlock, RangeMapDataset, SourceMapDataset
from grain_core.dataset.stats import attach_worker_stages
from grain_core.dataset.with_options import WithOptionsIterDataset
from grain_core.options import MultiprocessingOptions
from grain_core.sharding import ShardOptions, even_split

__all__ = [
    "MultiprocessPrefetchIterDataset",
    "build_worker_iterator",
    "loaded_plugin_names",
    "make_batch_in_shared_memory",
    "mp_prefetch",
    "remote_error",
    "shared_memory_batch_fn",
    "slice_for_worker",
    "with_shared_memory_output",
]

# MapDataset nodes that keep every index in place, so a contiguous block of their source is the
# same block of their output (what ``sequential_slice`` needs).
_POSITION_PRESERVING = (
    MapMapDataset,
    MapWithIndexMapDataset,
    RandomMapMapDataset,
    FilterMapDataset,
    _WithSeedMapDataset,
)


def mp_prefetch(
    ds: IterDataset[Any],
    options: MultiprocessingOptions | None = None,
    worker_init_fn: Callable[[int, int], None] | None = None,
    sequential_slice: bool = False,
) -> IterDataset[Any]:
    """Runs ``ds`` in ``options.num_workers`` processes (``ds`` itself when that is 0).

    On free-threaded CPython (GIL disabled) threads run in parallel too, so the workers are
    threads instead (``multithread_prefetch`` over a deep copy of ``ds`` per thread, the same
    output order) and ``worker_init_fn`` is ignored with a warning.

    Args:
      ds: The pipeline to run in workers.
      options: Worker count and per-worker buffer; default 10 workers.
      worker_init_fn: Called as ``fn(worker_index, worker_count)`` in each worker before the
        pipeline is unpickled.
      sequential_slice: Give each worker a contiguous block of the source instead of a strided
        share (only for element-wise MapDataset pipelines above the source).
    """
    if options is None:
        options = MultiprocessingOptions(num_workers=10)
    if options.num_workers == 0:
        return ds
    if not _gil_enabled():
        from grain_core.dataset.multithread import multithread_prefetch

        if worker_init_fn is not None:
            warnings.warn(
                "mp_prefetch runs its workers as threads on free-threaded Python (the GIL is "
                "disabled), so worker_init_fn is ignored.",
                RuntimeWarning,
                stacklevel=3,
            )
        return multithread_prefetch(
            ds,
            options.num_workers,
            options.per_worker_buffer_size,
            sequential_slice,
            copy_per_thread=True,
        )
    return MultiprocessPrefetchIterDataset(
        ds, options, worker_init_fn=worker_init_fn, sequential_slice=sequential_slice
    )


def _gil_enabled() -> bool:
    """False only on a free-threaded CPython running with the GIL disabled."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


def _upstream_options(ds: IterDataset[Any]) -> DatasetOptions | None:
    """The ``DatasetOptions`` of every ``WithOptionsIterDataset`` in the subtree of ``ds``,
    merged so that the most downstream explicitly set value wins (None if there are none)."""
    merged: DatasetOptions | None = None
    queue: list[Any] = [ds]
    seen: set[int] = set()
    while queue:  # breadth first: nearer the output comes first and wins
        node = queue.pop(0)
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, WithOptionsIterDataset):
            merged = node.options if merged is None else merged.merge(node.options)
        queue.extend(p for p in getattr(node, "_parents", ()) if isinstance(p, IterDataset))
    return merged


class MultiprocessPrefetchIterDataset(IterDataset[Any]):
    """The pipeline ``parent`` run by worker processes (see module docstring)."""

    def __init__(
        self,
        parent: IterDataset[Any],
        options: MultiprocessingOptions,
        *,
        worker_init_fn: Callable[[int, int], None] | None = None,
        sequential_slice: bool = False,
    ) -> None:
        super().__init__(parent)
        self.options = options
        self.worker_init_fn = worker_init_fn
        self.sequential_slice = sequential_slice
        self._payload: tuple[bytes, bytes | None] | None = None

    @property
    def num_workers(self) -> int:
        return self.options.num_workers

    def payload(self) -> tuple[bytes, bytes | None]:
        """The cloudpickled pipeline and ``worker_init_fn``, computed once.

        Raises:
          Exception: The pickling error, with a note naming the first node that cannot be
            pickled.
        """
        if self._payload is None:
            dataset = _pickle_pipeline(self._parents[0])
            init = None if self.worker_init_fn is None else _pickle_init_fn(self.worker_init_fn)
            self._payload = (dataset, init)
        return self._payload

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_payload": None}

    def __iter__(self) -> DatasetIterator[Any]:
        from grain_core.dataset import mp_dispatch

        make: Callable[[int], DatasetIterator[Any]]
        # What a worker_init_fn sets up may differ by worker: element k then has to come from
        # worker k % N, as in a single strided share each, for the output to be deterministic.
        if self.worker_init_fn is None and mp_dispatch.dispatchable(
            self._parents[0], self.num_workers, self.sequential_slice
        ):
            make = functools.partial(
                mp_dispatch.DispatchedClassIterator, mp_dispatch.PositionDispatcher(self)
            )
        else:
            make = functools.partial(_ProcessPrefetchIterator, self)
        workers = [_MergeInputIterDataset(make, w) for w in range(self.num_workers)]
        # Strict rotation that skips exhausted workers is an interleave with one slot per
        # worker; the worker processes are the read-ahead, so no input threads.
        it = iter(InterleaveIterDataset(workers, cycle_length=len(workers), iter_buffer_size=0))
        it._stage_label = f"MultiprocessPrefetch(num_workers={self.num_workers})"  # type: ignore[attr-defined]
        # Options set upstream apply in the workers (they are part of the pickled pipeline)
        # and, collected here, to the parent's side of the pipeline too, as in Grain.
        options = _upstream_options(self._parents[0])
        if options is not None:
            it._merge_dataset_options(options)
        return it

    def __repr__(self) -> str:
        return (
            f"MultiprocessPrefetchIterDataset(num_workers={self.num_workers}, "
            f"per_worker_buffer_size={self.options.per_worker_buffer_size}, "
            f"sequential_slice={self.sequential_slice})"
        )


# --------------------------------------------------------------------------- worker graph
def slice_for_worker(
    ds: IterDataset[Any], index: int, count: int, sequential: bool = False
) -> IterDataset[Any]:
    """Returns worker ``index`` of ``count``'s copy of ``ds``, re-sliced at its first sliceable
    node on every path. The nodes of ``ds`` are left untouched.

    Raises:
      ValueError: If a path reaches an IterDataset source that cannot be sliced, or
        ``sequential`` is asked for a pipeline it cannot honour.
    """
    if count == 1:
        return ds
    return _rebuild(ds, index, count, sequential)


def _rebuild(node: Any, index: int, count: int, sequential: bool) -> Any:
    if isinstance(node, PrefetchIterDataset):
        parent = node.map_parent
        if sequential:
            start, end = _sequential_block(parent, index, count)
            return node.with_parent(parent.slice(slice(start, end)))
        return node.with_parent(parent.slice(slice(index, None, count)))
    sl = slice(index, None, count)
    with_slice = getattr(node, "with_slice", None)
    if with_slice is not None:
        return with_slice(sl)
    if hasattr(node, "set_slice"):
        # Datasets over lists of inputs (interleave, multi-file readers) slice that list.
        clone = copy.copy(node)
        clone.set_slice(sl)
        return clone
    parents = node._parents
    if not parents or not all(isinstance(p, IterDataset) for p in parents):
        raise ValueError(
            f"Cannot slice `IterDataset` source {node!r} for {count} workers: it has no "
            "`set_slice`. Build the pipeline from a MapDataset with `to_iter_dataset()` (or a "
            "sliceable dataset), or use a single worker."
        )
    clone = copy.copy(node)
    clone._parents = tuple(_rebuild(p, index, count, sequential) for p in parents)
    return clone


def _sequential_block(ds: MapDataset[Any], index: int, count: int) -> tuple[int, int]:
    node = ds
    while isinstance(node, _POSITION_PRESERVING):
        node = node._parents[0]
    if not isinstance(node, (SourceMapDataset, RangeMapDataset)):
        raise ValueError(
            "sequential_slice needs the MapDataset part of the pipeline to keep positions "
            "(source, map, random_map, map_with_index, filter); "
            f"{type(node).__name__} changes them. Use the default strided slicing."
        )
    return even_split(len(ds), ShardOptions(index, count))


def make_batch_in_shared_memory(values: Sequence[Any]) -> Any:
    """``make_batch`` that stacks large numeric array leaves straight into shared memory.

    Used as the batch function of a batch that is the last step inside a worker: the batch is
    written once, into a block the parent maps without copying. Small, string and object
    leaves are batched as usual (strings are not truncated, objects stay Python objects).

    Raises:
      ValueError: As ``make_batch``.
    """
    if (
        len(values) < 2
        or isinstance(values, ColumnBlock)  # columns: the transport moves the large ones
        or not isinstance(values[0], (dict, list, tuple, np.ndarray))
    ):
        return make_batch(values)
    try:
        return _tree.map_structure(_stack_into_shared_memory, *values)
    except ValueError:
        return make_batch(values)  # raises the same error, described for the user


setattr(make_batch_in_shared_memory, STACKS_COLUMN_BLOCKS, True)


def _stack_into_shared_memory(*leaves: Any) -> Any:
    first = leaves[0]
    if (
        _shm.AVAILABLE
        and isinstance(first, np.ndarray)
        and first.dtype.kind not in "OUSV"
        and first.nbytes * len(leaves) >= _shm.DEFAULT_MIN_SHM_SIZE
        and all(map(isinstance, leaves, itertools.repeat(np.ndarray)))
        and len({(x.shape, x.dtype) for x in leaves}) == 1
    ):
        try:
            out = _shm.SharedMemoryArray((len(leaves), *first.shape), first.dtype)
        except _shm.SharedMemoryFullError as e:
            _shm.warn_full(e)
            return make_batch(list(leaves))
        if first.ndim:
            # The leaves end to end along their first axis are the batch's bytes: one C loop,
            # where np.stack expands every leaf in Python first (1.4x slower at 256 rows).
            np.concatenate(leaves, axis=0, out=out.reshape(-1, *first.shape[1:]))
        else:
            np.stack(leaves, out=out)
        return out
    return make_batch(list(leaves))


def with_shared_memory_output(ds: IterDataset[Any]) -> IterDataset[Any]:
    """``ds`` with its final batch writing into shared memory, when it ends with a batch (an
    IterDataset one, or a MapDataset one read by ``to_iter_dataset``) whose function allows
    it: the default one, or one with ``enable_shared_memory_output()``."""
    if isinstance(ds, BatchIterDataset):
        fn = shared_memory_batch_fn(ds.batch_fn)
        if fn is None:
            return ds
        return BatchIterDataset(
            ds._parents[0], ds.batch_size, drop_remainder=ds.drop_remainder, batch_fn=fn
        )
    if isinstance(ds, PrefetchIterDataset) and isinstance(ds.map_parent, BatchMapDataset):
        fn = shared_memory_batch_fn(ds.map_parent.batch_fn)
        if fn is None:
            return ds
        return ds.with_parent(ds.map_parent.with_batch_fn(fn))
    return ds


def shared_memory_batch_fn(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """``fn`` writing its output into shared memory (``make_batch`` or a function with
    ``enable_shared_memory_output()``), or None when it cannot."""
    if fn is make_batch:
        return make_batch_in_shared_memory
    if hasattr(fn, "enable_shared_memory_output"):
        fn = copy.copy(fn)
        fn.enable_shared_memory_output()
        return fn
    return None


def build_worker_iterator(
    ds: IterDataset[Any],
    index: int,
    count: int,
    sequential: bool,
    options: DatasetOptions | None,
) -> DatasetIterator[Any]:
    """Builds worker ``index``'s iterator with its multiprocessing context and options.

    ``options`` are the parent's: they already hold the options set in this pipeline, merged
    with those set downstream of ``mp_prefetch``, so they win.
    """
    # Before slicing: a worker's slice of a MapDataset batch is a slice over that batch.
    it = iter(slice_for_worker(with_shared_memory_output(ds), index, count, sequential))
    it._ctx.mp_context = MultiprocessingContext(index, count)
    if options is not None:
        it._merge_dataset_options(options)
    return it


# ----------------------------------------------------------------------------- pickling
def _pickle_pipeline(ds: IterDataset[Any]) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(ds)  # type: ignore[no-any-return]
    except Exception as e:
        node = _first_unpicklable_node(ds)
        if node is not None:
            e.add_note(
                f"Dataset: {node!r} cannot be pickled! Everything in an mp_prefetch pipeline "
                "is sent to worker processes: make its transformations picklable (module-level "
                "functions or classes, no open files, locks or generators)."
            )
        raise


def _pickle_init_fn(init_fn: Callable[[int, int], None]) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(init_fn)  # type: ignore[no-any-return]
    except Exception as e:
        e.add_note(
            f"worker_init_fn {init_fn!r} cannot be pickled! It is sent to every worker "
            "process: make it a module-level function (or a picklable callable) that opens "
            "what it needs (files, locks, connections) inside the worker."
        )
        raise


def _first_unpicklable_node(root: Any) -> Any:
    """The most upstream node that fails to pickle on its own (other nodes stubbed out)."""
    import cloudpickle

    order: list[Any] = []
    seen: set[int] = set()

    def visit(node: Any) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        for parent in getattr(node, "_parents", ()):
            visit(parent)
        order.append(node)

    visit(root)

    class _OneNodePickler(cloudpickle.Pickler):  # type: ignore[misc]
        def __init__(self, target: Any) -> None:
            super().__init__(io.BytesIO())
            self._target = target

        def persistent_id(self, obj: Any) -> Any:
            if obj is not self._target and isinstance(obj, (MapDataset, IterDataset)):
                return id(obj)
            return None

    for node in order:
        try:
            _OneNodePickler(node).dump(node)
        except Exception:  # noqa: BLE001 - this is the search for the failure
            return node
    return None


def loaded_plugin_names() -> list[str] | None:
    """Names of the plugins the parent loaded (workers load the same), or None if it has
    not loaded any yet."""
    from grain_core.plugins import _manager

    reg = _manager._registry
    if reg is None:
        return None
    return [
        r.name for r in reg.reports if r.status == "loaded" and r.name != _manager.BUILTIN_PLUGIN
    ]


def receive_side_message(
    kind: int, value: Any, iterator: DatasetIterator[Any] | None, registry: dict[Any, Any]
) -> None:
    """Takes a worker's message from outside the element stream (``STATS_GENERATION``):
    statistics go to ``iterator`` (if it is still there), a warning is issued again in this
    process under its filters, ``registry`` (one per iterator) showing a warning at one place
    once across all workers."""
    if kind == STATS:
        if iterator is not None:
            attach_worker_stages(iterator, value)
    elif kind == WARNING:
        category, text, filename, lineno = value
        warnings.warn_explicit(text, category, filename, lineno, registry=registry)


def remote_error(payload: tuple[Any, ...], index: int, count: int) -> BaseException:
    """The exception a worker sent (``_worker._error_message``), noted with its traceback."""
    exc_bytes, type_name, message, tb = payload
    error: BaseException | None = None
    if exc_bytes is not None:
        try:
            error = pickle.loads(exc_bytes)
        except Exception:  # noqa: BLE001 - fall back to a text description
            error = None
    if error is None:
        error = RuntimeError(f"{type_name}: {message}")
    error.add_note(
        f"Raised in mp_prefetch worker process {index} of {count}. Worker traceback:\n{tb}"
    )
    return error


# ----------------------------------------------------------------------------- iterator
class _MergeInputIterDataset(IterDataset[Any]):
    """Input ``index`` of an mp_prefetch's parent-side interleave: the output of worker
    ``index`` (rotation), or of class ``index`` (dispatch); ``make(index)`` reads it."""

    def __init__(self, make: Callable[[int], DatasetIterator[Any]], index: int) -> None:
        super().__init__()
        self.make = make
        self.index = index

    def __iter__(self) -> DatasetIterator[Any]:
        return self.make(self.index)

    def __repr__(self) -> str:
        return f"_MergeInputIterDataset(index={self.index})"


class _ProcessPrefetchIterator(DatasetIterator[Any]):
    """Reads one worker's output; its state is the worker pipeline's state after the last
    element handed out. The process starts on the first ``next``/``start_prefetch``."""

    def __init__(self, mp_ds: MultiprocessPrefetchIterDataset, index: int) -> None:
        super().__init__()
        self._mp_ds = mp_ds
        self._index = index
        self._count = mp_ds.num_workers
        # Credits: the buffer, returned as elements are handed out (a buffer of 0 asks for no
        # read-ahead at all: one credit per request). Small elements also go beyond them, on
        # the worker's overdraft (``_worker``), and while they do, credits go back in
        # batches (``credit_batch``).
        self._buffer = mp_ds.options.per_worker_buffer_size
        self._grant_batch = credit_batch(self._buffer)
        self._pool: WorkerPool | None = None
        self._finalizer: weakref.finalize | None = None
        self._state: Any = None
        self._exhausted = False
        self._generation = 0
        self._outstanding = 0
        self._error: BaseException | None = None
        # Blocks of elements the consumer has dropped go back with the next credit.
        self._recycled = _shm.RecycledBlocks()
        self._warning_registry: dict[Any, Any] = {}
        # Elements received, not handed out yet, each pickled with its state.
        self._received: collections.deque[bytes] = collections.deque()

    def _start(self) -> None:
        mp_ds = self._mp_ds
        dataset, init_fn = mp_ds.payload()
        spec = WorkerSpec(
            index=self._index,
            count=self._count,
            init_fn=init_fn,
            dataset=dataset,
            sequential_slice=mp_ds.sequential_slice,
            state=self._state,
            plugins=loaded_plugin_names(),
            options=self._ctx.dataset_options,
            shm_prefix=WorkerPool.new_prefix(self._index),
            pool_size=2 * self._buffer + 2,
            buffer_size=self._buffer,
        )
        self._pool = pool = WorkerPool([spec])
        self._finalizer = weakref.finalize(self, pool.shutdown)
        if not self._exhausted:
            self._grant(self._buffer)

    def _grant(self, credits: int) -> None:
        if credits > 0:
            assert self._pool is not None
            self._pool.send(0, ("credit", credits, self._recycled.take_released()))
            self._outstanding += credits

    def start_prefetch(self) -> None:
        if self._pool is None and not self._closed:
            self._start()

    def __next__(self) -> Any:
        self._check_open()
        if self._error is not None:
            raise self._error
        if self._exhausted:
            raise StopIteration
        if self._received:
            return self._hand_out_pickled()
        if self._pool is None:
            self._start()
        pool = self._pool
        assert pool is not None
        if self._outstanding == 0 and not self._buffer:
            self._grant(1)  # on request only
        while True:
            try:
                generation, kind, element, state, names, dropped = pool.recv(0)
            except (WorkerDiedError, UnreadableElementError) as e:
                self._error = e
                raise
            self._recycled.forget(dropped)
            if generation == self._generation:
                if kind != WANTS_CREDIT:
                    break
                # Everything it sent before was handed out, so what is outstanding here is
                # its credits now; more than it had then: credits were on their way, which
                # let it go on (or it asks again).
                if self._outstanding <= element:
                    self._grant(self._buffer - self._outstanding)
                continue
            if generation == STATS_GENERATION:
                receive_side_message(kind, element, self, self._warning_registry)
                continue
            self._recycled.released.extend(names)  # produced before the last set_state
        if kind == PICKLED_ELEMENTS:
            self._received.extend(element)
            if self._buffer:
                room = overdraft_room(max(map(len, element)))
                self._grant_batch = credit_batch(self._buffer, room)
            return self._hand_out_pickled()
        if kind == ELEMENT:  # in shared memory
            self._grant_batch = credit_batch(self._buffer)
            self._handed_out(state)
            return _shm.open_from_shm(element, self._recycled) if names else element
        self._outstanding -= 1
        if kind == END:
            self._state = state
            self._exhausted = True
            raise StopIteration
        self._error = remote_error(element, self._index, self._count)
        raise self._error

    def _hand_out_pickled(self) -> Any:
        blob = self._received.popleft()
        try:
            element, state = pickle.loads(blob)
        except Exception as e:
            self._received.clear()  # the stream stops at this element
            self._error = unreadable_element_error(f"{self._index} of {self._count}", e)
            raise self._error from e
        self._handed_out(state)
        return element

    def _handed_out(self, state: Any) -> None:
        """An element goes to the consumer; ``state`` is the worker's after it."""
        self._state = state
        self._outstanding -= 1
        owed = self._buffer - self._outstanding
        if owed >= self._grant_batch:
            self._grant(owed)

    def get_state(self) -> dict[str, Any]:
        if self._state is None:
            # Before the first element: build this worker's pipeline here only to read its
            # initial state; no process starts.
            mp_ds = self._mp_ds
            worker_ds = slice_for_worker(
                mp_ds._parents[0], self._index, self._count, mp_ds.sequential_slice
            )
            it = iter(worker_ds)
            self._state = it.get_state()
            it.close()
        return copy.deepcopy(self._state)

    def set_state(self, state: dict[str, Any]) -> None:
        if isinstance(self._error, WorkerDiedError):
            raise self._error
        self._state = copy.deepcopy(state)
        self._exhausted = False
        self._error = None
        self._received.clear()
        if self._pool is None:
            return
        released = self._drop_messages_in_flight()
        self._generation += 1
        self._pool.send(0, ("set_state", self._generation, self._state, self._buffer, released))
        self._outstanding = self._buffer

    def _drop_messages_in_flight(self) -> list[str]:
        """Reads what the worker has sent and the consumer will now never see, and returns the
        blocks to hand back with ``set_state``: restoring again and again without reading
        would otherwise leave a buffer's worth of blocks in the pipe each time.

        Raises:
          WorkerDiedError: The worker process ended.
        """
        assert self._pool is not None
        try:
            while self._pool.ready_workers():
                try:
                    generation, kind, element, _, names, dropped = self._pool.recv(0, ready=True)
                except UnreadableElementError:
                    continue  # dropped anyway
                self._recycled.forget(dropped)
                if generation == STATS_GENERATION:
                    receive_side_message(kind, element, self, self._warning_registry)
                else:
                    self._recycled.released.extend(names)
        except WorkerDiedError as e:
            self._error = e
            raise
        return self._recycled.take_released()

    def close(self) -> None:
        if self._closed:
            return
        if self._finalizer is not None:
            self._finalizer()
        super().close()

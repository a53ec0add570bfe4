"""The dataset runtime's low types: ``DatasetIterator`` (the iterator protocol: state,
closing, the context its pipeline shares) and the iterators that build on it alone
(``ParentStateIterator``, ``ElementwiseIterator``), its contexts (``IteratorContext``,
``MultiprocessingContext``, ``ShareContext``), ``ElementBlock``, and the seam to
observability (``PipelineObserver``).

Below the fluent layer (``base.py``'s datasets, the operators): it imports no dataset node, so
the engines of ``dataset/mp/`` build on it without importing the operators they run.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from grain_core._checkpoint_io import load_coroutine, save_coroutine, start_when_restored
from grain_core._checks import non_negative_int
from grain_core.dataset.options import DatasetOptions, ExecutionTrackingMode, pipeline_options

__all__ = [
    "DatasetIterator",
    "ElementBlock",
    "ElementwiseIterator",
    "IteratorContext",
    "MultiprocessingContext",
    "ParentStateIterator",
    "PipelineObserver",
    "ShareContext",
    "pipeline_observer",
    "set_pipeline_observer",
]

T = TypeVar("T")


class _FirstParent:
    """``node._parent`` of a dataset or iterator: its first parent, as subclasses written for
    Grain read their input.

    Read from ``_parents`` on every access, so worker copies of a pipeline (which replace
    ``_parents``) see their own. A non-data descriptor: grain_core's own one-input datasets set
    ``self._parent`` once, and that instance attribute wins (no call on per-element paths).
    """

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        parents = obj._parents
        if not parents:
            # hasattr(node, "_parent") must say False for a source (MaxText's close asks).
            raise AttributeError(f"{type(obj).__name__} has no parent", name="_parent", obj=obj)
        return parents[0]


class MultiprocessingContext:
    """Which worker of how many this iterator runs in (``(0, 1)`` outside workers)."""

    __slots__ = ("process_index", "process_count")

    def __init__(self, process_index: int = 0, process_count: int = 1) -> None:
        self.process_index = process_index
        self.process_count = process_count

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MultiprocessingContext) and (
            self.process_index,
            self.process_count,
        ) == (other.process_index, other.process_count)

    def __repr__(self) -> str:
        return f"MultiprocessingContext({self.process_index}, {self.process_count})"


class IteratorContext:
    """Mutable context shared by all iterators of one pipeline (options and worker identity)."""

    __slots__ = ("dataset_options", "mp_context", "is_dataloader_pipeline", "output")

    def __init__(
        self,
        dataset_options: DatasetOptions | None = None,
        mp_context: MultiprocessingContext | None = None,
    ) -> None:
        self.dataset_options = dataset_options or pipeline_options()
        self.mp_context = mp_context or MultiprocessingContext()
        self.is_dataloader_pipeline = False
        # The pipeline's output iterator (a weak reference), set only in debug mode and while
        # the dataset graph is visualized (grain_core.observe.graph).
        self.output: Any = None

    def merge(self, other: IteratorContext) -> None:
        """Merges ``other`` into this context.

        Raises:
          ValueError: if the two contexts belong to different worker processes.
        """
        if self.mp_context != other.mp_context:
            raise ValueError(
                f"Cannot merge contexts from different worker processes (iterator contexts): "
                f"{self.mp_context} vs {other.mp_context}."
            )
        self.dataset_options = self.dataset_options.merge(other.dataset_options)
        self.is_dataloader_pipeline = self.is_dataloader_pipeline or other.is_dataloader_pipeline

    def __eq__(self, other: object) -> bool:
        # Contexts are equal by what they tell iterators (the debug-mode ``output`` aside).
        if not isinstance(other, IteratorContext):
            return NotImplemented
        return (
            self.dataset_options == other.dataset_options
            and self.mp_context == other.mp_context
            and self.is_dataloader_pipeline == other.is_dataloader_pipeline
        )

    __hash__ = None  # type: ignore[assignment]  # mutable


class ShareContext(IteratorContext):
    """The context of share ``index`` of ``count`` of a pipeline read on threads
    (``multithread_prefetch``): the pipeline's options and flags (read and written through to
    its context), and its own worker identity, the pipeline's composed with the share's: share
    ``i`` of ``n`` inside worker ``p`` of ``P`` is worker ``p + P * i`` of ``P * n``, so steps
    that number their elements by worker (``random_map``) number them as one thread would.
    """

    __slots__ = ("_pipeline", "_index", "_count", "_outer", "_composed")

    def __init__(self, pipeline: IteratorContext, index: int, count: int) -> None:
        self._pipeline = pipeline
        self._index = index
        self._count = count
        self._outer: MultiprocessingContext | None = None
        self._composed = MultiprocessingContext()

    @property
    def dataset_options(self) -> DatasetOptions:
        return self._pipeline.dataset_options

    @dataset_options.setter
    def dataset_options(self, options: DatasetOptions) -> None:
        self._pipeline.dataset_options = options

    @property
    def is_dataloader_pipeline(self) -> bool:
        return self._pipeline.is_dataloader_pipeline

    @is_dataloader_pipeline.setter
    def is_dataloader_pipeline(self, value: bool) -> None:
        self._pipeline.is_dataloader_pipeline = value

    @property
    def output(self) -> Any:
        return self._pipeline.output

    @output.setter
    def output(self, value: Any) -> None:
        self._pipeline.output = value

    @property
    def mp_context(self) -> MultiprocessingContext:
        outer = self._pipeline.mp_context
        if outer is not self._outer:
            # Workers replace the pipeline's context once, after building it: compose lazily.
            self._outer = outer
            self._composed = MultiprocessingContext(
                outer.process_index + outer.process_count * self._index,
                outer.process_count * self._count,
            )
        return self._composed

    @mp_context.setter
    def mp_context(self, value: MultiprocessingContext) -> None:
        raise AttributeError(
            "A thread share's worker identity derives from its pipeline's; set the pipeline's."
        )


class DatasetIterator(Iterator[T], abc.ABC):
    """A stateful iterator whose position can be saved (``get_state``) and restored.

    ``get_state()`` returns a new JSON-serialisable dict that the caller may keep. Iterators are
    context managers: leaving the ``with`` block closes them and every parent, releasing threads,
    processes and shared memory deterministically.
    """

    _closed: bool = False

    def __init__(self, parents: DatasetIterator[Any] | Sequence[Any] = ()) -> None:
        if isinstance(parents, DatasetIterator):
            parents = (parents,)
        self._parents = tuple(parents)
        ctx = IteratorContext()
        for p in self._parents:
            parent_ctx = getattr(p, "_ctx", None)
            if parent_ctx is not None:
                ctx.merge(parent_ctx)
        self._ctx = ctx
        for p in self._parents:
            if isinstance(p, DatasetIterator):
                p._share_ctx(ctx)
        if self._start_stage_timing_if_enabled():
            # Debug mode and the dataset graph report from the pipeline's output: the
            # iterator built last, which no other iterator of its pipeline reads.
            _observer.watch_output(self)

    def _share_ctx(self, ctx: IteratorContext) -> None:
        if self._ctx is ctx:
            return
        self._ctx = ctx
        for p in self._parents:
            if isinstance(p, DatasetIterator):
                p._share_ctx(ctx)
        self._start_stage_timing_if_enabled()

    def _merge_dataset_options(self, options: DatasetOptions) -> None:
        """Merges ``options`` over the pipeline's options; explicit fields of ``options`` win."""
        self._ctx.dataset_options = options.merge(self._ctx.dataset_options)
        self._start_stage_timing_if_enabled()

    def _start_stage_timing_if_enabled(self) -> bool:
        """Installs stage timing if the pipeline tracks it; returns whether it does."""
        # Runs when an iterator joins a pipeline or its options change, never per element:
        # timing is installed on the iterators themselves (see grain_core.observe.stages).
        if self._ctx.dataset_options.execution_tracking_mode is ExecutionTrackingMode.DISABLED:
            return False
        _observer.time_stages(self)
        return True

    _parent = _FirstParent()

    def __iter__(self) -> DatasetIterator[T]:
        return self

    @abc.abstractmethod
    def __next__(self) -> T: ...

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """Returns a new JSON-serialisable dict describing the position of this iterator."""

    @abc.abstractmethod
    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a position returned by ``get_state`` (of an equally defined pipeline)."""

    def start_prefetch(self) -> None:
        """Starts background work (threads, processes) without consuming elements."""
        for p in self._parents:
            start = getattr(p, "start_prefetch", None)
            if start is not None:
                start()

    def _start_when_restored(self) -> bool:
        """Called at the end of ``set_state`` by an iterator with background work of its own:
        a restore that starts background work (``CheckpointHandler.restore``) starts it when
        every iterator has its state, so the restore walks the tree once. Returns whether the
        restore will start it."""
        return start_when_restored(self.start_prefetch)

    def close(self) -> None:
        """Releases resources of this iterator and its parents. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for p in self._parents:
            close = getattr(p, "close", None)
            if close is not None:
                close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(
                f"Trying to advance a closed iterator ({type(self).__name__}). Create a new "
                "iterator with iter(dataset)."
            )

    def __enter__(self) -> DatasetIterator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def _get_next_index(self) -> int:
        raise NotImplementedError(
            f"{type(self).__name__} cannot report how many elements it has produced."
        )

    def _state_int(self, state: Mapping[str, Any], key: str) -> int:
        """``state[key]``, a position or count that ``get_state`` saved, for ``set_state``.

        Raises:
          KeyError: ``key`` is missing.
          TypeError: the value is not an integer (``2.7``, ``True``, ``"3"``): never truncated.
          ValueError: the value is negative.
        """
        return non_negative_int(self._state_name(key), state[key])

    def _state_name(self, key: str) -> str:
        """How errors name ``key`` of this iterator's checkpoint state."""
        return f"{type(self).__name__.lstrip('_')} checkpoint `{key}`"

    def _progress_held(self) -> str | None:
        """What this iterator holds beyond its parent's position at the consumer's point, or
        ``None``: its state is its parent's, plus counters that may restart.

        ``ElasticIterator`` moves the progress of an IterDataset pipeline to another shard count
        only when every iterator above the sliced node returns ``None``; a description (the
        node and the elements it has handed out from a group it read, say) goes into the error.
        The default holds back: an iterator with a state of its own must say when it is empty.
        """
        return f"{type(self).__name__} keeps a position of its own"

    def _set_next_index(self, index: int) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} cannot jump to an element index without processing data."
        )

    # Orbax v1 "stateful checkpointable" protocol.
    async def save(self, directory: Any) -> Any:
        return save_coroutine(directory, self)

    async def load(self, directory: Any) -> Any:
        return load_coroutine(directory, self)


class ParentStateIterator(DatasetIterator[T]):
    """An iterator over one parent whose position is its parent's: it owns the state protocol
    (``get_state`` and ``set_state`` are the parent's, and it holds nothing of its own across
    shard counts), so a node built on it implements only its own logic (``__next__``)."""

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self._parents[0].get_state()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self._parents[0].set_state(state)

    def _progress_held(self) -> None:
        return None


class ElementwiseIterator(ParentStateIterator[T]):
    """A ``ParentStateIterator`` whose every element comes from the parent's next one, so it
    has produced as many elements as its parent and jumps where its parent jumps."""

    def _get_next_index(self) -> int:
        index: int = self._parents[0]._get_next_index()
        return index

    def _set_next_index(self, index: int) -> None:
        self._parents[0]._set_next_index(index)


class ElementBlock(Generic[T]):
    """Consecutive elements taken from an iterator in one call, and the iterator's state
    after each of them.

    Args:
      elements: The elements, in stream order (empty: the iterator is exhausted).
      state_after: ``state_after(k)`` is the iterator's ``get_state()`` once the first ``k``
        elements are taken (``0 <= k <= len(elements)``). It must stay right after the
        iterator moves on: it keeps what it needs, never reads the iterator's later position.
    """

    __slots__ = ("elements", "state_after")

    def __init__(self, elements: Sequence[T], state_after: Callable[[int], dict[str, Any]]) -> None:
        self.elements = elements
        self.state_after = state_after

    def __len__(self) -> int:
        return len(self.elements)

    def __repr__(self) -> str:
        return f"ElementBlock(len={len(self.elements)})"


class PipelineObserver:
    """What the dataset layer and the engines ask of observability, which sits above them
    (``grain_core.observe``, which ``grain_core.dataset`` imports, registers its own with
    ``set_pipeline_observer``). Asked only when a pipeline is built, when a worker reports and
    when a report is made, never per element. The default observes nothing."""

    def time_stages(self, iterator: DatasetIterator[Any]) -> None:
        """Installs stage timing on ``iterator`` and its inputs; their pipeline tracks them."""

    def watch_output(self, iterator: DatasetIterator[Any]) -> None:
        """Lets ``iterator``, built last in a tracked pipeline, report in debug mode."""

    def tracks(self, iterator: DatasetIterator[Any]) -> bool:
        """Whether ``iterator`` records stage statistics."""
        return False

    def worker_snapshot(self, iterator: DatasetIterator[Any]) -> Any:
        """A worker pipeline's statistics (and trace spans) under ``iterator``, an opaque
        picklable payload for the parent; None if it does not track them."""
        return None

    def receive_worker_snapshot(self, iterator: DatasetIterator[Any], snapshot: Any) -> None:
        """Puts a worker's ``snapshot`` under ``iterator``, the parent's stage receiving that
        worker's elements."""

    def span_wrapper(
        self, iterator: DatasetIterator[Any]
    ) -> Callable[[Callable[..., Any], str, str], Callable[..., Any]] | None:
        """For a worker whose pipeline (output ``iterator``) traces its stages: a function
        that wraps a callable of the worker loop so that each call is a span of the given name
        and category; None otherwise."""
        return None

    def receives_worker_stages(
        self,
        iterator: DatasetIterator[Any],
        request: Callable[[], None],
        receive: Callable[[], None],
    ) -> None:
        """Registers ``iterator``, built to receive a worker process's elements, as the stage
        that receives its statistics: ``request`` asks the worker for them now, ``receive``
        waits for the answer (both bound methods of ``iterator``, held weakly)."""

    def reads_inputs_on_own_thread(
        self,
        iterator: DatasetIterator[Any],
        inputs_paused: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        """Registers ``iterator``, built with a thread of its own that reads its inputs:
        ``inputs_paused()`` is a context in which that thread does not read them (a bound
        method of ``iterator``, held weakly)."""


_observer = PipelineObserver()


def pipeline_observer() -> PipelineObserver:
    """The observer registered with ``set_pipeline_observer``."""
    return _observer


def set_pipeline_observer(observer: PipelineObserver) -> None:
    """Registers ``observer`` (``grain_core.observe`` does, when imported)."""
    global _observer
    _observer = observer

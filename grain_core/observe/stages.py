"""Per-stage execution statistics: element counts and self time per pipeline stage.

With ``DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING)`` every
stage of a pipeline records how many elements it produced and its **self time**: wall time
spent in the stage's own code, excluding the time its input stages spent producing the
elements it consumed (``grain_core.observe.summary`` makes the table of them).

Cost model (Grain pays per element even with tracking off): nothing in any ``__next__`` or
``_getitems`` checks whether tracking is on. Timing is *installed* when an iterator joins a
pipeline whose options ask for it (``DatasetIterator`` construction, ``_share_ctx``, or options
merged later by ``WithOptionsIterDataset``):

* each ``DatasetIterator`` instance gets its class swapped for a cached subclass whose
  ``__next__`` times the original one (same name, same behaviour);
* each ``MapDataset`` graph an iterator reads from (``to_iter_dataset``) is replaced, for that
  iterator only, by a shallow copy whose nodes time ``__getitem__``/``_getitems`` (the datasets
  the user holds are never modified).

So a pipeline without tracking runs exactly the code it would run if this module did not exist.
Debug mode and the dataset-graph switch (``grain_core.observe.graph``) and an open
``Trace`` turn tracking on for the pipelines built meanwhile. Besides counts and times, each
stage records its least and largest self time per element and describes its first element
(``output_spec``); with ``STAGE_TRACING`` each timed call also appends a span to the trace ring
buffer (``grain_core.observe.spans``).

Worker processes (``mp_prefetch``). A tracked worker pipeline sends ``worker_stage_snapshot`` of
its stages to the parent before its stream ends or stops at an error, and whenever the parent
asks (nothing is sent, and nothing is checked per element, when tracking is off). The parent's
stage receiving a worker's elements registers itself when built (``register_worker_receiver``,
through ``PipelineObserver.receives_worker_stages``): every summary first asks all of them
and waits for the answers (``refresh_worker_stages``), so it shows what
the workers had done when it was taken. The parent keeps the latest snapshot of each worker
under its receiving stage (``attach_worker_stages``), so the summary shows the worker stages,
summed over workers and marked ``[worker]``, below the ``mp_prefetch`` stage whose self time is
the parent's wait for its workers.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from grain_core import _tree
from grain_core.dataset.base import Indices, MapDataset, transform_name
from grain_core.dataset.iterator import DatasetIterator
from grain_core.dataset.options import ExecutionTrackingMode
from grain_core.observe import spans

__all__ = [
    "StageStats",
    "attach_worker_stages",
    "is_tracing",
    "is_tracking",
    "refresh_worker_stages",
    "register_reader_thread",
    "register_worker_receiver",
    "same_named_subclass",
    "span_wrapper",
    "stages_of",
    "time_stages",
    "worker_stage_snapshot",
]

_TRACING = ExecutionTrackingMode.STAGE_TRACING
_now = spans.span_clock
_record_span = spans.record_span


class _Clock(threading.local):
    """Per thread: time spent in timed calls nested in the current one, its stage, and the
    thread's id for trace spans."""

    nested_ns = 0
    stage: Any = None

    def __init__(self) -> None:
        self.tid = spans.register_thread()


_clock = _Clock()


#: The counters of a stage that a worker's snapshot carries to the parent (in this order).
_STATS_FIELDS = (
    "name",
    "kind",
    "type_name",
    "count",
    "self_ns",
    "total_ns",
    "min_ns",
    "max_ns",
    "spec",
    "tid",
)


class StageStats:
    """Counters of one stage. Map stages may be updated from several reader threads.

    ``prepared`` is False for an iterator stage until its first ``next``: timing is installed
    from ``DatasetIterator.__init__``, before the subclass has set its attributes, so the
    MapDataset graph it reads from is timed on first use.

    ``min_ns``/``max_ns`` bound the self time of one call that produced an element; ``spec``
    describes the first element (``_tree.spec_str``) and ``tid`` the thread that produced it.
    ``traced`` stages also append a span per call to the trace ring buffer (``STAGE_TRACING``).

    ``inputs`` links the stats graph the summary walks. It outlives the iterators: an input
    that an interleave finished and dropped still counts. Links come from the iterator's
    attributes when it is prepared and, for inputs created later, from the first ``next`` call
    a consumer stage makes on them.

    ``receiver`` (weak references to its request and receive methods) is how to ask the
    worker process whose stages this stage receives for fresh ones, as ``refresh_worker_stages``
    does; ``reader_thread`` (a weak reference to its ``inputs_paused``) how to pause the thread
    of a stage whose inputs its own thread reads, which that refresh does while it uses them
    (both as registered when the iterator was built).
    """

    __slots__ = (
        *_STATS_FIELDS,
        "category",
        "traced",
        "lock",
        "prepared",
        "inputs",
        "has_consumer",
        "in_workers",
        "receiver",
        "reader_thread",
    )

    def __init__(self, name: str, kind: str, type_name: str = "", traced: bool = False) -> None:
        self.name = name
        self.kind = kind
        self.type_name = type_name
        self.category = _category(type_name, kind)
        self.count = 0
        self.self_ns = 0
        self.total_ns = 0
        self.min_ns = 0
        self.max_ns = 0
        self.spec: str | None = None
        self.tid = 0
        self.traced = traced
        self.lock = threading.Lock()
        self.prepared = kind == "map"
        self.inputs: list[StageStats] = []
        self.has_consumer = False
        self.in_workers = False
        self.receiver: _ReceiverMethods | None = None
        self.reader_thread: _PauseMethod | None = None

    def first_element(self, element: Any, own_ns: int, tid: int) -> None:
        """Records what only the first element tells: its spec, and the thread."""
        self.spec = _tree.spec_str(element)
        self.tid = tid
        self.min_ns = self.max_ns = own_ns

    def link(self, child: StageStats) -> None:
        child.has_consumer = True
        if all(child is not known for known in self.inputs):
            self.inputs.append(child)


def same_named_subclass(cls: type[Any], methods: dict[str, Any], base_attribute: str) -> type[Any]:
    """A subclass of ``cls`` that overrides ``methods`` and looks like ``cls`` (name, module,
    no instance ``__dict__`` of its own), with ``cls`` as its attribute ``base_attribute``: what
    an instance's ``__class__`` is swapped for to time it (or report from it), and back."""
    return type(
        cls.__name__,
        (cls,),
        {
            "__slots__": (),
            **methods,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            base_attribute: cls,
        },
    )


# ------------------------------------------------------------------------- iterator stages
_TIMED_ITERATOR_CLASSES: dict[type[Any], type[Any]] = {}


def _timed_iterator_class(cls: type[Any]) -> type[Any]:
    timed = _TIMED_ITERATOR_CLASSES.get(cls)
    if timed is not None:
        return timed
    untimed_next = cls.__next__
    untimed_next_block = getattr(cls, "next_block", None)

    def timed_call(self: Any, call: Any, *args: Any) -> tuple[Any, int]:
        """``call(self, *args)`` timed as this stage; returns its result and own time."""
        stats = self._stage_stats
        clock = _clock
        consumer = clock.stage
        if not stats.has_consumer and consumer is not None:
            consumer.link(stats)
        if not stats.prepared:
            _prepare(self)
        outer_nested = clock.nested_ns
        clock.nested_ns = 0
        clock.stage = stats
        start = _now()
        try:
            result = call(self, *args)
        finally:
            elapsed = _now() - start
            own = elapsed - clock.nested_ns
            stats.self_ns += own
            stats.total_ns += elapsed
            clock.nested_ns = outer_nested + elapsed
            clock.stage = consumer
            if stats.traced:
                _record_span((clock.tid, stats.name, stats.category, start, elapsed))
        return result, own

    def __next__(self: Any) -> Any:
        element, own = timed_call(self, untimed_next)
        stats = self._stage_stats
        if not stats.count:
            stats.first_element(element, own, _clock.tid)
        elif own > stats.max_ns:
            stats.max_ns = own
        elif own < stats.min_ns:
            stats.min_ns = own
        stats.count += 1
        return element

    def next_block(self: Any, max_size: int) -> Any:
        # A block of elements (SupportsNextBlock) counts as many elements as it holds.
        block, own = timed_call(self, untimed_next_block, max_size)
        stats = self._stage_stats
        if block.elements and not stats.count:
            stats.first_element(block.elements[0], own, _clock.tid)
        stats.count += len(block.elements)
        return block

    methods: dict[str, Any] = {"__next__": __next__}
    if untimed_next_block is not None:
        methods["next_block"] = next_block

    timed = same_named_subclass(cls, methods, "_untimed_class")
    _TIMED_ITERATOR_CLASSES[cls] = timed
    return timed


def _iterator_stage_name(it: DatasetIterator[Any]) -> str:
    label = vars(it).get("_stage_label")
    if label is not None:
        return str(label)
    name = type(it).__name__.lstrip("_")
    for suffix in ("DatasetIterator", "Iterator"):
        if name.endswith(suffix) and name != suffix:
            name = name[: -len(suffix)]
            break
    fn = getattr(it, "_fn", None)
    return f"{name}({transform_name(fn)})" if fn is not None else name


# ------------------------------------------------------------------------------ map stages
_TIMED_MAP_CLASSES: dict[type[Any], type[Any]] = {}
_NO_RESULT: Any = object()


def _run_timed(stats: StageStats, call: Any, count: int, batched: bool) -> Any:
    clock = _clock
    outer_nested = clock.nested_ns
    outer_stage = clock.stage
    clock.nested_ns = 0
    clock.stage = stats
    start = _now()
    result: Any = _NO_RESULT
    try:
        result = call()
        return result
    finally:
        elapsed = _now() - start
        own = elapsed - clock.nested_ns
        clock.nested_ns = outer_nested + elapsed
        clock.stage = outer_stage
        if stats.traced:
            _record_span((clock.tid, stats.name, stats.category, start, elapsed))
        with stats.lock:
            stats.self_ns += own
            stats.total_ns += elapsed
            # A node whose batched read loops over its own __getitem__ counts elements once.
            if outer_stage is not stats and count:
                per_element = own // count
                if not stats.count and result is not _NO_RESULT:
                    stats.first_element(result[0] if batched else result, per_element, clock.tid)
                elif per_element > stats.max_ns:
                    stats.max_ns = per_element
                elif per_element < stats.min_ns:
                    stats.min_ns = per_element
                stats.count += count


def _timed_map_class(cls: type[Any]) -> type[Any]:
    timed = _TIMED_MAP_CLASSES.get(cls)
    if timed is not None:
        return timed
    untimed_getitem = cls.__getitem__
    untimed_getitems = cls._getitems

    def __getitem__(self: Any, index: Any) -> Any:
        if isinstance(index, slice):
            return untimed_getitem(self, index)
        return _run_timed(self._stage_stats, lambda: untimed_getitem(self, index), 1, False)

    def _getitems(self: Any, indices: Indices) -> list[Any]:
        return _run_timed(
            self._stage_stats, lambda: untimed_getitems(self, indices), len(indices), True
        )

    timed = same_named_subclass(
        cls, {"__getitem__": __getitem__, "_getitems": _getitems}, "_untimed_class"
    )
    _TIMED_MAP_CLASSES[cls] = timed
    return timed


def _timed_map_graph(
    node: MapDataset[Any], memo: dict[int, MapDataset[Any]], traced: bool
) -> MapDataset[Any]:
    """Returns a copy of the graph under ``node`` whose nodes time their reads."""
    done = memo.get(id(node))
    if done is not None:
        return done
    if hasattr(node, "_stage_stats"):
        return node
    timed = copy.copy(node)
    memo[id(node)] = timed
    for name, value in vars(timed).items():
        replaced = _replace_map_datasets(value, memo, traced)
        if replaced is not value:
            setattr(timed, name, replaced)
    timed.__class__ = _timed_map_class(type(node))
    stats = StageStats(repr(node), "map", type(node).__name__, traced)
    for parent in timed.parents:
        if isinstance(parent, MapDataset) and hasattr(parent, "_stage_stats"):
            stats.link(parent._stage_stats)  # pyright: ignore[reportAttributeAccessIssue]
    timed._stage_stats = stats  # type: ignore[attr-defined]
    return timed


def _replace_map_datasets(value: Any, memo: dict[int, MapDataset[Any]], traced: bool) -> Any:
    if isinstance(value, MapDataset):
        return _timed_map_graph(value, memo, traced)
    if isinstance(value, (list, tuple)) and any(isinstance(v, MapDataset) for v in value):
        items = [
            _timed_map_graph(v, memo, traced) if isinstance(v, MapDataset) else v for v in value
        ]
        return type(value)(items) if type(value) in (list, tuple) else value
    return value


# ------------------------------------------------------------------------- installation
def _child_iterators(it: DatasetIterator[Any]) -> Iterator[DatasetIterator[Any]]:
    """Input iterators of ``it``: its parents and any it keeps elsewhere (e.g. interleave)."""
    seen: set[int] = set()
    candidates: list[Any] = list(it._parents)
    for value in vars(it).values():
        if isinstance(value, DatasetIterator):
            candidates.append(value)
        elif isinstance(value, (list, tuple)):
            candidates.extend(value)
    for child in candidates:
        if isinstance(child, DatasetIterator) and child is not it and id(child) not in seen:
            seen.add(id(child))
            yield child


def _map_graph_attributes(it: DatasetIterator[Any]) -> list[str]:
    return [name for name, value in vars(it).items() if isinstance(value, MapDataset)]


def time_stages(iterator: DatasetIterator[Any]) -> None:
    """Installs stage timing on ``iterator`` and every stage upstream of it. Idempotent."""
    stack = [iterator]
    while stack:
        it = stack.pop()
        if "_stage_stats" in vars(it):
            continue
        traced = it._ctx.dataset_options.execution_tracking_mode is _TRACING
        it._stage_stats = StageStats("", "iter", type(it).__name__, traced)  # type: ignore[attr-defined]
        it.__class__ = _timed_iterator_class(type(it))
        stack.extend(_child_iterators(it))


def _prepare(it: DatasetIterator[Any]) -> None:
    """Completes timing of ``it`` once it is fully built: its MapDataset graph and inputs."""
    stats = it._stage_stats  # type: ignore[attr-defined]
    stats.name = _iterator_stage_name(it)
    stats.category = _category(f"{stats.type_name} {vars(it).get('_stage_label', '')}", stats.kind)
    memo: dict[int, MapDataset[Any]] = {}
    for name in _map_graph_attributes(it):
        timed = _timed_map_graph(getattr(it, name), memo, stats.traced)
        setattr(it, name, timed)
        stats.link(timed._stage_stats)  # type: ignore[attr-defined]
    for child in _child_iterators(it):
        time_stages(child)
        stats.link(child._stage_stats)  # type: ignore[attr-defined]
    stats.receiver = _worker_receivers.get(it)
    stats.reader_thread = _reader_threads.get(it)
    stats.prepared = True


def _prepare_reachable(iterator: DatasetIterator[Any]) -> None:
    """Prepares every timed iterator under ``iterator`` and links those created since their
    consumer was prepared (inputs that have not produced yet, e.g. an interleave's)."""
    stack = [iterator]
    seen: set[int] = set()
    while stack:
        it = stack.pop()
        if id(it) in seen or "_stage_stats" not in vars(it):
            continue
        seen.add(id(it))
        stats = it._stage_stats  # type: ignore[attr-defined]
        if not stats.prepared:
            _prepare(it)
        for child in _child_iterators(it):
            if "_stage_stats" in vars(child):
                stats.link(child._stage_stats)  # type: ignore[attr-defined]
                stack.append(child)


# ---------------------------------------------------------------------- worker processes
#: One stage of a worker snapshot: the values of ``_STATS_FIELDS`` and the positions of the
#: stage's inputs in the snapshot.
_SnapshotRow = tuple[Any, ...]

#: What a worker sends: its stage rows (row 0 is its output stage), its worker index, its pid,
#: its thread names and the trace spans recorded since its previous snapshot.
WorkerSnapshot = tuple[list[_SnapshotRow], int, int, dict[int, str], list[spans.Span]]


def is_tracking(iterator: DatasetIterator[Any]) -> bool:
    """Whether ``iterator`` records stage timing (``STAGE_TIMING`` or ``STAGE_TRACING``)."""
    return stages_of(iterator) is not None


def stages_of(iterator: DatasetIterator[Any]) -> StageStats | None:
    """The statistics of ``iterator``'s stage (the root of its pipeline's stage graph), or
    None if its pipeline does not track its stages."""
    ctx = getattr(iterator, "_ctx", None)
    if ctx is None or ctx.dataset_options.execution_tracking_mode is ExecutionTrackingMode.DISABLED:
        return None
    return vars(iterator).get("_stage_stats")


def is_tracing(iterator: DatasetIterator[Any]) -> bool:
    """Whether ``iterator`` also records trace spans (``STAGE_TRACING``)."""
    mode = iterator._ctx.dataset_options.execution_tracking_mode
    return mode is _TRACING and "_stage_stats" in vars(iterator)


def span_wrapper(
    iterator: DatasetIterator[Any],
) -> Callable[[Callable[..., Any], str, str], Callable[..., Any]] | None:
    """For a worker whose pipeline (output ``iterator``) traces its stages: a function that
    wraps a callable of the worker loop so that each call is a span of the given name and
    category on this thread (a message sent, a wait for the parent); None otherwise, so that
    an untraced worker runs its plain methods."""
    if not is_tracing(iterator):
        return None
    tid = spans.register_thread()

    def wrap(call: Callable[..., Any], name: str, category: str) -> Callable[..., Any]:
        def traced(*args: Any) -> Any:
            start = spans.span_clock()
            result = call(*args)
            spans.record_span((tid, name, category, start, spans.span_clock() - start))
            return result

        return traced

    return wrap


def worker_stage_snapshot(iterator: DatasetIterator[Any]) -> WorkerSnapshot:
    """The stage statistics under ``iterator`` (and the trace spans of this process, which are
    taken) as plain values a worker sends to the parent."""
    _prepare_reachable(iterator)
    position: dict[int, int] = {}
    order: list[StageStats] = []
    stack: list[StageStats] = [iterator._stage_stats]  # type: ignore[attr-defined]
    while stack:
        stats = stack.pop()
        if id(stats) in position:
            continue
        position[id(stats)] = len(order)
        order.append(stats)
        stack.extend(reversed(stats.inputs))
    rows = [
        (
            *(getattr(s, field) for field in _STATS_FIELDS),
            tuple(position[id(c)] for c in s.inputs),
        )
        for s in order
    ]
    pid, thread_names, taken = spans.drain_local_spans()
    return rows, iterator._ctx.mp_context.process_index, pid, thread_names, taken


def attach_worker_stages(iterator: DatasetIterator[Any], snapshot: WorkerSnapshot) -> None:
    """Puts a worker's latest ``snapshot`` under ``iterator``, the parent stage receiving that
    worker's elements, replacing the previous one, and keeps its trace spans. Does nothing if
    ``iterator`` is untimed."""
    receiver = vars(iterator).get("_stage_stats")
    rows, index, pid, thread_names, sent = snapshot
    if receiver is None or not rows:
        return
    if sent:
        spans.add_remote_spans(pid, f"grain_core worker {index} ({pid})", thread_names, sent)
    nodes = []
    for row in rows:
        stats = StageStats(row[0], row[1], row[2])
        for field, value in zip(_STATS_FIELDS[3:], row[3:-1], strict=True):
            setattr(stats, field, value)
        stats.prepared = stats.in_workers = True
        nodes.append(stats)
    for stats, row in zip(nodes, rows, strict=True):
        for child in row[-1]:
            stats.link(nodes[child])
    receiver.inputs = [s for s in receiver.inputs if not s.in_workers]
    receiver.link(nodes[0])


#: How to ask for a worker's stages and wait for them: weak references to the request and
#: receive methods of the iterator that receives them.
_ReceiverMethods = tuple[
    weakref.WeakMethod[Callable[[], None]], weakref.WeakMethod[Callable[[], None]]
]
#: How to pause the thread that reads an iterator's inputs (a weak ``inputs_paused``).
_PauseMethod = weakref.WeakMethod[Callable[[], contextlib.AbstractContextManager[Any]]]

#: The iterators registered when built as receiving a worker's stages, and as reading their
#: inputs on a thread of their own; a stage takes its entry when it is prepared.
_worker_receivers: weakref.WeakKeyDictionary[DatasetIterator[Any], _ReceiverMethods] = (
    weakref.WeakKeyDictionary()
)
_reader_threads: weakref.WeakKeyDictionary[DatasetIterator[Any], _PauseMethod] = (
    weakref.WeakKeyDictionary()
)


def register_worker_receiver(
    iterator: DatasetIterator[Any], request: Callable[[], None], receive: Callable[[], None]
) -> None:
    """Registers ``iterator`` as the stage receiving a worker's stages: ``request`` and
    ``receive``, bound methods of it, ask the worker for them and wait for the answer."""
    _worker_receivers[iterator] = (weakref.WeakMethod(request), weakref.WeakMethod(receive))


def register_reader_thread(
    iterator: DatasetIterator[Any],
    inputs_paused: Callable[[], contextlib.AbstractContextManager[Any]],
) -> None:
    """Registers ``iterator`` as reading its inputs on a thread of its own, which
    ``inputs_paused()``, a bound method of it, stops while entered."""
    _reader_threads[iterator] = weakref.WeakMethod(inputs_paused)


def refresh_worker_stages(iterator: DatasetIterator[Any]) -> None:
    """The one function that asks workers for their statistics: asks every stage under
    ``iterator`` that receives a worker process's stages for fresh ones, and waits for them.

    Threading rule: call it from the thread that iterates ``iterator`` (the answers come on
    the pipes its elements come on), never from another thread while that one iterates.
    Threads that read inputs of their own (thread prefetch, ``device_put``) are stopped
    meanwhile (the ``inputs_paused`` registered with ``register_reader_thread``): they finish
    the read in progress, keep what they read and go on afterwards.
    """
    _prepare_reachable(iterator)
    receivers: list[tuple[Callable[[], None], Callable[[], None]]] = []
    # Outermost first: each reader thread reads from the ones after it.
    readers: list[Callable[[], contextlib.AbstractContextManager[Any]]] = []
    stack: list[StageStats] = [iterator._stage_stats]  # type: ignore[attr-defined]
    seen: set[int] = set()
    while stack:
        stats = stack.pop()
        if id(stats) in seen or stats.in_workers:
            continue
        seen.add(id(stats))
        if stats.receiver is not None:
            request, receive = (method() for method in stats.receiver)
            if request is not None and receive is not None:
                receivers.append((request, receive))
        inputs_paused = stats.reader_thread() if stats.reader_thread is not None else None
        if inputs_paused is not None:
            readers.append(inputs_paused)
        stack.extend(stats.inputs)
    if receivers:
        with _readers_paused(readers):
            for request, _ in receivers:  # all ask first: the workers answer at the same time
                request()
            for _, receive in receivers:
                receive()


@contextlib.contextmanager
def _readers_paused(
    readers: Sequence[Callable[[], contextlib.AbstractContextManager[Any]]],
) -> Iterator[None]:
    with contextlib.ExitStack() as paused:
        for inputs_paused in readers:
            paused.enter_context(inputs_paused())
        yield


def _category(description: str, kind: str) -> str:
    """The trace category of a stage from its class name (and label): read, transform, batch,
    wait (for threads) or transport (from worker processes)."""
    name = description.lower()
    if "process" in name or "dispatch" in name:
        return "transport"
    if "prefetch" in name or "thread" in name:
        return "wait"
    if "batch" in name:
        return "batch"
    if kind == "map" and ("source" in name or "range" in name):
        return "read"
    return "transform"

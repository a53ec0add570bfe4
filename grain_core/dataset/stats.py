"""Per-stage execution statistics: element counts and self time per pipeline stage.

With ``DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING)`` every
stage of a pipeline records how many elements it produced and its **self time**: wall time
spent in the stage's own code, excluding the time its input stages spent producing the
elements it consumed. ``get_execution_summary(iterator)`` returns an ``ExecutionSummary``;
``print(summary)`` shows it as a table, the first thing to read when a pipeline is slow.

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
Debug mode and the dataset-graph switch (``grain_core.dataset.debug``) and an open
``Trace`` turn tracking on for the pipelines built meanwhile. Besides counts and times, each
stage records its least and largest self time per element and describes its first element
(``output_spec``); with ``STAGE_TRACING`` each timed call also appends a span to the trace ring
buffer (``grain_core.dataset.trace``).

Worker processes (``mp_prefetch``). A tracked worker pipeline sends ``worker_stage_snapshot`` of
its stages to the parent before its stream ends or stops at an error, and whenever the parent
asks (nothing is sent, and nothing is checked per element, when tracking is off). The parent's
stage receiving a worker's elements is a ``capabilities.WorkerStageReceiver``: every summary
first asks all of them and waits for the answers (``refresh_worker_stages``), so it shows what
the workers had done when it was taken. The parent keeps the latest snapshot of each worker
under its receiving stage (``attach_worker_stages``), so the summary shows the worker stages,
summed over workers and marked ``[worker]``, below the ``mp_prefetch`` stage whose self time is
the parent's wait for its workers.

Self time is measured per thread: a stage's children run either on the same thread (their
time is subtracted) or on reader/prefetch threads (then the stage's self time is the time it
waited for them). Summed self time can therefore exceed wall time when threads overlap; shares
are of the summed self time. The wait share instead splits the consumer's time in ``next``:
the thread each stage produced its first element on tells which inputs sit behind a thread
or process boundary (see ``StageSummary.wait_share``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import textwrap
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from grain_core import _tree
from grain_core.capabilities import ReadsInputsOnOwnThread, WorkerStageReceiver
from grain_core.dataset import trace
from grain_core.dataset.base import Indices, MapDataset, transform_name
from grain_core.dataset.iterator import DatasetIterator
from grain_core.dataset.options import ExecutionTrackingMode

__all__ = [
    "ExecutionSummary",
    "StageSummary",
    "attach_worker_stages",
    "get_execution_summary",
    "is_tracing",
    "is_tracking",
    "refresh_worker_stages",
    "same_named_subclass",
    "stage_cell",
    "time_stages",
    "worker_stage_snapshot",
]

_TRACING = ExecutionTrackingMode.STAGE_TRACING
_now = trace.span_clock
_record_span = trace.record_span


class _Clock(threading.local):
    """Per thread: time spent in timed calls nested in the current one, its stage, and the
    thread's id for trace spans."""

    nested_ns = 0
    stage: Any = None

    def __init__(self) -> None:
        self.tid = trace.register_thread()


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


class _StageStats:
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

    ``receiver`` (a weak reference) is the iterator of a stage that receives a worker process's
    stages, which ``refresh_worker_stages`` asks for fresh ones; ``reader_thread`` (a weak
    reference) the iterator of a stage whose inputs its own thread reads, which that refresh
    pauses while it uses them.
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
        self.inputs: list[_StageStats] = []
        self.has_consumer = False
        self.in_workers = False
        self.receiver: weakref.ref[Any] | None = None
        self.reader_thread: weakref.ref[Any] | None = None

    def first_element(self, element: Any, own_ns: int, tid: int) -> None:
        """Records what only the first element tells: its spec, and the thread."""
        self.spec = _tree.spec_str(element)
        self.tid = tid
        self.min_ns = self.max_ns = own_ns

    def link(self, child: _StageStats) -> None:
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


def _run_timed(stats: _StageStats, call: Any, count: int, batched: bool) -> Any:
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
    stats = _StageStats(repr(node), "map", type(node).__name__, traced)
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
        it._stage_stats = _StageStats("", "iter", type(it).__name__, traced)  # type: ignore[attr-defined]
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
    if isinstance(it, WorkerStageReceiver):
        stats.receiver = weakref.ref(it)
    if isinstance(it, ReadsInputsOnOwnThread):
        stats.reader_thread = weakref.ref(it)
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
WorkerSnapshot = tuple[list[_SnapshotRow], int, int, dict[int, str], list[trace.Span]]


def is_tracking(iterator: DatasetIterator[Any]) -> bool:
    """Whether ``iterator`` records stage timing (``STAGE_TIMING`` or ``STAGE_TRACING``)."""
    mode = iterator._ctx.dataset_options.execution_tracking_mode
    return mode is not ExecutionTrackingMode.DISABLED and "_stage_stats" in vars(iterator)


def is_tracing(iterator: DatasetIterator[Any]) -> bool:
    """Whether ``iterator`` also records trace spans (``STAGE_TRACING``)."""
    mode = iterator._ctx.dataset_options.execution_tracking_mode
    return mode is _TRACING and "_stage_stats" in vars(iterator)


def worker_stage_snapshot(iterator: DatasetIterator[Any]) -> WorkerSnapshot:
    """The stage statistics under ``iterator`` (and the trace spans of this process, which are
    taken) as plain values a worker sends to the parent."""
    _prepare_reachable(iterator)
    position: dict[int, int] = {}
    order: list[_StageStats] = []
    stack: list[_StageStats] = [iterator._stage_stats]  # type: ignore[attr-defined]
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
    pid, thread_names, spans = trace.drain_local_spans()
    return rows, iterator._ctx.mp_context.process_index, pid, thread_names, spans


def attach_worker_stages(iterator: DatasetIterator[Any], snapshot: WorkerSnapshot) -> None:
    """Puts a worker's latest ``snapshot`` under ``iterator``, the parent stage receiving that
    worker's elements, replacing the previous one, and keeps its trace spans. Does nothing if
    ``iterator`` is untimed."""
    receiver = vars(iterator).get("_stage_stats")
    rows, index, pid, thread_names, spans = snapshot
    if receiver is None or not rows:
        return
    if spans:
        trace.add_remote_spans(pid, f"grain_core worker {index} ({pid})", thread_names, spans)
    nodes = []
    for row in rows:
        stats = _StageStats(row[0], row[1], row[2])
        for field, value in zip(_STATS_FIELDS[3:], row[3:-1], strict=True):
            setattr(stats, field, value)
        stats.prepared = stats.in_workers = True
        nodes.append(stats)
    for stats, row in zip(nodes, rows, strict=True):
        for child in row[-1]:
            stats.link(nodes[child])
    receiver.inputs = [s for s in receiver.inputs if not s.in_workers]
    receiver.link(nodes[0])


def refresh_worker_stages(iterator: DatasetIterator[Any]) -> None:
    """Asks every stage under ``iterator`` that receives a worker process's stages for fresh
    ones, and waits for them (call it from the thread that iterates: the answers come on the
    pipes its elements come on). Threads that read inputs of their own (thread prefetch,
    ``device_put``) are kept out of those inputs meanwhile: they finish the read in progress
    first."""
    _prepare_reachable(iterator)
    receivers = []
    readers = []  # outermost first: each reader thread reads from the ones after it
    stack: list[_StageStats] = [iterator._stage_stats]  # type: ignore[attr-defined]
    seen: set[int] = set()
    while stack:
        stats = stack.pop()
        if id(stats) in seen or stats.in_workers:
            continue
        seen.add(id(stats))
        receiver = stats.receiver() if stats.receiver is not None else None
        if receiver is not None:
            receivers.append(receiver)
        reader = stats.reader_thread() if stats.reader_thread is not None else None
        if reader is not None:
            readers.append(reader)
        stack.extend(stats.inputs)
    if receivers:
        with _readers_paused(readers):
            for receiver in receivers:  # all ask first: the workers answer at the same time
                receiver.request_worker_stages()
            for receiver in receivers:
                receiver.receive_worker_stages()


@contextlib.contextmanager
def _readers_paused(readers: Sequence[ReadsInputsOnOwnThread]) -> Iterator[None]:
    with contextlib.ExitStack() as paused:
        for reader in readers:
            paused.enter_context(reader.inputs_paused())
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


# ----------------------------------------------------------------------------- summaries
@dataclasses.dataclass(frozen=True)
class StageSummary:
    """One row of an execution summary.

    Attributes:
      id: row number; the output stage is 0.
      name: the stage (iterator class and transform, or the MapDataset's repr).
      kind: ``"iter"`` for an IterDataset stage, ``"map"`` for a MapDataset stage.
      depth: distance from the output stage.
      inputs: ids of the stages this one reads from.
      num_produced_elements: elements produced (for map stages: indices read, holes included).
      self_time_ns: time in this stage's own code, excluding its inputs.
      share: ``self_time_ns`` over the summed self time of all stages.
      instances: how many stage objects were merged into this row (interleave inputs).
      total_time_ns: time in this stage including its inputs (per thread).
      in_workers: the stage runs in ``mp_prefetch`` worker processes (figures summed over them).
      type_name: the class of the iterator or MapDataset.
      min_time_ns: the least self time of one call that produced an element (for batched
        reads, of one element on average over the batch).
      max_time_ns: the largest such self time.
      output_spec: structure, dtypes and shapes of the first element (``None`` before one).
      wait_share: the share of the consumer's wait in ``next`` this stage accounts for: on the
        consumer's thread, its self time; behind a thread or process boundary, the boundary's
        wait split in proportion to the time spent upstream (the boundary keeps none).
      category: what the stage does: ``read``, ``transform``, ``batch``, ``wait`` (for
        threads) or ``transport`` (elements from worker processes).
    """

    id: int
    name: str
    kind: str
    depth: int
    inputs: tuple[int, ...]
    num_produced_elements: int
    self_time_ns: int
    share: float
    instances: int
    total_time_ns: int
    in_workers: bool = False
    type_name: str = ""
    min_time_ns: int = 0
    max_time_ns: int = 0
    output_spec: str | None = None
    wait_share: float = 0.0
    category: str = ""

    @property
    def self_time_per_element_ns(self) -> float:
        return self.self_time_ns / self.num_produced_elements if self.num_produced_elements else 0.0


@dataclasses.dataclass(frozen=True)
class ExecutionSummary:
    """Per-stage counts and self times of one pipeline, output stage first.

    ``output_wait_ns`` is the time the consumer spent inside the output stage's ``next``.
    ``str(summary)`` is a readable table; ``to_dict()`` a JSON-serialisable form.
    """

    stages: tuple[StageSummary, ...]
    output_wait_ns: int = 0

    @property
    def total_self_time_ns(self) -> int:
        return sum(s.self_time_ns for s in self.stages)

    def slowest(self) -> StageSummary:
        """The stage with the largest self time."""
        return max(self.stages, key=lambda s: s.self_time_ns)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return self.to_text()

    def to_text(self, width: int | None = None) -> str:
        """The summary as a table (``str(summary)``).

        Args:
          width: None: every column, stage names cut at 100 characters. Else the most
            characters a line may have: the title is wrapped, the min and max columns are
            left out and stage names are cut so that every row fits.
        """
        narrow = width is not None
        header: tuple[str, ...] = (
            "id", "stage", "elements", "self time", "avg", "min", "max", "share", "wait",
        )  # fmt: skip
        rows: list[tuple[str, ...]] = []
        for s in self.stages:
            rows.append(
                (
                    str(s.id),
                    stage_cell(
                        ("[worker] " if s.in_workers else "") + s.name, s.depth, s.instances
                    ),
                    f"{s.num_produced_elements:,}",
                    _format_ns(s.self_time_ns),
                    _format_ns(s.self_time_per_element_ns),
                    _format_ns(s.min_time_ns),
                    _format_ns(s.max_time_ns),
                    f"{100 * s.share:.1f}%",
                    f"{100 * s.wait_share:.1f}%",
                )
            )
        if narrow:
            header = header[:5] + header[7:]
            rows = [row[:5] + row[7:] for row in rows]
        title = (
            f"grain_core execution summary: the consumer waited {_format_ns(self.output_wait_ns)} "
            "in next(). Self time excludes input stages; avg/min/max are per element; share is "
            f"of the {_format_ns(self.total_self_time_ns)} summed over stages and threads; wait "
            "is the share of the consumer's wait."
        )
        if any(s.in_workers for s in self.stages):
            title += " [worker] stages ran in mp_prefetch worker processes (summed over them)."
        if width is None:
            return format_table(title, header, rows)
        return format_table("\n".join(textwrap.wrap(title, width)), header, rows, width=width)


def stage_cell(name: str, depth: int, instances: int) -> str:
    """A stage's name in a table of a pipeline, output first: indented by its ``depth``, after
    ``<-`` below the output, with ``xN`` when ``N`` objects were merged into its row."""
    merged = f" x{instances}" if instances > 1 else ""
    return "  " * depth + ("<- " if depth else "") + name + merged


def format_table(
    title: str,
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    numbers: bool = True,
    width: int | None = None,
) -> str:
    """``rows`` under ``header`` as aligned text columns: the first right-aligned, the second
    (a stage name, indented by depth) left-aligned and cut at 100 characters (or so that a
    row fits in ``width``), the others right-aligned if they are ``numbers``, else
    left-aligned."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    others = sum(widths) - widths[1] + 3 * (len(widths) - 1)
    widths[1] = min(widths[1], 100 if width is None else max(len(header[1]), width - others))

    def line(cells: Sequence[str]) -> str:
        name = cells[1] if len(cells[1]) <= widths[1] else cells[1][: widths[1] - 3] + "..."
        return " | ".join(
            [cells[0].rjust(widths[0]), name.ljust(widths[1])]
            + [
                c.rjust(w) if numbers else c.ljust(w)
                for c, w in zip(cells[2:], widths[2:], strict=True)
            ]
        ).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *(line(r) for r in rows)])


def _format_ns(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.2f} {unit}"
    return f"{ns:.0f} ns"


def _per_worker_name(name: str) -> str:
    """Row name for a worker stage whose description differs between workers."""
    if name.endswith(_PER_WORKER):
        return name
    cut = min((i for i in (name.find("["), name.find("(")) if i > 0), default=len(name))
    return name[:cut] + _PER_WORKER


_PER_WORKER = " (differs per worker)"


def _wait_shares(rows: list[dict[str, Any]], total_wait: int) -> list[float]:
    """Splits the consumer's wait ``total_wait`` over the rows (see ``StageSummary``)."""
    wait = [0.0] * len(rows)

    def behind_boundary(parent: dict[str, Any], child: dict[str, Any]) -> bool:
        if parent["in_workers"] != child["in_workers"]:
            return True
        return bool(parent["tid"] and child["tid"] and parent["tid"] != child["tid"])

    def assign(i: int, share: float) -> None:
        row = rows[i]
        inputs = [rows[k] for k in row["inputs"]]
        synchronous = [
            k for k, c in zip(row["inputs"], inputs, strict=True) if not behind_boundary(row, c)
        ]
        boundary = [
            k for k, c in zip(row["inputs"], inputs, strict=True) if behind_boundary(row, c)
        ]
        own = row["self_ns"]
        denominator = own + sum(rows[k]["total_ns"] for k in synchronous)
        if denominator <= 0:
            wait[i] += share
            return
        own_share = share * own / denominator
        upstream = sum(rows[k]["total_ns"] for k in boundary)
        if boundary and upstream > 0:
            for k in boundary:
                assign(k, own_share * rows[k]["total_ns"] / upstream)
        else:
            wait[i] += own_share
        for k in synchronous:
            assign(k, share * rows[k]["total_ns"] / denominator)

    if rows and total_wait > 0:
        assign(0, 1.0)
    return wait


def get_execution_summary(iterator: DatasetIterator[Any]) -> ExecutionSummary:
    """Returns the per-stage statistics of the pipeline ``iterator`` is the output of.

    Interleave inputs with the same structure are merged into one row per stage. Stages in
    ``mp_prefetch`` worker processes are as the workers report them when asked, here (call it
    from the thread that iterates).

    Raises:
      ValueError: if the pipeline does not track execution statistics.
    """
    ctx = getattr(iterator, "_ctx", None)
    mode = ctx.dataset_options.execution_tracking_mode if ctx is not None else None
    if mode in (None, ExecutionTrackingMode.DISABLED) or "_stage_stats" not in vars(iterator):
        raise ValueError(
            "Execution statistics are not collected for this iterator. Set "
            "`grain_py_debug_mode` or set `execution_tracking_mode` in grain options to "
            "`STAGE_TIMING` to enable execution statistics collection: "
            "`grain_core.config.update('py_debug_mode', True)`, or "
            "`ds = grain_core.experimental.WithOptionsIterDataset(ds, "
            "grain_core.experimental.DatasetOptions(execution_tracking_mode="
            "grain_core.experimental.ExecutionTrackingMode.STAGE_TIMING))`, before iterating."
        )
    refresh_worker_stages(iterator)
    rows: list[dict[str, Any]] = []
    # Siblings merge into one row: by name, and for worker stages by position, since every
    # worker runs the same pipeline but names its own slice ("SliceMapDataset[1:24:2]").
    index: dict[tuple[int, str | int], int] = {}
    visited: set[int] = set()

    def add(stats: _StageStats, parent_row: int, depth: int, position: int) -> int:
        key = (parent_row, position if stats.in_workers else stats.name)
        row_id = index.get(key)
        if row_id is None:
            row_id = len(rows)
            index[key] = row_id
            rows.append(
                {
                    "stats": [],
                    "depth": depth,
                    "inputs": [],
                    "name": stats.name,
                    "kind": stats.kind,
                    "in_workers": stats.in_workers,
                }
            )
            if parent_row >= 0:
                rows[parent_row]["inputs"].append(row_id)
        elif rows[row_id]["name"] != stats.name:
            rows[row_id]["name"] = _per_worker_name(rows[row_id]["name"])
        rows[row_id]["stats"].append(stats)
        return row_id

    def walk(stats: _StageStats, parent_row: int, depth: int, position: int) -> None:
        if id(stats) in visited:
            return
        visited.add(id(stats))
        row = add(stats, parent_row, depth, position)
        for i, child in enumerate(stats.inputs):
            walk(child, row, depth + 1, i)

    walk(iterator._stage_stats, -1, 0, 0)  # type: ignore[attr-defined]
    for r in rows:
        produced = [s for s in r["stats"] if s.count]
        r["self_ns"] = sum(s.self_ns for s in r["stats"])
        r["total_ns"] = sum(s.total_ns for s in r["stats"])
        r["tid"] = next((s.tid for s in produced if s.tid), 0)
        r["min_ns"] = min((s.min_ns for s in produced), default=0)
        r["max_ns"] = max((s.max_ns for s in produced), default=0)
        r["spec"] = next((s.spec for s in produced if s.spec is not None), None)
    total = sum(r["self_ns"] for r in rows) or 1
    output_wait = rows[0]["total_ns"]
    wait = _wait_shares(rows, output_wait)
    stages = [
        StageSummary(
            id=i,
            name=r["name"],
            kind=r["kind"],
            depth=r["depth"],
            inputs=tuple(r["inputs"]),
            num_produced_elements=sum(s.count for s in r["stats"]),
            self_time_ns=r["self_ns"],
            share=r["self_ns"] / total,
            instances=len(r["stats"]),
            total_time_ns=r["total_ns"],
            in_workers=r["in_workers"],
            type_name=r["stats"][0].type_name,
            min_time_ns=r["min_ns"],
            max_time_ns=r["max_ns"],
            output_spec=r["spec"],
            wait_share=wait[i],
            category=r["stats"][0].category,
        )
        for i, r in enumerate(rows)
    ]
    return ExecutionSummary(tuple(stages), output_wait_ns=output_wait)

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

Worker processes (``mp_prefetch``). A tracked worker pipeline sends ``worker_stage_snapshot`` of
its stages to the parent with its first element, then at most once a second and before it ends
(nothing is sent, and nothing is checked per element, when tracking is off). The parent keeps the
latest snapshot of each worker under that worker's receiving stage (``attach_worker_stages``), so
the summary shows the worker stages, summed over workers and marked ``[worker]``, below the
``mp_prefetch`` stage whose self time is the parent's wait for its workers.

Self time is measured per thread: a stage's children run either on the same thread (their
time is subtracted) or on reader/prefetch threads (then the stage's self time is the time it
waited for them). Summed self time can therefore exceed wall time when threads overlap; shares
are of the summed self time.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from grain_core.dataset.base import DatasetIterator, Indices, MapDataset, transform_name
from grain_core.dataset.options import ExecutionTrackingMode

__all__ = [
    "ExecutionSummary",
    "StageSummary",
    "attach_worker_stages",
    "get_execution_summary",
    "is_tracking",
    "time_stages",
    "worker_stage_snapshot",
]

_now = time.perf_counter_ns


class _Clock(threading.local):
    """Per thread: time spent in timed calls nested in the current one, and its stage."""

    nested_ns = 0
    stage: Any = None


_clock = _Clock()


class _StageStats:
    """Counters of one stage. Map stages may be updated from several reader threads.

    ``prepared`` is False for an iterator stage until its first ``next``: timing is installed
    from ``DatasetIterator.__init__``, before the subclass has set its attributes, so the
    MapDataset graph it reads from is timed on first use.

    ``inputs`` links the stats graph the summary walks. It outlives the iterators: an input
    that an interleave finished and dropped still counts. Links come from the iterator's
    attributes when it is prepared and, for inputs created later, from the first ``next`` call
    a consumer stage makes on them.
    """

    __slots__ = (
        "name",
        "kind",
        "count",
        "self_ns",
        "total_ns",
        "lock",
        "prepared",
        "inputs",
        "has_consumer",
        "in_workers",
    )

    def __init__(self, name: str, kind: str) -> None:
        self.name = name
        self.kind = kind
        self.count = 0
        self.self_ns = 0
        self.total_ns = 0
        self.lock = threading.Lock()
        self.prepared = kind == "map"
        self.inputs: list[_StageStats] = []
        self.has_consumer = False
        self.in_workers = False

    def link(self, child: _StageStats) -> None:
        child.has_consumer = True
        if all(child is not known for known in self.inputs):
            self.inputs.append(child)


# ------------------------------------------------------------------------- iterator stages
_TIMED_ITERATOR_CLASSES: dict[type[Any], type[Any]] = {}


def _timed_iterator_class(cls: type[Any]) -> type[Any]:
    timed = _TIMED_ITERATOR_CLASSES.get(cls)
    if timed is not None:
        return timed
    untimed_next = cls.__next__

    def __next__(self: Any) -> Any:
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
            element = untimed_next(self)
        finally:
            elapsed = _now() - start
            stats.self_ns += elapsed - clock.nested_ns
            stats.total_ns += elapsed
            clock.nested_ns = outer_nested + elapsed
            clock.stage = consumer
        stats.count += 1
        return element

    timed = type(
        cls.__name__,
        (cls,),
        {
            "__slots__": (),
            "__next__": __next__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_untimed_class": cls,
        },
    )
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


def _run_timed(stats: _StageStats, call: Any, count: int) -> Any:
    clock = _clock
    outer_nested = clock.nested_ns
    outer_stage = clock.stage
    clock.nested_ns = 0
    clock.stage = stats
    start = _now()
    try:
        return call()
    finally:
        elapsed = _now() - start
        own = elapsed - clock.nested_ns
        clock.nested_ns = outer_nested + elapsed
        clock.stage = outer_stage
        with stats.lock:
            stats.self_ns += own
            stats.total_ns += elapsed
            # A node whose batched read loops over its own __getitem__ counts elements once.
            if outer_stage is not stats:
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
        return _run_timed(self._stage_stats, lambda: untimed_getitem(self, index), 1)

    def _getitems(self: Any, indices: Indices) -> list[Any]:
        return _run_timed(self._stage_stats, lambda: untimed_getitems(self, indices), len(indices))

    timed = type(
        cls.__name__,
        (cls,),
        {
            "__slots__": (),
            "__getitem__": __getitem__,
            "_getitems": _getitems,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_untimed_class": cls,
        },
    )
    _TIMED_MAP_CLASSES[cls] = timed
    return timed


def _timed_map_graph(node: MapDataset[Any], memo: dict[int, MapDataset[Any]]) -> MapDataset[Any]:
    """Returns a copy of the graph under ``node`` whose nodes time their reads."""
    done = memo.get(id(node))
    if done is not None:
        return done
    if hasattr(node, "_stage_stats"):
        return node
    timed = copy.copy(node)
    memo[id(node)] = timed
    for name, value in vars(timed).items():
        replaced = _replace_map_datasets(value, memo)
        if replaced is not value:
            setattr(timed, name, replaced)
    timed.__class__ = _timed_map_class(type(node))
    stats = _StageStats(repr(node), "map")
    for parent in timed.parents:
        if isinstance(parent, MapDataset) and hasattr(parent, "_stage_stats"):
            stats.link(parent._stage_stats)
    timed._stage_stats = stats  # type: ignore[attr-defined]
    return timed


def _replace_map_datasets(value: Any, memo: dict[int, MapDataset[Any]]) -> Any:
    if isinstance(value, MapDataset):
        return _timed_map_graph(value, memo)
    if isinstance(value, (list, tuple)) and any(isinstance(v, MapDataset) for v in value):
        items = [_timed_map_graph(v, memo) if isinstance(v, MapDataset) else v for v in value]
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
        it._stage_stats = _StageStats("", "iter")  # type: ignore[attr-defined]
        it.__class__ = _timed_iterator_class(type(it))
        stack.extend(_child_iterators(it))


def _prepare(it: DatasetIterator[Any]) -> None:
    """Completes timing of ``it`` once it is fully built: its MapDataset graph and inputs."""
    stats = it._stage_stats  # type: ignore[attr-defined]
    stats.name = _iterator_stage_name(it)
    memo: dict[int, MapDataset[Any]] = {}
    for name in _map_graph_attributes(it):
        timed = _timed_map_graph(getattr(it, name), memo)
        setattr(it, name, timed)
        stats.link(timed._stage_stats)  # type: ignore[attr-defined]
    for child in _child_iterators(it):
        time_stages(child)
        stats.link(child._stage_stats)  # type: ignore[attr-defined]
    stats.prepared = True


def _prepare_reachable(iterator: DatasetIterator[Any]) -> None:
    stack = [iterator]
    seen: set[int] = set()
    while stack:
        it = stack.pop()
        if id(it) in seen or "_stage_stats" not in vars(it):
            continue
        seen.add(id(it))
        if not it._stage_stats.prepared:  # type: ignore[attr-defined]
            _prepare(it)
        stack.extend(_child_iterators(it))


# ---------------------------------------------------------------------- worker processes
#: One stage of a worker snapshot: name, kind, count, self ns, total ns, in_workers and the
#: positions of its inputs in the snapshot.
_SnapshotRow = tuple[str, str, int, int, int, bool, tuple[int, ...]]


def is_tracking(iterator: DatasetIterator[Any]) -> bool:
    """Whether ``iterator`` records stage timing (its pipeline asks for ``STAGE_TIMING``)."""
    mode = iterator._ctx.dataset_options.execution_tracking_mode
    return mode is ExecutionTrackingMode.STAGE_TIMING and "_stage_stats" in vars(iterator)


def worker_stage_snapshot(iterator: DatasetIterator[Any]) -> list[_SnapshotRow]:
    """The stage statistics under ``iterator`` as plain tuples a worker sends to the parent.

    Row 0 is ``iterator``'s own stage.
    """
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
    return [
        (
            s.name,
            s.kind,
            s.count,
            s.self_ns,
            s.total_ns,
            s.in_workers,
            tuple(position[id(c)] for c in s.inputs),
        )
        for s in order
    ]


def attach_worker_stages(iterator: DatasetIterator[Any], snapshot: list[_SnapshotRow]) -> None:
    """Puts a worker's latest ``snapshot`` under ``iterator``, the parent stage receiving that
    worker's elements, replacing the previous one. Does nothing if ``iterator`` is untimed."""
    receiver = vars(iterator).get("_stage_stats")
    if receiver is None or not snapshot:
        return
    nodes = []
    for name, kind, count, self_ns, total_ns, _, _ in snapshot:
        stats = _StageStats(name, kind)
        stats.count, stats.self_ns, stats.total_ns = count, self_ns, total_ns
        stats.prepared = stats.in_workers = True
        nodes.append(stats)
    for stats, row in zip(nodes, snapshot, strict=True):
        for child in row[6]:
            stats.link(nodes[child])
    receiver.inputs = [s for s in receiver.inputs if not s.in_workers]
    receiver.link(nodes[0])


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
        header = ("id", "stage", "elements", "self time", "per element", "share")
        rows = []
        for s in self.stages:
            merged = f" x{s.instances}" if s.instances > 1 else ""
            where = "[worker] " if s.in_workers else ""
            rows.append(
                (
                    str(s.id),
                    "  " * s.depth + ("<- " if s.depth else "") + where + s.name + merged,
                    f"{s.num_produced_elements:,}",
                    _format_ns(s.self_time_ns),
                    _format_ns(s.self_time_per_element_ns),
                    f"{100 * s.share:.1f}%",
                )
            )
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        widths[1] = min(widths[1], 100)

        def line(cells: Sequence[str]) -> str:
            name = cells[1] if len(cells[1]) <= widths[1] else cells[1][: widths[1] - 3] + "..."
            return " | ".join(
                [cells[0].rjust(widths[0]), name.ljust(widths[1])]
                + [c.rjust(w) for c, w in zip(cells[2:], widths[2:], strict=True)]
            )

        rule = "-+-".join("-" * w for w in widths)
        title = (
            f"grain_core execution summary: the consumer waited {_format_ns(self.output_wait_ns)} "
            "in next(). Self time excludes input stages; share is of the "
            f"{_format_ns(self.total_self_time_ns)} summed over stages and threads."
        )
        if any(s.in_workers for s in self.stages):
            title += " [worker] stages ran in mp_prefetch worker processes (summed over them)."
        body = [line(r) for r in rows]
        return "\n".join([title, line(header), rule, *body])


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


def get_execution_summary(iterator: DatasetIterator[Any]) -> ExecutionSummary:
    """Returns the per-stage statistics of the pipeline ``iterator`` is the output of.

    Interleave inputs with the same structure are merged into one row per stage.

    Raises:
      ValueError: if the pipeline does not track execution statistics.
    """
    ctx = getattr(iterator, "_ctx", None)
    mode = ctx.dataset_options.execution_tracking_mode if ctx is not None else None
    if mode is not ExecutionTrackingMode.STAGE_TIMING or "_stage_stats" not in vars(iterator):
        raise ValueError(
            "Execution statistics are not collected for this iterator. Set "
            "`execution_tracking_mode` to `STAGE_TIMING`, e.g. "
            "`ds = grain_core.experimental.WithOptionsIterDataset(ds, "
            "grain_core.experimental.DatasetOptions(execution_tracking_mode="
            "grain_core.experimental.ExecutionTrackingMode.STAGE_TIMING))`, before iterating."
        )
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

    _prepare_reachable(iterator)
    walk(iterator._stage_stats, -1, 0, 0)  # type: ignore[attr-defined]
    total = sum(s.self_ns for r in rows for s in r["stats"]) or 1
    stages = []
    for i, r in enumerate(rows):
        self_ns = sum(s.self_ns for s in r["stats"])
        stages.append(
            StageSummary(
                id=i,
                name=r["name"],
                kind=r["kind"],
                depth=r["depth"],
                inputs=tuple(r["inputs"]),
                num_produced_elements=sum(s.count for s in r["stats"]),
                self_time_ns=self_ns,
                share=self_ns / total,
                instances=len(r["stats"]),
                total_time_ns=sum(s.total_ns for s in r["stats"]),
                in_workers=r["in_workers"],
            )
        )
    return ExecutionSummary(tuple(stages), output_wait_ns=stages[0].total_time_ns)

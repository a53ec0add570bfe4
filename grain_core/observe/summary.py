"""The execution summary: per-stage counts and self times of a running pipeline as a table.

``get_execution_summary(iterator)`` (``grain_core.experimental``) returns an
``ExecutionSummary`` built from the stage statistics that ``grain_core.observe.stages`` records;
``print(summary)`` shows it as a table, the first thing to read when a pipeline is slow.

Self time is measured per thread: a stage's children run either on the same thread (their
time is subtracted) or on reader/prefetch threads (then the stage's self time is the time it
waited for them). Summed self time can therefore exceed wall time when threads overlap; shares
are of the summed self time. The wait share instead splits the consumer's time in ``next``:
the thread each stage produced its first element on tells which inputs sit behind a thread
or process boundary (see ``StageSummary.wait_share``).
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any

from grain_core.dataset.iterator import DatasetIterator
from grain_core.observe.stages import StageStats, refresh_worker_stages, stages_of

__all__ = [
    "ExecutionSummary",
    "StageSummary",
    "format_table",
    "get_execution_summary",
    "stage_cell",
]


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
    root = stages_of(iterator)
    if root is None:
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

    def add(stats: StageStats, parent_row: int, depth: int, position: int) -> int:
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

    def walk(stats: StageStats, parent_row: int, depth: int, position: int) -> None:
        if id(stats) in visited:
            return
        visited.add(id(stats))
        row = add(stats, parent_row, depth, position)
        for i, child in enumerate(stats.inputs):
            walk(child, row, depth + 1, i)

    walk(root, -1, 0, 0)
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

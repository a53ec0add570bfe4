"""Grain's debugging switches: the execution summary in debug mode, and the dataset graph.

* ``grain_core.config.update("py_debug_mode", True)``: pipelines built from then on time their
  stages (``grain_core.observe.stages``), and the pipeline's output logs the execution summary
  to the ``grain_core.debug`` logger at level INFO every ``py_debug_summary_interval`` seconds
  (60 by default, as in Grain) while elements are produced, and once when iteration ends
  (``StopIteration`` or ``close()``).
* ``grain_core.config.update("py_dataset_visualization_output_dir", d)``: when the output
  produces its first element, the dataset graph is logged (``d == ""``) and, for a directory
  ``d``, also written there as ``dataset_graph-<pid>-<n>.txt`` and ``.json``. Behind
  ``mp_prefetch`` the parent first asks its workers for their stages and waits for them.

How. An iterator built while either switch is on (and whose pipeline therefore tracks stage
timing) gets a reporting subclass of its timed class and marks itself the output of its
pipeline (``IteratorContext.output``): the iterator built last is the one no other iterator
reads. On its first ``next``, an iterator that is not (or no longer) its pipeline's output
reverts to the timed class, so only the output reports; with only the graph asked for, the
output reverts once the graph is reported. Nothing reports in worker processes: they send
their stage statistics to the parent, whose graph and summary include them.

The graph's layout (stable, documented in ``docs/debugging.md``): a title line, a header
``id | node | type | inputs | where | element spec`` and one row per node, output first, each
indented by its distance from the output; ``inputs`` are the ids of the nodes it reads from,
``where`` is ``main`` or ``workers``, and the element spec describes the first element the node
produced (``-`` where none was seen). Worker nodes are summed over workers (``x2``: in two).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
import weakref
from typing import Any

from grain_core.config import config
from grain_core.dataset.iterator import DatasetIterator
from grain_core.observe.spans import write_report_file
from grain_core.observe.stages import same_named_subclass
from grain_core.observe.summary import (
    ExecutionSummary,
    format_table,
    get_execution_summary,
    stage_cell,
)

__all__ = [
    "HANDLER_NAME",
    "SUMMARY_TITLE",
    "DatasetGraph",
    "GraphNode",
    "dataset_graph",
    "watch_output",
]

_logger = logging.getLogger("grain_core.debug")

#: The clock of the periodic summary (tests replace it).
_monotonic = time.monotonic

_REPORTING_CLASSES: dict[type[Any], type[Any]] = {}
_graph_files = itertools.count()
_hinted_at_logging = False
#: The name of the handler grain_core adds to ``grain_core.debug`` when no other would show
#: its records (``docs/debugging.md`` says how to remove it).
HANDLER_NAME = "grain_core.debug"
#: The first words of the execution summary in the log (Grain's, which users' log monitoring
#: matches).
SUMMARY_TITLE = "Grain Dataset Execution Summary"


class _FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes ``grain_core.debug``'s records to stderr while no other handler would show them
    (a handler configured later takes over: no record is shown twice)."""

    def handle(self, record: logging.LogRecord) -> bool:
        if _shown_by_a_handler(record.levelno, besides=self):
            return False
        return bool(super().handle(record))


_fallback_handler: _FallbackHandler | None = None


@dataclasses.dataclass(frozen=True)
class GraphNode:
    """One node of a dataset graph.

    Attributes:
      id: the node's number; the output is 0.
      name: the stage (iterator and transform, or the MapDataset's repr).
      type: the node's class.
      inputs: ids of the nodes it reads from.
      depth: distance from the output.
      in_workers: the node runs in ``mp_prefetch`` worker processes.
      instances: how many objects were merged into this node (workers, interleave inputs).
      element_spec: structure, dtypes and shapes of its first element (``None``: none seen).
    """

    id: int
    name: str
    type: str
    inputs: tuple[int, ...]
    depth: int
    in_workers: bool
    instances: int
    element_spec: str | None


@dataclasses.dataclass(frozen=True)
class DatasetGraph:
    """The nodes of a running pipeline, output first; ``str()`` is the logged table."""

    nodes: tuple[GraphNode, ...]

    def to_dict(self) -> dict[str, Any]:
        """The graph as JSON values (what the written ``.json`` file holds)."""
        return {"nodes": [{**dataclasses.asdict(n), "inputs": list(n.inputs)} for n in self.nodes]}

    def __str__(self) -> str:
        rows = [
            (
                str(n.id),
                stage_cell(n.name, n.depth, n.instances),
                n.type,
                ",".join(map(str, n.inputs)) or "-",
                "workers" if n.in_workers else "main",
                n.element_spec or "-",
            )
            for n in self.nodes
        ]
        title = (
            f"grain_core dataset graph: {len(self.nodes)} nodes, output first; inputs are node "
            "ids; where: main process or mp_prefetch worker processes."
        )
        header = ("id", "node", "type", "inputs", "where", "element spec")
        return format_table(title, header, rows, numbers=False)


def graph_of(summary: ExecutionSummary) -> DatasetGraph:
    """The dataset graph described by an execution summary."""
    return DatasetGraph(
        tuple(
            GraphNode(
                id=s.id,
                name=s.name,
                type=s.type_name,
                inputs=s.inputs,
                depth=s.depth,
                in_workers=s.in_workers,
                instances=s.instances,
                element_spec=s.output_spec,
            )
            for s in summary.stages
        )
    )


def dataset_graph(iterator: DatasetIterator[Any]) -> DatasetGraph:
    """The graph of the pipeline ``iterator`` is the output of.

    Raises:
      ValueError: if the pipeline does not track stage timing (debug mode, a visualization
        directory, a ``Trace`` or ``STAGE_TIMING`` turns it on).
    """
    return graph_of(get_execution_summary(iterator))


def watch_output(iterator: DatasetIterator[Any]) -> None:
    """Makes ``iterator`` its pipeline's reporting output if debug mode or the graph is on."""
    if not config.py_debug_mode and config.py_dataset_visualization_output_dir is None:
        return
    iterator._ctx.output = weakref.ref(iterator)
    iterator.__class__ = _reporting_class(type(iterator))


class _Reporter:
    """What the output of one pipeline still has to report, and when."""

    __slots__ = ("debug", "graph_dir", "interval", "next_due", "finished")

    def __init__(self) -> None:
        self.debug = bool(config.py_debug_mode)
        self.graph_dir: str | None = config.py_dataset_visualization_output_dir
        self.interval = float(config.py_debug_summary_interval)
        self.next_due = _monotonic() + self.interval
        self.finished = False

    def produced(self, it: DatasetIterator[Any]) -> None:
        if self.graph_dir is not None:
            directory, self.graph_dir = self.graph_dir, None
            _report_graph(dataset_graph(it), directory)
            if not self.debug:
                _stop_reporting(it)
                return
        now = _monotonic()
        if now >= self.next_due:
            self.next_due = now + self.interval
            _log_summary(it, "periodic")

    def finish(self, it: DatasetIterator[Any]) -> None:
        if self.graph_dir is not None:
            directory, self.graph_dir = self.graph_dir, None
            _report_graph(dataset_graph(it), directory)
        if self.debug and not self.finished:
            self.finished = True
            _log_summary(it, "at the end of iteration")


def _reporter(it: DatasetIterator[Any]) -> _Reporter | None:
    """The reporter of ``it``, created on first use if ``it`` is its pipeline's output in the
    main process; otherwise ``it`` stops reporting and ``None`` is returned."""
    reporter: _Reporter | None = vars(it).get("_debug_reporter")
    if reporter is None:
        output = it._ctx.output
        if output is None or output() is not it or it._ctx.mp_context.process_count > 1:
            _stop_reporting(it)
            return None
        reporter = it._debug_reporter = _Reporter()  # type: ignore[attr-defined]
    return reporter


def _stop_reporting(it: DatasetIterator[Any]) -> None:
    it.__class__ = type(it)._timed_class  # type: ignore[attr-defined]


def _reporting_class(cls: type[Any]) -> type[Any]:
    reporting = _REPORTING_CLASSES.get(cls)
    if reporting is not None:
        return reporting
    timed_next = cls.__next__
    timed_close = cls.close

    def __next__(self: Any) -> Any:
        reporter = _reporter(self)
        if reporter is None:
            return timed_next(self)
        try:
            element = timed_next(self)
        except StopIteration:
            reporter.finish(self)
            raise
        reporter.produced(self)
        return element

    def close(self: Any) -> None:
        reporter = vars(self).get("_debug_reporter")
        if reporter is not None and not self._closed:
            reporter.finish(self)
        timed_close(self)

    reporting = same_named_subclass(cls, {"__next__": __next__, "close": close}, "_timed_class")
    _REPORTING_CLASSES[cls] = reporting
    return reporting


def _shown_by_a_handler(level: int, besides: logging.Handler | None = None) -> bool:
    """Whether a handler of ``grain_core.debug`` or of a logger it propagates to (other than
    ``besides``) would show a record of ``level`` (Python's last resort shows warnings only)."""
    logger: logging.Logger | None = _logger
    while logger is not None:
        if any(h is not besides and h.level <= level for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def _hint_at_logging() -> None:
    """Makes debug output visible as Grain's is: where INFO records of ``grain_core.debug``
    are enabled but no handler would show them (the root logger at INFO without a handler),
    adds a handler that writes them to stderr, once per process; where they are disabled,
    says once how to enable them."""
    global _hinted_at_logging, _fallback_handler
    if not _logger.isEnabledFor(logging.INFO):
        if not _hinted_at_logging:
            _hinted_at_logging = True
            _logger.warning(
                "grain_core debug output is logged at level INFO to the 'grain_core.debug' "
                "logger, which does not show it now: call "
                "logging.basicConfig(level=logging.INFO) or "
                "logging.getLogger('grain_core.debug').setLevel(logging.INFO)."
            )
        return
    if _fallback_handler is None and not _shown_by_a_handler(logging.INFO):
        _fallback_handler = _FallbackHandler()
        _fallback_handler.set_name(HANDLER_NAME)
        _fallback_handler.setFormatter(logging.Formatter("%(message)s"))
        _logger.addHandler(_fallback_handler)


def _log_summary(it: DatasetIterator[Any], when: str) -> None:
    _hint_at_logging()
    _logger.info("%s (%s):\n%s", SUMMARY_TITLE, when, get_execution_summary(it))


def _report_graph(graph: DatasetGraph, directory: str) -> None:
    """Logs ``graph`` and writes it to ``directory`` if not empty.

    Raises:
      OSError: if the directory cannot be written (the message names the file).
    """
    _hint_at_logging()
    _logger.info("%s", graph)
    if directory:
        stem = os.path.join(directory, f"dataset_graph-{os.getpid()}-{next(_graph_files)}")
        write_report_file(stem + ".txt", str(graph) + "\n")
        write_report_file(stem + ".json", json.dumps(graph.to_dict(), indent=1))
        _logger.info("Dataset graph written to %s.txt and .json", stem)

"""Profiling a pipeline into one HTML report (``grain-core profile``, :func:`profile`).

:func:`profile` runs a pipeline for some batches under a :class:`~grain_core.experimental.Trace`
and writes a self-contained HTML page (:mod:`grain_core.observe.report_html`, which needs the optional
``plotly``: ``pip install plotly``): the verdict on the bottleneck in plain
words, throughput over time, each stage's share of the time, how busy each process was, the
consumer's waiting share and the dataset graph. :func:`report_from_trace` makes the same page
from a trace saved with ``Trace.save`` or ``profile(..., trace_output=...)``.

Everything the page shows is computed here from the trace's spans (:func:`analyze`), so a live
run and a saved trace give the same report. Per stage: self time is a span's duration minus
the spans directly inside it on its thread. Per process: busy time is the self time of its
stages that compute (not those that wait for threads or processes, nor transport), over the
window. The consumer's wait is the time in the output stage's ``next`` over the window.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import cloudpickle

from grain_core._progress import progress as progress_bar
from grain_core.dataset.base import IterDataset, MapDataset
from grain_core.dataset.iterator import DatasetIterator
from grain_core.dataset.transfer_cost import (
    MARGIN,
    cheapest_transport_seconds,
    seconds_per_result_with_workers,
    transport_seconds,
    usable_cores,
)
from grain_core.observe import report_html
from grain_core.observe.graph import graph_of
from grain_core.observe.spans import Trace, span_clock, write_report_file
from grain_core.observe.summary import get_execution_summary

__all__ = [
    "PipelineError",
    "ProfileData",
    "ProcessTime",
    "StageTime",
    "analyze",
    "format_share",
    "load_pipeline",
    "profile",
    "report_from_trace",
    "stage_label",
]

#: Trace categories of stages that wait for others rather than compute.
_WAITING = ("wait", "transport")
#: Engine stages in the words of the user's pipeline (``mp_prefetch``'s own parts).
_ENGINE_STAGES = {
    "DispatchedClass": "receiving results from the workers",
    "ProcessPrefetch": "receiving results from the workers",
    "MultiprocessPrefetch": "mp_prefetch",
    "ClassBatches": "batch",
    "AssignedPositions": "the worker's share of positions",
    "Prefetch": "read-ahead of to_iter_dataset",
}


class PipelineError(RuntimeError):
    """The profiled pipeline (or the function building it) raised; the user's exception is
    chained as ``__cause__`` with its traceback."""


@dataclasses.dataclass(frozen=True)
class StageTime:
    """One stage's time in the window: ``self_s`` summed over threads and processes."""

    name: str
    category: str
    in_workers: bool
    self_s: float
    share: float
    calls: int

    @property
    def label(self) -> str:
        """The stage's name in the user's words (:func:`stage_label`)."""
        return stage_label(self.name)

    @property
    def share_text(self) -> str:
        """The stage's share of the time as the report writes it (:func:`format_share`)."""
        return format_share(self.share)


@dataclasses.dataclass(frozen=True)
class ProcessTime:
    """How busy one process was: ``busy_s`` of stage work in a window of ``window_s``."""

    name: str
    is_worker: bool
    busy_s: float
    window_s: float

    @property
    def utilisation(self) -> float:
        return min(1.0, self.busy_s / self.window_s) if self.window_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class ProfileData:
    """What the report shows.

    Attributes:
      window_s: the profiled wall time.
      batch_end_s: when each batch was produced, seconds from the window's start.
      stages: stage times, largest first.
      processes: the main process first, then each worker.
      consumer_wait_s: time the consumer spent in ``next``.
      graph: the dataset graph (``DatasetGraph.to_dict()``), ``None`` if the trace has none.
      graph_text: the same as text.
      step_s: the simulated training step per batch (0: none).
      transport_s: what moving one batch from a worker costs: the worker's and the main
        process's seconds (measured on the last batch, as ``mp_prefetch`` prices it).
      usable_cores: the CPU cores the profiled process could use (affinity, cgroup quota).
      verdict: the bottleneck in plain words.
    """

    window_s: float
    batch_end_s: tuple[float, ...]
    stages: tuple[StageTime, ...]
    processes: tuple[ProcessTime, ...]
    consumer_wait_s: float
    graph: dict[str, Any] | None
    graph_text: str | None
    step_s: float
    transport_s: tuple[float, float]
    usable_cores: float
    verdict: str

    @property
    def consumer_wait_share(self) -> float:
        return min(1.0, self.consumer_wait_s / self.window_s) if self.window_s > 0 else 0.0

    def throughput(self, bins: int = 40) -> tuple[list[float], list[float]]:
        """Batches per second over time: bin centres (s) and rates."""
        if not self.batch_end_s or self.window_s <= 0:
            return [], []
        n = max(1, min(bins, len(self.batch_end_s) // 8))
        width = self.window_s / n
        counts = [0] * n
        for t in self.batch_end_s:
            counts[min(n - 1, int(t / width))] += 1
        return [width * (i + 0.5) for i in range(n)], [c / width for c in counts]


# --------------------------------------------------------------------------------- running
def load_pipeline(spec: str) -> Callable[[], Any]:
    """The function named by ``spec``: ``package.module:function`` or ``path/file.py:function``.

    Raises:
      ValueError: if ``spec`` is malformed, or names nothing callable.
      ImportError: if the module cannot be imported (with the original error chained).
    """
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"Pipeline {spec!r} must be 'package.module:function' or 'path/to/file.py:function' "
            "naming a function that returns the dataset."
        )
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"Pipeline file {module_name!r} does not exist.")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"Cannot load Python file {module_name!r}.")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        module_spec.loader.exec_module(module)
        # Worker processes cannot import a file by path: its functions travel by value.
        cloudpickle.register_pickle_by_value(module)
    else:
        module = importlib.import_module(module_name)
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"Module {module_name!r} has no {attribute!r} (from {spec!r}).")
    if not callable(target):
        raise ValueError(f"{spec!r} is not a function returning a dataset.")
    return target  # type: ignore[no-any-return]


def _dataset_from(pipeline: Any) -> IterDataset[Any]:
    """The IterDataset to profile (a MapDataset is read as ``iter()`` reads it)."""
    if isinstance(pipeline, str):
        pipeline = load_pipeline(pipeline)
    if isinstance(pipeline, (IterDataset, MapDataset)):
        return _as_iter_dataset(pipeline)
    if not callable(pipeline):
        raise TypeError(
            f"profile() needs a dataset, a function returning one, or an import path; got "
            f"{type(pipeline).__name__}."
        )
    name = getattr(pipeline, "__qualname__", repr(pipeline))
    try:
        ds = pipeline()
    except Exception as e:
        raise PipelineError(
            f"The pipeline function {name} raised {type(e).__qualname__}: {e}"
        ) from e
    if not isinstance(ds, (IterDataset, MapDataset)):
        raise TypeError(
            f"The pipeline function {name} returned {type(ds).__name__}; it must return a "
            "grain_core MapDataset or IterDataset."
        )
    return _as_iter_dataset(ds)


def _as_iter_dataset(ds: IterDataset[Any] | MapDataset[Any]) -> IterDataset[Any]:
    return ds.to_iter_dataset() if isinstance(ds, MapDataset) else ds


def _check_writable(path: str | os.PathLike[str], what: str) -> None:
    """Fails before a long run if ``path`` cannot be written.

    Raises:
      OSError: naming ``path``.
    """
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        raise OSError(
            f"Cannot write the {what} {os.fspath(path)!r}: {directory!r} is not a writable "
            "directory. Choose another location."
        )


def profile(
    pipeline: Any,
    *,
    num_batches: int = 100,
    output: str | os.PathLike[str] | None = "grain_core_profile.html",
    trace_output: str | os.PathLike[str] | None = None,
    step_seconds: float = 0.0,
    progress: bool = True,
) -> ProfileData:
    """Runs ``pipeline`` for ``num_batches`` batches and writes the HTML report to ``output``.

    Args:
      pipeline: a dataset, a function returning one, or its import path
        (``package.module:function`` or ``path/file.py:function``).
      num_batches: batches to read (fewer if the dataset ends first).
      output: the HTML file to write (``None``: none; the data is returned).
      trace_output: also save the trace there (``report_from_trace`` reads it again).
      step_seconds: sleep this long per batch, as a training step would take; the consumer's
        waiting share then says whether the pipeline keeps up with such a step.
      progress: show a progress bar (tqdm, when it is installed and stderr is a terminal).

    Raises:
      ValueError: if ``num_batches`` is not positive or ``step_seconds`` is negative.
      OSError: if ``output`` or ``trace_output`` cannot be written (checked before running).
      PipelineError: if the pipeline function or the pipeline raises (the error is chained).
      ImportError: if plotly is missing for the report.
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches <= 0:
        raise ValueError(f"num_batches must be a positive int, got {num_batches!r}.")
    if not step_seconds >= 0:
        raise ValueError(f"step_seconds must be >= 0, got {step_seconds!r}.")
    if output is not None:
        _check_writable(output, "report")
        report_html.require_plotly()
    if trace_output is not None:
        _check_writable(trace_output, "trace")
    ds = _dataset_from(pipeline)
    batch_ends: list[int] = []
    batch: Any = None
    loop: Iterable[int] = range(num_batches)
    if progress:
        loop = progress_bar(loop, num_batches, "batch")
    with Trace() as recording:
        it = iter(ds)
        try:
            it.start_prefetch()
            loop_start = span_clock()
            for _ in loop:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                except Exception as e:
                    raise PipelineError(_failure(e, it, len(batch_ends))) from e
                batch_ends.append(span_clock())
                if step_seconds:
                    time.sleep(step_seconds)
            summary = get_execution_summary(it)
        finally:
            it.close()
    trace_json = recording.to_json()
    start = recording.start_ns or 0
    trace_json["otherData"]["grain_core"] = {
        "loop_start_ns": loop_start - start,
        "batch_end_ns": [t - loop_start for t in batch_ends],
        "consumer": [os.getpid(), threading.get_native_id()],
        "graph": graph_of(summary).to_dict(),
        "graph_text": str(graph_of(summary)),
        "step_s": step_seconds,
        "transport_s": list(cheapest_transport_seconds(batch)),
        "usable_cores": usable_cores(),
    }
    if trace_output is not None:
        write_report_file(trace_output, json.dumps(trace_json))
    data = analyze(trace_json)
    if output is not None:
        write_report_file(output, report_html.render(data))
    return data


def _failure(error: Exception, it: DatasetIterator[Any], batch: int) -> str:
    """What ``profile`` says when reading after ``batch`` batches raised ``error``: its type, message
    and where: the worker process its note names (the worker's traceback is in the note), else
    the innermost pipeline stage in its traceback."""
    where = next(
        (
            note.split(". ", 1)[0].removeprefix("Raised in ")
            for note in getattr(error, "__notes__", ())
            if note.startswith("Raised in ")
        ),
        None,
    )
    if where is None:
        for frame, _ in traceback.walk_tb(error.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, (MapDataset, DatasetIterator)) and owner is not it:
                where = f"the stage {stage_label(_stage_name(owner))}"
    return (
        f"The pipeline raised {type(error).__qualname__}"
        f"{f' in {where}' if where else ''} after {batch} batches: {error}"
    )


def _stage_name(owner: MapDataset[Any] | DatasetIterator[Any]) -> str:
    stats = vars(owner).get("_stage_stats")
    name = getattr(stats, "name", "")
    return name if name else repr(owner)


def report_from_trace(
    trace_path: str | os.PathLike[str], output: str | os.PathLike[str]
) -> ProfileData:
    """Writes the HTML report of a saved trace.

    Raises:
      ValueError: if the file is not a trace-event JSON file.
      OSError: if it cannot be read, or ``output`` cannot be written.
    """
    _check_writable(output, "report")
    report_html.require_plotly()
    text = Path(trace_path).read_text(encoding="utf-8")
    try:
        trace_json = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(trace_path)!r} is not JSON: {e}") from e
    if isinstance(trace_json, list):
        trace_json = {"traceEvents": trace_json}
    if not isinstance(trace_json, dict) or not isinstance(trace_json.get("traceEvents"), list):
        raise ValueError(
            f"{os.fspath(trace_path)!r} is not a trace-event file (no 'traceEvents' list); "
            "save one with grain_core.experimental.Trace.save or grain-core profile --trace-output."
        )
    data = analyze(trace_json)
    write_report_file(output, report_html.render(data))
    return data


# -------------------------------------------------------------------------------- analysis
def analyze(trace_json: dict[str, Any]) -> ProfileData:
    """Computes what the report shows from a trace (see the module docstring).

    Raises:
      ValueError: if the trace has no spans.
    """
    events = trace_json["traceEvents"]
    extra = trace_json.get("otherData", {}).get("grain_core", {})
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        raise ValueError("The trace has no spans: did the pipeline produce any element?")
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for span in spans:
        by_thread.setdefault((span["pid"], span["tid"]), []).append(span)
    main_pid = _main_pid(names, by_thread)
    consumer = tuple(extra["consumer"]) if "consumer" in extra else None
    if consumer not in by_thread:
        consumer = max((t for t in by_thread if t[0] == main_pid), key=lambda t: len(by_thread[t]))
    stage_self: dict[tuple[str, bool], list[float]] = {}
    stage_category: dict[tuple[str, bool], str] = {}
    busy: dict[int, float] = {}
    active: dict[int, list[float]] = {}
    consumer_tops: list[dict[str, Any]] = []
    for track, track_spans in by_thread.items():
        in_workers = track[0] != main_pid
        first = min(s["ts"] for s in track_spans) / 1e6
        last = max(s["ts"] + s["dur"] for s in track_spans) / 1e6
        span_of = active.setdefault(track[0], [first, last])
        span_of[0], span_of[1] = min(span_of[0], first), max(span_of[1], last)
        for span, own_us, top in _self_times(track_spans):
            key = (_stage_key(span["name"]) if in_workers else span["name"], in_workers)
            entry = stage_self.setdefault(key, [0.0, 0])
            entry[0] += own_us / 1e6
            entry[1] += 1
            stage_category[key] = span["cat"]
            if span["cat"] not in _WAITING:
                busy[track[0]] = busy.get(track[0], 0.0) + own_us / 1e6
            if top and track == consumer:
                consumer_tops.append(span)
    # The window starts when the consumer asks for its first batch (worker start-up, in
    # start_prefetch, comes before).
    loop_start_us = extra.get("loop_start_ns", 0) / 1e3
    consumer_tops = [s for s in consumer_tops if s["ts"] >= loop_start_us]
    if "batch_end_ns" in extra:
        batch_end = [t / 1e9 for t in extra["batch_end_ns"]]
    else:
        batch_end = sorted((s["ts"] + s["dur"]) / 1e6 for s in consumer_tops)
    window = max(batch_end, default=0.0)
    total_self = sum(v[0] for v in stage_self.values()) or 1.0
    stages = sorted(
        (
            StageTime(name, stage_category[(name, w)], w, v[0], v[0] / total_self, int(v[1]))
            for (name, w), v in stage_self.items()
        ),
        key=lambda s: -s.self_s,
    )
    pids = [main_pid] + sorted(p for p in {t[0] for t in by_thread} if p != main_pid)
    # A worker's window runs from its first span to its last: its start-up is not idle time.
    processes = tuple(
        ProcessTime(
            names.get(p, f"process {p}"),
            p != main_pid,
            busy.get(p, 0.0),
            window if p == main_pid else active[p][1] - active[p][0],
        )
        for p in pids
    )
    consumer_wait = sum(s["dur"] for s in consumer_tops) / 1e6
    data = ProfileData(
        window_s=window,
        batch_end_s=tuple(batch_end),
        stages=tuple(stages),
        processes=processes,
        consumer_wait_s=consumer_wait,
        graph=extra.get("graph"),
        graph_text=extra.get("graph_text"),
        step_s=float(extra.get("step_s", 0.0)),
        transport_s=_pair(extra.get("transport_s")),
        usable_cores=float(extra.get("usable_cores") or usable_cores()),
        verdict="",
    )
    return dataclasses.replace(data, verdict=verdict(data))


def _pair(value: Any) -> tuple[float, float]:
    """A trace's transport seconds; for a trace without them, those of a small element."""
    if isinstance(value, list) and len(value) == 2:
        return float(value[0]), float(value[1])
    return transport_seconds(0)


def _main_pid(names: dict[int, str], by_thread: dict[tuple[int, int], list[Any]]) -> int:
    for pid, name in names.items():
        if name.startswith("grain_core main process"):
            return pid
    return min(t[0] for t in by_thread)


def _self_times(spans: list[dict[str, Any]]) -> Iterable[tuple[dict[str, Any], float, bool]]:
    """Each span of one thread with its self time (µs) and whether it is top-level."""
    ordered = sorted(spans, key=lambda s: (s["ts"], -s["dur"]))
    own = [s["dur"] for s in ordered]
    top = [True] * len(ordered)
    stack: list[int] = []
    for i, span in enumerate(ordered):
        while stack and ordered[stack[-1]]["ts"] + ordered[stack[-1]]["dur"] <= span["ts"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= span["dur"]
            top[i] = False
        stack.append(i)
    return zip(ordered, own, top, strict=True)


def _stage_key(name: str) -> str:
    """A worker stage's name without what differs between workers (their slices)."""
    return re.sub(r"\[[0-9:]*\]", "[...]", name)


_STAGE_NAME = re.compile(r"(?P<kind>[A-Za-z_]+)(?:\((?P<args>.*)\))?$")
_TRANSFORM = re.compile(r"(?:transform=)?(?P<fn>[\w.<>]+) @ (?:\.\.\./)?(?P<where>[^)]*?)(?:\)|$)")


def stage_label(name: str) -> str:
    """A stage's name as the user's pipeline spells it: ``map square (pipe.py:9)`` for
    ``MapMapDataset(transform=square @ .../pipe.py:9)``, ``shuffle(seed=1)``, and the engine's
    own stages in words (``receiving results from the workers``)."""
    if " > " in name:
        return " > ".join(stage_label(part) for part in name.split(" > "))
    match = _STAGE_NAME.match(name)
    if match is None:
        return name
    kind = match.group("kind").removesuffix("MapDataset").removesuffix("IterDataset")
    if kind in _ENGINE_STAGES:
        return _ENGINE_STAGES[kind]
    operation = re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()
    args = match.group("args")
    transform = _TRANSFORM.match(args or "")
    if transform:
        return f"{operation} {transform.group('fn')} ({os.path.basename(transform.group('where'))})"
    return f"{operation}({args})" if args else operation


def format_share(share: float) -> str:
    """A stage's share of the time as the report writes it, in the chart and the verdict."""
    return f"{100 * share:.1f}%"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.1f} ms"


def _describe(stage: StageTime) -> str:
    """A stage in words: "the map `decode` (x.py:3)", "batching", "reading (source)"."""
    label = stage_label(stage.name)
    if stage.category == "batch":
        return "batching"
    if stage.category in _WAITING:
        return label
    if stage.category == "read":
        return f"reading ({label})"
    operation, _, rest = label.partition(" ")
    if rest and not rest.startswith("("):
        function, _, where = rest.partition(" ")
        return f"the {operation} `{function}` {where}".rstrip()
    return f"the stage {label}"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


@dataclasses.dataclass(frozen=True)
class _WorkerModel:
    """What worker processes would give this pipeline, in the model ``mp_prefetch`` decides
    with (docs/workers.md): a batch costs ``here_s`` in one process (its work and the
    consumer's time between two), ``with_workers_s`` at best with ``workers`` workers on the
    usable cores."""

    work_s: float
    move_s: float
    here_s: float
    workers: int
    with_workers_s: float
    cores: float

    @property
    def pays_off(self) -> bool:
        return self.with_workers_s < MARGIN * self.here_s

    def compared(self) -> str:
        return (
            f"computing a batch takes {_duration(self.work_s)} and moving one from a worker "
            f"process about {_duration(self.move_s)}"
        )


def _worker_model(data: ProfileData) -> _WorkerModel:
    batches = len(data.batch_end_s) or 1
    work = sum(s.self_s for s in data.stages if s.category not in _WAITING) / batches
    if data.step_s:
        between = data.step_s
    else:
        between = max(0.0, data.window_s - data.consumer_wait_s) / batches
    send, receive = data.transport_s
    cores = max(1.0, data.usable_cores)

    def per_batch(n: int) -> float:
        return seconds_per_result_with_workers(
            work, between, work, send, receive, n, min(n + 1, cores)
        )

    # Never more workers than usable cores; the fewest that come within 5% of the best.
    counts = range(1, max(1, int(cores)) + 1)
    best = min(per_batch(n) for n in counts)
    workers = next(n for n in counts if per_batch(n) <= 1.05 * best)
    return _WorkerModel(work, send + receive, work + between, workers, per_batch(workers), cores)


def verdict(data: ProfileData) -> str:
    """The bottleneck in plain words, with what to do about it: worker processes only where
    the model ``mp_prefetch`` decides with says they pay off, at most one per usable core."""
    computing = [s for s in data.stages if s.category not in _WAITING]
    workers = [p for p in data.processes if p.is_worker]
    waited = data.consumer_wait_share
    if data.step_s and waited < 0.1:
        return (
            f"The input pipeline keeps up: with a {data.step_s * 1000:.0f} ms step the consumer "
            f"waited only {waited:.0%} of the time in next(). Speeding up the pipeline would "
            "not speed up training."
        )
    if data.step_s:
        lead = (
            f"With a {data.step_s * 1000:.0f} ms step the consumer waited {waited:.0%} of the "
            "time for data. "
        )
    else:
        lead = (
            "No training step was simulated, so the consumer asked for each batch at once: "
            "pass your step's time (--step-ms, or step_seconds=) to see whether the pipeline "
            "keeps up with it. "
        )
    if not computing:
        return lead + "No stage did measurable work: the time went to waiting."
    model = _worker_model(data)
    cheaper = "(e.g. vectorise it over a batch: batch before it)"
    if workers:
        in_workers = [s for s in computing if s.in_workers]
        main = [s for s in computing if not s.in_workers]
        utilisation = sum(p.utilisation for p in workers) / len(workers)
        if in_workers and utilisation >= 0.5:
            top = in_workers[0]
            busy = (
                f"{_sentence(_describe(top))} in workers takes {format_share(top.share)} of "
                f"all stage time, and the {len(workers)} workers are busy {utilisation:.0%} of "
                "the time: "
            )
            if model.pays_off and model.workers > len(workers):
                return (
                    lead
                    + busy
                    + (
                        f"add workers (num_workers={model.workers}, for {model.cores:g} usable "
                        f"cores), or make {_describe(top)} cheaper {cheaper}."
                    )
                )
            return (
                lead
                + busy
                + (
                    f"more workers would not help on {model.cores:g} usable cores; make "
                    f"{_describe(top)} cheaper {cheaper}."
                )
            )
        moving = max(data.stages, key=lambda s: s.share if not s.in_workers else -1.0)
        if not main or moving.share > main[0].share:
            if not model.pays_off:
                return lead + (
                    f"The workers are idle {1 - utilisation:.0%} of the time: {model.compared()}"
                    f" ({_describe(moving)}: {format_share(moving.share)} of all stage time), "
                    "so this pipeline is faster in one process: remove .mp_prefetch (or set "
                    "num_workers=0)."
                )
            return lead + (
                f"The workers are idle {1 - utilisation:.0%} of the time and the time goes to "
                f"{stage_label(moving.name)} ({format_share(moving.share)} of all stage time): "
                "send smaller elements (batch or decode later), or check that the workers "
                "were not still starting."
            )
        top_main = main[0]
        return lead + (
            f"The workers are idle {1 - utilisation:.0%} of the time, so they are not the "
            f"bottleneck; in the main process {_describe(top_main)} takes "
            f"{format_share(top_main.share)} of all stage time: move it before mp_prefetch so "
            "that workers run it."
        )
    top = computing[0]
    where = f"{_sentence(_describe(top))} takes {format_share(top.share)} of all stage time"
    if not model.pays_off:
        return lead + (
            f"{where}. Worker processes would not make this faster: {model.compared()}, on "
            f"{model.cores:g} usable cores (docs/workers.md). Make {_describe(top)} cheaper "
            f"{cheaper}, or profile with a heavier pipeline step."
        )
    start = (
        "read with more threads (ReadOptions(num_threads=...)) or in worker processes: "
        if top.category == "read"
        else "run it in worker processes: "
    )
    return lead + (
        f"{where}, in the main process; {model.compared()}, so {start}call "
        f".mp_prefetch(grain.MultiprocessingOptions(num_workers={model.workers})) after it "
        f"(for {model.cores:g} usable cores)."
    )


# ------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``grain-core profile``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "pipeline",
        nargs="?",
        help="'package.module:function' or 'path/file.py:function' returning the dataset",
    )
    source.add_argument("--trace", help="make the report from a saved trace instead")
    parser.add_argument(
        "-n", "--num-batches", type=int, default=100, help="batches to read (default 100)"
    )
    parser.add_argument(
        "-o", "--output", default="grain_core_profile.html", help="the HTML report to write"
    )
    parser.add_argument("--trace-output", help="also save the trace (open in ui.perfetto.dev)")
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="simulate a training step of this many ms per batch (default 0)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs ``grain-core profile``."""
    start = time.perf_counter()
    try:
        report_html.require_plotly()
    except ImportError as e:
        print(f"grain-core profile: error: {e}", file=sys.stderr)
        return 1
    if args.trace:
        data = report_from_trace(args.trace, args.output)
    else:
        try:
            data = profile(
                args.pipeline,
                num_batches=args.num_batches,
                output=args.output,
                trace_output=args.trace_output,
                step_seconds=args.step_ms / 1000,
            )
        except PipelineError as e:
            # The user's own error: its traceback (with the stage's notes), then one line.
            traceback.print_exception(e.__cause__ or e, file=sys.stderr)
            print(f"grain-core profile: error: {e}", file=sys.stderr)
            return 1
    print(
        f"{len(data.batch_end_s)} batches in {data.window_s:.2f} s "
        f"({_rate(data):.1f} batches/s); report written to {args.output} "
        f"({time.perf_counter() - start:.1f} s in all)\n{data.verdict}"
    )
    return 0


def _rate(data: ProfileData) -> float:
    return len(data.batch_end_s) / data.window_s if data.window_s > 0 else math.nan

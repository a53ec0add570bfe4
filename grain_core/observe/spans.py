"""A timeline of pipeline stages: spans on one clock, exported as Chrome trace-event JSON.

``Trace`` (``grain_core.experimental.Trace``) records, while it is open, one span per call of
every stage of the pipelines built meanwhile: reads, each transform, batching, the parent's
wait for its threads and worker processes, and the consumer's ``next``; in each worker process
also every message it sends to the parent (category ``transport``) and every wait for the
parent's credits or work (``wait``). ``Trace.save(path)``
writes them in the trace-event format that ``ui.perfetto.dev`` and ``chrome://tracing`` open,
with one track per process and thread.

How it works. A pipeline built while a ``Trace`` is open runs with
``ExecutionTrackingMode.STAGE_TRACING``: stage timing (``grain_core.observe.stages``) plus one
tuple per timed call appended to this process's ring buffer (a bounded ``deque``: the newest
``capacity`` spans are kept). The mode travels with the pipeline's options to its
``mp_prefetch`` workers, which append to their own ring buffers and send the spans to the parent
with their stage statistics. Every process stamps spans with ``time.perf_counter_ns``, which on
Linux reads ``CLOCK_MONOTONIC``: one clock for all processes of the machine, so the parent's and
the workers' spans share one time axis. A pipeline built with tracing off runs no code of this
module.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from grain_core import storage
from grain_core.dataset.options import trace_pipelines

__all__ = [
    "DEFAULT_CAPACITY",
    "Trace",
    "span_clock",
    "validate_trace_events",
    "write_report_file",
]

#: The clock of every span, in every process.
span_clock = time.perf_counter_ns

#: Spans kept per process by default (a span is a tuple of 5 items: about 120 bytes).
DEFAULT_CAPACITY = 200_000

#: A span: thread id, stage name, category, start (ns) and duration (ns).
Span = tuple[int, str, str, int, int]


class _Recorder:
    """The spans of this process (``local``) and those workers sent to it (``remote``)."""

    def __init__(self) -> None:
        self.local: collections.deque[Span] = collections.deque(maxlen=DEFAULT_CAPACITY)
        self.remote: collections.deque[tuple[int, Span]] = collections.deque(
            maxlen=DEFAULT_CAPACITY
        )
        self.thread_names: dict[tuple[int, int], str] = {}
        self.process_names: dict[int, str] = {}
        self.open: Trace | None = None
        self.lock = threading.Lock()


_recorder = _Recorder()


def register_thread() -> int:
    """Returns the calling thread's id for spans and remembers its name."""
    tid = threading.get_native_id()
    _recorder.thread_names[(os.getpid(), tid)] = threading.current_thread().name
    return tid


def record_span(span: Span) -> None:
    """Appends ``span`` to this process's ring buffer (the oldest span goes when it is full)."""
    _recorder.local.append(span)


def drain_local_spans() -> tuple[int, dict[int, str], list[Span]]:
    """Takes this process's spans (a worker sends them to its parent): pid, thread names, spans."""
    pid = os.getpid()
    spans = []
    local = _recorder.local
    while local:
        spans.append(local.popleft())
    names = {tid: name for (p, tid), name in _recorder.thread_names.items() if p == pid}
    return pid, names, spans


def add_remote_spans(
    pid: int, process_name: str, thread_names: dict[int, str], spans: Iterable[Span]
) -> None:
    """Keeps spans a worker process ``pid`` sent, under ``process_name``."""
    with _recorder.lock:
        _recorder.process_names[pid] = process_name
        for tid, name in thread_names.items():
            _recorder.thread_names[(pid, tid)] = name
        _recorder.remote.extend((pid, span) for span in spans)


class Trace:
    """Records a timeline of the pipelines built while it is open.

    Use it as a context manager (or call ``start``/``stop``), then ``save`` the trace::

        with grain_core.experimental.Trace(seconds=10) as trace:
            for batch in iter(dataset):
                ...
        trace.save("/tmp/pipeline.trace.json")   # open in ui.perfetto.dev

    Args:
      seconds: keep only the first ``seconds`` of the window (``None``: until ``stop``).
      capacity: spans kept per process (the newest ones when there are more).

    Raises:
      ValueError: if ``seconds`` or ``capacity`` is not positive.
    """

    def __init__(self, seconds: float | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
        if seconds is not None and not seconds > 0:
            raise ValueError(
                f"Trace(seconds=...) must be a positive number of seconds or None, got {seconds!r}."
            )
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"Trace(capacity=...) must be a positive int, got {capacity!r}.")
        self.seconds = seconds
        self.capacity = capacity
        self.start_ns: int | None = None
        self.stop_ns: int | None = None
        self._events: list[dict[str, Any]] | None = None

    def start(self) -> Trace:
        """Opens the window: pipelines built from now on record spans.

        Raises:
          RuntimeError: if another ``Trace`` is open in this process, or this one was started.
        """
        with _recorder.lock:
            if _recorder.open is not None:
                raise RuntimeError("Another grain_core Trace is open; stop it first.")
            if self.start_ns is not None:
                raise RuntimeError("This Trace was already started; create a new one.")
            _recorder.open = self
            trace_pipelines(True)
            if _recorder.local.maxlen != self.capacity:
                _recorder.local = collections.deque(_recorder.local, maxlen=self.capacity)
                _recorder.remote = collections.deque(_recorder.remote, maxlen=self.capacity)
            self.start_ns = span_clock()
        return self

    def stop(self) -> None:
        """Closes the window and collects its spans. Idempotent."""
        with _recorder.lock:
            if self.start_ns is None or self.stop_ns is not None:
                return
            self.stop_ns = span_clock()
            if _recorder.open is self:
                _recorder.open = None
                trace_pipelines(False)
        self._events = None

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _window(self) -> tuple[int, int]:
        if self.start_ns is None:
            raise RuntimeError("This Trace was never started: use `with Trace() as trace:`.")
        end = self.stop_ns if self.stop_ns is not None else span_clock()
        if self.seconds is not None:
            end = min(end, self.start_ns + int(self.seconds * 1e9))
        return self.start_ns, end

    def events(self) -> list[dict[str, Any]]:
        """The trace events of the window: process and thread names, then one complete
        (``"ph": "X"``) event per span, microseconds from the window's start."""
        if self._events is not None:
            return self._events
        start, end = self._window()
        pid = os.getpid()
        with _recorder.lock:
            # Threads append spans without the lock: tuple() copies the deque in one step
            # (a Python loop over it raced with them: "deque mutated during iteration").
            spans = [(pid, s) for s in tuple(_recorder.local)] + list(_recorder.remote)
            thread_names = dict(_recorder.thread_names)
            process_names = dict(_recorder.process_names)
        process_names[pid] = f"grain_core main process ({pid})"
        kept = [(p, s) for p, s in spans if s[3] >= start and s[3] + s[4] <= end]
        kept.sort(key=lambda ps: (ps[0], ps[1][0], ps[1][3], -ps[1][4]))
        used = sorted({(p, s[0]) for p, s in kept})
        events: list[dict[str, Any]] = []
        for p in sorted({p for p, _ in used} | {pid}):
            events.append(
                {"ph": "M", "name": "process_name", "pid": p, "tid": 0,
                 "args": {"name": process_names.get(p, f"process {p}")}}
            )  # fmt: skip
            events.append(
                {"ph": "M", "name": "process_sort_index", "pid": p, "tid": 0,
                 "args": {"sort_index": 0 if p == pid else 1 + p}}
            )  # fmt: skip
        for p, tid in used:
            events.append(
                {"ph": "M", "name": "thread_name", "pid": p, "tid": tid,
                 "args": {"name": thread_names.get((p, tid), f"thread {tid}")}}
            )  # fmt: skip
        for p, (tid, name, category, begin, duration) in kept:
            events.append(
                {"ph": "X", "name": name, "cat": category, "pid": p, "tid": tid,
                 "ts": (begin - start) / 1000, "dur": duration / 1000}
            )  # fmt: skip
        if self.stop_ns is not None:
            self._events = events
        return events

    def to_json(self) -> dict[str, Any]:
        """The trace as a JSON object (``{"traceEvents": [...], ...}``)."""
        start, end = self._window()
        return {
            "traceEvents": self.events(),
            "displayTimeUnit": "ms",
            "otherData": {"producer": "grain_core", "window_ns": end - start},
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the trace to ``path`` (atomically: a temporary file renamed over it).

        Raises:
          OSError: if ``path`` cannot be written (the message names it).
        """
        write_report_file(path, json.dumps(self.to_json()))


def write_report_file(path: str | os.PathLike[str], text: str) -> None:
    """Writes a trace, graph or report file atomically.

    Raises:
      OSError: if ``path`` cannot be written; the message names it and what to do.
    """
    try:
        storage.write_bytes(path, text.encode())
    except OSError as e:
        raise OSError(
            e.errno, f"Cannot write {os.fspath(path)!r}: {e.strerror}. Choose a writable location."
        ) from e


def validate_trace_events(events: list[dict[str, Any]]) -> None:
    """Checks ``events`` against the trace-event format as grain_core writes it.

    Every event has ``ph``, ``pid``, ``tid``; complete events (``X``) have a name, a category
    and non-negative ``ts`` and ``dur``; on each thread they come in non-decreasing ``ts`` and
    nest (a span that starts inside another ends inside it); every process and thread with
    spans is named.

    Raises:
      ValueError: naming the first event that breaks a rule.
    """
    named_processes = set()
    named_threads = set()
    open_spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    last_start: dict[tuple[int, int], int] = {}
    for i, event in enumerate(events):
        for key in ("ph", "pid", "tid"):
            if key not in event:
                raise ValueError(f"Trace event {i} has no {key!r}: {event}")
        track = (event["pid"], event["tid"])
        if event["ph"] == "M":
            if event.get("name") == "process_name":
                named_processes.add(event["pid"])
            elif event.get("name") == "thread_name":
                named_threads.add(track)
            if not isinstance(event.get("args", {}).get("name", event.get("args")), (str, dict)):
                raise ValueError(f"Metadata event {i} has no args: {event}")
            continue
        if event["ph"] != "X":
            raise ValueError(f"Trace event {i} has phase {event['ph']!r}, expected X or M.")
        if not isinstance(event.get("name"), str) or not isinstance(event.get("cat"), str):
            raise ValueError(f"Trace event {i} needs a string name and cat: {event}")
        # Integer nanoseconds, so that the float microseconds compare exactly.
        begin = round(event["ts"] * 1000)
        end = begin + round(event["dur"] * 1000)
        if begin < 0 or end < begin:
            raise ValueError(f"Trace event {i} has a negative ts or dur: {event}")
        if begin < last_start.get(track, begin):
            raise ValueError(f"Trace event {i} starts before the previous one on its thread.")
        last_start[track] = begin
        stack = open_spans.setdefault(track, [])
        while stack and stack[-1][1] <= begin:
            stack.pop()
        if stack and end > stack[-1][1]:
            raise ValueError(
                f"Trace event {i} ({event['name']}) starts inside an earlier span on its thread "
                "but ends after it: spans must nest."
            )
        stack.append((begin, end))
        if event["pid"] not in named_processes:
            raise ValueError(f"Trace event {i}: process {event['pid']} has no process_name.")
        if track not in named_threads:
            raise ValueError(f"Trace event {i}: thread {track} has no thread_name.")

"""Tests for grain_core.observe.spans: the timeline trace in Chrome trace-event format."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import numpy as np
import pytest
from conftest import image_pipeline

import grain_core as grain
from grain_core.experimental import ExecutionTrackingMode, Trace
from grain_core.observe import spans as observe_spans
from grain_core.observe import stages
from grain_core.observe.spans import validate_trace_events

SYNC = grain.ReadOptions(num_threads=0)


def _spans(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "X"]


def test_a_pipeline_built_outside_a_trace_runs_untimed() -> None:
    with Trace():
        pass
    it = iter(image_pipeline())
    next(it)
    assert "_stage_stats" not in vars(it) and "_untimed_class" not in vars(type(it))


def test_spans_of_every_stage_nest_on_one_clock(tmp_path: Any) -> None:
    with Trace() as recording:
        it = iter(image_pipeline())
        assert (
            it._ctx.dataset_options.execution_tracking_mode is ExecutionTrackingMode.STAGE_TRACING
        )
        assert len(list(it)) == 8
    events = recording.events()
    validate_trace_events(events)
    spans = _spans(events)
    names = [s["name"] for s in spans]
    assert names.count("Batch") == 9  # 8 batches and the call that ended iteration
    assert sum(n.startswith("Map(normalize") for n in names) == 65
    assert {s["cat"] for s in spans} == {"batch", "transform", "wait", "read"}
    # Each batch span contains the 8 map spans of its elements.
    first_batch = next(s for s in spans if s["name"] == "Batch")
    inside = [
        s
        for s in spans
        if s["ts"] >= first_batch["ts"]
        and s["ts"] + s["dur"] <= first_batch["ts"] + first_batch["dur"]
        and s["name"].startswith("Map(")
    ]
    assert len(inside) == 8
    pid = os.getpid()
    meta = {(e["name"], e["pid"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[("process_name", pid)]["name"] == f"grain_core main process ({pid})"
    assert meta[("thread_name", pid)]["name"] == "MainThread"
    path = tmp_path / "pipeline.trace.json"
    recording.save(path)
    saved = json.loads(path.read_text())
    assert saved["traceEvents"] == json.loads(json.dumps(events))
    assert saved["displayTimeUnit"] == "ms"


def test_reader_threads_get_their_own_named_tracks() -> None:
    # The first two reads wait for each other (as reads waiting on I/O do), so they run on
    # read threads: reads that keep the CPU busy stay in the consumer's thread.
    barrier = threading.Barrier(2)

    def waits_on_the_other(x: int) -> int:
        if x < 2:
            barrier.wait(timeout=60)
        return x

    ds = grain.MapDataset.range(16).map(waits_on_the_other)
    with Trace() as recording:
        list(iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))))
    events = recording.events()
    validate_trace_events(events)
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "MainThread" in threads and len(threads) >= 2


def test_the_window_keeps_the_first_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    now = {"ns": 0}

    def clock() -> int:
        return now["ns"]

    def one_second(x: np.ndarray) -> np.ndarray:
        now["ns"] += 1_000_000_000
        return x

    monkeypatch.setattr(stages, "_now", clock)
    monkeypatch.setattr(observe_spans, "span_clock", clock)
    ds = grain.MapDataset.range(10).to_iter_dataset(SYNC).map(one_second)
    with Trace(seconds=3.5) as recording:
        list(iter(ds))
    spans = [s for s in _spans(recording.events()) if s["name"].startswith("Map(")]
    # Spans that ended within 3.5 s of the start: the first three elements.
    assert [s["ts"] for s in spans] == [0.0, 1e6, 2e6]
    assert recording.to_json()["otherData"]["window_ns"] == 3_500_000_000


def test_memory_is_bounded_by_the_ring_buffer() -> None:
    with Trace(capacity=50) as recording:
        list(iter(image_pipeline(n=256)))
    spans = _spans(recording.events())
    assert len(spans) == 50
    validate_trace_events(recording.events())
    # The newest spans are kept: the last one is the call that ended iteration.
    assert max(spans, key=lambda s: s["ts"] + s["dur"])["name"] == "Batch"


@pytest.mark.parametrize("seconds", [0, -1.5])
def test_a_window_of_no_time_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match="positive number of seconds"):
        Trace(seconds=seconds)
    with pytest.raises(ValueError, match="capacity"):
        Trace(capacity=0)


def test_one_trace_at_a_time_and_a_trace_is_used_once() -> None:
    with Trace() as first:
        with pytest.raises(RuntimeError, match="Another grain_core Trace is open"):
            Trace().start()
    with pytest.raises(RuntimeError, match="already started"):
        first.start()
    with pytest.raises(RuntimeError, match="never started"):
        Trace().events()


def test_an_unwritable_path_names_it(tmp_path: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with Trace() as recording:
        pass
    with pytest.raises(OSError, match=r"Cannot write '.*file/t\.json'"):
        recording.save(blocker / "t.json")


def test_validator_rejects_broken_traces() -> None:
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "p"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "t"}},
    ]

    def span(ts: float, dur: float) -> dict[str, Any]:
        return {"ph": "X", "name": "s", "cat": "c", "pid": 1, "tid": 2, "ts": ts, "dur": dur}

    validate_trace_events([*meta, span(0, 10), span(1, 2), span(5, 5), span(10, 1)])
    with pytest.raises(ValueError, match="spans must nest"):
        validate_trace_events([*meta, span(0, 10), span(5, 10)])
    with pytest.raises(ValueError, match="starts before the previous one"):
        validate_trace_events([*meta, span(5, 1), span(1, 1)])
    with pytest.raises(ValueError, match="no process_name"):
        validate_trace_events([meta[1], span(0, 1)])
    with pytest.raises(ValueError, match="no thread_name"):
        validate_trace_events([meta[0], span(0, 1)])


def _wide(x: int) -> np.ndarray:
    return np.full(1 << 16, x, np.float32)  # batches of four go through shared memory


@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatching", "strided"])
def test_every_worker_process_appears_on_the_same_clock(
    dispatch: bool, request: pytest.FixtureRequest
) -> None:
    # Every worker waits for the parent at least once (after its last element, until the
    # iterator closes and asks for its last spans; batches in shared memory with a buffer of
    # one also wait for credits), and every wait and send is a span on its main thread,
    # nested with its stages' spans, on the parent's clock.
    from grain_core.dataset.mp.worker import SEND_SPAN, WAIT_SPAN

    if not dispatch:
        request.getfixturevalue("strict_rotation")
    ds = grain.MapDataset.range(32).map(_wide).to_iter_dataset(SYNC).batch(4)
    options = grain.MultiprocessingOptions(num_workers=2, per_worker_buffer_size=1)
    with Trace() as recording:
        with iter(ds.mp_prefetch(options)) as it:
            assert len(list(it)) == 8
        closed = observe_spans.span_clock()  # the workers' last spans came before close returned
    events = recording.events()
    validate_trace_events(events)  # nesting, per-thread order, named tracks
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    workers = {pid: name for pid, name in processes.items() if pid != os.getpid()}
    assert sorted(name.split(" (")[0] for name in workers.values()) == [
        "grain_core worker 0",
        "grain_core worker 1",
    ]
    spans = _spans(events)
    for pid in workers:
        own = {(s["name"], s["cat"]) for s in spans if s["pid"] == pid}
        assert any(n.startswith("MapMapDataset(transform=_wide") for n, _ in own), own
        assert (SEND_SPAN, "transport") in own and (WAIT_SPAN, "wait") in own, own
    main = [s for s in spans if s["pid"] == os.getpid()]
    assert {s["cat"] for s in main} >= {"transport"}
    # One clock: every span lies between the trace's start and the iterator's close.
    assert recording.start_ns is not None
    end = (closed - recording.start_ns) / 1000
    assert all(0 <= s["ts"] and s["ts"] + s["dur"] <= end for s in spans)

"""Tests for grain_core.observe.profile and its HTML page (grain_core.observe.report_html)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import grain_core as grain
from grain_core import cli
from grain_core.observe import profile, report_html
from grain_core.observe.profile import ProcessTime, ProfileData, StageTime, verdict
from grain_core.observe.spans import validate_trace_events

pytest.importorskip("plotly", reason="the report needs plotly: pip install plotly")

SYNC = grain.ReadOptions(num_threads=0)


def _decode(x: np.ndarray) -> np.ndarray:
    return np.sort(np.repeat(x, 64).astype(np.float64))  # some real work per element


def _pipeline() -> grain.IterDataset:
    source = np.arange(512, dtype=np.uint8).reshape(-1, 4)
    return (
        grain.MapDataset.source(source)
        .seed(42)
        .shuffle()
        .repeat()
        .map(_decode)
        .to_iter_dataset(SYNC)
        .batch(8)
    )


def _worker_pipeline() -> grain.IterDataset:
    return _pipeline().mp_prefetch(grain.MultiprocessingOptions(num_workers=2))


PIPELINE_FILE = textwrap.dedent(
    """
    import numpy as np
    import grain_core as grain

    def decode(x):
        return np.sort(np.repeat(x, 64).astype(np.float64))

    def make():
        source = np.arange(512, dtype=np.uint8).reshape(-1, 4)
        return grain.MapDataset.source(source).map(decode).to_iter_dataset().batch(8)

    def broken():
        raise FileNotFoundError("no data in /nowhere")

    def check(x):
        if x[0] == 20:
            raise ValueError("boom")
        return x

    def raising():
        source = np.arange(512, dtype=np.uint8).reshape(-1, 4)
        return grain.MapDataset.source(source).map(check).to_iter_dataset().batch(2)

    not_a_function = 3
    """
)


@pytest.fixture
def pipeline_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_pipeline.py"
    path.write_text(PIPELINE_FILE)
    return path


def test_profile_reads_the_batches_and_names_the_busiest_stage(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    trace_out = tmp_path / "trace.json"
    data = profile.profile(_pipeline, num_batches=12, output=out, trace_output=trace_out)
    assert len(data.batch_end_s) == 12
    assert list(data.batch_end_s) == sorted(data.batch_end_s) and data.window_s > 0
    names = [s.name for s in data.stages]
    assert any(n.startswith("MapMapDataset(transform=_decode") for n in names)
    assert [p.is_worker for p in data.processes] == [False]
    assert data.graph is not None and data.graph["nodes"][0]["name"] == "Batch"
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and data.verdict[:40] in page
    assert page.count("<script") >= 5  # plotly.js inline, the error hook, four charts
    # Self-contained: nothing is loaded from elsewhere.
    assert not re.search(r"<(script|img|iframe)[^>]*\ssrc=|<link", page)
    saved = json.loads(trace_out.read_text())
    validate_trace_events(saved["traceEvents"])
    # The saved trace gives the same report.
    again = profile.report_from_trace(trace_out, tmp_path / "again.html")
    assert again == data


def test_profile_takes_a_dataset_or_an_import_path(pipeline_file: Path, tmp_path: Path) -> None:
    data = profile.profile(_pipeline(), num_batches=3, output=None)
    assert len(data.batch_end_s) == 3
    data = profile.profile(f"{pipeline_file}:make", num_batches=3, output=None)
    assert len(data.batch_end_s) == 3
    # A finite dataset ends the run early.
    data = profile.profile(grain.MapDataset.range(5).batch(2), num_batches=10, output=None)
    assert len(data.batch_end_s) == 3


def test_workers_appear_with_their_utilisation(tmp_path: Path) -> None:
    data = profile.profile(_worker_pipeline, num_batches=24, output=None)
    workers = [p for p in data.processes if p.is_worker]
    assert sorted(p.name.split(" (")[0] for p in workers) == [
        "grain_core worker 0",
        "grain_core worker 1",
    ]
    assert all(0 < p.utilisation <= 1 for p in workers)
    decode = next(s for s in data.stages if "_decode" in s.name)
    assert decode.in_workers
    assert any(n["in_workers"] for n in data.graph["nodes"])  # type: ignore[index]


# ------------------------------------------------------------------------------ bad input
def test_an_unwritable_output_fails_before_running(tmp_path: Path) -> None:
    called = []

    def pipeline() -> grain.IterDataset:
        called.append(1)
        return _pipeline()

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"Cannot write the report '.*file/r\.html'.*not a writable"):
        profile.profile(pipeline, output=blocker / "r.html")
    with pytest.raises(OSError, match="Cannot write the trace"):
        profile.profile(pipeline, output=None, trace_output=blocker / "t.json")
    assert not called


def test_a_pipeline_function_that_raises_is_named(pipeline_file: Path) -> None:
    with pytest.raises(
        profile.PipelineError, match="pipeline function broken raised FileNotFoundError"
    ) as e:
        profile.profile(f"{pipeline_file}:broken", output=None)
    assert isinstance(e.value.__cause__, FileNotFoundError)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_colon", "must be 'package.module:function'"),
        ("/nonexistent/file.py:make", "does not exist"),
        ("{file}:missing", "has no 'missing'"),
        ("{file}:not_a_function", "is not a function"),
    ],
)
def test_bad_import_paths_are_refused(spec: str, match: str, pipeline_file: Path) -> None:
    with pytest.raises(ValueError, match=match):
        profile.profile(spec.format(file=pipeline_file), output=None)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="num_batches must be a positive int"):
            profile.profile(_pipeline, num_batches=bad, output=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step_seconds must be >= 0"):
        profile.profile(_pipeline, step_seconds=-1, output=None)
    with pytest.raises(TypeError, match="must return a grain_core MapDataset"):
        profile.profile(lambda: [1, 2], output=None)
    not_a_trace = tmp_path / "x.json"
    not_a_trace.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a trace-event file"):
        profile.report_from_trace(not_a_trace, tmp_path / "r.html")
    not_a_trace.write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        profile.report_from_trace(not_a_trace, tmp_path / "r.html")


def test_missing_plotly_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "plotly", None)
    with pytest.raises(ImportError, match=r"pip install plotly"):
        profile.profile(_pipeline, output=tmp_path / "r.html")


# -------------------------------------------------------------------------------- verdict
def _data(
    stages: list[StageTime],
    processes: list[ProcessTime],
    wait: float,
    step: float = 0.0,
    move_s: float = 50e-6,
    cores: float = 8.0,
) -> ProfileData:
    """10 batches in 10 s."""
    return ProfileData(
        window_s=10.0,
        batch_end_s=tuple(float(i) for i in range(1, 11)),
        stages=tuple(stages),
        processes=tuple(processes),
        consumer_wait_s=10.0 * wait,
        graph=None,
        graph_text=None,
        step_s=step,
        transport_s=(move_s / 2, move_s / 2),
        usable_cores=cores,
        verdict="",
    )


MAIN = ProcessTime("main", False, 1.0, 10.0)
DECODE = StageTime("MapMapDataset(transform=decode @ x.py:3)", "transform", True, 8.2, 0.8, 10)
RECEIVE = StageTime("DispatchedClass", "transport", False, 1.0, 0.1, 10)


def test_verdict_for_busy_workers_says_add_workers_up_to_the_usable_cores() -> None:
    busy = [ProcessTime(f"worker {i}", True, 9.0, 10.0) for i in range(2)]
    other = StageTime("Batch", "batch", True, 1.8, 0.2, 10)
    # A batch costs 1 s of work and the step 200 ms: 5 workers keep up with the step.
    text = verdict(_data([DECODE, other, RECEIVE], [MAIN, *busy], wait=0.7, step=0.2))
    assert text == (
        "With a 200 ms step the consumer waited 70% of the time for data. The map `decode` "
        "(x.py:3) in workers takes 80.0% of all stage time, and the 2 workers are busy 90% of "
        "the time: add workers (num_workers=5, for 8 usable cores), or make the map `decode` "
        "(x.py:3) cheaper (e.g. vectorise it over a batch: batch before it)."
    )
    # Never more workers than the cores the process may use.
    text = verdict(_data([DECODE, other, RECEIVE], [MAIN, *busy], wait=0.7, cores=2))
    assert "more workers would not help on 2 usable cores; make the map `decode`" in text
    assert "num_workers" not in text


def test_verdict_recommends_workers_only_when_the_work_outweighs_moving_a_result() -> None:
    # 10 batches; the map costs 0.8 s per batch, moving one 50 us: workers pay off.
    heavy = StageTime(
        "MapMapDataset(transform=decode @ .../x.py:3)", "transform", False, 8, 0.8, 10
    )
    text = verdict(_data([heavy], [MAIN], wait=0.95, cores=2))
    assert (
        "computing a batch takes 800.0 ms and moving one from a worker process about 50 µs" in text
    )
    assert "num_workers=2)) after it (for 2 usable cores)" in text
    text = verdict(_data([heavy], [MAIN], wait=0.95, cores=16))
    assert "num_workers=16)) after it (for 16 usable cores)" in text
    # A cheap pipeline (40 us per batch, 50 us to move one) gets no worker advice.
    cheap = dataclasses.replace(heavy, self_s=4e-4)
    text = verdict(_data([cheap], [MAIN], wait=0.95, cores=16))
    assert "Worker processes would not make this faster: computing a batch takes 40 µs" in text
    assert "mp_prefetch" not in text
    # Nor on a machine with one usable core.
    text = verdict(_data([heavy], [MAIN], wait=0.95, cores=1))
    assert "Worker processes would not make this faster" in text


def test_verdict_for_idle_workers_points_at_the_main_process_or_at_one_process() -> None:
    idle = [ProcessTime(f"worker {i}", True, 1.0, 10.0) for i in range(2)]
    main_map = StageTime("Map(augment @ .../x.py:9)", "transform", False, 5.0, 0.5, 10)
    text = verdict(_data([main_map, DECODE], [MAIN, *idle], wait=0.9))
    assert "The workers are idle 90% of the time" in text
    assert "the map `augment` (x.py:9) takes 50.0% of all stage time: move it before" in text
    receive = StageTime("DispatchedClass", "transport", False, 8.0, 0.8, 10)
    cheap = dataclasses.replace(DECODE, self_s=1e-4, share=0.01)
    text = verdict(_data([receive, cheap], [MAIN, *idle], wait=0.9))
    assert "receiving results from the workers: 80.0% of all stage time" in text
    assert "faster in one process: remove .mp_prefetch" in text
    assert "DispatchedClass" not in text


def test_verdict_without_workers_and_when_the_pipeline_keeps_up() -> None:
    read = StageTime("SourceMapDataset(source=x)", "read", False, 6.0, 0.6, 10)
    wait = StageTime("Prefetch", "wait", False, 4.0, 0.4, 10)
    text = verdict(_data([read, wait], [MAIN], wait=0.95))
    assert "Reading (source(source=x)) takes 60.0% of all stage time" in text
    assert "ReadOptions(num_threads=...)" in text
    text = verdict(_data([read], [MAIN], wait=0.05, step=0.1))
    assert text.startswith("The input pipeline keeps up: with a 100 ms step")


def test_without_a_step_the_verdict_asks_for_one() -> None:
    read = StageTime("SourceMapDataset(source=x)", "read", False, 6.0, 1.0, 10)
    text = verdict(_data([read], [MAIN], wait=1.0))
    assert "pass your step's time (--step-ms, or step_seconds=)" in text
    assert "waited" not in text


def test_stage_labels_are_the_users_words() -> None:
    assert profile.stage_label("DispatchedClass") == "receiving results from the workers"
    assert (
        profile.stage_label("MapMapDataset(transform=square @ .../tmp/p/pipe.py:9)")
        == "map square (pipe.py:9)"
    )
    assert profile.stage_label("ShuffleMapDataset(seed=3)") == "shuffle(seed=3)"
    assert profile.stage_label("Batch") == "batch"
    assert profile.stage_label("MapWithIndexMapDataset") == "map_with_index"


def test_the_chart_and_the_verdict_show_one_percentage_per_stage(tmp_path: Path) -> None:
    data = profile.profile(_pipeline, num_batches=12, output=None)
    top = next(s for s in data.stages if s.category not in ("wait", "transport"))
    assert profile.format_share(top.share) in data.verdict
    figures = report_html._figures(data)
    bars = figures[1].data[0]
    label = profile.stage_label(top.name)
    assert (
        f"{profile.format_share(top.share)} · {top.category}"
        == bars.text[list(bars.y).index(label)]
    )
    assert not any("MapDataset" in y for y in bars.y)


# -------------------------------------------------------------------------------- the CLI
def test_cli_profile_and_report_from_trace(
    pipeline_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, trace_out = tmp_path / "r.html", tmp_path / "t.json"
    argv = ["profile", f"{pipeline_file}:make", "-n", "4", "-o", str(out)]
    assert cli.main([*argv, "--trace-output", str(trace_out)]) == 0
    printed = capsys.readouterr().out
    assert re.match(r"4 batches in [0-9.]+ s \([0-9.]+ batches/s\); report written to ", printed)
    assert "--step-ms" in printed and out.is_file()
    assert cli.main(["profile", "--trace", str(trace_out), "-o", str(tmp_path / "b.html")]) == 0
    assert cli.main(["profile", f"{pipeline_file}:make", "-o", "/nonexistent/r.html"]) == 1
    assert "Cannot write the report '/nonexistent/r.html'" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [0, 2])
def test_cli_profile_shows_the_users_exception(
    pipeline_file: Path, tmp_path: Path, workers: int
) -> None:
    """The user's own error: its type, the stage or worker, and its traceback with the user's
    file and line (a worker's too: functions of a file run by path travel by value)."""
    pipeline = f"{pipeline_file}:raising"
    if workers:
        wrapper = tmp_path / "with_workers.py"
        wrapper.write_text(
            "import grain_core as grain\n"
            f"import importlib.util, sys\nspec = importlib.util.spec_from_file_location('u', {str(pipeline_file)!r})\n"
            "u = importlib.util.module_from_spec(spec); spec.loader.exec_module(u)\n"
            "def make():\n"
            f"    return u.raising().mp_prefetch(grain.MultiprocessingOptions(num_workers={workers}))\n"
        )
        pipeline = f"{wrapper}:make"
    done = subprocess.run(
        [sys.executable, "-m", "grain_core", "profile", pipeline, "-o", str(tmp_path / "r.html")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    where = "mp_prefetch worker process" if workers else "the stage map check (user_pipeline.py:"
    assert last.startswith(f"grain-core profile: error: The pipeline raised ValueError in {where}")
    assert re.search(r" after \d+ batches: boom$", last)
    assert f'File "{pipeline_file}", line 17, in check\n    raise ValueError("boom")' in done.stderr
    assert "<dynamic-code>" not in done.stderr


# -------------------------------------------------------------------- in a real browser
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip(
        "no Chromium to open the report in: install Debian's chromium package (the nox "
        "session tests-all installs it with apt-get where it can)"
    )


def test_the_report_renders_in_a_headless_browser(tmp_path: Path) -> None:
    browser = _chromium()
    out = tmp_path / "report.html"
    profile.profile(_worker_pipeline, num_batches=16, output=out)
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=10000",
        "--dump-dom",
        out.as_uri(),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    dom = result.stdout
    assert result.returncode == 0, result.stderr[-2000:]
    body = re.search(r"<body[^>]*>", dom)
    assert body, dom[:2000]
    # The page's own hook: charts with a rendered SVG, and errors recorded while loading.
    assert 'data-errors="0"' in body.group(0), re.search(r'id="report-status"[^<]*', dom)
    assert 'data-rendered-charts="4"' in body.group(0)
    assert dom.count('class="main-svg"') >= 4
    assert "Dataset graph" in dom and "grain_core worker 1" in dom
    os.remove(out)

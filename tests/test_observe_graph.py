"""Tests for grain_core.observe.graph: Grain's debug mode and dataset-graph switches."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import image_pipeline

import grain_core as grain
from grain_core.config import config
from grain_core.experimental import dataset_graph, get_execution_summary
from grain_core.observe import graph, stages, summary

SYNC = grain.ReadOptions(num_threads=0)
GRAPH_TITLE = "grain_core dataset graph:"
GRAPH_HEADER = "id | node | type | inputs | where | element spec"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def debug_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(graph, "_monotonic", fake)
    return fake


@pytest.fixture
def switches() -> Iterator[Any]:
    """Restores the debugging switches after a test."""
    names = ("py_debug_mode", "py_debug_summary_interval", "py_dataset_visualization_output_dir")
    saved = {n: getattr(config, n) for n in names}
    yield config
    for name, value in saved.items():
        config.update(name, value)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="grain_core.debug")
    return caplog


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_switches_off_install_nothing(switches: Any) -> None:
    it = iter(image_pipeline())
    next(it)
    assert "_stage_stats" not in vars(it) and "_debug_reporter" not in vars(it)
    with pytest.raises(ValueError, match="py_debug_mode"):
        get_execution_summary(it)


def test_debug_mode_logs_the_summary_once_at_the_end(
    switches: Any, logs: pytest.LogCaptureFixture, debug_clock: FakeClock
) -> None:
    switches.update("py_debug_mode", True)
    it = iter(image_pipeline())
    assert len(list(it)) == 8
    summaries = _messages(logs, graph.SUMMARY_TITLE)
    assert len(summaries) == 1
    assert summaries[0].startswith("Grain Dataset Execution Summary (at the end of iteration)")
    assert "grain_core execution summary" in summaries[0] and "Map(normalize" in summaries[0]
    it.close()  # the end was reported already
    assert len(_messages(logs, graph.SUMMARY_TITLE)) == 1
    # Only the output reports: its inputs reverted to their timed classes.
    assert "_debug_reporter" in vars(it)
    assert all("_debug_reporter" not in vars(p) for p in it._parents)


def test_debug_mode_logs_the_summary_periodically_and_on_close(
    switches: Any, logs: pytest.LogCaptureFixture, debug_clock: FakeClock
) -> None:
    switches.update("py_debug_mode", True)
    switches.update("py_debug_summary_interval", 5)

    def tick(x: np.ndarray) -> np.ndarray:
        debug_clock.now += 1.0  # one second per element
        return x

    ds = grain.MapDataset.range(100).repeat().to_iter_dataset(SYNC).map(tick)
    it = iter(ds)
    periodic = []
    for _ in range(23):
        next(it)
        periodic.append(len(_messages(logs, "(periodic)")))
    # Due at 5 s, then 5 s after each summary: after elements 5, 10, 15 and 20.
    assert periodic == [0] * 4 + [1] * 5 + [2] * 5 + [3] * 5 + [4] * 4
    it.close()
    assert len(_messages(logs, "(at the end of iteration)")) == 1


def test_default_interval_is_grains() -> None:
    from grain_core.config import Config

    assert Config().py_debug_summary_interval == 60.0


def test_the_graph_is_logged_when_the_first_element_is_produced(
    switches: Any, logs: pytest.LogCaptureFixture
) -> None:
    switches.update("py_dataset_visualization_output_dir", "")
    it = iter(image_pipeline())
    assert not _messages(logs, GRAPH_TITLE)
    next(it)
    graphs = _messages(logs, GRAPH_TITLE)
    assert len(graphs) == 1
    lines = graphs[0].splitlines()
    assert lines[0].startswith("grain_core dataset graph: 6 nodes, output first")
    assert " | ".join(c.strip() for c in lines[1].split("|")) == GRAPH_HEADER
    cells = [[c.strip() for c in line.split("|")] for line in lines[3:]]
    assert [c[2] for c in cells] == [
        "_BatchIterator",
        "_MapIterator",
        "PrefetchDatasetIterator",
        "ShuffleMapDataset",
        "_WithSeedMapDataset",
        "SourceMapDataset",
    ]
    assert [c[3] for c in cells] == ["1", "2", "3", "4", "5", "-"]
    assert {c[4] for c in cells} == {"main"}
    assert cells[0][5] == "ndarray[float32[8, 1]]" and cells[-1][5] == "ndarray[uint8[1]]"
    assert cells[1][1].startswith("<- Map(normalize")
    list(it)
    assert len(_messages(logs, GRAPH_TITLE)) == 1
    # Without debug mode the output stops reporting after the graph; no summary is logged.
    assert "_debug_reporter" not in vars(type(it)) and not _messages(logs, graph.SUMMARY_TITLE)


def test_the_graph_is_written_to_the_directory(
    switches: Any, logs: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    out = tmp_path / "graphs" / "nested"
    switches.update("py_dataset_visualization_output_dir", str(out))
    assert out.is_dir()  # created when set
    it = iter(image_pipeline())
    next(it)
    (text,) = out.glob("dataset_graph-*.txt")
    (js,) = out.glob("dataset_graph-*.json")
    assert text.stem == js.stem
    assert text.read_text() == str(dataset_graph(it)) + "\n"
    nodes = json.loads(js.read_text())["nodes"]
    assert [n["id"] for n in nodes] == list(range(6))
    assert nodes[0] == {
        "id": 0,
        "name": "Batch",
        "type": "_BatchIterator",
        "inputs": [1],
        "depth": 0,
        "in_workers": False,
        "instances": 1,
        "element_spec": "ndarray[float32[8, 1]]",
    }
    assert not list(out.glob("*.tmp"))


def test_unwritable_visualization_directory_is_refused(switches: Any, tmp_path: Any) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="a_file/graphs.*cannot be created.*writable"):
        switches.update("py_dataset_visualization_output_dir", str(blocker / "graphs"))
    with pytest.raises(ValueError, match="None, '' or a directory"):
        switches.update("py_dataset_visualization_output_dir", 3)
    assert config.py_dataset_visualization_output_dir is None


def test_a_directory_that_became_unwritable_fails_with_its_name(
    switches: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "graphs"
    switches.update("py_dataset_visualization_output_dir", str(out))
    out.rmdir()
    out.write_text("now a file")
    it = iter(image_pipeline())
    with pytest.raises(OSError, match=r"Cannot write '.*graphs/dataset_graph-.*\.txt'"):
        next(it)


def test_reporting_is_hinted_when_info_logs_are_hidden(
    switches: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(graph, "_hinted_at_logging", False)
    caplog.set_level(logging.WARNING, logger="grain_core.debug")
    switches.update("py_dataset_visualization_output_dir", "")
    next(iter(image_pipeline()))
    next(iter(image_pipeline()))
    hints = _messages(caplog, "logging.basicConfig(level=logging.INFO)")
    assert len(hints) == 1


def test_summary_has_the_information_grain_logs(switches: Any) -> None:
    switches.update("py_debug_mode", True)
    it = iter(image_pipeline())
    list(it)
    summary = get_execution_summary(it)
    for s in summary.stages:
        assert s.type_name and s.output_spec is not None
        assert 0 <= s.min_time_ns <= s.self_time_per_element_ns <= s.max_time_ns or (
            s.kind == "map"  # batched reads record per-element averages per call
        )
    assert sum(s.wait_share for s in summary.stages) == pytest.approx(1.0)
    header = str(summary).splitlines()[1]
    for column in ("elements", "self time", "avg", "min", "max", "share", "wait"):
        assert column in header


def test_wait_share_goes_behind_a_thread_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = {"now": 0}
    monkeypatch.setattr(stages, "_now", lambda: clock["now"])
    rows = [
        {"inputs": [1], "in_workers": False, "tid": 1, "self_ns": 10, "total_ns": 100},
        {"inputs": [2, 3], "in_workers": False, "tid": 1, "self_ns": 90, "total_ns": 90},
        {"inputs": [], "in_workers": False, "tid": 2, "self_ns": 300, "total_ns": 300},
        {"inputs": [], "in_workers": True, "tid": 1, "self_ns": 100, "total_ns": 100},
    ]
    shares = summary._wait_shares(rows, 100)
    # The output keeps its own 10%; the prefetch's 90% is split 3:1 between its inputs.
    assert shares == pytest.approx([0.1, 0.0, 0.675, 0.225])


def _triple(x: int) -> int:
    return 3 * x


@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatching", "strided"])
def test_the_graph_shows_the_nodes_in_worker_processes(
    dispatch: bool,
    switches: Any,
    logs: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from grain_core.dataset.mp import positions as mp_positions

    if not dispatch:
        monkeypatch.setattr(mp_positions, "dispatchable", lambda *_: False)
    switches.update("py_dataset_visualization_output_dir", "")
    ds = grain.MapDataset.range(64).map(_triple).to_iter_dataset(SYNC).batch(4)
    with iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))) as it:
        assert len(list(it)) == 16
        (graph,) = _messages(logs, GRAPH_TITLE)
        nodes = dataset_graph(it).nodes
    rows = [[c.strip() for c in line.split("|")] for line in graph.splitlines()[3:]]
    assert rows[0][1] == "MultiprocessPrefetch(num_workers=2)" and rows[0][4] == "main"
    workers = [r for r in rows if r[4] == "workers"]
    assert any(r[1].startswith("<- MapMapDataset(transform=_triple") for r in workers)
    assert all(r[1].endswith(" x2") for r in workers)  # summed over both workers
    assert {n.in_workers for n in nodes} == {False, True}


_LOGGING_SCRIPT = """
import logging
import sys

import grain_core as grain
from grain_core.observe import graph

mode = sys.argv[1]
if mode == "root-at-info":  # as Grain's debugging tutorial runs, absl setting the level
    logging.getLogger().setLevel(logging.INFO)
elif mode == "basic-config":
    logging.basicConfig(level=logging.INFO, format="configured: %(message)s")
grain.config.update("py_debug_mode", True)
grain.config.update("py_dataset_visualization_output_dir", "")


def run():
    list(grain.MapDataset.range(8).map(lambda x: x + 1).to_iter_dataset().batch(4))


run()
if mode == "root-at-info":
    debug_logger = logging.getLogger("grain_core.debug")
    for handler in list(debug_logger.handlers):
        if handler.get_name() == graph.HANDLER_NAME:
            debug_logger.removeHandler(handler)
    print("removed", file=sys.stderr, flush=True)
    run()
"""


def _run_logging_script(tmp_path: Any, mode: str) -> str:
    script = tmp_path / "tutorial.py"
    script.write_text(_LOGGING_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), mode], capture_output=True, text=True, check=True
    )
    return done.stderr


def test_debug_output_shows_where_grains_does(tmp_path: Any) -> None:
    """The root logger at INFO without a handler (Grain's tutorial run as a script): the graph
    and the summary are shown, by a handler added once, which the user can remove."""
    shown, removed = _run_logging_script(tmp_path, "root-at-info").split("removed\n")
    assert shown.count(GRAPH_TITLE) == 1
    assert shown.count(f"{graph.SUMMARY_TITLE} (at the end of iteration)") == 1
    assert removed == ""


def test_a_configured_handler_shows_debug_output_once(tmp_path: Any) -> None:
    err = _run_logging_script(tmp_path, "basic-config")
    assert err.count(GRAPH_TITLE) == 1
    assert err.count(f"configured: {graph.SUMMARY_TITLE}") == 1
    assert err.count(graph.SUMMARY_TITLE) == 1


def test_hidden_info_records_get_a_hint_not_a_handler(tmp_path: Any) -> None:
    err = _run_logging_script(tmp_path, "default")
    assert GRAPH_TITLE not in err and graph.SUMMARY_TITLE not in err
    assert err.count("logging.basicConfig(level=logging.INFO)") == 1

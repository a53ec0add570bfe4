"""Tests for the benchmark harness's mechanics (registry, runner output); never timings."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ModuleType, ModuleType]]:
    """Imports benchmarks/_harness.py and run.py and registers a tiny workload in them."""
    if not (BENCHMARKS / "run.py").is_file():
        pytest.skip("benchmarks/ is not in this checkout")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _harness
    import run

    calls: list[str] = []

    def counted(label: str) -> Callable[[], object]:
        return lambda: calls.append(label)

    tiny = _harness.Workload("tiny", elements=10, description="tiny")
    tiny.implementations[_harness.GRAIN_CORE] = (lambda: counted("ours"), None)
    tiny.baseline("python")(lambda: counted("python"))
    tiny.baseline("absent", requires="no_such_module_for_grain_core_tests")(
        lambda: counted("absent")
    )

    def unavailable() -> Callable[[], object]:
        raise _harness.Unavailable("its peer has a virtualenv of its own")

    tiny.baseline("elsewhere")(unavailable)
    monkeypatch.setitem(_harness.WORKLOADS, "tiny", tiny)
    yield _harness, run
    assert "absent" not in calls
    sys.modules.pop("run", None)


def test_json_output_has_every_implementation_and_ratios(
    harness: tuple[ModuleType, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    _, run = harness
    assert run.main(["--only", "tiny", "--repeats", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    results = {r["implementation"]: r for r in data["results"]}
    assert set(results) == {"grain_core", "python"}
    assert len(results["python"]["seconds"]) == 3
    assert results["grain_core"]["grain_core_speedup"] == 1.0
    assert results["python"]["elements"] == 10
    assert {
        "workload": "tiny",
        "implementation": "absent",
        "reason": "no_such_module_for_grain_core_tests is not installed",
    } in data["skipped"]
    assert {
        "workload": "tiny",
        "implementation": "elsewhere",
        "reason": "its peer has a virtualenv of its own",
    } in data["skipped"]


def test_table_output_and_unknown_workloads(
    harness: tuple[ModuleType, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    _harness, run = harness
    assert run.main(["--only", "tiny", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == [
        "workload",
        "implementation",
        "elements/s",
        "median",
        "s",
        "grain_core",
        "speed-up",
    ]
    assert "skipped: no_such_module_for_grain_core_tests is not installed" in out
    with pytest.raises(SystemExit):
        run.main(["--only", "tiny,nope"])
    assert "unknown workloads ['nope']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="already has 'python'"):
        _harness.WORKLOADS["tiny"].baseline("python")(lambda: lambda: None)


def test_initial_workloads_are_registered(
    harness: tuple[ModuleType, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    _, run = harness
    assert run.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name in ("range_shuffle_map_batch", "seed_pipeline", "index_shuffle_1m"):
        assert f"{name}: " in listed
    assert "[grain_core, numpy loop, grain]" in listed


def test_alternating_workloads_interleave_passes(harness: tuple[ModuleType, ModuleType]) -> None:
    _harness, _ = harness
    calls: list[str] = []
    bench = _harness.Workload("alt", elements=1, description="alt", alternate=True)
    bench.implementations[_harness.GRAIN_CORE] = (lambda: lambda: calls.append("a"), None)
    bench.baseline("b")(lambda: lambda: calls.append("b"))
    bench.baseline("absent", requires="no_such_module_for_grain_core_tests")(
        lambda: lambda: calls.append("absent")
    )
    results = _harness.measure_all(bench, repeats=3)
    # Warm-ups first, then rounds in alternating order: a, b | b, a | a, b.
    assert "".join(calls) == "ab" + "ab" + "ba" + "ab"
    assert [r.implementation for r in results] == ["grain_core", "b", "absent"]
    assert [len(r.seconds) for r in results[:2]] == [3, 3]
    assert isinstance(results[2], _harness.Skipped)


def test_long_lived_iterators_are_closed_once_timed(harness: tuple[ModuleType, ModuleType]) -> None:
    _harness, _ = harness

    class Counting:
        def __init__(self) -> None:
            self.closed = False
            self.left = 5

        def __iter__(self) -> Counting:
            return self

        def __next__(self) -> int:
            if self.left == 0:
                raise StopIteration
            self.left -= 1
            return self.left

        def close(self) -> None:
            self.closed = True

    made: list[Counting] = []

    def make() -> Counting:
        made.append(Counting())
        return made[-1]

    bench = _harness.Workload("steady", elements=3, description="steady")
    bench.implementations[_harness.GRAIN_CORE] = (lambda: _harness.steady_pass(make, 3), None)
    (result,) = _harness.measure_all(bench, repeats=2)
    # 3 passes of 3 elements from iterators of 5: the first ran out and was replaced.
    assert len(result.seconds) == 2
    assert len(made) == 2
    assert all(it.closed for it in made)

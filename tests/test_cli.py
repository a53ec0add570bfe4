"""Tests for the grain-core command line, run as the installed console script."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import grain_core
from grain_core import cli, plugins

RunCli = Callable[..., tuple[int, str, str]]

CONSOLE_SCRIPT = Path(sys.executable).with_name("grain-core")

GOOD_PLUGIN = """
from grain_core import hookimpl
from grain_core.plugins import FormatSpec

@hookimpl
def register_formats(register):
    register(FormatSpec(name="fakefmt", suffixes=(".fake",), source=list,
                        description="a format without inspector"))
"""


@pytest.fixture
def grain_core_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[RunCli]:
    """Returns ``run(*args, **env)``: the CLI in this process, with a fresh registry."""
    for variable in (plugins.PLUGINS_ENV, plugins.DISABLE_ENV):
        monkeypatch.delenv(variable, raising=False)

    def run(*args: str, **env: str) -> tuple[int, str, str]:
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        plugins.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", plugins.PluginWarning)
            code = cli.main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    plugins.reset()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Puts two fake plugin distributions on sys.path: one good, one broken on import."""
    root = tmp_path / "site"
    modules = []
    for dist, entry, module, code in [
        ("fake-good", "good", "fake_good_plugin", GOOD_PLUGIN),
        ("fake-broken", "broken", "fake_broken_plugin", "raise RuntimeError('broken on import')"),
    ]:
        info = root / f"{dist.replace('-', '_')}-2.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 2.0\n")
        (info / "entry_points.txt").write_text(f"[grain_core]\n{entry} = {module}\n")
        (root / f"{module}.py").write_text(textwrap.dedent(code))
        modules.append(module)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    yield root
    for module in modules:
        sys.modules.pop(module, None)


def _subprocess(*command: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRAIN_CORE_")}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**clean, **env}
    )


def test_console_script_prints_version_and_plugins() -> None:
    result = _subprocess(str(CONSOLE_SCRIPT), "--version")
    assert result.returncode == 0, result.stderr
    version, loaded = result.stdout.splitlines()
    assert version == f"grain-core {grain_core.__version__}"
    assert loaded.startswith("plugins: builtins")


def test_python_dash_m_runs_the_same_cli() -> None:
    result = _subprocess(sys.executable, "-m", "grain_core", "plugins", GRAIN_CORE_PLUGINS="")
    assert result.returncode == 0, result.stderr
    header, builtins = result.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "DISTRIBUTION", "VERSION", "STATUS", "PROVIDES"]
    assert builtins.split()[:4] == ["builtins", "grainpipe", grain_core.__version__, "loaded"]
    assert "shuffle: global, window; sharding: none, even_split, strided, jax_process" in builtins


def test_version_lists_loaded_plugins(site: Path, grain_core_cli: RunCli) -> None:
    code, out, _ = grain_core_cli("--version", GRAIN_CORE_PLUGINS="good,broken")
    assert code == 0
    assert out.splitlines()[1] == "plugins: builtins, good (fake-good 2.0)"


def test_plugins_table_shows_installed_and_broken_plugins(
    site: Path, grain_core_cli: RunCli
) -> None:
    code, out, _ = grain_core_cli("plugins", GRAIN_CORE_PLUGINS="good,broken")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line}
    assert lines["good"].split()[1:] == ["fake-good", "2.0", "loaded", "formats:", "fakefmt"]
    assert lines["broken"].split()[1:4] == ["fake-broken", "2.0", "failed"]
    assert lines["broken"].endswith("could not be loaded: RuntimeError: broken on import")
    assert "--verbose shows the tracebacks" in out

    _, verbose, _ = grain_core_cli("plugins", "--verbose")
    assert "Traceback (most recent call last)" in verbose
    assert 'fake_broken_plugin.py", line 1' in verbose


def test_plugins_json(site: Path, grain_core_cli: RunCli) -> None:
    _, out, _ = grain_core_cli("plugins", "--json", GRAIN_CORE_PLUGINS="good,broken,typo")
    data = json.loads(out)
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["good"]["provides"] == {"formats": ["fakefmt"]}
    assert by_name["good"]["hooks"] == ["register_formats"]
    assert by_name["broken"]["status"] == "failed"
    assert "RuntimeError: broken on import" in by_name["broken"]["traceback"]
    assert data["formats"] == [
        {
            "name": "fakefmt",
            "suffixes": [".fake"],
            "url_patterns": [],
            "provides": ["source"],
            "description": "a format without inspector",
        }
    ]
    installed = ", ".join(sorted(p for p in by_name if p != "builtins"))
    assert data["problems"] == [
        f"GRAIN_CORE_PLUGINS names 'typo', which is not an installed plugin (installed: {installed})."
    ]


def test_blocked_plugins_are_reported_as_disabled(site: Path, grain_core_cli: RunCli) -> None:
    _, out, _ = grain_core_cli("plugins", "--json", GRAIN_CORE_DISABLE_PLUGINS="good,broken")
    data = json.loads(out)
    statuses = {p["name"]: p["status"] for p in data["plugins"]}
    assert statuses["good"] == statuses["broken"] == "disabled"
    assert "fakefmt" not in {f["name"] for f in data["formats"]}


def test_jsonl_plugin_appears_only_when_installed(grain_core_cli: RunCli) -> None:
    data = json.loads(grain_core_cli("plugins", "--json")[1])
    installed = importlib.util.find_spec("grain_jsonl") is not None
    assert ("jsonl" in {p["name"] for p in data["plugins"]}) == installed
    assert ("jsonl" in {f["name"] for f in data["formats"]}) == installed


def test_inspect_jsonl_file(tmp_path: Path, grain_core_cli: RunCli) -> None:
    pytest.importorskip("grain_jsonl")
    path = tmp_path / "data.jsonl-00000-of-00001"
    path.write_text('{"label": 3, "text": "x"}\n{"label": 4, "text": "y"}\n')
    code, out, err = grain_core_cli("inspect", str(path), "--sample", "1")
    assert code == 0, err
    assert out.splitlines()[:4] == [
        f"path:    {path}",
        "format:  jsonl",
        "records: 2",
        'schema:  {"label": "int", "text": "str"}',
    ]
    assert "sample[0]: {'label': 3, 'text': 'x'}" in out
    assert "sample[1]" not in out
    data = json.loads(grain_core_cli("inspect", str(path), "--json")[1])
    assert (data["format"], data["num_records"], len(data["sample"])) == ("jsonl", 2, 2)


def test_inspect_errors_are_clear(site: Path, tmp_path: Path, grain_core_cli: RunCli) -> None:
    code, _, err = grain_core_cli("inspect", str(tmp_path / "x.csv"), GRAIN_CORE_PLUGINS="good")
    assert code == 1
    assert "No installed format claims" in err and "fakefmt (.fake)" in err
    code, _, err = grain_core_cli("inspect", "x.fake")
    assert code == 1
    assert "Format 'fakefmt' has no inspector; it offers: source." in err
    code, _, err = grain_core_cli("inspect", "x.fake", "--format", "nope")
    assert "No format named 'nope' is installed. Installed: fakefmt." in err


def test_bench_delegates_to_the_checkout_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grain_core_cli: RunCli
) -> None:
    runner = tmp_path / "benchmarks" / "run.py"
    runner.parent.mkdir()
    runner.write_text("import sys\nsys.exit(10 + len(sys.argv[1:]))\n")
    monkeypatch.chdir(tmp_path)
    assert grain_core_cli("bench", "--only", "x", "--json")[0] == 13
    monkeypatch.chdir(runner.parent)
    code, _, err = grain_core_cli("bench")
    assert code == 1
    assert "runs benchmarks/run.py of a grain_core source checkout" in err


def test_unknown_arguments_and_no_command(grain_core_cli: RunCli) -> None:
    with pytest.raises(SystemExit) as exited:
        grain_core_cli("plugins", "--bogus")
    assert exited.value.code == 2
    assert grain_core_cli()[0] == 2


def test_progress_is_off_when_stderr_is_not_a_terminal() -> None:
    items = [1, 2, 3]
    assert cli.progress(items, 3, "x") is items


def test_help_does_not_load_plugins(grain_core_cli: RunCli) -> None:
    with pytest.raises(SystemExit):
        grain_core_cli("--help")
    assert plugins.loaded_plugin_names() is None


def test_convert_jsonl_round_trip_is_atomic(tmp_path: Path, grain_core_cli: RunCli) -> None:
    pytest.importorskip("grain_jsonl")
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"label": {i}, "text": "t{i}"}}\n' for i in range(5)))
    target = tmp_path / "out.jsonl"
    code, out, err = grain_core_cli("convert", str(source), str(target))
    assert code == 0, err
    assert out.startswith(f"5 records: {source} (jsonl) -> {target} (jsonl) in ")
    assert target.read_text() == source.read_text().replace(": ", ":").replace(", ", ",")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_convert_errors_name_the_formats_and_keep_the_old_output(
    site: Path, tmp_path: Path, grain_core_cli: RunCli
) -> None:
    code, _, err = grain_core_cli("convert", "x.fake", str(tmp_path / "y.fake"))
    assert code == 1
    assert "Format 'fakefmt' has no writer; it offers: source." in err
    pytest.importorskip("grain_jsonl")
    source = tmp_path / "in.jsonl"
    source.write_text('{"a": 1}\n')
    target = tmp_path / "out.jsonl"
    target.write_text("previous\n")
    code, _, err = grain_core_cli("convert", str(tmp_path / "missing.jsonl"), str(target))
    assert code == 1 and "missing.jsonl" in err
    assert target.read_text() == "previous\n"


def test_convert_between_arrayrecord_and_tfrecord(tmp_path: Path, grain_core_cli: RunCli) -> None:
    arrayrecord = pytest.importorskip("grain_arrayrecord")
    tfrecord = pytest.importorskip("grain_tfrecord")
    records = [bytes([i]) * (i + 1) for i in range(40)]
    first = tmp_path / "a.array_record"
    with arrayrecord.ArrayRecordWriter(str(first)) as writer:
        for r in records:
            writer.write(r)
    middle = tmp_path / "b.tfrecord.gz"
    last = tmp_path / "c.array_record"
    for src, dst in ((first, middle), (middle, last)):
        code, out, err = grain_core_cli("convert", str(src), str(dst))
        assert code == 0, err
        assert out.startswith("40 records:")
    assert list(tfrecord.TFRecordIterDataset(str(middle))) == records
    assert arrayrecord.ArrayRecordDataSource(str(last)).__getitems__(range(40)) == records


def test_convert_rows_to_examples_and_reject_what_the_target_cannot_hold(
    tmp_path: Path, grain_core_cli: RunCli
) -> None:
    pytest.importorskip("grain_jsonl")
    tfrecord = pytest.importorskip("grain_tfrecord")
    source = tmp_path / "in.jsonl"
    source.write_text('{"a": 1, "b": [0.5, 1.5]}\n')
    examples = tmp_path / "out.tfrecord"
    code, _, err = grain_core_cli("convert", str(source), str(examples))
    assert code == 0, err  # TFRecordWriter encodes rows as tf.train.Example
    (record,) = list(tfrecord.TFRecordIterDataset(str(examples)))
    decoded = tfrecord.decode_example(record)
    assert decoded["a"].tolist() == [1] and decoded["b"].tolist() == [0.5, 1.5]
    back = tmp_path / "back.jsonl"
    code, _, err = grain_core_cli("convert", str(examples), str(back))
    assert code == 1
    assert "Record 0 of" in err and "(tfrecord, a bytes) cannot be written as jsonl" in err
    assert not back.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.tfrecord"]

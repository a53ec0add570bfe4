"""Tests for the grain-core command line, run as the installed console script."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
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
    assert code == 0, err  # Examples are decoded for a format that stores rows
    assert json.loads(back.read_text()) == {"a": [1], "b": [0.5, 1.5]}
    raw = tmp_path / "raw.tfrecord"
    with tfrecord.TFRecordWriter(str(raw)) as writer:
        writer.write(b"\xff not an Example")
    code, _, err = grain_core_cli("convert", str(raw), str(tmp_path / "raw.jsonl"))
    assert code == 1
    assert "Record 0 of" in err and "(tfrecord, a bytes) cannot be written as jsonl" in err
    assert not (tmp_path / "raw.jsonl").exists()


# convert and inspect on real files: overwriting, options, shards, TFRecord to Parquet, pipes.


def _write_examples(path: Path, rows: list[dict[str, Any]]) -> None:
    tfrecord = pytest.importorskip("grain_tfrecord")
    with tfrecord.TFRecordWriter(str(path)) as writer:
        for row in rows:
            writer.write(tfrecord.encode_example(row))


def _examples(count: int) -> list[dict[str, Any]]:
    return [
        {"label": np.array([i]), "tokens": np.arange(i % 4), "weight": np.float32([i, 0.5])}
        for i in range(count)
    ]


def test_convert_refuses_an_existing_output_unless_overwrite(
    tmp_path: Path, grain_core_cli: RunCli
) -> None:
    tfrecord = pytest.importorskip("grain_tfrecord")
    source, target = tmp_path / "in.tfrecord", tmp_path / "out.tfrecord"
    _write_examples(source, _examples(5))
    target.write_bytes(b"precious")
    code, _, err = grain_core_cli("convert", str(source), str(target))
    assert code == 1
    assert f"{target} already exists" in err and "--overwrite" in err
    assert target.read_bytes() == b"precious"
    code, _, err = grain_core_cli("convert", str(source), str(target), "--overwrite")
    assert code == 0, err
    assert len(list(tfrecord.TFRecordIterDataset(str(target)))) == 5
    shards = tmp_path / "s.tfrecord"
    (tmp_path / "s.tfrecord-00001-of-00002").write_bytes(b"precious")
    code, _, err = grain_core_cli("convert", str(source), f"{shards}@2")
    assert code == 1 and "s.tfrecord-00001-of-00002 already exists" in err
    assert not (tmp_path / "s.tfrecord-00000-of-00002").exists()


def test_convert_errors_name_the_users_paths_and_the_cli_options(
    tmp_path: Path, grain_core_cli: RunCli
) -> None:
    pytest.importorskip("grain_tfrecord")
    gzipped = tmp_path / "in.tfrecord.gz"
    _write_examples(gzipped, _examples(3))
    unsuffixed = tmp_path / "in.tfrecord"
    unsuffixed.write_bytes(gzipped.read_bytes())
    code, _, err = grain_core_cli("convert", str(unsuffixed), str(tmp_path / "o.tfrecord"))
    assert code == 1 and "--compression GZIP" in err and "compression=" not in err
    code, _, err = grain_core_cli(
        "convert", str(unsuffixed), str(tmp_path / "o.tfrecord"), "--compression", "gzip"
    )
    assert code == 0, err
    damaged = tmp_path / "damaged.tfrecord"
    _write_examples(damaged, _examples(3))
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0xFF  # the last record's payload: its data CRC no longer matches
    damaged.write_bytes(bytes(data))
    code, _, err = grain_core_cli("convert", str(damaged), str(tmp_path / "d.tfrecord"))
    assert code == 1 and "--no-verify-crc" in err and "verify_crc" not in err
    code, _, err = grain_core_cli(
        "convert", str(damaged), str(tmp_path / "d.tfrecord"), "--no-verify-crc"
    )
    assert code == 0, err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    nowhere = blocker / "out.tfrecord"  # its directory is a file: nothing can be written
    code, _, err = grain_core_cli("convert", str(gzipped), str(nowhere))
    assert code == 1 and str(blocker) in err and ".tmp" not in err
    code, _, err = grain_core_cli(
        "convert", str(gzipped), str(tmp_path / "o.parquet"), "--compression", "ZLIB"
    )
    assert code == 1


def test_convert_compression_on_read_and_write(tmp_path: Path, grain_core_cli: RunCli) -> None:
    tfrecord = pytest.importorskip("grain_tfrecord")
    plain = tmp_path / "plain.tfrecord"
    _write_examples(plain, _examples(6))
    records = list(tfrecord.TFRecordIterDataset(str(plain)))
    for compression, magic in (("ZLIB", b"\x78"), ("GZIP", b"\x1f\x8b")):
        packed = tmp_path / f"{compression}.tfrecord"
        code, _, err = grain_core_cli(
            "convert", str(plain), str(packed), "--output-compression", compression
        )
        assert code == 0, err
        assert packed.read_bytes()[: len(magic)] == magic
        back = tmp_path / f"{compression}-back.tfrecord"
        code, _, err = grain_core_cli(
            "convert", str(packed), str(back), "--compression", compression
        )
        assert code == 0, err
        assert list(tfrecord.TFRecordIterDataset(str(back))) == records


@pytest.mark.parametrize("spelling", ["--shards", "@", "-of-"])
def test_convert_writes_shards_with_records_split_evenly(
    tmp_path: Path, grain_core_cli: RunCli, spelling: str
) -> None:
    tfrecord = pytest.importorskip("grain_tfrecord")
    source = tmp_path / "in.tfrecord"
    _write_examples(source, _examples(11))
    records = list(tfrecord.TFRecordIterDataset(str(source)))
    base = tmp_path / "out.tfrecord"
    output = {
        "--shards": [str(base), "--shards", "3"],
        "@": [f"{base}@3"],
        "-of-": [f"{base}-00000-of-00003"],
    }[spelling]
    code, out, err = grain_core_cli("convert", str(source), *output)
    assert code == 0, err
    assert out.startswith(f"11 records: {source} (tfrecord) -> 3 files {base}-00000-of-00003")
    shards = [list(tfrecord.TFRecordIterDataset(f"{base}-{i:05d}-of-00003")) for i in range(3)]
    assert [len(s) for s in shards] == [4, 4, 3]
    assert shards == [records[i::3] for i in range(3)]  # record k in file k % 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.tfrecord",
        *(f"out.tfrecord-{i:05d}-of-00003" for i in range(3)),
    ]
    code, _, err = grain_core_cli(
        "convert", str(source), f"{base}@2", "--shards", "3", "--overwrite"
    )
    assert code == 1 and "names 2 shards but --shards is 3" in err


def test_convert_tfrecord_examples_to_parquet_columns(
    tmp_path: Path, grain_core_cli: RunCli
) -> None:
    parquet = pytest.importorskip("grain_parquet")
    source = tmp_path / "in.tfrecord"
    _write_examples(source, _examples(7))
    target = tmp_path / "out.parquet"
    code, _, err = grain_core_cli("convert", str(source), str(target))
    assert code == 0, err
    rows = parquet.ParquetDataSource(str(target)).__getitems__(range(7))
    for i, row in enumerate(rows):
        assert row["label"].tolist() == [i]
        assert row["tokens"].tolist() == list(range(i % 4))
        assert row["weight"].tolist() == [i, 0.5]
    info = parquet.inspect_parquet(str(target), 0)
    assert info.schema["tokens"] == "list<element: int64>"
    for bad, message in (
        ({"label": np.array([1])}, "it lacks the feature(s) ['tokens', 'weight'] of record 0"),
        (
            {
                "label": np.array([b"x"], dtype=object),
                "tokens": np.arange(2),
                "weight": np.float32([1, 2]),
            },
            "its feature 'label' holds object values, record 0's holds int64",
        ),
    ):
        mixed = tmp_path / "mixed.tfrecord"
        _write_examples(mixed, [*_examples(2), bad])
        code, _, err = grain_core_cli("convert", str(mixed), str(tmp_path / "mixed.parquet"))
        assert code == 1
        assert f"Record 2 of {mixed} (tfrecord, a bytes) cannot be written as parquet" in err
        assert message in err
        assert not (tmp_path / "mixed.parquet").exists()


def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    source = tmp_path / "many.tfrecord"
    _write_examples(source, _examples(3000))
    reader = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "inspect", str(source), "--sample", "3000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert reader.stdout is not None and reader.stderr is not None
    assert reader.stdout.readline().startswith(b"path:")
    reader.stdout.close()  # what `| head -1` does after its line
    stderr = reader.stderr.read()
    assert reader.wait() == 141  # 128 + SIGPIPE, as for coreutils
    assert stderr == b""


def test_inspect_takes_shard_patterns_and_writes_nothing_beside_the_data(
    tmp_path: Path, grain_core_cli: RunCli
) -> None:
    pytest.importorskip("grain_tfrecord")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        _write_examples(data / f"x.tfrecord-{i:05d}-of-00002", _examples(3 + i))
    _write_examples(data / "z.tfrecord.gz-00000-of-00001", _examples(2))
    data.chmod(0o555)  # read-only: nothing can be written there, and nothing should be tried
    try:
        for pattern in ("x.tfrecord@2", "x.tfrecord-*-of-00002", "x.tfrecord-?????-of-*"):
            code, out, err = grain_core_cli("inspect", str(data / pattern), "--json")
            assert code == 0, err
            assert err == ""
            assert json.loads(out)["num_records"] == 7
        code, out, err = grain_core_cli("inspect", str(data / "z.tfrecord.gz@1"), "--json")
        assert code == 0, err
        assert json.loads(out)["details"]["compression"] == "GZIP"
        assert sorted(p.name for p in data.iterdir()) == [
            "x.tfrecord-00000-of-00002",
            "x.tfrecord-00001-of-00002",
            "z.tfrecord.gz-00000-of-00001",
        ]
    finally:
        data.chmod(0o755)


def test_inspect_reads_the_schema_from_a_sample_of_examples(
    tmp_path: Path, grain_core_cli: RunCli
) -> None:
    pytest.importorskip("grain_tfrecord")
    source = tmp_path / "x.tfrecord"
    rows = _examples(10)
    rows[9] = {"label": np.array([9]), "tokens": np.arange(6), "weight": np.float32([9, 0.5])}
    del rows[4]["weight"]
    _write_examples(source, rows)
    code, out, err = grain_core_cli("inspect", str(source), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["schema"] == {
        "label": {"dtype": "int64", "shape": [1]},
        "tokens": {"dtype": "int64", "shape": [None], "lengths": [0, 6]},
        "weight": {"dtype": "float32", "shape": [2], "missing": "in 1 of 10 records"},
    }
    assert summary["details"]["schema_from_records"] == 10
    code, out, err = grain_core_cli("inspect", str(source), "--json", "--schema-sample", "1")
    assert json.loads(out)["schema"]["tokens"] == {"dtype": "int64", "shape": [0]}


# ``grain-core convert`` that stops half-way through its records (and announces it) until its
# stdin closes; the writing process is killed there.
_HALTED_CONVERT = """
import sys
from grain_core import cli

records_of = cli._records_of

def halted(fmt, path, options):
    records, total = records_of(fmt, path, options)
    def first_half_then_wait():
        for i, record in enumerate(records):
            if i == 100:
                print("writing", flush=True)
                sys.stdin.read()
            yield record
    return first_half_then_wait(), total

cli._records_of = halted
sys.exit(cli.main(["convert", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("suffix", [".tfrecord", ".array_record"])
def test_a_killed_converts_hidden_files_go_with_the_next_write_of_its_target(
    suffix: str, tmp_path: Path, grain_core_cli: RunCli
) -> None:
    tfrecord = pytest.importorskip("grain_tfrecord")
    if suffix == ".array_record":
        pytest.importorskip("grain_arrayrecord")
    source = tmp_path / "in.tfrecord"
    with tfrecord.TFRecordWriter(source) as writer:
        for i in range(200):
            writer.write(bytes([i]) * 1000)
    out = tmp_path / "out"
    out.mkdir()
    target, other = out / f"data{suffix}", out / f"other{suffix}"
    # Killed writing the target, killed writing another file, and still writing the target.
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _HALTED_CONVERT, str(source), str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for path in (target, other, target)
    ]
    hidden = []
    for child in children:
        assert child.stdout is not None and child.stdout.readline() == "writing\n"
        hidden.append({p for p in os.listdir(out) if p.startswith(f".tmp.{child.pid}.")})
        assert hidden[-1], os.listdir(out)
    killed_target, killed_other, live = children
    for child in (killed_target, killed_other):
        child.kill()
        child.wait()
    code, _, err = grain_core_cli("convert", str(source), str(target))
    assert code == 0, err
    left = set(os.listdir(out))
    assert not hidden[0] & left  # the killed writer's files went with the next write
    assert hidden[1] <= left and hidden[2] <= left  # another target's, and a live writer's
    assert live.stdin is not None
    live.stdin.close()
    assert live.wait() == 0  # it checked for the target before the other convert wrote it
    assert sorted(os.listdir(out)) == sorted({target.name, *hidden[1]})


# What `grain-core inspect --help` promises, each form run for every format on shards that
# `grain-core convert` wrote.
_INSPECT_FORMS = ("x@2", "x-*-of-00002", "x-?????-of-00002", "x-*", "*")


@pytest.mark.parametrize("suffix", [".tfrecord", ".array_record", ".parquet"])
def test_inspect_reads_every_shard_pattern_of_every_format(
    tmp_path: Path, grain_core_cli: RunCli, suffix: str
) -> None:
    for module in ("grain_tfrecord", "grain_arrayrecord", "grain_parquet"):
        pytest.importorskip(module)
    source = tmp_path / "in.tfrecord"
    _write_examples(source, _examples(7))
    data = tmp_path / "data"
    data.mkdir()
    base = data / f"x{suffix}"
    converted = _subprocess(str(CONSOLE_SCRIPT), "convert", str(source), f"{base}@2")
    assert converted.returncode == 0, converted.stderr
    for form in _INSPECT_FORMS:
        pattern = str(base) + form[1:] if form != "*" else str(data / f"*{suffix}-*")
        code, out, err = grain_core_cli("inspect", pattern, "--json")
        assert code == 0, (form, err)
        assert json.loads(out)["num_records"] == 7, form
    # x@2 through the installed command, and an unquoted glob that the shell expands into
    # several paths.
    for command in (
        f"{CONSOLE_SCRIPT} inspect {base}@2 --json",
        f"{CONSOLE_SCRIPT} inspect {data}/x{suffix}-* --json",
    ):
        shell = _subprocess("/bin/sh", "-c", command)
        assert shell.returncode == 0, (command, shell.stderr)
        assert json.loads(shell.stdout)["num_records"] == 7, command
    # convert reads the same forms, several paths included.
    joined = tmp_path / "joined.tfrecord"
    shell = _subprocess("/bin/sh", "-c", f"{CONSOLE_SCRIPT} convert {data}/x{suffix}-* {joined}")
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.startswith(f"7 records: {base}-00000-of-00002 {base}-00001-of-00002 (")


def test_inspect_help_lists_the_tested_forms(grain_core_cli: RunCli) -> None:
    with pytest.raises(SystemExit):
        grain_core_cli("inspect", "--help")
    # argparse wraps the help text: compare without line breaks.
    help_text = " ".join(_subprocess(str(CONSOLE_SCRIPT), "inspect", "--help").stdout.split())
    for form in ("x@4", "x-*-of-00004", "x-*", "a glob", "several paths"):
        assert form in help_text


def test_no_format_claims_names_the_plugins_and_their_suffixes(grain_core_cli: RunCli) -> None:
    pytest.importorskip("grain_arrayrecord")
    code, _, err = grain_core_cli("inspect", "data.unknown-*")
    assert code == 1
    assert "No installed format claims 'data.unknown-*'" in err
    assert "arrayrecord (.array_record, .arrayrecord) of plugin arrayrecord" in err
    assert "pip install" not in err  # every first-party plugin is installed here


@pytest.mark.parametrize(
    ("url", "missing", "package"),
    [
        ("s3://bucket/x.tfrecord", "fsspec", "fsspec s3fs"),
        ("gs://bucket/x.tfrecord", "gs", "gcsfs"),
        ("hf://datasets/user/x.tfrecord", "hf", "huggingface_hub"),
        # Parquet too (pyarrow's own GCS client waited for the network for minutes).
        ("gs://bucket/x.parquet", "gs", "gcsfs"),
    ],
)
def test_a_missing_store_package_is_one_line_naming_what_to_install(
    url: str, missing: str, package: str, monkeypatch: pytest.MonkeyPatch, grain_core_cli: RunCli
) -> None:
    pytest.importorskip("grain_parquet" if url.endswith(".parquet") else "grain_tfrecord")
    if missing == "fsspec":
        monkeypatch.setitem(sys.modules, "fsspec", None)
    else:  # the scheme's implementation cannot be imported, as when its package is missing
        registry = importlib.import_module("fsspec.registry")
        monkeypatch.setitem(
            registry.known_implementations,
            missing,
            {"class": "no_such_store_package.FileSystem", "err": f"Install {package}"},
        )
        monkeypatch.delitem(registry._registry, missing, raising=False)
    code, out, err = grain_core_cli("inspect", url)
    assert code == 1 and out == ""
    assert err.count("\n") == 1, err
    assert err.startswith(f"grain-core inspect: error: Opening {url} needs ")
    assert err.endswith(f": pip install {package}\n")


def test_an_import_error_without_a_hint_gets_one(
    grain_core_cli: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(args: Any) -> int:
        try:
            import no_such_module_for_this_test  # noqa: F401
        except ImportError as e:
            raise ImportError("Install it to access the store") from e
        return 0

    monkeypatch.setattr(cli, "_cmd_plugins", fail)
    code, _, err = grain_core_cli("plugins")
    assert code == 1
    assert err == (
        "grain-core plugins: error: Install it to access the store: "
        "pip install no_such_module_for_this_test\n"
    )


def test_an_unreachable_store_fails_with_one_line_within_its_retries(tmp_path: Path) -> None:
    """A store that refuses connections (a closed port on 127.0.0.1) ends ``inspect`` after
    the configured retries with one line naming the URL, instead of waiting silently."""
    pytest.importorskip("s3fs")
    pytest.importorskip("grain_tfrecord")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{listener.getsockname()[1]}"
    store = {
        "endpoint_url": closed,
        "key": "testing",
        "secret": "testing",
        "config_kwargs": {"retries": {"max_attempts": 2}},
    }
    result = _subprocess(
        sys.executable, "-m", "grain_core", "inspect", "s3://bucket/x.tfrecord",
        FSSPEC_S3=json.dumps(store),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("grain-core inspect: error: Looking up s3://bucket/x.tfrecord")
    assert "failed after the file system's retries" in result.stderr
    assert "Check that the store is reachable" in result.stderr


def test_convert_says_when_the_target_format_changes_a_columns_type(
    tmp_path: Path, grain_core_cli: RunCli
) -> None:
    pytest.importorskip("grain_tfrecord")
    pytest.importorskip("grain_parquet")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    source = tmp_path / "in.parquet"
    table = pa.table({"x": pa.array(np.arange(4, dtype=np.int32)), "name": ["a", "b", "c", "d"]})
    pq.write_table(table, source)
    code, out, _ = grain_core_cli("convert", str(source), str(tmp_path / "out.tfrecord"))
    assert code == 0
    assert out.splitlines()[-1] == (
        "note: tfrecord stores these columns with other types than parquet did: "
        "x: int32 -> int64[1]; name: string -> bytes[1]"
    )
    code, out, _ = grain_core_cli("convert", str(source), str(tmp_path / "same.parquet"))
    assert code == 0 and "note:" not in out

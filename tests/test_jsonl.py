"""The third-party test plugin grain-jsonl, installed as a real distribution.

Runs where nox installed ``tests/plugin_jsonl`` (tests-all); skipped elsewhere.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest

import grain_core
from grain_core import plugins
from grain_core.plugins import NoFormatForPathError, Registry

grain_jsonl = pytest.importorskip("grain_jsonl")


@pytest.fixture(autouse=True)
def _fresh_global_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAIN_CORE_PLUGINS", raising=False)
    monkeypatch.delenv("GRAIN_CORE_DISABLE_PLUGINS", raising=False)
    plugins.reset()


def _write(path: Path, records: list[object]) -> None:
    with plugins.format_for_path(path).get("writer")(path) as writer:
        for record in records:
            writer.write(record)


def test_installed_plugin_is_found_through_entry_points() -> None:
    report = next(r for r in plugins.registry().reports if r.name == "jsonl")
    assert (report.status, report.distribution) == ("loaded", "grain-jsonl")
    assert report.provides == {
        "formats": ["jsonl"],
        "exports": ["grain_core.sources.JsonlDataSource"],
    }
    fmt = plugins.get_format("jsonl")
    assert fmt.provides == ("source", "writer", "inspector")
    assert plugins.format_for_path("/d/train.jsonl-00001-of-00004") is fmt
    assert plugins.format_for_path("x.NDJSON") is fmt
    assert grain_core.sources.JsonlDataSource is grain_jsonl.JsonlDataSource  # type: ignore[attr-defined]


def test_write_then_read_through_the_lookup_api(tmp_path: Path) -> None:
    records = [{"id": i, "image": np.arange(i, dtype=np.uint8)} for i in range(20)]
    paths = [tmp_path / "part.jsonl-00000-of-00002", tmp_path / "part.jsonl-00001-of-00002"]
    _write(paths[0], records[:12])
    _write(paths[1], records[12:])
    source = plugins.format_for_path(paths[0]).get("source")(paths)
    assert len(source) == 20
    assert source[13] == {"id": 13, "image": list(range(13))}
    assert [r["id"] for r in source.__getitems__([19, 0, 12, 11])] == [19, 0, 12, 11]
    ds = grain_core.MapDataset.source(source).seed(3).shuffle().map(lambda r: r["id"])
    assert sorted(ds) == list(range(20))
    restored = pickle.loads(pickle.dumps(source))
    assert restored[5] == source[5]


def test_inspector_reports_count_schema_and_sample(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    _write(path, [{"label": 1, "text": "a"}, {"label": 2, "text": "b"}, {"label": 3, "text": "c"}])
    info = plugins.get_format("jsonl").get("inspector")(str(path), 2)
    assert info.num_records == 3
    assert info.schema == {"label": "int", "text": "str"}
    assert info.sample == ({"label": 1, "text": "a"}, {"label": 2, "text": "b"})


def test_blank_lines_are_not_records_and_empty_files_are_empty(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("1\n\n2\n3")
    (tmp_path / "b.jsonl").write_text("")
    source = grain_jsonl.JsonlDataSource([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    assert [source[i] for i in range(len(source))] == [1, 2, 3]


def test_bad_record_names_file_index_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ok": 1}\n{"broken": \n')
    source = grain_jsonl.JsonlDataSource(path)
    with pytest.raises(
        ValueError, match=r"bad.jsonl: record 1 \(byte offset 10\) is not valid JSON"
    ):
        source[1]
    with pytest.raises(IndexError, match="Record index 2 out of range for 2 records"):
        source[2]


def test_failed_write_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    with pytest.raises(TypeError, match="record 1 cannot be written: object is not JSON"):
        with grain_jsonl.JsonlWriter(path) as writer:
            writer.write({"fine": 1})
            writer.write({"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_blocking_or_not_selecting_removes_it(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    for environ in ({"GRAIN_CORE_DISABLE_PLUGINS": "jsonl"}, {"GRAIN_CORE_PLUGINS": ""}):
        registry = Registry(environ)
        assert "jsonl" not in {f.name for f in registry.objects("formats")}
        with pytest.raises(NoFormatForPathError):
            registry.format_for_path(str(path))
        with pytest.raises(AttributeError):
            registry.resolve_public_name("grain_core.sources", "JsonlDataSource")


def test_the_plugin_guide_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/writing-a-plugin.md shows this plugin's hooks and its use; the blocks run in order.
    guide = Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md"
    blocks = re.findall(r"^```python\n(.*?)^```", guide.read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    namespace: dict[str, object] = {"__name__": "writing_a_plugin"}
    for number, code in enumerate(blocks, start=1):
        exec(compile(code, f"{guide}:block{number}", "exec"), namespace)
    assert (tmp_path / "data" / "train.jsonl-00000-of-00002").is_file()

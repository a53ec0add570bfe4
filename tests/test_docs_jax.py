"""Runs the ``python`` code blocks of docs/jax.md, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

DOC = Path(__file__).resolve().parents[1] / "docs" / "jax.md"
# ```python blocks run here; ```py blocks need a real cluster (see tests/test_jax_multihost.py).
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_doc_has_the_expected_sections_and_blocks() -> None:
    text = DOC.read_text()
    for heading in ("## Single host", "## Many hosts", "## Checkpointing"):
        assert heading in text
    assert len(BLOCK.findall(text)) == 5
    assert "jax.distributed.initialize(" in text


def test_code_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the examples write checkpoints to relative paths
    namespace: dict[str, object] = {"__name__": "docs_jax"}
    for number, code in enumerate(BLOCK.findall(DOC.read_text()), start=1):
        exec(compile(code, f"{DOC}:block{number}", "exec"), namespace)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step_1").iterdir()) == [
        "process_0-of-1.json"
    ]
    assert (tmp_path / "checkpoints" / "orbax" / "10").is_dir()
    assert (
        tmp_path / "checkpoints" / "orbax_v1" / "11" / "loader" / "process_0-of-1.json"
    ).is_file()

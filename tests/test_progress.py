"""Tests for grain_core._progress: the command-line tools' progress bar."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest

from grain_core._progress import progress


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_is_off_when_stderr_is_not_a_terminal() -> None:
    items = [1, 2, 3]
    with contextlib.redirect_stderr(io.StringIO()):
        assert progress(items, 3, "x") is items


def test_a_terminal_gets_a_bar_over_the_same_items() -> None:
    pytest.importorskip("tqdm")  # the optional `progress` extra
    terminal = _Terminal()
    with contextlib.redirect_stderr(terminal):
        bar = progress([1, 2, 3], 3, "rec")
        assert bar is not None
        assert list(bar) == [1, 2, 3]
    assert "0/3" in terminal.getvalue()


def test_a_terminal_without_tqdm_gets_the_items_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if the extra were not installed
    items = [1, 2, 3]
    terminal = _Terminal()
    with contextlib.redirect_stderr(terminal):
        assert progress(items, 3, "rec") is items
    assert terminal.getvalue() == ""

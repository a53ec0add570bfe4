"""The entry point module: registers the ``jsonl`` format with grain_core."""

from __future__ import annotations

from collections.abc import Callable

from grain_core import hookimpl
from grain_core.plugins import FormatSpec
from grain_jsonl._jsonl import JsonlDataSource, JsonlWriter, inspect_jsonl

__all__ = ["register_formats"]


@hookimpl
def register_formats(register: Callable[[FormatSpec], None]) -> None:
    """Registers the JSON Lines format."""
    register(
        FormatSpec(
            name="jsonl",
            suffixes=(".jsonl", ".ndjson"),
            source=JsonlDataSource,
            writer=JsonlWriter,
            inspector=inspect_jsonl,
            exports={"grain_core.sources": {"JsonlDataSource": JsonlDataSource}},
            description="JSON Lines: one JSON value per line",
        )
    )

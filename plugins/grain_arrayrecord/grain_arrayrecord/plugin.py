"""The entry-point module: registers the ``arrayrecord`` format with grain_core."""

from __future__ import annotations

from collections.abc import Callable

from grain_arrayrecord._inspect import inspect_array_record
from grain_arrayrecord._source import ArrayRecordDataSource
from grain_arrayrecord._writer import ArrayRecordWriter
from grain_core import hookimpl
from grain_core.plugins import FormatSpec

__all__ = ["register_formats"]


@hookimpl
def register_formats(register: Callable[[FormatSpec], None]) -> None:
    """Registers the ArrayRecord format (``.array_record``, ``.arrayrecord`` and shards)."""
    register(
        FormatSpec(
            name="arrayrecord",
            suffixes=(".array_record", ".arrayrecord"),
            source=ArrayRecordDataSource,
            writer=ArrayRecordWriter,
            inspector=inspect_array_record,
            exports={"grain_core.sources": {"ArrayRecordDataSource": ArrayRecordDataSource}},
            description="ArrayRecord: indexed, compressed records with batched parallel random reads",
        )
    )

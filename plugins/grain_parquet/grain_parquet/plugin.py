"""The entry-point module: registers the ``parquet`` format with grain_core."""

from __future__ import annotations

from collections.abc import Callable

from grain_core import hookimpl
from grain_core.plugins import FormatSpec
from grain_parquet._inspect import inspect_parquet
from grain_parquet._iter_dataset import ParquetIterDataset
from grain_parquet._source import ParquetDataSource
from grain_parquet._writer import ParquetWriter

__all__ = ["register_formats"]


@hookimpl
def register_formats(register: Callable[[FormatSpec], None]) -> None:
    """Registers the Parquet format (``.parquet``, ``.pq`` and shards)."""
    register(
        FormatSpec(
            name="parquet",
            suffixes=(".parquet", ".pq"),
            source=ParquetDataSource,
            iter_dataset=ParquetIterDataset,
            writer=ParquetWriter,
            inspector=inspect_parquet,
            exports={
                "grain_core.experimental": {
                    "ParquetIterDataset": ParquetIterDataset,
                    "ParquetDataSource": ParquetDataSource,
                },
                "grain_core.sources": {"ParquetDataSource": ParquetDataSource},
            },
            description="Parquet: rows or column batches by row group, random access, columns",
        )
    )

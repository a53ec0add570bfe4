"""grain-parquet: Parquet files for grain_core.

``ParquetIterDataset`` streams rows (or column batches) row group by row group;
``ParquetDataSource`` gives random access for global shuffles; ``ParquetWriter`` writes rows
or columns in row groups of a chosen size; ``inspect_parquet`` describes a file.
"""

from __future__ import annotations

from grain_parquet._inspect import inspect_parquet
from grain_parquet._iter_dataset import ParquetIterDataset
from grain_parquet._source import DEFAULT_CACHE_BYTES, ParquetDataSource
from grain_parquet._writer import DEFAULT_ROW_GROUP_SIZE, ParquetWriter

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_ROW_GROUP_SIZE",
    "ParquetDataSource",
    "ParquetIterDataset",
    "ParquetWriter",
    "inspect_parquet",
]

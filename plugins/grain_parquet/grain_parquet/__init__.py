"""grainpipe-parquet: Parquet files for grain_core.

``ParquetIterDataset`` streams rows (or column batches) row group by row group;
``ParquetDataSource`` gives random access for global shuffles; ``ParquetWriter`` writes rows
or columns in row groups of a chosen size; ``inspect_parquet`` describes a file.
"""

from __future__ import annotations

# The package index's `grain-core` is an unrelated project that also installs a top-level
# grain_core package; this plugin extends the grain_core of the `grainpipe` distribution.
try:
    import grain_core.plugins  # noqa: F401
except ModuleNotFoundError as err:
    if err.name not in ("grain_core", "grain_core.plugins"):
        raise
    raise ImportError(
        "grain_parquet needs grain_core from the `grainpipe` distribution, "
        + (
            "which is not installed: pip install . (in a clone of grain_core)"
            if err.name == "grain_core"
            else "but the grain_core installed here has no grain_core.plugins: it is another "
            "project's (the package index's `grain-core`). Replace it: "
            "pip uninstall grain-core && pip install . (in a clone of grain_core)"
        ),
        name="grain_core",
    ) from err

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

"""grain_core: deterministic, resumable, pluggable data loading for JAX.

``import grain_core as grain`` gives the names of Google Grain's ``grain`` namespace.
"""

from __future__ import annotations

from grain_core import (
    checkpoint,
    experimental,
    sharding,
    sources,
    transforms,
)
from grain_core.dataset.base import DatasetIterator, IterDataset, MapDataset
from grain_core.options import MultiprocessingOptions, ReadOptions
from grain_core.plugins import hookimpl

__version__ = "0.1.0"
__version_info__ = (0, 1, 0)

__all__ = [
    "DatasetIterator",
    "IterDataset",
    "MapDataset",
    "MultiprocessingOptions",
    "ReadOptions",
    "checkpoint",
    "experimental",
    "hookimpl",
    "sharding",
    "sources",
    "transforms",
]

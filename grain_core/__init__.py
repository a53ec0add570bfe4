"""grain_core: deterministic, resumable, pluggable data loading for JAX.

``import grain_core as grain`` gives the names of Google Grain's ``grain`` namespace.
"""

from __future__ import annotations

from grain_core import (
    checkpoint,
    constants,
    experimental,
    multiprocessing,
    samplers,
    sharding,
    sources,
    transforms,
)
from grain_core.config import config
from grain_core.data_loader import DataLoader, DataLoaderIterator, load
from grain_core.dataset.base import DatasetIterator, IterDataset, MapDataset
from grain_core.options import MultiprocessingOptions, ReadOptions
from grain_core.plugins import hookimpl
from grain_core.record import Record, RecordMetadata

__version__ = "0.1.0"
__version_info__ = (0, 1, 0)

__all__ = [
    "DataLoader",
    "DataLoaderIterator",
    "DatasetIterator",
    "IterDataset",
    "MapDataset",
    "MultiprocessingOptions",
    "ReadOptions",
    "Record",
    "RecordMetadata",
    "checkpoint",
    "config",
    "constants",
    "experimental",
    "hookimpl",
    "load",
    "multiprocessing",
    "samplers",
    "sharding",
    "sources",
    "transforms",
]

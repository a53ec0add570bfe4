"""Legacy alias package: ``import grain_core.python as grain`` runs code written for
``import grain.python as grain``.

Every name is the modern ``grain_core`` object (``PyGrainDatasetIterator`` is
``DataLoaderIterator``, ``MapTransform`` is ``transforms.Map``, …) except the legacy
``*Operation`` classes, which live here. ``ArrayRecordDataSource`` (from the ArrayRecord format
plugin) and ``PyGrainCheckpointSave``/``PyGrainCheckpointRestore`` (which need Orbax) resolve
on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from grain_core.checkpoint import CheckpointHandler as PyGrainCheckpointHandler
from grain_core.config import config
from grain_core.constants import (
    DATASET_INDEX,
    EPOCH,
    INDEX,
    META_FEATURES,
    RECORD,
    RECORD_KEY,
    SEED,
)
from grain_core.data_loader import DataLoader, load
from grain_core.data_loader import DataLoaderIterator as PyGrainDatasetIterator
from grain_core.dataset.base import IterDataset, MapDataset
from grain_core.dataset.iterator import DatasetIterator
from grain_core.multiprocessing import SharedMemoryArray
from grain_core.options import MultiprocessingOptions, ReadOptions
from grain_core.python import experimental
from grain_core.python._operations import (
    BatchOperation,
    FilterOperation,
    MapOperation,
    Operation,
    RandomMapOperation,
)
from grain_core.record import Record, RecordMetadata
from grain_core.samplers import IndexSampler, Sampler, SequentialSampler
from grain_core.sharding import NoSharding, ShardByJaxProcess, ShardOptions
from grain_core.sources import RandomAccessDataSource, RangeDataSource
from grain_core.sources import SharedMemoryDataSource as InMemoryDataSource
from grain_core.transforms import Batch, DatasetSelectionMap, Transformation, Transformations
from grain_core.transforms import Filter as FilterTransform
from grain_core.transforms import Map as MapTransform
from grain_core.transforms import MapWithIndex as MapWithIndexTransform
from grain_core.transforms import RandomMap as RandomMapTransform

__all__ = [
    "DATASET_INDEX",
    "EPOCH",
    "INDEX",
    "META_FEATURES",
    "RECORD",
    "RECORD_KEY",
    "SEED",
    "Batch",
    "BatchOperation",
    "DataLoader",
    "DatasetIterator",
    "DatasetSelectionMap",
    "FilterOperation",
    "FilterTransform",
    "InMemoryDataSource",
    "IndexSampler",
    "IterDataset",
    "MapDataset",
    "MapOperation",
    "MapTransform",
    "MapWithIndexTransform",
    "MultiprocessingOptions",
    "NoSharding",
    "Operation",
    "PyGrainCheckpointHandler",
    "PyGrainDatasetIterator",
    "RandomAccessDataSource",
    "RandomMapOperation",
    "RandomMapTransform",
    "RangeDataSource",
    "ReadOptions",
    "Record",
    "RecordMetadata",
    "Sampler",
    "SequentialSampler",
    "ShardByJaxProcess",
    "ShardOptions",
    "SharedMemoryArray",
    "Transformation",
    "Transformations",
    "config",
    "experimental",
    "load",
]

# Resolved on first access: a format plugin, or Orbax (slow to import, optional).
_LAZY = {
    "ArrayRecordDataSource": ("grain_core.sources", "ArrayRecordDataSource"),
    "PyGrainCheckpointSave": ("grain_core.checkpoint", "CheckpointSave"),
    "PyGrainCheckpointRestore": ("grain_core.checkpoint", "CheckpointRestore"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)
    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted([*__all__, *_LAZY])

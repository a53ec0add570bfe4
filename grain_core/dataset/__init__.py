"""Dataset API: MapDataset, IterDataset, DatasetIterator and their transformation nodes."""

from __future__ import annotations

from grain_core.dataset.base import IterDataset, MapDataset
from grain_core.dataset.iterator import DatasetIterator
from grain_core.dataset.options import DatasetOptions, ExecutionTrackingMode

__all__ = [
    "DatasetIterator",
    "DatasetOptions",
    "ExecutionTrackingMode",
    "IterDataset",
    "MapDataset",
]

"""Dataset API: MapDataset, IterDataset, DatasetIterator and their transformation nodes."""

from __future__ import annotations

# Registers grain_core's pipeline observer before any pipeline can be built (see observe).
from grain_core import observe as _observe  # noqa: F401, E402
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

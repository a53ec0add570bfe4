"""Feature-name constants of Grain's index pipelines (``grain.constants``)."""

from __future__ import annotations

__all__ = ["DATASET_INDEX", "EPOCH", "INDEX", "META_FEATURES", "RECORD", "RECORD_KEY", "SEED"]

INDEX = "_index"
RECORD_KEY = "_record_key"
DATASET_INDEX = "_dataset_index"
EPOCH = "_epoch"
SEED = "_seed"
RECORD = "_record"
META_FEATURES = frozenset({INDEX, RECORD_KEY, DATASET_INDEX, EPOCH, SEED, RECORD})

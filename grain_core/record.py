"""The unit flowing through ``DataLoader`` pipelines: ``Record(metadata, data)``."""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

import numpy as np

__all__ = ["Record", "RecordMetadata"]

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class RecordMetadata:
    """Where a record comes from.

    Attributes:
      index: Global position in the sampler's sequence (across all shards and epochs).
      record_key: Key read from the data source (None once records are combined).
      rng: Per-record generator derived from the sampler seed (None without a seed).
    """

    index: int
    record_key: int | None = None
    rng: np.random.Generator | None = None

    def remove_record_key(self) -> RecordMetadata:
        """Returns a copy without ``record_key`` (``self`` if it has none)."""
        if self.record_key is None:
            return self
        return RecordMetadata(index=self.index, record_key=None, rng=self.rng)

    def __str__(self) -> str:
        return f"RecordMetadata(index={self.index}, record_key={self.record_key}, rng={self.rng})"


@dataclasses.dataclass(slots=True)
class Record(Generic[T]):
    """A data element together with its :class:`RecordMetadata`."""

    metadata: RecordMetadata
    data: T

    def __str__(self) -> str:
        return f"Record(metadata={self.metadata}, data={self.data!r})"

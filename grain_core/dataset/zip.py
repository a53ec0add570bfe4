"""Zipping datasets element by element."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grain_core.dataset.base import MapDataset

__all__ = ["ZipMapDataset"]


class ZipMapDataset(MapDataset[tuple[Any, ...]]):
    """``ds[i] = tuple(p[i] for p in parents)``; a hole in any parent is a hole here.

    Raises:
      ValueError: for no parents or parents of different lengths.
    """

    def __init__(self, parents: Sequence[MapDataset[Any]]) -> None:
        parents = list(parents)
        super().__init__(parents)
        if not parents:
            raise ValueError("ZipMapDataset needs at least one parent.")
        lengths = [len(p) for p in parents]
        if len(set(lengths)) != 1:
            raise ValueError(f"All datasets zipped must have the same length, got {lengths}.")
        self._len = lengths[0]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        values = tuple(p[index] for p in self._parents)
        return None if any(v is None for v in values) else values

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        columns = [p._getitems(indices) for p in self._parents]
        return [
            None if any(v is None for v in row) else row
            for row in zip(*columns, strict=True)
        ]

    def __repr__(self) -> str:
        return f"ZipMapDataset(num_parents={len(self._parents)})"

"""Zipping datasets element by element."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grain_core.dataset.base import DatasetIterator, Indices, IterDataset, MapDataset
from grain_core.dataset.element_spec import every_parent_spec

__all__ = ["ZipIterDataset", "ZipMapDataset"]


class ZipMapDataset(MapDataset[tuple[Any, ...]]):
    """``ds[i] = tuple(p[i] for p in parents)``: a parent's hole (a filtered-out
    element) is a ``None`` in the tuple, as in Grain, not a hole of the zip.

    Raises:
      ValueError: for no parents or parents of different lengths.
    """

    element_spec_rule = every_parent_spec

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
        return tuple(p[index] for p in self._parents)

    def _getitems(self, indices: Indices) -> list[Any]:
        columns = [p._getitems(indices) for p in self._parents]
        return list(zip(*columns, strict=True))

    def __repr__(self) -> str:
        return f"ZipMapDataset(num_parents={len(self._parents)})"


class ZipIterDataset(IterDataset[tuple[Any, ...]]):
    """Yields ``tuple(next(p) for p in parents)``; state ``{"parents": [...]}``.

    Args:
      parents: the datasets to zip (at least one).
      strict: like ``zip(strict=True)``: when one parent ends before the others, the iterator
        raises ``ValueError`` naming the shorter (or longer) argument instead of stopping.

    Raises:
      ValueError: for no parents.
    """

    element_spec_rule = every_parent_spec

    def __init__(self, parents: Sequence[IterDataset[Any]], *, strict: bool = True) -> None:
        parents = list(parents)
        super().__init__(parents)
        if not parents:
            raise ValueError("ZipIterDataset needs at least one parent.")
        self.strict = strict

    def __iter__(self) -> DatasetIterator[tuple[Any, ...]]:
        return _ZipIterator([p.__iter__() for p in self._parents], self.strict)

    def __repr__(self) -> str:
        return f"ZipIterDataset(num_parents={len(self._parents)}, strict={self.strict})"


class _ZipIterator(DatasetIterator[tuple[Any, ...]]):
    def __init__(self, parents: list[DatasetIterator[Any]], strict: bool) -> None:
        super().__init__(parents)
        self._strict = strict

    def __next__(self) -> tuple[Any, ...]:
        values = []
        for i, parent in enumerate(self._parents):
            try:
                values.append(next(parent))
            except StopIteration:
                if self._strict:
                    self._check_all_ended(i)
                raise
        return tuple(values)

    def _check_all_ended(self, ended: int) -> None:
        """Raises ``ValueError`` unless every parent ended at the same element."""
        if ended > 0:
            earlier = "argument 1" if ended == 1 else f"arguments 1-{ended}"
            raise ValueError(f"ZipIterDataset argument {ended + 1} is shorter than {earlier}")
        for j, other in enumerate(self._parents[1:], start=2):
            try:
                next(other)
            except StopIteration:
                continue
            earlier = "argument 1" if j == 2 else f"arguments 1-{j - 1}"
            raise ValueError(f"ZipIterDataset argument {j} is longer than {earlier}")

    def get_state(self) -> dict[str, Any]:
        return {"parents": [p.get_state() for p in self._parents]}

    def set_state(self, state: dict[str, Any]) -> None:
        states = state["parents"]
        if len(states) != len(self._parents):
            raise ValueError(
                f"Zip checkpoint has {len(states)} parents, this pipeline zips "
                f"{len(self._parents)}: the checkpoint belongs to a different pipeline."
            )
        for parent, parent_state in zip(self._parents, states, strict=True):
            parent.set_state(parent_state)

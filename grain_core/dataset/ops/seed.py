"""``.seed()``: a pass-through node carrying the seed that random steps downstream derive theirs
from (``_Node._default_seed`` in ``base.py`` finds it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from grain_core import random as _random
from grain_core.dataset.base import DatasetIterator, Indices, IterDataset, MapDataset
from grain_core.dataset.element_spec import parent_spec

# The node classes keep Grain's private names, which the dataset graph and execution summary
# show (docs/debugging.md); worker_slicing.py knows the map one as position-preserving.
__all__: list[str] = []

T = TypeVar("T")


class _WithSeedMapDataset(MapDataset[T]):
    """Pass-through node carrying the seed set by ``MapDataset.seed()``."""

    passes_values = True
    element_spec_rule = parent_spec

    def __init__(self, parent: MapDataset[T], seed: int) -> None:
        super().__init__(parent)
        self._seed_value = _random.validate_seed(seed, "`.seed()`", below_2_32=False)
        self._parent = parent

    def __len__(self) -> int:
        return len(self._parent)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        return self._parent[index]

    def _getitems(self, indices: Indices) -> Sequence[Any]:
        return self._parent._getitems(indices)

    def __repr__(self) -> str:
        return f"SeedMapDataset(seed={self._seed_value})"


class _WithSeedIterDataset(IterDataset[T]):
    """Pass-through node carrying the seed set by ``IterDataset.seed()``."""

    element_spec_rule = parent_spec

    def __init__(self, parent: IterDataset[T], seed: int) -> None:
        super().__init__(parent)
        self._seed_value = _random.validate_seed(seed, "`.seed()`", below_2_32=False)

    def __iter__(self) -> DatasetIterator[T]:
        return self._parents[0].__iter__()

    def __repr__(self) -> str:
        return f"SeedIterDataset(seed={self._seed_value})"

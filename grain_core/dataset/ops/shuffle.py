"""Global shuffle: a per-epoch keyed permutation of the parent's indices, bit-exact with Grain."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_core import random as _random
from grain_core.dataset.base import Indices, MapDataset
from grain_core.dataset.element_spec import parent_spec

__all__ = ["ShuffleMapDataset"]

_SEED_MODULUS = 2**32


class ShuffleMapDataset(MapDataset[Any]):
    """``ds[e*n + j] = parent[e*n + index_shuffle(j, n - 1, (seed + e) % 2**32)]``.

    O(1) memory and random access; every epoch uses a different permutation. Blocks of indices
    are permuted with one vectorised call.
    """

    element_spec_rule = parent_spec

    passes_values = True

    def __init__(self, parent: MapDataset[Any], *, seed: int | None = None) -> None:
        super().__init__(parent)
        self._parent = parent
        self._seed = self._resolve_seed(seed, "shuffle")
        self._len = len(parent)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        n = self._len
        if n == 0:
            raise IndexError("Cannot read from an empty dataset.")
        epoch, j = divmod(index, n)
        seed = (self._seed + epoch) % _SEED_MODULUS
        return self._parent[_random.index_shuffle(j, n - 1, seed) + epoch * n]

    def _getitems(self, indices: Indices) -> Sequence[Any]:
        n = self._len
        if n == 0:
            raise IndexError("Cannot read from an empty dataset.")
        if isinstance(indices, range) and indices.step == 1 and len(indices):
            # A block of consecutive indices (what to_iter_dataset and batch read): within one
            # epoch it permutes with one slice of the permutation.
            epoch, start = divmod(indices.start, n)
            stop = start + len(indices)
            if stop <= n:
                seed = (self._seed + epoch) % _SEED_MODULUS
                mapped = _random.index_shuffle_range(start, stop, n - 1, seed)
                return self._parent._getitems(mapped + epoch * n if epoch else mapped)
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return []
        epochs, pos = np.divmod(idx, n)
        first_epoch = int(epochs[0])
        if (epochs == first_epoch).all():
            seed = (self._seed + first_epoch) % _SEED_MODULUS
            mapped = _random.index_shuffle_array(pos, n - 1, seed) + first_epoch * n
        else:
            mapped = np.empty_like(idx)
            for epoch in np.unique(epochs).tolist():
                mask = epochs == epoch
                seed = (self._seed + epoch) % _SEED_MODULUS
                mapped[mask] = _random.index_shuffle_array(pos[mask], n - 1, seed) + epoch * n
        return self._parent._getitems(mapped)

    def __repr__(self) -> str:
        return f"ShuffleMapDataset(seed={self._seed})"

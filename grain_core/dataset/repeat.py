"""``MapDataset.repeat``: only the length changes; epochs are already part of the index."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_core._checks import positive_int
from grain_core.dataset.base import INFINITE, Indices, MapDataset

__all__ = ["RepeatMapDataset"]


class RepeatMapDataset(MapDataset[Any]):
    """``len = num_epochs * n`` (``sys.maxsize`` when infinite); ``ds[i] = parent[i]``.

    With ``reseed_each_epoch=False`` the index is reduced modulo ``n`` so every epoch reads the
    parent's first epoch and random transforms repeat exactly.
    """

    passes_values = True

    def __init__(
        self,
        parent: MapDataset[Any],
        num_epochs: int | None = None,
        *,
        reseed_each_epoch: bool = True,
    ) -> None:
        super().__init__(parent)
        n = len(parent)
        if n >= INFINITE:
            raise ValueError(
                f"Repeating already infinite dataset {parent!r} does nothing. Remove the "
                "`repeat()` call."
            )
        if num_epochs is not None:
            num_epochs = positive_int("num_epochs", num_epochs)
        self._parent = parent
        self._parent_len = n
        self._num_epochs = num_epochs
        self._reseed = reseed_each_epoch
        if n == 0:
            self._len = 0
        elif num_epochs is None:
            self._len = INFINITE
        else:
            self._len = min(INFINITE, num_epochs * n)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        if not self._reseed:
            index %= self._parent_len
        return self._parent[index]

    def _getitems(self, indices: Indices) -> Sequence[Any]:
        if not self._reseed:
            indices = np.asarray(indices, dtype=np.int64) % self._parent_len
        return self._parent._getitems(indices)

    def __repr__(self) -> str:
        return f"RepeatMapDataset(num_epochs={self._num_epochs})"

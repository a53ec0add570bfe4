"""Slicing and re-indexing of MapDatasets (``ds[a:b:c]``, ``ds.slice(indices)``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_core.dataset.base import Indices, MapDataset
from grain_core.dataset.element_spec import parent_spec

__all__ = ["ReindexMapDataset", "SliceMapDataset"]


class SliceMapDataset(MapDataset[Any]):
    """``ds[i] = parent[start + (i % len) * step + (i // len) * n]``."""

    element_spec_rule = parent_spec

    passes_values = True

    def __init__(self, parent: MapDataset[Any], sl: slice) -> None:
        super().__init__(parent)
        if not isinstance(sl, slice):
            raise ValueError(
                f"SliceMapDataset takes a `slice`: sl is not a slice: {type(sl)} (got {sl!r})."
            )
        self._parent = parent
        self._parent_len = len(parent)
        self._start, self._stop, self._step = sl.indices(self._parent_len)
        self._len = len(range(self._start, self._stop, self._step))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        if self._len == 0:
            raise IndexError("Cannot read from an empty slice.")
        epoch, j = divmod(index, self._len)
        return self._parent[self._start + j * self._step + epoch * self._parent_len]

    def _getitems(self, indices: Indices) -> Sequence[Any]:
        if self._len == 0:
            raise IndexError("Cannot read from an empty slice.")
        epoch, j = np.divmod(np.asarray(indices, dtype=np.int64), self._len)
        return self._parent._getitems(self._start + j * self._step + epoch * self._parent_len)

    def __repr__(self) -> str:
        return f"SliceMapDataset[{self._start}:{self._stop}:{self._step}]"


class ReindexMapDataset(MapDataset[Any]):
    """``ds[i] = parent[indices[i % len] + (i // len) * n]``."""

    element_spec_rule = parent_spec

    def __init__(self, parent: MapDataset[Any], indices: Sequence[int] | MapDataset[int]) -> None:
        super().__init__(parent)
        self._parent = parent
        self._parent_len = len(parent)
        self._indices = indices
        self._len = len(indices)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        if self._len == 0:
            raise IndexError("Cannot read from an empty dataset.")
        epoch, j = divmod(index, self._len)
        return self._parent[int(self._indices[j]) + epoch * self._parent_len]

    def _getitems(self, indices: Indices) -> Sequence[Any]:
        if self._len == 0:
            raise IndexError("Cannot read from an empty dataset.")
        epoch, j = np.divmod(np.asarray(indices, dtype=np.int64), self._len)
        if isinstance(self._indices, MapDataset):
            inner = np.asarray(self._indices._getitems(j), dtype=np.int64)
        else:
            inner = np.asarray(self._indices, dtype=np.int64)[j]
        return self._parent._getitems(inner + epoch * self._parent_len)

    def __repr__(self) -> str:
        if isinstance(self._indices, MapDataset):
            shown = repr(self._indices)
        elif self._len <= 8:
            shown = str(list(map(int, self._indices)))
        else:
            head = ", ".join(str(int(self._indices[k])) for k in range(4))
            shown = f"[{head}, ... ({self._len} indices)]"
        return f"ReindexMapDataset(indices={shown})"

"""Repetition over epochs: ``MapDataset.repeat`` changes only the length (epochs are already
part of the index); ``RepeatIterDataset`` replays an IterDataset, rewinding its iterator."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_core._checks import positive_int
from grain_core.dataset.base import INFINITE, DatasetIterator, Indices, IterDataset, MapDataset
from grain_core.dataset.element_spec import parent_spec

__all__ = ["RepeatIterDataset", "RepeatMapDataset"]


class RepeatMapDataset(MapDataset[Any]):
    """``len = num_epochs * n`` (``sys.maxsize`` when infinite); ``ds[i] = parent[i]``.

    With ``reseed_each_epoch=False`` the index is reduced modulo ``n`` so every epoch reads the
    parent's first epoch and random transforms repeat exactly.
    """

    element_spec_rule = parent_spec

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


class RepeatIterDataset(IterDataset[Any]):
    """Repeats ``parent`` ``num_epochs`` times (``None``: forever); every epoch is identical.

    At the end of an epoch the parent iterator is rewound to the state it had when it was built,
    so its threads, worker processes and interleave inputs stay alive across epochs.

    Raises:
      ValueError: if ``num_epochs`` is not positive.
    """

    element_spec_rule = parent_spec

    def __init__(self, parent: IterDataset[Any], num_epochs: int | None = None) -> None:
        super().__init__(parent)
        if num_epochs is not None:
            num_epochs = positive_int("num_epochs", num_epochs)
        self.num_epochs = num_epochs

    def __iter__(self) -> DatasetIterator[Any]:
        return _RepeatIterator(self._parents[0].__iter__(), self.num_epochs)

    def __repr__(self) -> str:
        return f"RepeatIterDataset(num_epochs={self.num_epochs})"


class _RepeatIterator(DatasetIterator[Any]):
    """State ``{"parent", "epoch"}``."""

    def __init__(self, parent: DatasetIterator[Any], num_epochs: int | None) -> None:
        super().__init__(parent)
        self._num_epochs = num_epochs
        self._initial_state = parent.get_state()
        self._epoch = 0
        # True right after a rewind: an epoch that ends before its first element means the
        # parent is empty, and repeating it forever would spin.
        self._rewound = False

    def __next__(self) -> Any:
        parent = self._parents[0]
        while True:
            if self._num_epochs is not None and self._epoch >= self._num_epochs:
                raise StopIteration
            try:
                x = next(parent)
            except StopIteration:
                if self._rewound:
                    raise
                self._epoch += 1
                if self._num_epochs is not None and self._epoch >= self._num_epochs:
                    raise
                parent.set_state(copy.deepcopy(self._initial_state))
                self._rewound = True
                continue
            self._rewound = False
            return x

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parents[0].get_state(), "epoch": self._epoch}

    def _progress_held(self) -> str | None:
        return f"RepeatIterDataset is in epoch {self._epoch}" if self._epoch else None

    def set_state(self, state: dict[str, Any]) -> None:
        self._parents[0].set_state(state["parent"])
        self._epoch = self._state_int(state, "epoch")
        self._rewound = False

"""``LimitIterDataset``: stop after a number of elements."""

from __future__ import annotations

from typing import Any

from grain_core._checks import positive_int
from grain_core.dataset.base import DatasetIterator, IterDataset
from grain_core.dataset.element_spec import parent_spec

__all__ = ["LimitIterDataset"]


class LimitIterDataset(IterDataset[Any]):
    """Yields at most ``count`` elements of ``parent``.

    Raises:
      ValueError: if ``count`` is not a positive integer.
    """

    element_spec_rule = parent_spec

    def __init__(self, parent: IterDataset[Any], count: int) -> None:
        super().__init__(parent)
        self.count = positive_int("LimitIterDataset count", count)

    def __iter__(self) -> DatasetIterator[Any]:
        return _LimitIterator(self._parents[0].__iter__(), self.count)

    def __repr__(self) -> str:
        return f"LimitIterDataset(count={self.count})"


class _LimitIterator(DatasetIterator[Any]):
    """State ``{"parent", "count_elements_read"}``."""

    def __init__(self, parent: DatasetIterator[Any], count: int) -> None:
        super().__init__(parent)
        self._limit = count
        self._read = 0

    def __next__(self) -> Any:
        if self._read >= self._limit:
            raise StopIteration
        x = next(self._parents[0])
        self._read += 1
        return x

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parents[0].get_state(), "count_elements_read": self._read}

    def _progress_held(self) -> str | None:
        if not self._read:
            return None
        return f"LimitIterDataset(count={self._limit}) has let {self._read} element(s) through"

    def set_state(self, state: dict[str, Any]) -> None:
        self._parents[0].set_state(state["parent"])
        self._read = self._state_int(state, "count_elements_read")

    def _get_next_index(self) -> int:
        return self._parents[0]._get_next_index()

    def _set_next_index(self, index: int) -> None:
        self._parents[0]._set_next_index(index)
        self._read = index

"""``get_next_index`` / ``set_next_index``: position an iterator by element count."""

from __future__ import annotations

from typing import Any

from grain_core.dataset.iterator import DatasetIterator

__all__ = ["get_next_index", "set_next_index"]


def get_next_index(iterator: DatasetIterator[Any]) -> int:
    """Returns how many elements ``iterator`` has produced, without processing data.

    Raises:
      NotImplementedError: if a node of the pipeline cannot count (filter, packing, several
        workers or interleave inputs...). The message names that node.
    """
    return iterator._get_next_index()


def set_next_index(iterator: DatasetIterator[Any], index: int) -> None:
    """Positions ``iterator`` so that the next element it produces is element ``index``.

    Raises:
      ValueError: if ``index`` is negative.
      NotImplementedError: if a node of the pipeline cannot jump without processing data.
    """
    if index < 0:
        raise ValueError(f"set_next_index needs a non-negative index, got {index}.")
    iterator._set_next_index(index)

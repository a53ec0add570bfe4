"""``CacheIterDataset``: keep the first pass in memory and replay it."""

from __future__ import annotations

import copy
from typing import Any

from grain_core._checks import as_flag
from grain_core.dataset.base import DatasetIterator, IterDataset
from grain_core.dataset.element_spec import parent_spec

__all__ = ["CacheIterDataset"]


class CacheIterDataset(IterDataset[Any]):
    """Caches every element of ``parent`` in the iterator's memory.

    The first pass reads the parent and appends to the cache. Once the parent is exhausted,
    rewinding (``set_state`` — typically by an outer ``RepeatIterDataset``) serves later passes
    from memory without touching the parent. Each iterator (each worker, under ``mp_prefetch``)
    has its own cache; a state restored in a fresh iterator rebuilds the cache by re-reading the
    parent from its start.
    """

    element_spec_rule = parent_spec

    def __init__(self, parent: IterDataset[Any]) -> None:
        super().__init__(parent)

    def __iter__(self) -> DatasetIterator[Any]:
        return _CacheIterator(self._parents[0].__iter__())


class _CacheIterator(DatasetIterator[Any]):
    """State ``{"parent", "position", "cache_filled"}``.

    Until the cache is complete the parent stands right after the last cached element, and
    ``position == len(cache)``. Once it is complete the parent stays at its end and elements come
    from ``cache[position]``.
    """

    def __init__(self, parent: DatasetIterator[Any]) -> None:
        super().__init__(parent)
        self._initial_parent_state = parent.get_state()
        self._cache: list[Any] = []
        self._filled = False
        self._position = 0
        # The state restored onto a complete cache, reported as-is until the next element (it
        # may describe the first pass, where the parent had not reached its end yet).
        self._restored: dict[str, Any] | None = None

    def __next__(self) -> Any:
        self._restored = None
        if self._filled:
            if self._position >= len(self._cache):
                raise StopIteration
            x = self._cache[self._position]
            self._position += 1
            return x
        try:
            x = next(self._parents[0])
        except StopIteration:
            self._filled = True
            raise
        self._cache.append(x)
        self._position += 1
        return x

    def get_state(self) -> dict[str, Any]:
        if self._restored is not None:
            return copy.deepcopy(self._restored)
        return {
            "parent": self._parents[0].get_state(),
            "position": self._position,
            "cache_filled": self._filled,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        position = self._state_int(state, "position")
        filled = as_flag(self._state_name("cache_filled"), state["cache_filled"])
        parent = self._parents[0]
        self._restored = None
        if self._filled and position <= len(self._cache):
            self._position = position
            if not filled:
                self._restored = copy.deepcopy(state)
            return
        if filled:
            self._rebuild(None)
        elif position <= len(self._cache) and not self._filled:
            del self._cache[position:]
            parent.set_state(state["parent"])
        else:
            self._rebuild(position)
        if position > len(self._cache):
            raise ValueError(
                f"Cache checkpoint position {position} is past the end of the parent "
                f"({len(self._cache)} elements): the checkpoint belongs to a different pipeline."
            )
        self._position = position

    def _rebuild(self, count: int | None) -> None:
        """Re-reads the parent from its start: ``count`` elements, or all when ``None``."""
        parent = self._parents[0]
        parent.set_state(copy.deepcopy(self._initial_parent_state))
        self._cache = []
        self._filled = False
        while count is None or len(self._cache) < count:
            try:
                self._cache.append(next(parent))
            except StopIteration:
                self._filled = True
                break

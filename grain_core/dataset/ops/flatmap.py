"""One-to-many transformations: ``FlatMapMapDataset`` and ``FlatMapIterDataset``.

Unlike Grain (see docs/compatibility.md): the Map version computes each input's splits
once per block of reads (and keeps the most recent inputs' splits for the next block) instead
of once per output slot, and the Iter version enforces ``max_fan_out`` too.
"""

from __future__ import annotations

import collections
import copy
import operator
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_core._checks import positive_int
from grain_core.capabilities import FanOutBounded
from grain_core.dataset.base import (
    INFINITE,
    DatasetIterator,
    Indices,
    IterDataset,
    MapDataset,
    _transform_fn,
    stop_iteration_error,
    transform_name,
)

__all__ = ["FlatMapIterDataset", "FlatMapMapDataset"]

# Inputs whose splits the Map version remembers: the ones at the edges of recent blocks, which
# the next block (possibly read by another thread) usually continues.
_SPLITS_CACHE_SIZE = 8


def _max_fan_out(transform: Any) -> int | None:
    """The transform's ``max_fan_out``, or None if it has none.

    Raises:
      TypeError: not an integer.
      ValueError: not positive.
    """
    if not isinstance(transform, FanOutBounded) or transform.max_fan_out is None:
        return None
    return positive_int("max_fan_out", transform.max_fan_out)


class _Splitter:
    """Calls ``flat_map`` and checks the number of splits against ``max_fan_out``."""

    __slots__ = ("_fn", "_name", "_max_fan_out")

    def __init__(self, transform: Any, max_fan_out: int | None) -> None:
        self._fn = _transform_fn(transform, "flat_map")
        self._name = transform_name(transform)
        self._max_fan_out = max_fan_out

    def __call__(self, element: Any, where: str) -> Sequence[Any]:
        try:
            splits = self._fn(element)
            if not isinstance(splits, Sequence):
                splits = list(splits)
        except StopIteration as e:
            raise stop_iteration_error(self._name) from e
        if self._max_fan_out is not None and len(splits) > self._max_fan_out:
            raise ValueError(
                f"FlatMap {self._name} produced {len(splits)} elements from {where}, more than "
                f"its max_fan_out={self._max_fan_out}. Raise max_fan_out or split less."
            )
        return splits


class FlatMapMapDataset(MapDataset[Any]):
    """``ds[j * F + k]`` is split ``k`` of ``flat_map(parent[j])``, or a hole past the last one.

    ``F`` is the transform's ``max_fan_out``; ``len = F * len(parent)`` (capped at
    ``sys.maxsize``). Convert with ``to_iter_dataset()`` to skip the holes.

    Raises:
      ValueError: the transform has no positive ``max_fan_out``; at read time, an input
        produced more than ``max_fan_out`` splits.
    """

    creates_holes = True
    display_name = "FlatMapMapDataset"

    def __init__(self, parent: MapDataset[Any], transform: Any) -> None:
        super().__init__(parent)
        self._parent = parent
        self._transform = transform
        fan_out = _max_fan_out(transform)
        if fan_out is None:
            raise ValueError(
                f"FlatMapMapDataset needs the transform's `max_fan_out` (the most elements one "
                f"input can produce); {transform_name(transform)} has none."
            )
        self._fan_out = fan_out
        self._split = _Splitter(transform, fan_out)
        self._len = min(self._fan_out * len(parent), INFINITE)
        self._cache: collections.OrderedDict[int, Sequence[Any] | None] = collections.OrderedDict()
        self._cache_lock = threading.Lock()

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = collections.OrderedDict()
        del state["_cache_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._cache_lock = threading.Lock()

    def _cached(self, j: int) -> tuple[bool, Sequence[Any] | None]:
        with self._cache_lock:
            if j in self._cache:
                self._cache.move_to_end(j)
                return True, self._cache[j]
        return False, None

    def _remember(self, j: int, splits: Sequence[Any] | None) -> None:
        with self._cache_lock:
            self._cache[j] = splits
            self._cache.move_to_end(j)
            while len(self._cache) > _SPLITS_CACHE_SIZE:
                self._cache.popitem(last=False)

    def _splits_of(self, j: int, element: Any) -> Sequence[Any] | None:
        return None if element is None else self._split(element, f"input {j}")

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        j, k = divmod(operator.index(index), self._fan_out)
        found, splits = self._cached(j)
        if not found:
            splits = self._splits_of(j, self._parent[j])
            self._remember(j, splits)
        return splits[k] if splits is not None and k < len(splits) else None

    def _getitems(self, indices: Indices) -> list[Any]:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return []
        inputs, slots = np.divmod(idx, self._fan_out)
        unique_inputs = list(dict.fromkeys(inputs.tolist()))
        splits_by_input: dict[int, Sequence[Any] | None] = {}
        missing = []
        for j in unique_inputs:
            found, splits = self._cached(j)
            if found:
                splits_by_input[j] = splits
            else:
                missing.append(j)
        if missing:
            for j, element in zip(missing, self._parent._getitems(missing), strict=True):
                splits_by_input[j] = self._splits_of(j, element)
        # Edge inputs are the ones a neighbouring block may still need.
        for j in {unique_inputs[0], unique_inputs[-1]}:
            self._remember(j, splits_by_input[j])
        out = []
        for j, k in zip(inputs.tolist(), slots.tolist(), strict=True):
            splits = splits_by_input[j]
            out.append(splits[k] if splits is not None and k < len(splits) else None)
        return out

    def __repr__(self) -> str:
        return (
            f"FlatMapMapDataset(transform={transform_name(self._transform)}, "
            f"max_fan_out={self._fan_out})"
        )


class FlatMapIterDataset(IterDataset[Any]):
    """Yields the splits of each parent element in order.

    State ``{"parent": <parent state before the current input>, "next_index_in_buffer"}``;
    restoring re-reads that one input and recomputes its splits. ``max_fan_out`` is enforced
    when the transform defines it.

    Raises:
      ValueError: at read time, an input produced more than ``max_fan_out`` splits.
    """

    def __init__(self, parent: IterDataset[Any], transform: Any) -> None:
        super().__init__(parent)
        self._transform = transform
        self._split = _Splitter(transform, _max_fan_out(transform))

    def __iter__(self) -> DatasetIterator[Any]:
        return _FlatMapIterator(self._parents[0].__iter__(), self._split)

    def __repr__(self) -> str:
        return f"FlatMapIterDataset(transform={transform_name(self._transform)})"


class _FlatMapIterator(DatasetIterator[Any]):
    def __init__(self, parent: DatasetIterator[Any], split: _Splitter) -> None:
        super().__init__(parent)
        self._split = split
        self._input_state: dict[str, Any] = {}
        self._buffer: Sequence[Any] = ()
        self._next_in_buffer = 0

    def _read_input(self) -> None:
        parent = self._parents[0]
        self._input_state = parent.get_state()
        element = next(parent)
        self._buffer = self._split(element, f"an input at parent state {self._input_state}")
        self._next_in_buffer = 0

    def __next__(self) -> Any:
        if self._closed:
            self._check_open()
        while self._next_in_buffer >= len(self._buffer):
            self._read_input()
        element = self._buffer[self._next_in_buffer]
        self._next_in_buffer += 1
        return element

    def get_state(self) -> dict[str, Any]:
        if self._next_in_buffer < len(self._buffer):
            parent_state = copy.deepcopy(self._input_state)
            offset = self._next_in_buffer
        else:
            parent_state, offset = self._parents[0].get_state(), 0
        return {"parent": parent_state, "next_index_in_buffer": offset}

    def _progress_held(self) -> str | None:
        if not 0 < self._next_in_buffer < len(self._buffer):
            return None
        return (
            f"FlatMapIterDataset has handed out {self._next_in_buffer} of the "
            f"{len(self._buffer)} elements split from one input"
        )

    def set_state(self, state: dict[str, Any]) -> None:
        self._parents[0].set_state(state["parent"])
        self._buffer = ()
        self._next_in_buffer = 0
        offset = self._state_int(state, "next_index_in_buffer")
        if offset:
            self._read_input()
            # Equal to the number of splits: the input was used up, as Google Grain's states
            # say where this one names the next input instead.
            if offset > len(self._buffer):
                raise ValueError(
                    f"Checkpoint offset {offset} is past the {len(self._buffer)} splits of the "
                    "restored input: the checkpoint belongs to a different pipeline."
                )
            self._next_in_buffer = offset

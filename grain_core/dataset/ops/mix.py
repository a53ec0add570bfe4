"""Mixing and concatenation of datasets."""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np

from grain_core import _tree
from grain_core._checks import as_flag
from grain_core.capabilities import SupportsNextBlock
from grain_core.dataset.base import (
    INFINITE,
    DatasetIterator,
    ElementBlock,
    Indices,
    IterDataset,
    MapDataset,
)
from grain_core.dataset.element_spec import parent_spec
from grain_core.transforms import DatasetSelectionMap

# Most elements taken from a block-reading component at once.
_BLOCK_SIZE: Final = 4096

__all__ = [
    "ConcatenateMapDataset",
    "MixedIterDataset",
    "MixedMapDataset",
    "SelectionWithProportionsMap",
    "integer_weights",
    "select_by_proportions",
]


def integer_weights(weights: Sequence[float] | None, n: int) -> tuple[int, ...]:
    """Validates mixing weights and converts floats to integers (smallest becomes 100).

    Raises:
      ValueError: if a weight is zero or negative, or the count does not match ``n``.
    """
    if weights is None:
        return (1,) * n
    weights = list(weights)
    if len(weights) != n:
        raise ValueError(f"Got {len(weights)} mixing weights for {n} datasets.")
    if any(w == 0 for w in weights):
        raise ValueError(f"Must specify all non-zero proportions for mixing, got {weights}.")
    if any(w < 0 for w in weights):
        raise ValueError(f"Mixing proportions must be positive, got {weights}.")
    if all(isinstance(w, (int, np.integer)) for w in weights):
        return tuple(int(w) for w in weights)
    smallest = min(weights)
    return tuple(int(w * 100 / smallest) for w in weights)


def select_by_proportions(k: int, proportions: Sequence[int]) -> tuple[int, int]:
    """Routes mix position ``k`` to ``(dataset_index, index_in_dataset)``, bit-exact with Grain."""
    remaining = sum(proportions)
    a, b = k, k + 1
    last = len(proportions) - 1
    for i, p in enumerate(proportions):
        if i == last:
            return i, b - 1
        rest = remaining - p
        a_on = a * rest // remaining
        b_on = b * rest // remaining
        if b - b_on != a - a_on:
            return i, b - b_on - 1
        a, b = a_on, b_on
        remaining = rest
    raise AssertionError("unreachable")


class SelectionWithProportionsMap(DatasetSelectionMap):
    """Exact-proportion selection map over ``len(proportions)`` datasets."""

    def __init__(self, proportions: Sequence[int], length: int) -> None:
        self._proportions = tuple(proportions)
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple[int, int]:
        return select_by_proportions(index, self._proportions)

    def __repr__(self) -> str:
        return (
            f"SelectionWithProportionsMap(proportions={self._proportions}, length={self._length})"
        )


class MixedMapDataset(MapDataset[Any]):
    """Element ``i`` is ``parents[d][j]`` with ``(d, j)`` from a selection map."""

    element_spec_rule = parent_spec

    def __init__(
        self,
        parents: Sequence[MapDataset[Any]],
        proportions: Sequence[float] | None = None,
        selection_map: DatasetSelectionMap | None = None,
    ) -> None:
        parents = list(parents)
        super().__init__(parents)
        if not parents:
            raise ValueError("Mixing needs at least one dataset.")
        if proportions is not None and selection_map is not None:
            raise ValueError("Specify either mixing proportions or a selection map, not both.")
        lengths = [len(p) for p in parents]
        self._lengths = lengths
        if selection_map is None:
            if any(n == 0 for n in lengths):
                empty = ", ".join(f"index {i} ({p!r})" for i, p in enumerate(parents) if not len(p))
                raise ValueError(
                    "All datasets must have positive length for mixing, but dataset(s) at "
                    f"{empty} have length 0 (lengths: {lengths})."
                )
            ints = integer_weights(proportions, len(parents))
            total = sum(ints)
            length = min(n / (w / total) for n, w in zip(lengths, ints, strict=True))
            selection_map = SelectionWithProportionsMap(ints, min(INFINITE, int(length)))
        self._selection_map = selection_map
        self._len = len(selection_map)

    def __len__(self) -> int:
        return self._len

    def _route(self, index: int) -> tuple[int, int]:
        if isinstance(self._selection_map, SelectionWithProportionsMap):
            return self._selection_map[index]
        epoch, j = divmod(index, self._len)
        d, k = self._selection_map[j]
        return d, k + epoch * self._lengths[d]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        d, k = self._route(index)
        try:
            return self._parents[d][k]
        except Exception as e:
            e.add_note(f"Raised while reading element {k} of mixed dataset {d}.")
            raise

    def _getitems(self, indices: Indices) -> list[Any]:
        routes = [self._route(int(i)) for i in indices]
        per_dataset: dict[int, list[int]] = {}
        for d, k in routes:
            per_dataset.setdefault(d, []).append(k)
        values: dict[int, Any] = {}
        for d, keys in per_dataset.items():
            try:
                values[d] = iter(self._parents[d]._getitems(keys))
            except Exception as e:
                e.add_note(f"Raised while reading mixed dataset {d}.")
                raise
        return [next(values[d]) for d, _ in routes]

    def __repr__(self) -> str:
        return f"MixedMapDataset(parent_lengths={self._lengths}, selection_map={self._selection_map!r})"


class ConcatenateMapDataset(MapDataset[Any]):
    """Epoch ``e`` of the result is epoch ``e`` of every component, in order."""

    element_spec_rule = parent_spec

    def __init__(self, parents: Sequence[MapDataset[Any]]) -> None:
        parents = list(parents)
        super().__init__(parents)
        if not parents:
            raise ValueError("concatenate needs at least one dataset.")
        lengths = [len(p) for p in parents]
        if any(n >= INFINITE for n in lengths):
            raise ValueError(
                f"Cannot concatenate infinite datasets (lengths {lengths}): nothing after an "
                "infinite component would ever be read."
            )
        self._lengths = lengths
        self._cumulative = list(itertools.accumulate(lengths, initial=0))
        self._len = self._cumulative[-1]

    def __len__(self) -> int:
        return self._len

    def _route(self, index: int) -> tuple[int, int]:
        if self._len == 0:
            raise IndexError("Cannot read from an empty concatenation.")
        epoch, j = divmod(index, self._len)
        c = bisect.bisect_right(self._cumulative, j) - 1
        return c, j - self._cumulative[c] + epoch * self._lengths[c]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        c, k = self._route(index)
        return self._parents[c][k]

    def _getitems(self, indices: Indices) -> list[Any]:
        routes = [self._route(int(i)) for i in indices]
        per: dict[int, list[int]] = {}
        for c, k in routes:
            per.setdefault(c, []).append(k)
        values = {c: iter(self._parents[c]._getitems(keys)) for c, keys in per.items()}
        return [next(values[c]) for c, _ in routes]

    def __repr__(self) -> str:
        return f"ConcatenateMapDataset(lengths={self._lengths})"


# ----------------------------------------------------------------------------- iter mix
_NOTHING = object()
_NO_ELEMENTS: Iterator[Any] = iter(())


class _MixedIterator(DatasetIterator[Any]):
    """Draws each element from the component ``select_by_proportions`` names. A component whose
    iterator has ``next_block`` is read a block at a time: the rest of its block is kept here
    and its state is the block's state after the elements drawn (see ``InterleaveIterDataset``).
    """

    def __init__(self, ds: MixedIterDataset) -> None:
        self._keys = ds._keys
        super().__init__([iter(p) for p in ds._parents])
        self._proportions = ds._proportions
        self._index = 0
        self._stop = False
        self._blockwise = [isinstance(p, SupportsNextBlock) for p in self._parents]
        self._blocks: list[ElementBlock[Any] | None] = [None] * len(self._parents)
        self._buffered: list[Iterator[Any]] = [_NO_ELEMENTS] * len(self._parents)

    def __next__(self) -> Any:
        if self._stop:
            raise StopIteration
        d, _ = select_by_proportions(self._index, self._proportions)
        value = next(self._buffered[d], _NOTHING)
        if value is _NOTHING:
            value = self._next_from(d)
        self._index += 1
        return value

    def _next_from(self, d: int) -> Any:
        parent = self._parents[d]
        try:
            if not self._blockwise[d]:
                return next(parent)
            block = parent.next_block(_BLOCK_SIZE)
            if not block.elements:
                self._blocks[d], self._buffered[d] = None, _NO_ELEMENTS
                raise StopIteration
            self._blocks[d] = block
            self._buffered[d] = buffered = iter(block.elements)
            return next(buffered)
        except StopIteration:
            self._stop = True
            raise
        except Exception as e:
            self._stop = True
            e.add_note(f"Raised while reading mixed dataset {self._keys[d] if self._keys else d}.")
            raise

    def _parent_state(self, d: int) -> dict[str, Any]:
        block = self._blocks[d]
        if block is None:
            return self._parents[d].get_state()
        return block.state_after(len(block) - operator.length_hint(self._buffered[d]))

    def get_state(self) -> dict[str, Any]:
        states = [self._parent_state(d) for d in range(len(self._parents))]
        parents: Any = dict(zip(self._keys, states, strict=True)) if self._keys else states
        return {"parents": parents, "index": self._index, "stop": self._stop}

    def set_state(self, state: dict[str, Any]) -> None:
        parents = state["parents"]
        if self._keys:
            for key, it in zip(self._keys, self._parents, strict=True):
                if key in parents:
                    it.set_state(parents[key])
        else:
            if len(parents) != len(self._parents):
                raise ValueError(
                    f"Checkpoint has states for {len(parents)} mixed datasets, the pipeline has "
                    f"{len(self._parents)}. Use a mapping of named datasets to change components."
                )
            for it, s in zip(self._parents, parents, strict=True):
                it.set_state(s)
        self._index = self._state_int(state, "index")
        self._stop = as_flag(self._state_name("stop"), state["stop"])
        self._blocks = [None] * len(self._parents)
        self._buffered = [_NO_ELEMENTS] * len(self._parents)


class MixedIterDataset(IterDataset[Any]):
    """Proportional mix of IterDatasets; a mapping of names allows changing components later."""

    element_spec_rule = parent_spec

    def __init__(
        self,
        datasets: Sequence[IterDataset[Any]] | Mapping[str, IterDataset[Any]],
        weights: Sequence[float] | Mapping[str, float] | None = None,
    ) -> None:
        if isinstance(datasets, Mapping):
            keys = sorted(datasets)
            parents = [datasets[k] for k in keys]
            if isinstance(weights, Mapping):
                if set(weights) != set(keys):
                    raise ValueError(
                        f"Weight keys {sorted(weights)} do not match dataset keys {keys}."
                    )
                weights = _tree.flatten(dict(weights))
        else:
            keys = []
            parents = list(datasets)
        super().__init__(parents)
        if not parents:
            raise ValueError("Mixing needs at least one dataset.")
        self._keys = keys
        self._proportions = integer_weights(weights, len(parents))  # type: ignore[arg-type]

    def __iter__(self) -> DatasetIterator[Any]:
        return _MixedIterator(self)

    def __repr__(self) -> str:
        return f"MixedIterDataset(proportions={self._proportions})"

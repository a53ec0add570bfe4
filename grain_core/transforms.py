"""Transformation base classes users subclass (``grain.transforms``).

Implementations must be thread-safe (they run on read threads) and picklable (they run in
worker processes).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_core._checks import positive_int

__all__ = [
    "Batch",
    "DatasetSelectionMap",
    "Filter",
    "FlatMap",
    "Map",
    "MapWithIndex",
    "RandomMap",
    "TfRandomMap",
    "Transformation",
    "Transformations",
]


class Map(abc.ABC):
    """1:1 transformation: ``map(element) -> element``.

    A subclass with ``batched = True`` maps a batch of elements to a batch of results
    instead (see ``MapDataset.map(..., batched=True)``).
    """

    batched: bool = False

    @abc.abstractmethod
    def map(self, element: Any) -> Any: ...


class RandomMap(abc.ABC):
    """1:1 transformation with a deterministic, index-derived ``np.random.Generator``."""

    @abc.abstractmethod
    def random_map(self, element: Any, rng: np.random.Generator) -> Any: ...


class TfRandomMap(abc.ABC):
    """Legacy name of a random map (``np_random_map``); accepted by ``DataLoader``."""

    @abc.abstractmethod
    def np_random_map(self, element: Any, rng: np.random.Generator) -> Any: ...


class MapWithIndex(abc.ABC):
    """1:1 transformation that also receives the element's position."""

    @abc.abstractmethod
    def map_with_index(self, index: int, element: Any) -> Any: ...


class Filter(abc.ABC):
    """Keeps an element when ``filter(element)`` is true."""

    @abc.abstractmethod
    def filter(self, element: Any) -> bool: ...


class FlatMap(abc.ABC):
    """1:N transformation producing at most ``max_fan_out`` elements per input."""

    max_fan_out: int

    @abc.abstractmethod
    def flat_map(self, element: Any) -> Sequence[Any]: ...


@dataclasses.dataclass(frozen=True)
class Batch:
    """Batching step for ``apply`` and ``DataLoader`` operations."""

    batch_size: int
    drop_remainder: bool = False
    batch_fn: Callable[[Sequence[Any]], Any] | None = None

    def __post_init__(self) -> None:
        positive_int("batch_size", self.batch_size)


class DatasetSelectionMap(abc.ABC):
    """Maps a mix position to ``(dataset_index, index_in_dataset)``; stateless and picklable."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __getitem__(self, index: int) -> tuple[int, int]: ...


Transformation = Batch | Map | RandomMap | TfRandomMap | Filter | FlatMap | MapWithIndex
Transformations = Sequence[Transformation]

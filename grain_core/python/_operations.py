"""Legacy DataLoader operations of ``grain.python`` (``MapOperation``, ``BatchOperation`` …).

Each operation is a callable from an iterator of ``Record``s to an iterator of ``Record``s (the
``Operation`` protocol); its output records keep their index and generator but no record key,
as Grain's operations (a ``DataLoader`` running them as transforms keeps the key). Each is also the matching modern
transform (``MapOperation`` is a ``transforms.Map``, ``BatchOperation`` a ``transforms.Batch``,
…), so a ``DataLoader`` runs it exactly as that transform: ``RandomMapOperation`` gets the
sampler's per-record generator and a sampler without a seed is rejected at construction.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from grain_core import _tree, transforms
from grain_core.data_loader import _RecordBatch, _RecordFilter, _RecordMap
from grain_core.dataset.ops.batch import make_batch
from grain_core.record import Record

__all__ = [
    "BatchOperation",
    "FilterOperation",
    "MapOperation",
    "Operation",
    "RandomMapOperation",
]


@runtime_checkable
class Operation(Protocol):
    """A legacy DataLoader operation: maps an iterator of ``Record``s to an iterator of
    ``Record``s. It has no state of its own (a checkpoint is its input's position)."""

    def __call__(self, input_iterator: Iterator[Record[Any]]) -> Iterator[Record[Any]]: ...


def _name(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


def _check_callable(function: Any, what: str) -> None:
    if not callable(function):
        raise TypeError(f"{what} must be callable, got {type(function).__name__} ({function!r}).")


class MapOperation(transforms.Map):
    """Applies ``map_function`` to each record's data.

    Args:
      map_function: ``element -> element``; picklable (it runs in worker processes).

    Raises:
      TypeError: If ``map_function`` is not callable.
    """

    def __init__(self, map_function: Callable[[Any], Any]) -> None:
        _check_callable(map_function, "map_function")
        self.map_function = map_function

    def map(self, element: Any) -> Any:
        return self.map_function(element)

    def __call__(self, input_iterator: Iterable[Record[Any]]) -> Iterator[Record[Any]]:
        return map(_RecordMap(self), _without_record_keys(input_iterator))

    def __repr__(self) -> str:
        return f"MapOperation(map_function={_name(self.map_function)})"


class RandomMapOperation(transforms.RandomMap):
    """Applies ``random_map_function(data, rng)`` with each record's generator (from a seeded
    sampler).

    Args:
      random_map_function: ``(element, np.random.Generator) -> element``; picklable.

    Raises:
      TypeError: If ``random_map_function`` is not callable.
      ValueError: On a record without a generator (the sampler has no seed).
    """

    def __init__(self, random_map_function: Callable[[Any, np.random.Generator], Any]) -> None:
        _check_callable(random_map_function, "random_map_function")
        self.random_map_function = random_map_function

    def random_map(self, element: Any, rng: np.random.Generator) -> Any:
        return self.random_map_function(element, rng)

    def __call__(self, input_iterator: Iterable[Record[Any]]) -> Iterator[Record[Any]]:
        return map(_RecordMap(self), _without_record_keys(input_iterator))

    def __repr__(self) -> str:
        return f"RandomMapOperation(random_map_function={_name(self.random_map_function)})"


class FilterOperation(transforms.Filter):
    """Keeps the records whose data satisfy ``condition_function``.

    Args:
      condition_function: ``element -> bool``; picklable.

    Raises:
      TypeError: If ``condition_function`` is not callable.
    """

    def __init__(self, condition_function: Callable[[Any], bool]) -> None:
        _check_callable(condition_function, "condition_function")
        self.condition_function = condition_function

    def filter(self, element: Any) -> bool:
        return bool(self.condition_function(element))

    def __call__(self, input_iterator: Iterable[Record[Any]]) -> Iterator[Record[Any]]:
        return filter(_RecordFilter(self), _without_record_keys(input_iterator))

    def __repr__(self) -> str:
        return f"FilterOperation(condition_function={_name(self.condition_function)})"


class BatchOperation(transforms.Batch):
    """Stacks ``batch_size`` consecutive records' data (``make_batch``); a batch keeps the last
    record's metadata without its record key. Runs in a DataLoader as ``transforms.Batch``.

    Args:
      batch_size: Records per batch; positive.
      drop_remainder: Drop a final batch of fewer than ``batch_size`` records.

    Raises:
      ValueError: If ``batch_size`` is not positive.
      TypeError: When iterated, if the records of a batch have different structures (without
        a ``batch_fn``).
    """

    def __call__(self, input_iterator: Iterable[Record[Any]]) -> Iterator[Record[Any]]:
        combine = _RecordBatch(self.batch_fn or make_batch)
        records = iter(input_iterator)
        while chunk := list(itertools.islice(records, self.batch_size)):
            if len(chunk) < self.batch_size and self.drop_remainder:
                return
            if self.batch_fn is None:
                _check_same_structure([r.data for r in chunk])
            yield combine(chunk)


def _without_record_keys(records: Iterable[Record[Any]]) -> Iterator[Record[Any]]:
    for r in records:
        yield Record(r.metadata.remove_record_key(), r.data)


def _check_same_structure(values: list[Any]) -> None:
    """Raises ``TypeError`` naming the values whose structure differs from the first's (the
    message Grain's users match on)."""
    first = values[0]
    differing = [i for i, v in enumerate(values[1:], 1) if not _tree.same_structure(first, v)]
    if differing:
        raise TypeError(
            f"Record structures do not match. Record at position 0 has structure {first}, "
            f"while records at positions {differing} have structures "
            f"{[values[i] for i in differing]}."
        )

"""Random-access data sources (``grain.sources``).

Format plugins add their sources here lazily: ``grain_core.sources.ArrayRecordDataSource``
resolves through the plugin registry, with an install hint when the plugin is missing.
"""

from __future__ import annotations

import math
import operator
from multiprocessing import shared_memory
from typing import Any, Protocol, SupportsIndex, TypeVar, runtime_checkable

import numpy as np

from grain_core.dataset.source import ColumnBlock

__all__ = [
    "ColumnBlock",
    "RandomAccessDataSource",
    "RangeDataSource",
    "SharedMemoryDataSource",
    "record_keys_array",
]

T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class RandomAccessDataSource(Protocol[T_co]):
    """Anything with a length and thread-safe, deterministic ``__getitem__`` for ``0 <= i < len``.

    A source may also offer ``__getitems__(indices)`` to read many records in one call; the
    pipeline then reads whole blocks at once. A source of dict rows stored column-wise may
    further offer ``read_columns(indices) -> ColumnBlock`` (the same rows as columns): a
    default ``batch`` over it, with only shuffles, slices and repeats between, then stacks
    whole columns instead of building and unpacking a dict per row. Give it a stable ``__repr__`` (it identifies the
    source in DataLoader checkpoints) and make it picklable (workers receive it); other names
    checkpoints may give it (Google Grain's for the same data) go in an optional
    ``checkpoint_reprs() -> list[str]``.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> T_co: ...


def record_keys_array(record_keys: Any) -> np.ndarray:
    """The keys a ``__getitems__`` received, as a 1-D int64 array (for source authors).

    Raises:
      TypeError: If a key is not an integer (a float would otherwise be truncated).
    """
    keys = np.asarray(record_keys)
    if keys.size and keys.dtype.kind not in "iu":  # floats, objects: each must be an index
        try:
            keys = np.asarray([operator.index(k) for k in np.ravel(keys)], dtype=np.int64)
        except TypeError as e:
            raise TypeError(f"Record keys must be integers, got {keys.dtype} keys: {e}.") from e
    return keys.astype(np.int64, copy=False).reshape(-1)


class RangeDataSource:
    """Integers ``start, start + step, ...`` below ``stop``, as a random-access source."""

    def __init__(self, start: int, stop: int, step: int) -> None:
        assert step != 0, "step must not be 0"
        self._start, self._stop, self._step = start, stop, step
        length = math.ceil((stop - start) / step)
        assert length >= 0, f"RangeDataSource({start}, {stop}, {step}) has negative length"
        self._len = length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: SupportsIndex) -> int:
        i = operator.index(index)
        if not 0 <= i < self._len:
            raise IndexError(f"RangeDataSource index {i} out of range [0, {self._len}).")
        return self._start + i * self._step

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [self[i] for i in indices]

    def __repr__(self) -> str:
        return f"RangeDataSource(start={self._start}, stop={self._stop}, step={self._step})"


class SharedMemoryDataSource(shared_memory.ShareableList):  # type: ignore[type-arg]
    """A list in POSIX shared memory; worker processes attach by name instead of copying.

    Values are limited to ``int``, ``float``, ``bool``, ``str``/``bytes`` (< 10 MB) and ``None``.
    Unlike Grain's, its ``repr`` is a stable fingerprint (length only), so DataLoader checkpoints
    neither embed the data nor a random shared-memory name, and restore after a restart.

    Raises:
      ValueError: if neither ``elements`` nor ``name`` is given.
    """

    def __init__(self, elements: Any = None, *, name: str | None = None) -> None:
        if elements is None and name is None:
            raise ValueError("Elements or name must be provided.")
        super().__init__(elements, name=name)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [self[i] for i in indices]

    def __reduce__(self) -> Any:
        return (_attach_shared_memory_source, (type(self), self.shm.name))

    def close(self) -> None:
        self.shm.close()

    def unlink(self) -> None:
        self.shm.unlink()

    def __repr__(self) -> str:
        return f"SharedMemoryDataSource(len={len(self)})"

    def __str__(self) -> str:
        return f"InMemoryDataSource(name={self.shm.name}, len={len(self)})"


def _attach_shared_memory_source(
    cls: type[SharedMemoryDataSource], name: str
) -> SharedMemoryDataSource:
    return cls(name=name)


def __getattr__(name: str) -> Any:
    from grain_core.plugins import resolve_public_name  # import cost

    return resolve_public_name(__name__, name)

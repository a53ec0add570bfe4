"""Leaf MapDatasets: ``MapDataset.source(...)`` and ``MapDataset.range(...)``."""

from __future__ import annotations

from typing import Any

import numpy as np

from grain_core.dataset.base import Indices, MapDataset

__all__ = ["RangeMapDataset", "SourceMapDataset", "batched_read"]


def batched_read(source: Any, keys: list[int]) -> list[Any]:
    """Reads ``keys`` from ``source`` with its batched read when it has one.

    Both the ``__getitems__`` spelling (array_record, PyTorch) and Grain's ``_getitems`` are
    honoured; Grain itself only looks for the latter, so ArrayRecord's parallel batched read was
    never used (rough edge 19).
    """
    getitems = getattr(source, "__getitems__", None) or getattr(source, "_getitems", None)
    if getitems is not None:
        return list(getitems(keys))
    return [source[k] for k in keys]


class SourceMapDataset(MapDataset[Any]):
    """Wraps any object with ``__len__``/``__getitem__``; ``ds[i]`` reads ``source[i % len]``."""

    def __init__(self, source: Any) -> None:
        super().__init__()
        self._source = source
        self._len = len(source)

    @property
    def source(self) -> Any:
        return self._source

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        if self._len == 0:
            raise IndexError("Cannot read from an empty source.")
        return self._source[index % self._len]

    def _getitems(self, indices: Indices) -> list[Any]:
        if self._len == 0:
            raise IndexError("Cannot read from an empty source.")
        keys = (np.asarray(indices, dtype=np.int64) % self._len).tolist()
        return batched_read(self._source, keys)

    def __repr__(self) -> str:
        src = self._source
        if isinstance(src, (list, tuple, np.ndarray)):
            desc = f"{type(src).__name__}(len={self._len})"
        else:
            desc = repr(src)
        return f"SourceMapDataset(source={desc})"


class RangeMapDataset(MapDataset[int]):
    """Integers ``start + (i % len) * step`` with Python ``range`` argument rules."""

    def __init__(self, start: int, stop: int | None = None, step: int = 1) -> None:
        super().__init__()
        if stop is None:
            start, stop = 0, start
        self._range = range(start, stop, step)
        self.start, self.stop, self.step = start, stop, step

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        n = len(self._range)
        if n == 0:
            raise IndexError("Cannot read from an empty range.")
        return self._range[index % n]

    def _getitems(self, indices: Indices) -> list[Any]:
        n = len(self._range)
        if n == 0:
            raise IndexError("Cannot read from an empty range.")
        idx = np.asarray(indices, dtype=np.int64) % n
        return (self.start + idx * self.step).tolist()

    def to_iter_dataset(self, read_options: Any = None, *, allow_nones: bool = False) -> Any:
        from grain_core.options import ReadOptions

        # Values are computed arithmetically: read them in blocks in the consumer thread;
        # read threads would only add overhead.
        return super().to_iter_dataset(
            read_options or ReadOptions(num_threads=0), allow_nones=allow_nones
        )

    def __repr__(self) -> str:
        return f"RangeMapDataset(start={self.start}, stop={self.stop}, step={self.step})"

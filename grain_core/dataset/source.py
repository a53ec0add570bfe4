"""Leaf MapDatasets: ``MapDataset.source(...)`` and ``MapDataset.range(...)``, and the columnar
reads a batch may ask of a source.

A source that holds its elements in NumPy arrays of numbers (an array, or a dict of equally long
arrays whose rows are the elements) is read with one fancy index per array for a whole block
of indices; under ``columns_wanted()`` the gathered arrays are handed up as they are (a
``StackedBlock``, or a ``ColumnBlock`` for a dict), so a batch is one gather instead of a read
and a stack per element.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from grain_core import _tree
from grain_core.capabilities import BatchedReadSource, ColumnReadSource, GrainBatchedReadSource
from grain_core.dataset.base import Indices, MapDataset
from grain_core.dataset.element_spec import range_spec
from grain_core.options import ReadOptions
from grain_core.sharding import ShardOptions, even_split

__all__ = [
    "ColumnBlock",
    "RangeMapDataset",
    "SourceMapDataset",
    "StackedBlock",
    "BatchedReader",
    "columns_wanted",
]


class ColumnBlock(Sequence[dict[str, Any]]):
    """Rows kept as the columns they were read from.

    A source that stores rows column-wise (Parquet) can answer a batched read with a block
    instead of one dict per row (``read_columns``); ``make_batch`` of a block slices and stacks
    whole columns. As a sequence it is the rows ``{name: column[i]}``, built on access, so any
    other consumer sees what ``__getitems__`` returns.

    Args:
      names: The column names, in the rows' key order.
      columns: One NumPy array per name, all of the same length; row ``i`` holds ``column[i]``.
    """

    __slots__ = ("columns", "names")

    def __init__(self, names: Sequence[str], columns: Sequence[np.ndarray]) -> None:
        if len(names) != len(columns) or not columns:
            raise ValueError(f"A ColumnBlock needs one column per name, got {list(names)}.")
        if len({len(c) for c in columns}) > 1:
            raise ValueError(
                f"The columns of a ColumnBlock differ in length: {[len(c) for c in columns]}."
            )
        self.names = tuple(names)
        self.columns = tuple(columns)

    def __len__(self) -> int:
        return len(self.columns[0])

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> ColumnBlock: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | ColumnBlock:
        if isinstance(index, slice):
            return ColumnBlock(self.names, [c[index] for c in self.columns])
        return dict(zip(self.names, (c[index] for c in self.columns), strict=True))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # C-level map/zip: no Python frame per row.
        return map(dict, map(zip, itertools.repeat(self.names), zip(*self.columns, strict=True)))

    def __repr__(self) -> str:
        return f"ColumnBlock(rows={len(self)}, names={list(self.names)})"


class StackedBlock(Sequence[Any]):
    """Elements kept stacked: element ``i`` is ``leaf[i]`` of every leaf of ``batch``.

    What a source of arrays gathers for a block of indices and what a batched map returns;
    ``make_batch`` of a block is its ``batch``, with no element taken apart and stacked again.
    As a sequence it is the elements, built on access.

    Args:
      batch: A tree (dicts, lists, tuples) of NumPy arrays, all ``length`` long.
      length: The number of elements.
    """

    __slots__ = ("batch", "_length")

    def __init__(self, batch: Any, length: int) -> None:
        self.batch = batch
        self._length = length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> StackedBlock: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return StackedBlock(
                _tree.map_structure(lambda leaf: leaf[index], self.batch),
                len(range(*index.indices(self._length))),
            )
        if not -self._length <= index < self._length:
            raise IndexError(f"Element {index} of a block of {self._length}.")
        return _tree.map_structure(lambda leaf: leaf[index], self.batch)

    def __repr__(self) -> str:
        return f"StackedBlock(len={self._length}, batch={_tree.spec_str(self.batch)})"


def _numeric_arrays(source: Any) -> np.ndarray | dict[str, np.ndarray] | None:
    """``source`` if it holds its elements in arrays of numbers: an array (elements are its
    rows), or a dict of equally long arrays with ``str`` keys (elements are dicts of rows)."""
    if isinstance(source, np.ndarray):
        return source if _is_numeric_array(source) else None
    if (
        isinstance(source, Mapping)
        and source
        and all(isinstance(k, str) and _is_numeric_array(v) for k, v in source.items())
        and len({len(v) for v in source.values()}) == 1
    ):
        return dict(source)
    return None


def _is_numeric_array(x: Any) -> bool:
    # Rows of numbers stack back into exactly the gathered array (same dtype and shape);
    # strings and objects may not (np.array picks the itemsize from the values).
    return isinstance(x, np.ndarray) and x.ndim > 0 and x.dtype.kind in "biufc"


_columns_wanted: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "grain_core_columns_wanted", default=False
)


def columns_wanted() -> contextlib.AbstractContextManager[None]:
    """Within it, a ``BatchedReader`` answers with a ``ColumnBlock`` where the source can.

    Only a batch whose every node below passes values through unchanged asks for it, so a
    block never reaches code that expects a list.
    """
    return _ColumnsWanted()


class _ColumnsWanted(contextlib.AbstractContextManager[None]):
    # A class, not a generator: entered once per batch read, where @contextmanager's
    # generator costs three times as much.
    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _columns_wanted.set(True)

    def __exit__(self, *exc_info: object) -> None:
        _columns_wanted.reset(self._token)


class BatchedReader:
    """Reads a list of record keys from ``source`` with its batched read when it has one
    (``capabilities.BatchedReadSource``, or Grain's ``GrainBatchedReadSource``; Grain itself
    looks only for the latter, so ArrayRecord's parallel batched read was never used), and
    under ``columns_wanted()`` with its ``read_columns`` (``capabilities.ColumnReadSource``).
    The capabilities are found once, when it is made.
    """

    __slots__ = ("_source", "_getitems", "_read_columns")

    def __init__(self, source: Any) -> None:
        self._source = source
        self._getitems: Callable[[list[int]], Sequence[Any]] | None = None
        if isinstance(source, BatchedReadSource):
            self._getitems = source.__getitems__
        elif isinstance(source, GrainBatchedReadSource):
            self._getitems = source._getitems
        self._read_columns = source.read_columns if isinstance(source, ColumnReadSource) else None

    def __call__(self, keys: list[int]) -> Sequence[Any]:
        if self._read_columns is not None and _columns_wanted.get():
            return self._read_columns(keys)  # type: ignore[no-any-return]
        if self._getitems is not None:
            return list(self._getitems(keys))
        source = self._source
        return [source[k] for k in keys]


class SourceMapDataset(MapDataset[Any]):
    """Wraps any object with ``__len__``/``__getitem__``; ``ds[i]`` reads ``source[i % len]``.

    A dict of equally long NumPy arrays of numbers with ``str`` keys is a source too: element
    ``i`` is ``{key: array[i]}``. Sources of arrays are read with one fancy index per array
    for a block of indices (see the module docstring).
    """

    def __init__(self, source: Any) -> None:
        super().__init__()
        self._source = source
        self._arrays = _numeric_arrays(source)
        self._read_batch = BatchedReader(source)
        if isinstance(self._arrays, dict):
            self._len = len(next(iter(self._arrays.values())))
        else:
            self._len = len(source)
        # ``set_slice`` narrows the reads to ``[_offset, _offset + _len)`` of the source.
        self._offset = 0
        self._full_len = self._len

    @property
    def source(self) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
        """The wrapped source (``MapDataset.source``, the factory, is called on the class)."""
        return self._source

    @property
    def reads_columns(self) -> bool:
        """Whether a block of elements can be read as a ``ColumnBlock`` (the source's
        ``read_columns``, or a dict of arrays) or a ``StackedBlock`` (an array)."""
        return self._arrays is not None or isinstance(self._source, ColumnReadSource)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        if self._len == 0:
            raise IndexError("Cannot read from an empty source.")
        key = self._offset + index % self._len
        if isinstance(self._arrays, dict):
            return {k: v[key] for k, v in self._arrays.items()}
        return self._source[key]

    def _getitems(self, indices: Indices) -> Sequence[Any]:
        if self._len == 0:
            raise IndexError("Cannot read from an empty source.")
        keys = np.asarray(indices, dtype=np.int64) % self._len + self._offset
        arrays = self._arrays
        if arrays is None:
            return self._read_batch(keys.tolist())
        if isinstance(arrays, dict):
            block = ColumnBlock(list(arrays), [v[keys] for v in arrays.values()])
            return block if _columns_wanted.get() else list(block)
        rows = arrays[keys]
        return StackedBlock(rows, len(rows)) if _columns_wanted.get() else list(rows)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain's in-place worker slice: reads only block ``sl.start`` of ``sl.step`` contiguous
        blocks of the whole source from now on (``even_split``). grain_core's workers slice a
        copy of the pipeline instead; this serves code that calls it directly.

        Args:
          sl: ``slice(worker_index, None, worker_count)``.
          sequential_slice: Must be True: only contiguous blocks are supported.

        Raises:
          AssertionError: If ``sequential_slice`` is False (the exception Grain raises).
        """
        self._offset, end = _sequential_block(self._full_len, sl, sequential_slice)
        self._len = end - self._offset

    def __repr__(self) -> str:
        src = self._source
        if isinstance(src, (list, tuple, np.ndarray)):
            desc = f"{type(src).__name__}(len={self._len})"
        else:
            desc = repr(src)
        return f"SourceMapDataset(source={desc})"


class RangeMapDataset(MapDataset[int]):
    """Integers ``start + (i % len) * step`` with Python ``range`` argument rules."""

    element_spec_rule = range_spec

    def __init__(self, start: int, stop: int | None = None, step: int = 1) -> None:
        super().__init__()
        if stop is None:
            start, stop = 0, start
        self._range = range(start, stop, step)
        self._full_range = self._range
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

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain's in-place worker slice: yields only block ``sl.start`` of ``sl.step`` contiguous
        blocks of the whole range from now on (``even_split``), as ``SourceMapDataset.set_slice``.

        Args:
          sl: ``slice(worker_index, None, worker_count)``.
          sequential_slice: Must be True: only contiguous blocks are supported.

        Raises:
          AssertionError: If ``sequential_slice`` is False (the exception Grain raises).
        """
        start, end = _sequential_block(len(self._full_range), sl, sequential_slice)
        self._range = self._full_range[start:end]
        self.start, self.stop = self._range.start, self._range.stop

    def to_iter_dataset(self, read_options: Any = None, *, allow_nones: bool = False) -> Any:
        # Values are computed arithmetically: read them in blocks in the consumer thread;
        # read threads would only add overhead.
        return super().to_iter_dataset(
            read_options or ReadOptions(num_threads=0), allow_nones=allow_nones
        )

    def __repr__(self) -> str:
        return f"RangeMapDataset(start={self.start}, stop={self.stop}, step={self.step})"


def _sequential_block(length: int, sl: slice, sequential_slice: bool) -> tuple[int, int]:
    """``(start, end)`` of block ``sl.start`` of ``sl.step`` over ``length`` elements."""
    if not sequential_slice:
        # Grain's tests and callers expect this type for the refusal.
        raise AssertionError(
            "set_slice on a source supports only sequential_slice=True (contiguous blocks); "
            "for strided worker shares use mp_prefetch, which slices a copy of the pipeline."
        )
    return even_split(length, ShardOptions(sl.start or 0, sl.step or 1))

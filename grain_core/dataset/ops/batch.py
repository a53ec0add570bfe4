"""Batching: ``make_batch`` and the Map/Iter ``batch`` nodes."""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_core import _tree
from grain_core._checks import positive_int
from grain_core.capabilities import (
    BatchMapping,
    ColumnBlockReading,
    ColumnBlockStacking,
    HoleMaking,
)
from grain_core.dataset.base import (
    INFINITE,
    DatasetIterator,
    Indices,
    IterDataset,
    MapDataset,
    ParentStateIterator,
)
from grain_core.dataset.element_spec import batch_spec
from grain_core.dataset.source import ColumnBlock, StackedBlock, columns_wanted

__all__ = [
    "BatchIterDataset",
    "BatchMapDataset",
    "has_holes_upstream",
    "make_batch",
    "reads_blocks",
]


def _stack_leaves(*leaves: Any) -> np.ndarray:
    first = leaves[0]
    if isinstance(first, np.ndarray):
        if first.dtype != object and first.dtype.names is None:
            # np.array copies equally shaped arrays in one C loop (about 2x np.stack); unequal
            # shapes raise ValueError, described by the caller. (It would read structured
            # arrays as sequences of tuples.)
            return np.array(leaves, dtype=first.dtype if _same_dtype(leaves) else None)
        return np.stack(leaves)
    if (
        isinstance(first, np.generic)
        and first.dtype.kind in "biufc"
        and len(set(map(type, leaves))) == 1
    ):
        # One scalar type of fixed size: its dtype is the batch's, and naming it spares NumPy
        # discovering it from every leaf (about 1.6x faster).
        return np.array(leaves, dtype=first.dtype)
    # Python scalars, bytes and str become a 1-D array in one call; mixed types are promoted
    # as np.stack promotes them ([1, 2.5] -> float64).
    return np.asarray(leaves)


def _same_dtype(leaves: Sequence[Any]) -> bool:
    try:
        return len(set(map(_dtype_of, leaves))) == 1
    except AttributeError:  # not all arrays: np.array decides (and describes the error)
        return False


_dtype_of = operator.attrgetter("dtype")


def make_batch(values: Sequence[Any]) -> Any:
    """Stacks a sequence of equally structured elements leaf-wise into NumPy arrays.

    Raises:
      ValueError: for no values, differing structures (naming the first element that differs),
        or leaves that cannot be stacked (naming the leaf's shapes).
    """
    if len(values) == 0:
        raise ValueError("Cannot batch 0 values: make_batch needs at least one element.")
    if isinstance(values, ColumnBlock):
        return _stack_columns(values)
    if isinstance(values, StackedBlock):
        return values.batch
    first = values[0]
    if isinstance(first, (int, float, np.generic)):
        return _stack_leaves(*values)
    if type(first) is bytes and set(map(type, values)) == {bytes}:
        # Bytes are leaves: one S array, without the tree walk (about a quarter of the cost).
        return np.asarray(values)
    if len(values) == 1:
        return _tree.map_structure(lambda x: np.expand_dims(x, 0), first)
    try:
        return _tree.map_structure(_stack_leaves, *values)
    except ValueError as e:
        raise ValueError(_describe_batch_error(values, e)) from e


make_batch.stacks_column_blocks = True  # type: ignore[attr-defined]  # ColumnBlockStacking


def _stack_columns(block: ColumnBlock) -> Any:
    """``make_batch(list(block))``, stacked a whole column at a time."""
    if len(block) < 2:
        return make_batch(list(block))
    batch = {}
    try:
        for name, column in sorted(zip(block.names, block.columns, strict=True), key=_first):
            if column.dtype.kind in "biufc":
                # Rows hold this column's scalars (or equally shaped arrays): stacking them
                # gives the column back.
                batch[name] = column if column.flags.writeable else column.copy()
            else:
                batch[name] = make_batch(list(column))
    except (TypeError, ValueError):
        return make_batch(list(block))  # the row path describes the error
    return batch


_first = operator.itemgetter(0)


def _describe_batch_error(values: Sequence[Any], error: ValueError) -> str:
    first_spec = _tree.spec_str(values[0])
    for i, v in enumerate(values[1:], start=1):
        spec = _tree.spec_str(v)
        if spec != first_spec:
            # The text starts as Grain's, which users match on.
            return (
                "Expected all input elements to have the same structure but got: element 0 is "
                f"{first_spec} and element {i} is {spec} (structures and leaf shapes must "
                "match to batch them). Pad or resize elements first, or pass a custom "
                "`batch_fn`."
            )
    return f"Could not batch elements of structure {first_spec}: {error}"


def _resolve_batch_fn(batch_fn: Callable[[Sequence[Any]], Any] | None) -> Callable[..., Any]:
    return make_batch if batch_fn is None else batch_fn


def _in_shared_memory(batch_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``batch_fn`` writing its output into shared memory, or ``batch_fn`` itself when it
    cannot (a custom function without ``enable_shared_memory_output()``)."""
    # Shared memory (grain_core._ipc.shm, 30 ms) loads only for a batch sent between processes.
    from grain_core.dataset.ops.shm_batch import shared_memory_batch_fn  # import cost

    return shared_memory_batch_fn(batch_fn) or batch_fn


def reads_blocks(ds: MapDataset[Any]) -> bool:
    """Whether ``ds`` is a source reading whole columns (``ColumnBlock``/``StackedBlock``),
    under nodes that pass values through: reads under ``columns_wanted()`` then give blocks."""
    while ds.passes_values:
        ds = ds.parents[0]
    return isinstance(ds, ColumnBlockReading) and ds.reads_columns


def has_holes_upstream(ds: MapDataset[Any]) -> HoleMaking | None:
    """A node above ``ds`` (or ``ds``) that leaves holes (``None``) in the index space, or
    None."""
    stack: list[MapDataset[Any]] = [ds]
    while stack:
        node = stack.pop()
        if isinstance(node, HoleMaking) and node.creates_holes:
            return node
        stack.extend(p for p in node.parents if isinstance(p, MapDataset))
    return None


class _BatchShape:
    """What the element spec of a batch node follows (``capabilities.FunctionBatching``): its
    batch size, ``drop_remainder`` and batch function as given, wherever its batches are
    written."""

    _batch_size: int
    _drop_remainder: bool
    _given_batch_fn: Callable[..., Any]

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def drop_remainder(self) -> bool:
        return self._drop_remainder

    @property
    def custom_batch_fn(self) -> Callable[..., Any] | None:
        """The batch function as given; None for the default stacking (``make_batch``)."""
        return None if self._given_batch_fn is make_batch else self._given_batch_fn


class BatchMapDataset(_BatchShape, MapDataset[Any]):
    """``ds[i]`` batches parent elements ``[e*n + j*b, e*n + min(n, (j+1)*b))``."""

    element_spec_rule = batch_spec

    def __init__(
        self,
        parent: MapDataset[Any],
        batch_size: int,
        drop_remainder: bool = False,
        batch_fn: Callable[[Sequence[Any]], Any] | None = None,
    ) -> None:
        super().__init__(parent)
        batch_size = positive_int("batch_size", batch_size)
        holes = has_holes_upstream(parent)
        if holes is not None:
            raise ValueError(
                f"`MapDataset.batch` can not follow `{holes.display_name}`, which leaves holes "
                "in the index space. Convert to an IterDataset with `to_iter_dataset()` first "
                "and batch there."
            )
        self._parent = parent
        self._batch_size = int(batch_size)
        self._drop_remainder = drop_remainder
        # The function as given: the element spec is its, wherever the batches are written.
        self._given_batch_fn = _resolve_batch_fn(batch_fn)
        self._use_batch_fn(self._given_batch_fn)
        self._maps_batches = isinstance(parent, BatchMapping) and parent.maps_batches
        n = len(parent)
        self._parent_len = n
        if n >= INFINITE:
            self._len = INFINITE // self._batch_size
        elif drop_remainder:
            self._len = n // self._batch_size
        else:
            self._len = -(-n // self._batch_size)

    def _use_batch_fn(self, batch_fn: Callable[[Sequence[Any]], Any]) -> None:
        self._batch_fn = batch_fn
        self._reads_columns = (
            isinstance(batch_fn, ColumnBlockStacking)
            and batch_fn.stacks_column_blocks
            and reads_blocks(self._parent)
        )

    def enable_shared_memory_output(self) -> None:
        """Makes this batch write its large numeric leaves straight into shared memory, as the
        last batch inside a worker process does: with the default batch function, or one that
        has ``enable_shared_memory_output()`` (others are left as they are). The consumer
        frees a block by calling ``unlink_on_del()`` on the array it receives."""
        self._use_batch_fn(_in_shared_memory(self._batch_fn))

    def __len__(self) -> int:
        return self._len

    def _parent_range(self, index: int) -> range:
        if self._len == 0:
            raise IndexError("Cannot read from an empty batched dataset.")
        epoch, j = divmod(index, self._len)
        base = epoch * self._parent_len
        start = j * self._batch_size
        stop = min(self._parent_len, start + self._batch_size)
        return range(base + start, base + stop)

    def _read(self, indices: Indices) -> Sequence[Any]:
        with columns_wanted() if self._reads_columns else contextlib.nullcontext():
            return self._parent._getitems(indices)

    def _make(self, values: Sequence[Any]) -> Any:
        try:
            return self._batch_fn(values)
        except Exception as e:
            e.add_note(
                "If elements have holes or varying shapes, batch after `to_iter_dataset()` or "
                "pass a custom `batch_fn`."
            )
            raise

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        return self._make(self._read(self._parent_range(index)))

    def _getitems(self, indices: Indices) -> list[Any]:
        ranges = [self._parent_range(int(i)) for i in indices]
        if self._maps_batches:
            # One batched map call per batch: arrays of one batch stay in the CPU's caches,
            # where those of many batches at once would not (3x slower on 28x28 images).
            return [self._make(self._read(r)) for r in ranges]
        flat: Indices
        if all(a.stop == b.start for a, b in itertools.pairwise(ranges)):
            flat = range(ranges[0].start, ranges[-1].stop) if ranges else range(0)
        else:  # the batches wrap around an epoch's end
            flat = np.concatenate([np.arange(r.start, r.stop, dtype=np.int64) for r in ranges])
        values = self._read(flat)
        out = []
        pos = 0
        for r in ranges:
            out.append(self._make(values[pos : pos + len(r)]))
            pos += len(r)
        return out

    @property
    def batch_fn(self) -> Callable[[Sequence[Any]], Any]:
        return self._batch_fn

    def with_batch_fn(self, batch_fn: Callable[[Sequence[Any]], Any]) -> BatchMapDataset:
        """The same batching of the same parent, with another batch function."""
        return BatchMapDataset(
            self._parent, self._batch_size, drop_remainder=self._drop_remainder, batch_fn=batch_fn
        )

    def __repr__(self) -> str:
        return (
            f"BatchMapDataset(batch_size={self._batch_size}, drop_remainder={self._drop_remainder})"
        )


class _BatchIterator(ParentStateIterator[Any]):
    def __init__(self, parent: DatasetIterator[Any], ds: BatchIterDataset) -> None:
        super().__init__(parent)
        self._batch_size = ds._batch_size
        self._drop_remainder = ds._drop_remainder
        self._batch_fn = ds._batch_fn

    def __next__(self) -> Any:
        parent = self._parents[0]
        values = []
        for _ in range(self._batch_size):
            try:
                values.append(next(parent))
            except StopIteration:
                break
        if not values or (self._drop_remainder and len(values) < self._batch_size):
            raise StopIteration
        return self._batch_fn(values)

    def _get_next_index(self) -> int:
        return -(-self._parents[0]._get_next_index() // self._batch_size)

    def _set_next_index(self, index: int) -> None:
        self._parents[0]._set_next_index(index * self._batch_size)


class BatchIterDataset(_BatchShape, IterDataset[Any]):
    """Pulls up to ``batch_size`` elements per batch; state is the parent's."""

    element_spec_rule = batch_spec

    def __init__(
        self,
        parent: IterDataset[Any],
        batch_size: int,
        drop_remainder: bool = False,
        batch_fn: Callable[[Sequence[Any]], Any] | None = None,
    ) -> None:
        super().__init__(parent)
        self._batch_size = positive_int("batch_size", batch_size)
        self._drop_remainder = drop_remainder
        # The function as given: the element spec is its, wherever the batches are written.
        self._given_batch_fn = _resolve_batch_fn(batch_fn)
        self._batch_fn = self._given_batch_fn

    @property
    def batch_fn(self) -> Callable[..., Any]:
        return self._batch_fn

    def enable_shared_memory_output(self) -> None:
        """As ``BatchMapDataset.enable_shared_memory_output``, for the iterators made from now
        on."""
        self._batch_fn = _in_shared_memory(self._batch_fn)

    def __iter__(self) -> DatasetIterator[Any]:
        return _BatchIterator(self._parents[0].__iter__(), self)

    def __repr__(self) -> str:
        return (
            f"BatchIterDataset(batch_size={self._batch_size}, "
            f"drop_remainder={self._drop_remainder})"
        )

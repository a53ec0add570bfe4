"""Element-wise transformations: map, map_with_index, random_map and filter (Map and Iter)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from grain_core import _tree
from grain_core import random as _random
from grain_core.dataset.base import (
    DatasetIterator,
    ElementwiseIterator,
    Indices,
    IterDataset,
    MapDataset,
    ParentStateIterator,
    _transform_fn,
    stop_iteration_error,
    transform_name,
)
from grain_core.dataset.element_spec import parent_spec, transform_spec
from grain_core.dataset.ops.batch import has_holes_upstream, make_batch, reads_blocks
from grain_core.dataset.options import FilterRatioChecker
from grain_core.dataset.source import StackedBlock, columns_wanted
from grain_core.transforms import Filter

__all__ = [
    "BatchedMapMapDataset",
    "FilterIterDataset",
    "FilterMapDataset",
    "MapIterDataset",
    "MapMapDataset",
    "MapWithIndexIterDataset",
    "MapWithIndexMapDataset",
    "RandomMapIterDataset",
    "RandomMapMapDataset",
]


class _TransformApplying:
    """A node's transform as given (``capabilities.TransformApplying``)."""

    _transform: Any

    @property
    def transform(self) -> Any:
        """The function or transformation object applied to each element."""
        return self._transform


class _ElementwiseMapDataset(_TransformApplying, MapDataset[Any]):
    """One parent, same length; subclasses define ``__getitem__`` and ``_getitems`` only."""

    def __init__(self, parent: MapDataset[Any], transform: Any) -> None:
        super().__init__(parent)
        self._parent = parent
        self._transform = transform

    def __len__(self) -> int:
        return len(self._parent)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(transform={transform_name(self._transform)})"


class MapMapDataset(_ElementwiseMapDataset):
    """``ds[i] = fn(parent[i])``; holes pass through."""

    element_spec_rule = transform_spec

    def __init__(self, parent: MapDataset[Any], transform: Any) -> None:
        super().__init__(parent, transform)
        self._fn = _transform_fn(transform, "map")

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        x = self._parent[index]
        return None if x is None else self._fn(x)

    def _getitems(self, indices: Indices) -> list[Any]:
        fn = self._fn
        return [None if x is None else fn(x) for x in self._parent._getitems(indices)]


class BatchedMapMapDataset(_ElementwiseMapDataset):
    """``ds[i] = fn(make_batch([parent[i]]))`` leaf ``[0]``: ``fn`` maps a batch to a batch.

    A block of indices is read from the parent as one batch (whole gathered columns where the
    source holds arrays, see ``grain_core.dataset.source``), mapped with one call, and handed
    on as a ``StackedBlock``, which a ``batch`` above takes as its batch.

    Raises:
      ValueError: If a node below leaves holes (the elements of a batch must all exist).
    """

    #: A ``batch`` right above reads one batch per call, not many at once.
    maps_batches = True

    def __init__(self, parent: MapDataset[Any], transform: Any) -> None:
        super().__init__(parent, transform)
        holes = has_holes_upstream(parent)
        if holes is not None:
            raise ValueError(
                f"A batched map cannot follow `{type(holes).__name__}`, which leaves holes in "
                "the index space; map element by element (batched=False), or batch after "
                "`to_iter_dataset()` and map the batches."
            )
        self._fn = _transform_fn(transform, "map")
        self._reads_blocks = reads_blocks(parent)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        return self._getitems([index])[0]

    def _getitems(self, indices: Indices) -> StackedBlock:
        with columns_wanted() if self._reads_blocks else contextlib.nullcontext():
            values = self._parent._getitems(indices)
        if len(values) == 0:
            return StackedBlock((), 0)
        try:
            out = self._fn(make_batch(values))
        except StopIteration as e:
            raise stop_iteration_error(transform_name(self._transform)) from e
        lengths = {len(leaf) for leaf in _tree.flatten(out)}
        if lengths != {len(values)}:
            raise ValueError(
                f"The batched map {transform_name(self._transform)} returned leaves of "
                f"lengths {sorted(lengths)} for a batch of {len(values)} elements; a batched "
                "map returns one result per element along the first axis of every leaf."
            )
        return StackedBlock(out, len(values))

    def __repr__(self) -> str:
        return f"BatchedMapMapDataset(transform={transform_name(self._transform)})"


class MapWithIndexMapDataset(_ElementwiseMapDataset):
    """``ds[i] = fn(i, parent[i])`` with the raw index ``i``."""

    element_spec_rule = transform_spec

    def __init__(self, parent: MapDataset[Any], transform: Any) -> None:
        super().__init__(parent, transform)
        self._fn = _transform_fn(transform, "map_with_index")

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        x = self._parent[index]
        return None if x is None else self._fn(index, x)

    def _getitems(self, indices: Indices) -> list[Any]:
        fn = self._fn
        values = self._parent._getitems(indices)
        return [None if x is None else fn(int(i), x) for i, x in zip(indices, values, strict=True)]


class RandomMapMapDataset(_ElementwiseMapDataset):
    """``ds[i] = fn(parent[i], rng_i)``; ``rng_i`` is Philox with counter ``[0, 0, 0, i]``."""

    element_spec_rule = transform_spec

    def __init__(self, parent: MapDataset[Any], transform: Any, *, seed: int | None = None) -> None:
        super().__init__(parent, transform)
        self._fn = _transform_fn(transform, "random_map")
        self._seed = self._resolve_seed(seed, "random_map", below_2_32=False)
        self._pool = _random.RngPool(self._seed)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        x = self._parent[index]
        if x is None:
            return None
        rng = self._pool.acquire_rng(index)
        try:
            return self._fn(x, rng)
        finally:
            self._pool.release_rng(rng)

    def _getitems(self, indices: Indices) -> list[Any]:
        values = self._parent._getitems(indices)
        fn = self._fn
        rng = self._pool.acquire_rng(0)
        reset = _random.reset_philox
        out: list[Any] = []
        try:
            for i, x in zip(indices, values, strict=True):
                if x is None:
                    out.append(None)
                    continue
                reset(rng, int(i))
                out.append(fn(x, rng))
        finally:
            self._pool.release_rng(rng)
        return out


class FilterMapDataset(_ElementwiseMapDataset):
    """``ds[i] = parent[i]`` if the predicate holds, else ``None`` (a hole)."""

    element_spec_rule = parent_spec

    creates_holes = True
    # Grain's words in MapDataset.batch's refusal, which users match on.
    display_name = "MapDataset.filter"

    def __init__(self, parent: MapDataset[Any], transform: Any) -> None:
        super().__init__(parent, transform)
        self._fn = _transform_fn(transform, "filter")

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        x = self._parent[index]
        return None if x is None or not self._fn(x) else x

    def _getitems(self, indices: Indices) -> list[Any]:
        fn = self._fn
        return [None if x is None or not fn(x) else x for x in self._parent._getitems(indices)]


# ------------------------------------------------------------------------ IterDataset side
class _ElementwiseIterDataset(_TransformApplying, IterDataset[Any]):
    _iterator_cls: type[DatasetIterator[Any]]

    def __init__(self, parent: IterDataset[Any], transform: Any) -> None:
        super().__init__(parent)
        self._transform = transform

    def __iter__(self) -> DatasetIterator[Any]:
        return self._iterator_cls(iter(self._parents[0]), self)  # type: ignore[call-arg]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(transform={transform_name(self._transform)})"


class _MapIterator(ElementwiseIterator[Any]):
    def __init__(self, parent: DatasetIterator[Any], ds: MapIterDataset) -> None:
        super().__init__(parent)
        self._fn = _transform_fn(ds._transform, "map")

    def __next__(self) -> Any:
        x = next(self._parents[0])
        try:
            return self._fn(x)
        except StopIteration as e:
            raise stop_iteration_error(transform_name(self._fn)) from e


class MapIterDataset(_ElementwiseIterDataset):
    """Applies ``fn`` to every element; state is the parent's."""

    element_spec_rule = transform_spec

    _iterator_cls = _MapIterator


class _IndexedIterator(DatasetIterator[Any]):
    """Shared by map_with_index and random_map: both number the elements they pull.

    Inside worker ``p`` of ``P`` the ``k``-th element gets the global-looking index
    ``p + k * P``, so per-worker streams interleave into the single-process numbering (Grain
    does this for random_map only; doing it for map_with_index too makes its counter
    independent of the worker count).
    """

    _state_key: str

    def __init__(self, parent: DatasetIterator[Any]) -> None:
        super().__init__(parent)
        self._count = 0

    def _index(self) -> int:
        mp = self._ctx.mp_context
        return mp.process_index + self._count * mp.process_count

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parents[0].get_state(), self._state_key: self._count}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parents[0].set_state(state["parent"])
        self._count = self._state_int(state, self._state_key)

    def _progress_held(self) -> None:
        # The count only numbers elements: under another shard count it restarts at 0.
        return None

    def _get_next_index(self) -> int:
        return self._parents[0]._get_next_index()

    def _set_next_index(self, index: int) -> None:
        self._parents[0]._set_next_index(index)
        self._count = index


class _MapWithIndexIterator(_IndexedIterator):
    _state_key = "counter"

    def __init__(self, parent: DatasetIterator[Any], ds: MapWithIndexIterDataset) -> None:
        super().__init__(parent)
        self._fn = _transform_fn(ds._transform, "map_with_index")

    def __next__(self) -> Any:
        x = next(self._parents[0])
        index = self._index()
        self._count += 1
        try:
            return self._fn(index, x)
        except StopIteration as e:
            raise stop_iteration_error(transform_name(self._fn)) from e


class MapWithIndexIterDataset(_ElementwiseIterDataset):
    """Applies ``fn(index, element)``; state ``{"parent", "counter"}``."""

    element_spec_rule = transform_spec

    _iterator_cls = _MapWithIndexIterator


class _RandomMapIterator(_IndexedIterator):
    _state_key = "index_for_rng"

    def __init__(self, parent: DatasetIterator[Any], ds: RandomMapIterDataset) -> None:
        super().__init__(parent)
        self._fn = _transform_fn(ds._transform, "random_map")
        self._rng = np.random.Generator(np.random.Philox(ds._seed))

    def __next__(self) -> Any:
        x = next(self._parents[0])
        _random.reset_philox(self._rng, self._index())
        self._count += 1
        try:
            return self._fn(x, self._rng)
        except StopIteration as e:
            raise stop_iteration_error(transform_name(self._fn)) from e


class RandomMapIterDataset(_ElementwiseIterDataset):
    """Applies ``fn(element, rng)``; state ``{"parent", "index_for_rng"}``."""

    element_spec_rule = transform_spec

    _iterator_cls = _RandomMapIterator

    def __init__(
        self, parent: IterDataset[Any], transform: Any, *, seed: int | None = None
    ) -> None:
        super().__init__(parent, transform)
        self._seed = self._resolve_seed(seed, "random_map", below_2_32=False)


class _FilterIterator(ParentStateIterator[Any]):
    def __init__(self, parent: DatasetIterator[Any], ds: FilterIterDataset) -> None:
        super().__init__(parent)
        self._fn = _transform_fn(ds._transform, "filter")
        # A Filter object is named by its class, as Grain names it (not by a dataclass repr).
        transform = ds._transform
        name = type(transform).__name__ if isinstance(transform, Filter) else None
        self._checker = FilterRatioChecker(
            f"FilterDatasetIterator(transform={name or transform_name(transform)})"
        )

    def __next__(self) -> Any:
        parent = self._parents[0]
        fn = self._fn
        dropped = 0
        while True:
            x = next(parent)
            try:
                keep = fn(x)
            except StopIteration as e:
                raise stop_iteration_error(transform_name(fn)) from e
            if keep:
                self._checker.record(dropped + 1, dropped, self._ctx.dataset_options)
                return x
            dropped += 1
            if dropped >= 1000:
                self._checker.record(dropped, dropped, self._ctx.dataset_options)
                dropped = 0


class FilterIterDataset(_ElementwiseIterDataset):
    """Keeps elements for which the predicate holds; state is the parent's."""

    element_spec_rule = parent_spec

    _iterator_cls = _FilterIterator

"""Element specs: the structure, shapes and dtypes of a dataset's elements.

``get_element_spec(ds)`` answers without reading data by walking the graph: sources with a
known element type start the walk, each node derives its spec from its parents'. A node class
(also a third-party one) takes part by defining ``_element_spec(self) -> spec``; the built-in
nodes are described in this module so that node modules need no spec code of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from grain_core import _tree
from grain_core.capabilities import BatchFunctionOutputSpec, TransformOutputSpec
from grain_core.dataset import mp as _mp
from grain_core.dataset import prefetch as _prefetch
from grain_core.dataset import source as _source
from grain_core.dataset import with_options as _with_options
from grain_core.dataset.base import (
    IterDataset,
    MapDataset,
    _WithSeedIterDataset,
    _WithSeedMapDataset,
)
from grain_core.dataset.ops import batch as _batch
from grain_core.dataset.ops import cache as _cache
from grain_core.dataset.ops import interleave as _interleave
from grain_core.dataset.ops import limit as _limit
from grain_core.dataset.ops import map as _map
from grain_core.dataset.ops import mix as _mix
from grain_core.dataset.ops import rebatch as _rebatch
from grain_core.dataset.ops import repeat as _repeat
from grain_core.dataset.ops import shuffle as _shuffle
from grain_core.dataset.ops import slice as _slice
from grain_core.dataset.ops import window_shuffle as _window_shuffle
from grain_core.dataset.ops import zip as _zip

__all__ = ["ShapeDtypeStruct", "ShapeDtypeStructProtocol", "get_element_spec"]


@runtime_checkable
class ShapeDtypeStructProtocol(Protocol):
    """Anything with ``shape`` and ``dtype`` (``jax.ShapeDtypeStruct`` satisfies it)."""

    @property
    def shape(self) -> tuple[int | None, ...]: ...

    @property
    def dtype(self) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ShapeDtypeStruct:
    """Shape and dtype of one leaf; ``None`` in ``shape`` marks a dimension of unknown size."""

    shape: tuple[int | None, ...]
    dtype: Any  # anything np.dtype accepts; stored as an np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))


def get_element_spec(ds: MapDataset[Any] | IterDataset[Any]) -> Any:
    """Returns the PyTree of ``ShapeDtypeStruct`` describing ``ds``'s elements, reading no data.

    Raises:
      ValueError: if a map transform has no ``output_spec(input_spec)`` method (the message says
        which transform needs one).
      NotImplementedError: for a node whose spec cannot be derived (e.g. a source over
        arbitrary records, flat_map, packing, or a custom ``batch_fn`` without ``output_spec``).
    """
    own = getattr(ds, "_element_spec", None)
    if own is not None:
        return own()
    for cls in type(ds).__mro__:
        rule = _RULES.get(cls)
        if rule is not None:
            return rule(ds)
    raise NotImplementedError(
        f"Cannot derive the element spec of {ds!r} without reading data. Give its class an "
        "`_element_spec(self)` method, or read an element and inspect it."
    )


def _parent_spec(ds: Any) -> Any:
    return get_element_spec(ds._parents[0])


def _transform_output_spec(ds: Any) -> Any:
    transform = ds._transform
    if not isinstance(transform, TransformOutputSpec):
        raise ValueError(
            f"Cannot infer the element spec after {ds!r}: its transform has no "
            "`output_spec(input_spec)` method. Implement one on the transform (a "
            "`grain.transforms.Map`/`RandomMap`/`MapWithIndex` subclass) returning the PyTree of "
            "`ShapeDtypeStruct` it produces."
        )
    return transform.output_spec(_parent_spec(ds))


def _batch_spec(ds: Any) -> Any:
    size, drop = ds._batch_size, ds._drop_remainder
    batch_fn = ds._given_batch_fn
    if batch_fn is not _batch.make_batch:
        if not isinstance(batch_fn, BatchFunctionOutputSpec):
            raise NotImplementedError(
                f"Cannot infer the element spec of {ds!r}: its custom batch_fn has no "
                "`output_spec(input_spec, batch_size, drop_remainder)` method."
            )
        return batch_fn.output_spec(_parent_spec(ds), size, drop)
    return _with_leading_dim(_parent_spec(ds), size if drop else None)


def _with_leading_dim(spec: Any, dim: int | None) -> Any:
    return _tree.map_structure(lambda s: ShapeDtypeStruct((dim, *s.shape), s.dtype), spec)


def _rebatch_spec(ds: Any) -> Any:
    return _tree.map_structure(
        lambda s: ShapeDtypeStruct((ds._batch_size, *s.shape[1:]), s.dtype), _parent_spec(ds)
    )


def _zip_spec(ds: Any) -> Any:
    return tuple(get_element_spec(p) for p in ds._parents)


def _first_input_spec(ds: Any) -> Any:
    return get_element_spec(ds._parents[0])


def _interleave_spec(ds: _interleave.InterleaveIterDataset) -> Any:
    if not len(ds.datasets):
        raise NotImplementedError("An interleave of no datasets has no element spec.")
    return get_element_spec(ds.datasets[0])


def _range_spec(ds: Any) -> Any:
    return ShapeDtypeStruct((), np.int64)


_PASS_THROUGH: tuple[type, ...] = (
    _WithSeedMapDataset,
    _WithSeedIterDataset,
    _map.FilterMapDataset,
    _map.FilterIterDataset,
    _shuffle.ShuffleMapDataset,
    _slice.SliceMapDataset,
    _slice.ReindexMapDataset,
    _repeat.RepeatMapDataset,
    _prefetch.PrefetchIterDataset,
    _prefetch.ThreadPrefetchIterDataset,
    _window_shuffle.WindowShuffleMapDataset,
    _window_shuffle.WindowShuffleIterDataset,
    _limit.LimitIterDataset,
    _repeat.RepeatIterDataset,
    _cache.CacheIterDataset,
    _with_options.WithOptionsIterDataset,
    _mp.MultiprocessPrefetchIterDataset,
)

_RULES: dict[type, Callable[[Any], Any]] = {
    **dict.fromkeys(_PASS_THROUGH, _parent_spec),
    _source.RangeMapDataset: _range_spec,
    **dict.fromkeys(
        (
            _map.MapMapDataset,
            _map.MapIterDataset,
            _map.RandomMapMapDataset,
            _map.RandomMapIterDataset,
            _map.MapWithIndexMapDataset,
            _map.MapWithIndexIterDataset,
        ),
        _transform_output_spec,
    ),
    _batch.BatchMapDataset: _batch_spec,
    _batch.BatchIterDataset: _batch_spec,
    _rebatch.RebatchIterDataset: _rebatch_spec,
    _zip.ZipMapDataset: _zip_spec,
    _zip.ZipIterDataset: _zip_spec,
    _mix.MixedMapDataset: _first_input_spec,
    _mix.ConcatenateMapDataset: _first_input_spec,
    _mix.MixedIterDataset: _first_input_spec,
    _interleave.InterleaveIterDataset: _interleave_spec,
}

"""Element specs: the structure, shapes and dtypes of a dataset's elements.

``get_element_spec(ds)`` answers without reading data by walking the graph: sources with a
known element type start the walk, each node derives its spec from its parents'. A node class
takes part in one line, ``element_spec_rule = <a rule of this module>`` (the rules below read
what a node exposes through the capabilities ``TransformApplying``, ``Batching`` and
``FunctionBatching``), or, a third-party one, by defining ``_element_spec(self) -> spec``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from grain_core import _tree
from grain_core.capabilities import (
    BatchFunctionOutputSpec,
    Batching,
    FunctionBatching,
    TransformApplying,
    TransformOutputSpec,
)

if TYPE_CHECKING:
    from grain_core.dataset.base import IterDataset, MapDataset

__all__ = [
    "ShapeDtypeStruct",
    "ShapeDtypeStructProtocol",
    "batch_spec",
    "every_parent_spec",
    "first_dataset_spec",
    "get_element_spec",
    "parent_spec",
    "range_spec",
    "rebatch_spec",
    "transform_spec",
]


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
    rule = getattr(type(ds), "element_spec_rule", None)  # None too for a non-dataset
    if rule is None:
        raise NotImplementedError(
            f"Cannot derive the element spec of {ds!r} without reading data. Give its class an "
            "`_element_spec(self)` method, or read an element and inspect it."
        )
    return rule(ds)


def parent_spec(ds: Any) -> Any:
    """The rule of a node whose elements are its (first) parent's, or like them."""
    return get_element_spec(ds.parents[0])


def every_parent_spec(ds: Any) -> Any:
    """The rule of a node whose elements are tuples of one element of each parent."""
    return tuple(get_element_spec(p) for p in ds.parents)


def first_dataset_spec(ds: Any) -> Any:
    """The rule of a node reading the elements of ``ds.datasets`` (interleave).

    Raises:
      NotImplementedError: for no datasets.
    """
    if not len(ds.datasets):
        raise NotImplementedError("An interleave of no datasets has no element spec.")
    return get_element_spec(ds.datasets[0])


def range_spec(ds: Any) -> Any:
    """The rule of a range of integers."""
    return ShapeDtypeStruct((), np.int64)


def transform_spec(ds: TransformApplying) -> Any:
    """The rule of a node applying a transform to each element: the transform's
    ``output_spec`` of its parent's spec.

    Raises:
      ValueError: if the transform has no ``output_spec``.
    """
    transform = ds.transform
    if not isinstance(transform, TransformOutputSpec):
        raise ValueError(
            f"Cannot infer the element spec after {ds!r}: its transform has no "
            "`output_spec(input_spec)` method. Implement one on the transform (a "
            "`grain.transforms.Map`/`RandomMap`/`MapWithIndex` subclass) returning the PyTree of "
            "`ShapeDtypeStruct` it produces."
        )
    return transform.output_spec(parent_spec(ds))


def batch_spec(ds: FunctionBatching) -> Any:
    """The rule of ``batch``: the parent's spec with a leading batch dimension (``None`` unless
    ``drop_remainder``), or a custom batch function's ``output_spec``.

    Raises:
      NotImplementedError: for a custom batch function without ``output_spec``.
    """
    size, drop = ds.batch_size, ds.drop_remainder
    batch_fn = ds.custom_batch_fn
    if batch_fn is not None:
        if not isinstance(batch_fn, BatchFunctionOutputSpec):
            raise NotImplementedError(
                f"Cannot infer the element spec of {ds!r}: its custom batch_fn has no "
                "`output_spec(input_spec, batch_size, drop_remainder)` method."
            )
        return batch_fn.output_spec(parent_spec(ds), size, drop)
    return _tree.map_structure(
        lambda s: ShapeDtypeStruct((size if drop else None, *s.shape), s.dtype), parent_spec(ds)
    )


def rebatch_spec(ds: Batching) -> Any:
    """The rule of ``RebatchIterDataset``: the parent's batches with ``batch_size`` rows."""
    return _tree.map_structure(
        lambda s: ShapeDtypeStruct((ds.batch_size, *s.shape[1:]), s.dtype), parent_spec(ds)
    )

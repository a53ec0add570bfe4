"""``apply_transformations``: dispatch transformation objects to dataset methods."""

from __future__ import annotations

from typing import Any

from grain_core import transforms
from grain_core.dataset.base import MapDataset
from grain_core.dataset.ops import flatmap

__all__ = ["apply_transformations"]


def apply_transformations(ds: Any, transformations: Any) -> Any:
    """Applies one transformation or a sequence of them to ``ds`` in order.

    Raises:
      NotImplementedError: for a transformation type with no dataset equivalent.
    """
    if not isinstance(transformations, (list, tuple)):
        transformations = [transformations]
    for t in transformations:
        ds = _apply_one(ds, t)
    return ds


def _apply_one(ds: Any, t: Any) -> Any:
    if isinstance(t, transforms.Batch):
        return ds.batch(t.batch_size, drop_remainder=t.drop_remainder, batch_fn=t.batch_fn)
    if isinstance(t, transforms.Map):
        return ds.map(t)
    if isinstance(t, transforms.RandomMap):
        return ds.random_map(t)
    if isinstance(t, transforms.MapWithIndex):
        return ds.map_with_index(t)
    if isinstance(t, transforms.Filter):
        return ds.filter(t)
    if isinstance(t, transforms.FlatMap):
        if isinstance(ds, MapDataset):
            return flatmap.FlatMapMapDataset(ds, t)
        return flatmap.FlatMapIterDataset(ds, t)
    raise NotImplementedError(
        f"Transformation {t!r} of type {type(t).__name__} is not supported by `apply`. Use Map, "
        "RandomMap, MapWithIndex, Filter, FlatMap or Batch."
    )

"""Worker shares of a pipeline: the copy of a graph that worker ``index`` of ``count`` runs,
shared by worker processes (``mp_prefetch``), threads (``multithread_prefetch``) and
``ElasticIterator``.

On every path from the output to the sources, the first sliceable node reads only its share:
normally the MapDataset→IterDataset boundary (``to_iter_dataset``), re-pointed at
``map_parent[index::count]``. The graph is rebuilt for the worker; nothing the user holds is
mutated.
"""

from __future__ import annotations

import copy
from typing import Any

from grain_core.capabilities import InPlaceSliceable, WorkerSliceable
from grain_core.dataset.base import IterDataset, MapDataset
from grain_core.dataset.ops.map import (
    FilterMapDataset,
    MapMapDataset,
    MapWithIndexMapDataset,
    RandomMapMapDataset,
)
from grain_core.dataset.ops.seed import _WithSeedMapDataset
from grain_core.dataset.prefetch import PrefetchIterDataset
from grain_core.dataset.source import RangeMapDataset, SourceMapDataset
from grain_core.sharding import ShardOptions, even_split

__all__ = ["slice_for_worker"]

# MapDataset nodes that keep every index in place, so a contiguous block of their source is the
# same block of their output (what ``sequential_slice`` needs).
_POSITION_PRESERVING = (
    MapMapDataset,
    MapWithIndexMapDataset,
    RandomMapMapDataset,
    FilterMapDataset,
    _WithSeedMapDataset,
)


def slice_for_worker(
    ds: IterDataset[Any], index: int, count: int, sequential: bool = False
) -> IterDataset[Any]:
    """Returns worker ``index`` of ``count``'s copy of ``ds``, re-sliced at its first sliceable
    node on every path. The nodes of ``ds`` are left untouched.

    Raises:
      ValueError: If a path reaches an IterDataset source that cannot be sliced, or
        ``sequential`` is asked for a pipeline it cannot honour.
    """
    if count == 1:
        return ds
    return _rebuild(ds, index, count, sequential)


def _rebuild(node: Any, index: int, count: int, sequential: bool) -> Any:
    if isinstance(node, PrefetchIterDataset):
        parent = node.map_parent
        if sequential:
            start, end = _sequential_block(parent, index, count)
            return node.with_parent(parent.slice(slice(start, end)))
        return node.with_parent(parent.slice(slice(index, None, count)))
    sl = slice(index, None, count)
    if isinstance(node, WorkerSliceable):
        return node.with_slice(sl)
    if isinstance(node, InPlaceSliceable):
        # Datasets over lists of inputs (interleave, multi-file readers) slice that list.
        clone = copy.copy(node)
        clone.set_slice(sl)
        return clone
    # An IterDataset node over a MapDataset (a packer built on one) iterates it as
    # ``to_iter_dataset()`` does: that boundary is the one sliced.
    parents = tuple(
        PrefetchIterDataset(p) if isinstance(p, MapDataset) else p for p in node._parents
    )
    if not parents or not all(isinstance(p, IterDataset) for p in parents):
        raise ValueError(
            f"Cannot slice `IterDataset` source {node!r} for {count} workers: it has no "
            "`set_slice`. Build the pipeline from a MapDataset with `to_iter_dataset()` (or a "
            "sliceable dataset), or use a single worker."
        )
    clone = copy.copy(node)
    clone._parents = tuple(_rebuild(p, index, count, sequential) for p in parents)
    return clone


def _sequential_block(ds: MapDataset[Any], index: int, count: int) -> tuple[int, int]:
    node = ds
    while isinstance(node, _POSITION_PRESERVING):
        node = node._parents[0]
    if not isinstance(node, (SourceMapDataset, RangeMapDataset)):
        raise ValueError(
            "sequential_slice needs the MapDataset part of the pipeline to keep positions "
            "(source, map, random_map, map_with_index, filter); "
            f"{type(node).__name__} changes them. Use the default strided slicing."
        )
    return even_split(len(ds), ShardOptions(index, count))

"""``grain.experimental.pick_performance_config``: worker and buffer counts from a RAM budget."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from typing import Any

import numpy as np

from grain_core.dataset.base import IterDataset, MapDataset
from grain_core.dataset.prefetch import PrefetchIterDataset
from grain_core.options import MultiprocessingOptions, ReadOptions

__all__ = ["PerformanceConfig", "pick_performance_config"]

_DEFAULT_MAX_BUFFER_SIZE = 1000


@dataclasses.dataclass(frozen=True)
class PerformanceConfig:
    """Options chosen by :func:`pick_performance_config`."""

    multiprocessing_options: MultiprocessingOptions
    read_options: ReadOptions


def element_size(element: Any) -> int:
    """Bytes of an element: ``nbytes`` of arrays, ``sys.getsizeof`` of other leaves."""
    if isinstance(element, np.ndarray):
        return int(element.nbytes)
    if isinstance(element, dict):
        return sum(element_size(v) for v in element.values())
    if isinstance(element, (list, tuple)):
        return sum(element_size(v) for v in element)
    return sys.getsizeof(element)


def _mean_size(elements: list[Any]) -> float:
    return sum(element_size(e) for e in elements) / len(elements) if elements else 0.0


def _reader_nodes(ds: Any) -> list[PrefetchIterDataset]:
    found: list[PrefetchIterDataset] = []
    stack = [ds]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, PrefetchIterDataset):
            found.append(node)
        stack.extend(getattr(node, "_parents", ()))
    return found


def pick_performance_config(
    ds: IterDataset[Any],
    *,
    ram_budget_mb: int,
    max_workers: int | None,
    max_buffer_size: int | None = None,
    samples_to_check: int = 5,
) -> PerformanceConfig:
    """Chooses ``num_workers`` and ``prefetch_buffer_size`` so buffers fit in ``ram_budget_mb``.

    Reads ``samples_to_check`` output elements of ``ds`` (and of the MapDatasets read by its
    ``to_iter_dataset`` nodes) to estimate element sizes. ``num_workers = min(budget / output
    size, max_workers or cpu_count)`` (all of ``max_workers`` when nothing could be measured);
    ``prefetch_buffer_size = min(budget / (input size * number of readers), max_buffer_size or
    1000)``. The options it returns leave the in-process choice to measurement
    (``in_process="auto"``: a pipeline the dispatching engine takes runs in this process while
    workers would not deliver it faster; docs/workers.md says what that gives up).

    Raises:
      ValueError: If ``ram_budget_mb`` or ``samples_to_check`` is not positive.
    """
    if ram_budget_mb <= 0:
        raise ValueError(f"ram_budget_mb must be positive, got {ram_budget_mb}.")
    if samples_to_check <= 0:
        raise ValueError(f"samples_to_check must be positive, got {samples_to_check}.")
    budget = ram_budget_mb * 1024 * 1024
    cap_workers = max_workers if max_workers is not None else (os.cpu_count() or 1)
    it = iter(ds)
    try:
        outputs = list(itertools.islice(it, samples_to_check))
    finally:
        it.close()
    out_size = _mean_size(outputs)
    if out_size == 0 or len(outputs) < samples_to_check:
        num_workers = cap_workers
    else:
        num_workers = min(int(budget // out_size), cap_workers)
    readers = _reader_nodes(ds)
    cap_buffer = max_buffer_size if max_buffer_size is not None else _DEFAULT_MAX_BUFFER_SIZE
    inputs: list[Any] = []
    for reader in readers:
        parent: MapDataset[Any] = reader.map_parent
        count = min(samples_to_check, len(parent))
        inputs.extend(x for x in parent._getitems(range(count)) if x is not None)
    in_size = _mean_size(inputs)
    if in_size == 0 or not readers:
        buffer = cap_buffer
    else:
        buffer = min(int(budget // (in_size * len(readers))), cap_buffer)
    return PerformanceConfig(
        multiprocessing_options=MultiprocessingOptions(
            num_workers=max(num_workers, 0), in_process="auto"
        ),
        read_options=ReadOptions(prefetch_buffer_size=max(buffer, 0)),
    )

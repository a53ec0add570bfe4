"""``multithread_prefetch``: the thread analogue of ``mp_prefetch``."""

from __future__ import annotations

import copy
from typing import Any

from grain_core._checks import non_negative_int
from grain_core.dataset.base import IterDataset
from grain_core.dataset.interleave import InterleaveIterDataset
from grain_core.dataset.worker_slicing import slice_for_worker

__all__ = ["multithread_prefetch"]


def multithread_prefetch(
    ds: IterDataset[Any],
    num_threads: int,
    buffer_size: int,
    sequential_slice: bool = False,
    *,
    copy_per_thread: bool = False,
) -> IterDataset[Any]:
    """Runs ``num_threads`` slices of ``ds`` on threads, merged in strict round-robin order.

    Thread ``i`` runs a rebuilt copy of the pipeline sliced ``i::num_threads`` at its first
    sliceable node (like ``mp_prefetch`` workers; ``sequential_slice`` gives contiguous blocks),
    reading up to ``buffer_size`` elements ahead. The output order is that of ``mp_prefetch``
    with ``num_threads`` workers. Each thread has its own nodes and iterators; user transforms
    are shared, as in ``to_iter_dataset``'s read threads, so they must be thread-safe.

    Args:
      ds: the pipeline.
      num_threads: number of slices (0: return ``ds`` unchanged).
      buffer_size: elements each thread reads ahead (0: slices are read on the consumer thread).
      sequential_slice: contiguous blocks of the source instead of strided slices.
      copy_per_thread: give each thread a deep copy of ``ds`` (transforms included), the
        isolation worker processes give (``mp_prefetch`` on free-threaded Python).

    Raises:
      ValueError: for negative counts, or a pipeline with no sliceable node (when
        ``num_threads > 1``).
    """
    non_negative_int("num_threads", num_threads)
    non_negative_int("buffer_size", buffer_size)
    if num_threads == 0:
        return ds
    shards = [
        slice_for_worker(
            copy.deepcopy(ds) if copy_per_thread else ds, i, num_threads, sequential_slice
        )
        for i in range(num_threads)
    ]
    return InterleaveIterDataset(
        shards,
        cycle_length=num_threads,
        num_make_iter_threads=num_threads,
        iter_buffer_size=buffer_size,
    )

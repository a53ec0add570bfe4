"""``multithread_prefetch``: the thread analogue of ``mp_prefetch``."""

from __future__ import annotations

import copy
from typing import Any

from grain_core._checks import non_negative_int
from grain_core.capabilities import SupportsNextBlock
from grain_core.dataset.base import (
    DatasetIterator,
    ElementBlock,
    ElementwiseIterator,
    IteratorContext,
    IterDataset,
    ShareContext,
)
from grain_core.dataset.ops.interleave import InterleaveIterDataset
from grain_core.dataset.worker_slicing import slice_for_worker

__all__ = ["ThreadShareIterDataset", "multithread_prefetch"]


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
    with ``num_threads`` workers, and each thread's iterators see the worker identity ``i`` of
    ``num_threads`` in their context, so ``random_map`` gives each element the random stream
    it gets on one thread. Each thread has its own nodes and iterators; user transforms
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
        ThreadShareIterDataset(
            slice_for_worker(
                copy.deepcopy(ds) if copy_per_thread else ds, i, num_threads, sequential_slice
            ),
            i,
            num_threads,
        )
        for i in range(num_threads)
    ]
    return InterleaveIterDataset(
        shards,
        cycle_length=num_threads,
        num_make_iter_threads=num_threads,
        iter_buffer_size=buffer_size,
    )


class ThreadShareIterDataset(IterDataset[Any]):
    """Share ``index`` of ``count`` of a pipeline read on its own thread: its iterators see
    that worker identity (composed with the pipeline's, see ``ShareContext``); elements and
    state are the parent's."""

    def __init__(self, parent: IterDataset[Any], index: int, count: int) -> None:
        super().__init__(parent)
        self.index = index
        self.count = count

    def __iter__(self) -> DatasetIterator[Any]:
        parent = iter(self._parents[0])
        blockwise = isinstance(parent, SupportsNextBlock)
        share = _BlockwiseThreadShareIterator if blockwise else _ThreadShareIterator
        return share(parent, self.index, self.count)

    def __repr__(self) -> str:
        return f"ThreadShareIterDataset(index={self.index}, count={self.count})"


class _ThreadShareIterator(ElementwiseIterator[Any]):
    """Gives its parents the share's context whenever it joins a pipeline's."""

    def __init__(self, parent: DatasetIterator[Any], index: int, count: int) -> None:
        super().__init__(parent)
        self._index = index
        self._count = count
        parent._share_ctx(ShareContext(self._ctx, index, count))

    def _share_ctx(self, ctx: IteratorContext) -> None:
        if self._ctx is ctx:
            return
        self._ctx = ctx
        self._parents[0]._share_ctx(ShareContext(ctx, self._index, self._count))
        self._start_stage_timing_if_enabled()

    def __next__(self) -> Any:
        return next(self._parents[0])


class _BlockwiseThreadShareIterator(_ThreadShareIterator):
    """A share whose parent hands out blocks (``SupportsNextBlock``) keeps that capability."""

    def next_block(self, max_size: int) -> ElementBlock[Any]:
        parent: SupportsNextBlock[Any] = self._parents[0]  # type: ignore[assignment]  # checked in __iter__
        return parent.next_block(max_size)

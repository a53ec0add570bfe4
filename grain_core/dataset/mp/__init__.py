"""``IterDataset.mp_prefetch``: the pipeline runs in worker processes.

Two engines, one output. With only 1:1 transformations after the slice point the output
equals the single-process output; in every case it and the checkpoints are those of strict
rotation over ``N`` strided worker shares:

* ``rotation``: worker ``w`` of ``N`` runs its share of the pipeline (``worker_slicing``) and
  streams it; the parent takes one element from each worker in turn. Any pipeline.
* ``dispatch``: when every element is a function of its position (a MapDataset read by
  ``to_iter_dataset``, optionally followed by IterDataset ``map`` steps and one final
  ``batch``), the parent hands positions to whichever worker is free, so a worker on a slower
  core does not hold back the others (``config.py_mp_prefetch_dispatch = False`` keeps each
  worker on its share; so does a ``worker_init_fn``, which may set workers up differently).

This module chooses the engine and merges: the parent side is an ``InterleaveIterDataset``
with one input per worker (rotation) or per strided class of positions (dispatch), so the
state is the interleave state with one worker pipeline state per input. The rest of the
folder: ``protocol`` (the messages), ``pickling``, ``worker`` (the worker loop both engines
share), ``positions`` (what dispatching
workers compute), ``share_index`` (``get_next_index``/``set_next_index`` with one worker). The processes themselves are ``grain_core._ipc``'s.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from grain_core.dataset.base import IterDataset
from grain_core.dataset.element_spec import parent_spec
from grain_core.dataset.iterator import DatasetIterator
from grain_core.dataset.mp import dispatch, positions, remote, rotation
from grain_core.dataset.mp.consumer import ClassConsumer, DispatchedClassIterator
from grain_core.dataset.mp.pickling import EngineInput
from grain_core.dataset.mp.worker import WarmWorkers, start_worker_server
from grain_core.dataset.multithread import multithread_prefetch
from grain_core.dataset.ops.interleave import InterleaveIterDataset
from grain_core.dataset.options import DatasetOptions
from grain_core.dataset.with_options import WithOptionsIterDataset
from grain_core.options import MultiprocessingOptions

__all__ = [
    "MultiprocessPrefetchIterDataset",
    "mp_prefetch",
    "start_worker_server",
]


def mp_prefetch(
    ds: IterDataset[Any],
    options: MultiprocessingOptions | None = None,
    worker_init_fn: Callable[[int, int], None] | None = None,
    sequential_slice: bool = False,
) -> IterDataset[Any]:
    """Runs ``ds`` in ``options.num_workers`` processes (``ds`` itself when that is 0).

    On free-threaded CPython (GIL disabled) threads run in parallel too, so the workers are
    threads instead (``multithread_prefetch`` over a deep copy of ``ds`` per thread, the same
    output order) and ``worker_init_fn`` is ignored with a warning.

    Args:
      ds: The pipeline to run in workers.
      options: Worker count and per-worker buffer; default 10 workers.
      worker_init_fn: Called as ``fn(worker_index, worker_count)`` in each worker before the
        pipeline is unpickled.
      sequential_slice: Give each worker a contiguous block of the source instead of a strided
        share (only for element-wise MapDataset pipelines above the source).
    """
    if options is None:
        options = MultiprocessingOptions(num_workers=10)
    if options.num_workers == 0:
        return ds
    if options.backend == "local" and not _gil_enabled():
        if worker_init_fn is not None:
            warnings.warn(
                "mp_prefetch runs its workers as threads on free-threaded Python (the GIL is "
                "disabled), so worker_init_fn is ignored.",
                RuntimeWarning,
                stacklevel=3,
            )
        return multithread_prefetch(
            ds,
            options.num_workers,
            options.per_worker_buffer_size,
            sequential_slice,
            copy_per_thread=True,
        )
    return MultiprocessPrefetchIterDataset(
        ds, options, worker_init_fn=worker_init_fn, sequential_slice=sequential_slice
    )


def _gil_enabled() -> bool:
    """False only on a free-threaded CPython running with the GIL disabled."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


def _upstream_options(ds: IterDataset[Any]) -> DatasetOptions | None:
    """The ``DatasetOptions`` of every ``WithOptionsIterDataset`` in the subtree of ``ds``,
    merged so that the most downstream explicitly set value wins (None if there are none)."""
    merged: DatasetOptions | None = None
    queue: list[Any] = [ds]
    seen: set[int] = set()
    while queue:  # breadth first: nearer the output comes first and wins
        node = queue.pop(0)
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, WithOptionsIterDataset):
            merged = node.options if merged is None else merged.merge(node.options)
        queue.extend(p for p in getattr(node, "_parents", ()) if isinstance(p, IterDataset))
    return merged


class MultiprocessPrefetchIterDataset(IterDataset[Any]):
    """The pipeline ``parent`` run by worker processes (see module docstring)."""

    element_spec_rule = parent_spec

    def __init__(
        self,
        parent: IterDataset[Any],
        options: MultiprocessingOptions,
        *,
        worker_init_fn: Callable[[int, int], None] | None = None,
        sequential_slice: bool = False,
    ) -> None:
        super().__init__(parent)
        #: Where the workers run: None for local processes.
        self.backend = remote.worker_backend(options)
        if self.backend is not None:
            remote.check_remote_pipeline(
                positions.dispatch_obstacle(parent),
                self.backend,
                worker_init_fn is not None,
                sequential_slice,
            )
        elif options.num_workers > 0:
            start_worker_server()
        # What every engine runs, built once (with its pickled payload, on first use).
        # Arrays go through this host's shared memory to local worker processes only.
        self.engine = EngineInput(
            parent,
            options,
            positions.PIPELINE_NODES,
            sequential_slice=sequential_slice,
            worker_init_fn=worker_init_fn,
            share_arrays=self.backend is None,
        )
        if self.backend is None and options.persistent_workers and options.num_workers > 0:
            warm = self.engine.warm_workers = WarmWorkers()
            weakref.finalize(self, warm.close)

    @property
    def options(self) -> MultiprocessingOptions:
        return self.engine.options

    @property
    def num_workers(self) -> int:
        return self.engine.num_workers

    def close(self) -> None:
        """Stops the worker processes kept for the next iterator
        (``MultiprocessingOptions.persistent_workers``); those of an open iterator stop when
        it is closed, and iterators made later stop their own. Idempotent."""
        if self.engine.warm_workers is not None:
            self.engine.warm_workers.close()

    def __iter__(self) -> DatasetIterator[Any]:
        engine = self.engine
        backend = self.backend
        make: Callable[[int], DatasetIterator[Any]]
        # What a worker_init_fn sets up may differ by worker: element k then has to come from
        # worker k % N, as in a single strided share each, for the output to be deterministic.
        # (A worker backend takes none: check_remote_pipeline.)
        if backend is not None:
            consumer = ClassConsumer(
                engine, lambda c: remote.BackendWorkers(c, backend), in_process="never"
            )
            make = functools.partial(DispatchedClassIterator, consumer)
        elif engine.worker_init_fn is None and positions.dispatchable(
            engine.pipeline, engine.num_workers, engine.sequential_slice
        ):
            consumer = ClassConsumer(engine, dispatch.LocalWorkers, engine.options.in_process)
            make = functools.partial(DispatchedClassIterator, consumer)
        else:
            make = functools.partial(rotation.RotationIterator, engine)
        workers = [_MergeInputIterDataset(make, w) for w in range(engine.num_workers)]
        # Strict rotation that skips exhausted workers is an interleave with one slot per
        # worker; the worker processes are the read-ahead, so no input threads.
        it = iter(InterleaveIterDataset(workers, cycle_length=len(workers), iter_buffer_size=0))
        it._stage_label = f"MultiprocessPrefetch(num_workers={engine.num_workers})"  # type: ignore[attr-defined]
        # Options set upstream apply in the workers (they are part of the pickled pipeline)
        # and, collected here, to the parent's side of the pipeline too, as in Grain.
        options = _upstream_options(engine.pipeline)
        if options is not None:
            it._merge_dataset_options(options)
        return it

    def __repr__(self) -> str:
        return (
            f"MultiprocessPrefetchIterDataset(num_workers={self.num_workers}, "
            f"per_worker_buffer_size={self.options.per_worker_buffer_size}, "
            f"sequential_slice={self.engine.sequential_slice})"
        )


class _MergeInputIterDataset(IterDataset[Any]):
    """Input ``index`` of an mp_prefetch's parent-side interleave: the output of worker
    ``index`` (rotation), or of class ``index`` (dispatch); ``make(index)`` reads it."""

    def __init__(self, make: Callable[[int], DatasetIterator[Any]], index: int) -> None:
        super().__init__()
        self.make = make
        self.index = index

    def __iter__(self) -> DatasetIterator[Any]:
        return self.make(self.index)

    def __repr__(self) -> str:
        return f"_MergeInputIterDataset(index={self.index})"

"""Window shuffle throughput and the cost of execution statistics.

* ``window_shuffle_map_1m`` / ``window_shuffle_iter_1m``: a full pass over 1,000,000 ints
  window-shuffled with windows of 10,000, against Google Grain's same datasets. Both read
  with ``ReadOptions(num_threads=0)`` so the shuffle is measured, not the reader thread pool
  (with 16 reader threads Grain's map version takes ~0.7 ms per element: over 10 minutes a
  pass).
* ``stats_overhead_seed_pipeline``: harness workload (b) (``bench_core.seed_pipeline``) with
  execution tracking disabled (the default), against the same pipeline with the tracking
  hook removed altogether, and with ``STAGE_TIMING`` on. The first ratio is the overhead of
  *disabled* tracking (1.00x = none; the claim is < 2 %); the second what timing costs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from _harness import import_google_grain, workload
from bench_core import SEED_BATCHES, _records

import grain_core
from grain_core import _demo
from grain_core.dataset.iterator import DatasetIterator
from grain_core.experimental import (
    DatasetOptions,
    ExecutionTrackingMode,
    WindowShuffleIterDataset,
    WindowShuffleMapDataset,
    WithOptionsIterDataset,
)

WINDOW_N = 1_000_000
WINDOW_SIZE = 10_000


def _sync_reads(api: Any) -> Any:
    return api.ReadOptions(num_threads=0)


def _drain(iterable: Any) -> Callable[[], None]:
    def run() -> None:
        for _ in iterable:
            pass

    return run


# ------------------------------------------------------------------------ window shuffle
@workload(
    "window_shuffle_map_1m",
    elements=WINDOW_N,
    description="WindowShuffleMapDataset(range(1M), window_size=10k), sync reads, full pass",
)
def window_shuffle_map_1m() -> Callable[[], None]:
    ds = WindowShuffleMapDataset(
        grain_core.MapDataset.range(WINDOW_N), window_size=WINDOW_SIZE, seed=0
    )
    return _drain(ds.to_iter_dataset(_sync_reads(grain_core)))


@window_shuffle_map_1m.baseline("grain", requires="grain")
def _window_map_grain() -> Callable[[], None]:
    grain: Any = import_google_grain()
    ds = grain.experimental.WindowShuffleMapDataset(
        grain.MapDataset.range(WINDOW_N), window_size=WINDOW_SIZE, seed=0
    )
    return _drain(ds.to_iter_dataset(_sync_reads(grain)))


@workload(
    "window_shuffle_iter_1m",
    elements=WINDOW_N,
    description="WindowShuffleIterDataset(range(1M) iterated with sync reads, window_size=10k)",
)
def window_shuffle_iter_1m() -> Callable[[], None]:
    parent = grain_core.MapDataset.range(WINDOW_N).to_iter_dataset(_sync_reads(grain_core))
    ds = WindowShuffleIterDataset(parent, window_size=WINDOW_SIZE, seed=0)
    return _drain(ds)


@window_shuffle_iter_1m.baseline("grain", requires="grain")
def _window_iter_grain() -> Callable[[], None]:
    grain: Any = import_google_grain()
    parent = grain.MapDataset.range(WINDOW_N).to_iter_dataset(_sync_reads(grain))
    ds = grain.experimental.WindowShuffleIterDataset(parent, window_size=WINDOW_SIZE, seed=0)
    return _drain(ds)


# --------------------------------------------------------------------- stats overhead
def _take_batches(make_iterable: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        iterator = iter(make_iterable())
        for _ in range(SEED_BATCHES):
            next(iterator)
        iterator.close()

    return run


def _seed_iter_dataset() -> Any:
    return _demo.seed_pipeline(grain_core, _records()).to_iter_dataset()


@workload(
    "stats_overhead_seed_pipeline",
    elements=SEED_BATCHES * _demo.BATCH_SIZE,
    description="workload (b) seed_pipeline, execution tracking DISABLED (default options)",
    # Every pass opens and closes its iterator, and the claim is a difference of < 2 %.
    alternate=True,
)
def stats_overhead_seed_pipeline() -> Callable[[], None]:
    return _take_batches(_seed_iter_dataset)


@contextmanager
def _tracking_hook_removed() -> Iterator[None]:
    hook = DatasetIterator._start_stage_timing_if_enabled
    DatasetIterator._start_stage_timing_if_enabled = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        DatasetIterator._start_stage_timing_if_enabled = hook  # type: ignore[method-assign]


@stats_overhead_seed_pipeline.baseline("tracking code removed")
def _seed_without_hook() -> Callable[[], None]:
    run_pass = _take_batches(_seed_iter_dataset)

    def run() -> None:
        with _tracking_hook_removed():
            run_pass()

    return run


@stats_overhead_seed_pipeline.baseline("STAGE_TIMING on")
def _seed_with_timing() -> Callable[[], None]:
    options = DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING)
    return _take_batches(lambda: WithOptionsIterDataset(_seed_iter_dataset(), options))

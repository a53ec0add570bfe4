"""Core Dataset-API workloads: index pipeline, the seed pipeline, vectorised shuffling."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from _harness import import_google_grain, workload

import grain_core
from grain_core import _demo
from grain_core.random import index_shuffle_array

RANGE_N = 1_000_000
RANGE_BATCH = 256
SEED_RECORDS = 50_000
SEED_BATCHES = 400
SHUFFLE_N = 1_000_000


def _double(x: int) -> int:
    return x * 2


def _drain(dataset: Any) -> Callable[[], None]:
    def run() -> None:
        for _ in dataset.to_iter_dataset():
            pass

    return run


def _take_batches(dataset: Any, count: int) -> Callable[[], None]:
    def run() -> None:
        iterator = iter(dataset.to_iter_dataset())
        for _ in range(count):
            next(iterator)

    return run


# (a) MapDataset.range(1_000_000).seed(0).shuffle().map(x * 2).batch(256), full pass.


@workload(
    "range_shuffle_map_batch",
    elements=RANGE_N,
    description="range(1M).seed(0).shuffle().map(x*2).batch(256), full pass",
)
def range_shuffle_map_batch() -> Callable[[], None]:
    return _drain(
        grain_core.MapDataset.range(RANGE_N).seed(0).shuffle().map(_double).batch(RANGE_BATCH)
    )


@range_shuffle_map_batch.baseline("numpy loop")
def _range_numpy() -> Callable[[], None]:
    def run() -> None:
        order = np.random.default_rng(0).permutation(RANGE_N)
        for start in range(0, RANGE_N, RANGE_BATCH):
            np.array([_double(int(i)) for i in order[start : start + RANGE_BATCH]])

    return run


@range_shuffle_map_batch.baseline("grain", requires="grain")
def _range_grain() -> Callable[[], None]:
    grain: Any = import_google_grain()
    return _drain(grain.MapDataset.range(RANGE_N).seed(0).shuffle().map(_double).batch(RANGE_BATCH))


# (b) The seed pipeline over 50,000 in-memory records, 400 batches of 128.


@functools.cache
def _records() -> list[dict[str, Any]]:
    return _demo.make_records(SEED_RECORDS)


@workload(
    "seed_pipeline",
    elements=SEED_BATCHES * _demo.BATCH_SIZE,
    description="50k {image uint8[28,28,1], label} -> seed/shuffle/repeat/map/batch(128) x400",
)
def seed_pipeline() -> Callable[[], None]:
    return _take_batches(_demo.seed_pipeline(grain_core, _records()), SEED_BATCHES)


@seed_pipeline.baseline("numpy loop")
def _seed_numpy() -> Callable[[], None]:
    records = _records()

    def run() -> None:
        rng = np.random.default_rng(42)
        order = rng.permutation(len(records))
        for b in range(SEED_BATCHES):
            start = b * _demo.BATCH_SIZE % len(records)
            if start + _demo.BATCH_SIZE > len(records):
                order = rng.permutation(len(records))
                start = 0
            batch = [_demo.normalise(records[i]) for i in order[start : start + _demo.BATCH_SIZE]]
            {
                "image": np.stack([r["image"] for r in batch]),
                "label": np.array([r["label"] for r in batch]),
            }

    return run


@seed_pipeline.baseline("grain", requires="grain")
def _seed_grain() -> Callable[[], None]:
    return _take_batches(_demo.seed_pipeline(import_google_grain(), _records()), SEED_BATCHES)


# (c) A permutation of 1,000,000 indices in one vectorised call.


@workload(
    "index_shuffle_1m",
    elements=SHUFFLE_N,
    description="shuffle 1M indices: index_shuffle_array in one call",
)
def index_shuffle_1m() -> Callable[[], object]:
    indices = np.arange(SHUFFLE_N)
    return lambda: index_shuffle_array(indices, SHUFFLE_N - 1, seed=0)


@index_shuffle_1m.baseline("numpy permutation")
def _shuffle_numpy() -> Callable[[], object]:
    return lambda: np.random.default_rng(0).permutation(SHUFFLE_N)


@index_shuffle_1m.baseline("grain per-index loop", requires="grain")
def _shuffle_grain() -> Callable[[], object]:
    grain: Any = import_google_grain()
    index_shuffle = grain.experimental.index_shuffle
    return lambda: [index_shuffle(i, SHUFFLE_N - 1, 0, 4) for i in range(SHUFFLE_N)]


# (d) The seed pipeline with grain_core's debugging tools on: the ratio against the same
# pipeline with them off (same run, passes alternated) is the tool's cost.


def _take_batches_with(switch: Callable[[], Any], count: int) -> Callable[[], None]:
    """One pass over ``count`` batches of the seed pipeline, built while ``switch()`` is on."""

    def run() -> None:
        with switch():
            iterator = iter(_demo.seed_pipeline(grain_core, _records()).to_iter_dataset())
        for _ in range(count):
            next(iterator)
        iterator.close()

    return run


@contextlib.contextmanager
def _debug_mode() -> Iterator[None]:
    grain_core.config.update("py_debug_mode", True)
    try:
        yield
    finally:
        grain_core.config.update("py_debug_mode", False)


@workload(
    "seed_pipeline_debug_mode",
    elements=SEED_BATCHES * _demo.BATCH_SIZE,
    description="the seed pipeline built in debug mode (stage timing, periodic summary)",
    alternate=True,
)
def seed_pipeline_debug_mode() -> Callable[[], None]:
    return _take_batches_with(_debug_mode, SEED_BATCHES)


@seed_pipeline_debug_mode.baseline("debug mode off")
def _seed_debug_off() -> Callable[[], None]:
    return _take_batches_with(contextlib.nullcontext, SEED_BATCHES)


@workload(
    "seed_pipeline_traced",
    elements=SEED_BATCHES * _demo.BATCH_SIZE,
    description="the seed pipeline built under experimental.Trace (a span per stage call)",
    alternate=True,
)
def seed_pipeline_traced() -> Callable[[], None]:
    return _take_batches_with(grain_core.experimental.Trace, SEED_BATCHES)


@seed_pipeline_traced.baseline("trace off")
def _seed_trace_off() -> Callable[[], None]:
    return _take_batches_with(contextlib.nullcontext, SEED_BATCHES)

"""MNIST-like small records in memory (issue 29): 60,000 28x28 uint8 images and int64 labels,
a seeded global shuffle, normalise to float32, batches of 128; one pass is one epoch.

* ``mnist_batched``: ``MapDataset.source({"image", "label"}).seed(0).shuffle()
  .map(normalise, batched=True).batch(128)``: each batch is one gather per array and one
  normalise. Baseline: the vectorised NumPy limit (one permutation, a fancy-index gather per
  batch, one normalise per batch); target >= 0.5x of it.
* ``mnist_per_element``: the same with a per-element ``map(normalise)``. Baselines: a plain
  Python loop over the same arrays (index, normalise each element, stack each batch; target
  >= 1x) and the same pipeline with ``ReadOptions(num_threads=0)`` (the default must not be
  slower).
* ``mnist_batched_2_workers`` / ``mnist_per_element_2_workers``: the same pipelines through
  ``mp_prefetch`` with 2 worker processes, one epoch per pass (workers started by the pass,
  from the server that stays up; the workers compute every result, the default); baselines:
  0 workers, and 2 workers with the opt-in ``py_mp_prefetch_in_process="auto"`` (results
  computed in this process while workers would not deliver them faster).
* ``range_default_read_options``: ``range(1M).shuffle().map(add one).batch(256)``, whose
  per-element work holds the GIL: the default ``ReadOptions`` against ``num_threads=0``.

tf.data (``tensorflow``) is an optional peer, skipped where it is not importable.
All passes are timed in alternation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from _harness import with_config, workload

import grain_core as grain

RECORDS = 60_000
BATCH = 128
SEED = 0
RANGE = 1_000_000
RANGE_BATCH = 256


@functools.cache
def _arrays() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    images = rng.integers(0, 256, (RECORDS, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, RECORDS).astype(np.int64)
    return images, labels


def _normalise(element: dict[str, Any]) -> dict[str, Any]:
    return {"image": element["image"].astype(np.float32) / 255.0, "label": element["label"]}


def _drain(ds: Any, expected: int) -> Callable[[], None]:
    def run() -> None:
        count = 0
        with iter(ds) as it:
            for batch in it:
                count += len(batch["label"])
        if count != expected:
            raise AssertionError(f"{count} elements, expected {expected}")

    return run


def _source() -> grain.MapDataset[Any]:
    images, labels = _arrays()
    return grain.MapDataset.source({"image": images, "label": labels}).seed(SEED).shuffle()


@workload(
    "mnist_batched",
    elements=RECORDS,
    description="60k x 28x28 uint8 in memory: shuffle, batched normalise, batch 128",
    alternate=True,
)
def mnist_batched() -> Callable[[], None]:
    ds = _source().map(_normalise, batched=True).batch(BATCH)
    return _drain(ds.to_iter_dataset(), RECORDS)


@mnist_batched.baseline("vectorised numpy limit")
def _numpy_limit() -> Callable[[], None]:
    images, labels = _arrays()

    def run() -> None:
        order = np.random.default_rng(SEED).permutation(RECORDS)
        count = 0
        for start in range(0, RECORDS, BATCH):
            index = order[start : start + BATCH]
            batch = {"image": images[index].astype(np.float32) / 255.0, "label": labels[index]}
            count += len(batch["label"])
        if count != RECORDS:
            raise AssertionError(count)

    return run


@workload(
    "mnist_per_element",
    elements=RECORDS,
    description="60k x 28x28 uint8 in memory: shuffle, per-element normalise, batch 128",
    alternate=True,
)
def mnist_per_element() -> Callable[[], None]:
    return _drain(_source().map(_normalise).batch(BATCH).to_iter_dataset(), RECORDS)


@mnist_per_element.baseline("plain Python loop")
def _plain_loop() -> Callable[[], None]:
    images, labels = _arrays()

    def run() -> None:
        order = np.random.default_rng(SEED).permutation(RECORDS).tolist()
        count = 0
        for start in range(0, RECORDS, BATCH):
            elements = [
                _normalise({"image": images[i], "label": labels[i]})
                for i in order[start : start + BATCH]
            ]
            batch = {key: np.stack([e[key] for e in elements]) for key in ("image", "label")}
            count += len(batch["label"])
        if count != RECORDS:
            raise AssertionError(count)

    return run


@mnist_per_element.baseline("grain_core ReadOptions(num_threads=0)")
def _per_element_inline() -> Callable[[], None]:
    ds = _source().map(_normalise).batch(BATCH)
    return _drain(ds.to_iter_dataset(grain.ReadOptions(num_threads=0)), RECORDS)


def _with_workers(batched: bool, workers: int) -> Callable[[], None]:
    ds = _source().map(_normalise, batched=batched).batch(BATCH).to_iter_dataset()
    if workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return _drain(ds, RECORDS)


def _in_process_auto(batched: bool) -> Callable[[], object]:
    return with_config("py_mp_prefetch_in_process", "auto", _with_workers(batched, 2))


for _batched, _name in ((True, "mnist_batched"), (False, "mnist_per_element")):
    _bench = workload(
        f"{_name}_2_workers",
        elements=RECORDS,
        description=f"{_name}, mp_prefetch 2 workers, one epoch per pass",
        alternate=True,
    )(functools.partial(_with_workers, _batched, 2))
    _bench.baseline("0 workers")(functools.partial(_with_workers, _batched, 0))
    _bench.baseline("2 workers, py_mp_prefetch_in_process=auto")(
        functools.partial(_in_process_auto, _batched)
    )


def _tf_pipeline(batch_then_map: bool) -> Callable[[], None]:
    import tensorflow as tf  # optional peer

    images, labels = _arrays()
    ds = tf.data.Dataset.from_tensor_slices({"image": images, "label": labels})
    ds = ds.shuffle(RECORDS, seed=SEED, reshuffle_each_iteration=False)

    def normalise(e: Any) -> Any:
        return {"image": tf.cast(e["image"], tf.float32) / 255.0, "label": e["label"]}

    if batch_then_map:
        ds = ds.batch(BATCH).map(normalise)
    else:
        ds = ds.map(normalise).batch(BATCH)

    def run() -> None:
        count = sum(int(b["label"].shape[0]) for b in ds.as_numpy_iterator())
        if count != RECORDS:
            raise AssertionError(count)

    return run


mnist_batched.baseline("tf.data batch then map", requires="tensorflow")(
    functools.partial(_tf_pipeline, True)
)
mnist_per_element.baseline("tf.data map then batch", requires="tensorflow")(
    functools.partial(_tf_pipeline, False)
)


def _add_one(x: int) -> int:
    return x + 1


def _range_pipeline(read_options: grain.ReadOptions | None) -> Callable[[], None]:
    ds = grain.MapDataset.range(RANGE).seed(SEED).shuffle().map(_add_one).batch(RANGE_BATCH)
    iter_ds = ds.to_iter_dataset(read_options)

    def run() -> None:
        count = 0
        with iter(iter_ds) as it:
            for batch in it:
                count += len(batch)
        if count != RANGE:
            raise AssertionError(count)

    return run


@workload(
    "range_default_read_options",
    elements=RANGE,
    description="range(1M).shuffle().map(add one).batch(256), default ReadOptions",
    alternate=True,
)
def range_default_read_options() -> Callable[[], None]:
    return _range_pipeline(None)


range_default_read_options.baseline("ReadOptions(num_threads=0)")(
    functools.partial(_range_pipeline, grain.ReadOptions(num_threads=0))
)

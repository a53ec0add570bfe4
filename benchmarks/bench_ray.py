"""Ray actors as workers (grainpipe-ray) against local worker processes, in the same run, on a
Ray instance this module starts (2 CPUs, 100 MB object store, no dashboard; shut down at exit).

* ``ray_cpu_heavy``: ``mp_cpu_heavy``'s pipeline (about 1 ms of NumPy per element, batch 64)
  with 2 Ray actors; baselines: 2 local workers, 0 workers. Steady state (one long-lived
  iterator per implementation; actor start-up is ``ray_first_batch``'s). The overhead per
  batch is ``(1 / ray - 1 / local) * 64`` seconds.
* ``ray_small_batches``: batches of 8 cheap ints through 2 Ray actors, steady state: the
  per-batch cost of the backend (a task, ``ray.wait``, ``ray.get``, filing by position);
  baselines: 2 local workers, 0 workers. µs per batch = 8e6 / elements/s.
* ``ray_first_batch``: seconds from ``iter()`` to the first batch with 2 actors, the Ray
  instance already running (each pass starts and kills its actors); baseline: 2 local workers
  (each pass starts their processes). elements/s = 1 / seconds.

Figures and what they mean: docs/ray.md.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from typing import Any

import cloudpickle
import grain_ray  # noqa: F401 - without the plugin this module is skipped
import numpy as np
import ray
from _harness import steady_pass, workload

# The pipelines' functions travel by value: Ray's worker processes cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

HEAVY_BATCH = 64
HEAVY_PASS = 64 * 40  # elements per timed pass: 40 batches
SMALL_BATCH = 8
SMALL_PASS = 8 * 500  # elements per timed pass: 500 batches


def _ray() -> None:
    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            object_store_memory=100 * 1024 * 1024,
            include_dashboard=False,
            log_to_driver=False,
        )
        atexit.register(ray.shutdown)


def heavy(x: int) -> np.ndarray:
    """About 1 ms of NumPy work on small arrays (``bench_mp.heavy``)."""
    a = np.full(64, float(x))
    for _ in range(150):
        a = np.sin(a) * 0.5 + 1.0
    return a


def cheap(x: int) -> int:
    return x + 1


def _pipeline(fn: Callable[[int], Any], batch: int, workers: int, backend: str) -> Any:
    import grain_core as grain

    ds = grain.MapDataset.range(10**8).map(fn).batch(batch).to_iter_dataset()
    if workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, backend=backend))
    return ds


def _steady(
    fn: Callable[[int], Any], batch: int, elements: int, backend: str, workers: int = 2
) -> Callable[[], None]:
    if backend == "ray":
        _ray()
    ds = _pipeline(fn, batch, workers, backend)
    return steady_pass(lambda: iter(ds), elements // batch)


@workload(
    "ray_cpu_heavy",
    elements=HEAVY_PASS,
    description="1 ms NumPy map, batch 64, mp_prefetch on 2 Ray actors, steady state",
)
def ray_cpu_heavy() -> Callable[[], None]:
    return _steady(heavy, HEAVY_BATCH, HEAVY_PASS, "ray")


@ray_cpu_heavy.baseline("grain_core 2 local workers")
def _() -> Callable[[], None]:
    return _steady(heavy, HEAVY_BATCH, HEAVY_PASS, "local")


@ray_cpu_heavy.baseline("grain_core 0 workers")
def _() -> Callable[[], None]:
    return _steady(heavy, HEAVY_BATCH, HEAVY_PASS, "local", workers=0)


@workload(
    "ray_small_batches",
    elements=SMALL_PASS,
    description="batches of 8 ints on 2 Ray actors, steady state (us/batch = 8e6 / elements/s)",
)
def ray_small_batches() -> Callable[[], None]:
    return _steady(cheap, SMALL_BATCH, SMALL_PASS, "ray")


@ray_small_batches.baseline("grain_core 2 local workers")
def _() -> Callable[[], None]:
    return _steady(cheap, SMALL_BATCH, SMALL_PASS, "local")


@ray_small_batches.baseline("grain_core 0 workers")
def _() -> Callable[[], None]:
    return _steady(cheap, SMALL_BATCH, SMALL_PASS, "local", workers=0)


def _first_batch(backend: str) -> Callable[[], None]:
    ds = _pipeline(cheap, SMALL_BATCH, 2, backend)

    def run() -> None:
        it = iter(ds)
        next(it)
        it.close()

    return run


@workload(
    "ray_first_batch",
    elements=1,
    description="iter() to first batch on 2 Ray actors, Ray running (1/s = seconds)",
    alternate=True,
)
def ray_first_batch() -> Callable[[], None]:
    _ray()
    return _first_batch("ray")


@ray_first_batch.baseline("grain_core 2 local workers")
def _() -> Callable[[], None]:
    return _first_batch("local")

"""Whole epochs with 2 worker processes (issue 35), each pass in a new Python process as a
user's training script meets them; the child times itself, so interpreter start-up and
building the data are left out (the pipeline or pool is set up ``SETUP_S`` before, as a
script builds its model meanwhile).

* ``first_epoch_cpu_heavy_2_workers``: ``HEAVY_ELEMENTS`` elements of about 1 ms of
  GIL-bound NumPy each, batches of 64, the first epoch from ``iter()`` (workers start in it).
  Baselines: grain_core with 0 workers, ``multiprocessing.Pool(2)`` (the platform's default
  start method; created in the timed span) mapping the same batches, torch's ``DataLoader``
  with 2 forked workers.
* ``first_epoch_mnist_per_element_2_workers``: 60,000 28x28 uint8 images in memory (47 MB),
  seeded shuffle, per-element normalise to float32, batches of 128 (the cheap per-element
  pipeline); the same baselines (``Pool(2)``: each task reads and normalises one batch's
  elements and stacks them).
* ``second_epoch_cpu_heavy_2_workers``: the second epoch of the heavy pipeline with
  ``persistent_workers=True`` (the workers of the first serve it: steady state with no
  start-up); baselines: grain_core's second epoch without it (new workers), the second
  ``imap`` over the same ``Pool(2)``, torch with ``persistent_workers=True``.
* ``second_epoch_worker_setup_2_workers``: the same with workers that have real set-up
  work: the map's transformation builds a 4M-entry table when a worker unpickles it (about
  0.3 s of CPU, as loading a vocabulary or a model does). What ``persistent_workers`` saves
  is that set-up (and the start of the processes) once per epoch; baselines: grain_core's
  second epoch with new workers, a ``Pool(2)`` whose initializer builds the table once,
  second ``imap``. (The plain heavy pipeline above has almost no set-up to save: its new
  workers start in tens of milliseconds.)
* ``import_and_first_pipeline``: ``import grain_core`` and the first batch of a small
  in-process pipeline, in a new process; baseline: ``import numpy`` alone.

torch runs where ``GRAIN_BENCH_TORCH_PYTHON`` names a Python with torch (its own virtualenv:
``nox -s bench-torch``); elsewhere that baseline is skipped. elements/s = elements / seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from _harness import ReportedSeconds, workload
from bench_first_batch import (
    COMMON,
    GRAIN_CORE,
    SETUP_S,
    TORCH,
    child_args,
    child_pass,
    torch_python,
)

HEAVY_ELEMENTS = 6_000
MNIST_RECORDS = 60_000

_POOL = (
    COMMON
    + """
import multiprocessing

order = np.random.default_rng(0).permutation(len(labels))

def mnist_batch(start):
    elements = [normalise({"image": images[i], "label": labels[i]}) for i in order[start:start + 128]]
    return {
        "image": np.stack([e["image"] for e in elements]),
        "label": np.stack([e["label"] for e in elements]),
    }

def heavy_batch(start):
    return np.stack([heavy(x) for x in range(start, min(start + 64, heavy_elements))])

def build_table():
    global table
    table = lookup_table()

if workload == "mnist":
    task, starts = mnist_batch, range(0, len(labels), 128)
else:
    task, starts = heavy_batch, range(0, heavy_elements, 64)
time.sleep(setup_s)
start = time.perf_counter()
pool = multiprocessing.Pool(workers, build_table if workload == "setup" else None)
for epoch in range(epochs):
    if epoch:
        start = time.perf_counter()
    count = sum(len(b["label"] if workload == "mnist" else b) for b in pool.imap(task, starts))
    seconds = time.perf_counter() - start
    check(count)
print(seconds)
pool.terminate()
"""
)


def _pass(
    script: str, name: str, workers: int, epochs: int, persistent: bool
) -> Callable[[], ReportedSeconds]:
    args = child_args(name, SETUP_S, HEAVY_ELEMENTS, workers, epochs, persistent)
    return child_pass(None, script, *args)


def _torch(name: str, epochs: int, persistent: bool) -> Callable[[], ReportedSeconds]:
    args = child_args(name, SETUP_S, HEAVY_ELEMENTS, 2, epochs, persistent)
    return child_pass(torch_python(), TORCH, *args)


for _name, _label, _elements, _description in (
    ("heavy", "first_epoch_cpu_heavy_2_workers", HEAVY_ELEMENTS, "~1 ms NumPy map, batch 64"),
    (
        "mnist",
        "first_epoch_mnist_per_element_2_workers",
        MNIST_RECORDS,
        "60k 28x28 uint8, per-element normalise, batch 128",
    ),
):
    _bench = workload(
        _label,
        elements=_elements,
        description=f"first epoch from iter(), 2 workers, new process: {_description}",
        alternate=True,
    )(functools.partial(_pass, GRAIN_CORE, _name, 2, 1, False))
    _bench.baseline("grain_core 0 workers")(
        functools.partial(_pass, GRAIN_CORE, _name, 0, 1, False)
    )
    _bench.baseline("multiprocessing.Pool(2)")(functools.partial(_pass, _POOL, _name, 2, 1, False))
    _bench.baseline("torch DataLoader, 2 forked workers")(
        functools.partial(_torch, _name, 1, False)
    )

second_epoch_cpu_heavy_2_workers = workload(
    "second_epoch_cpu_heavy_2_workers",
    elements=HEAVY_ELEMENTS,
    description="second epoch, persistent_workers=True, new process: ~1 ms NumPy map",
    alternate=True,
)(functools.partial(_pass, GRAIN_CORE, "heavy", 2, 2, True))
second_epoch_cpu_heavy_2_workers.baseline("grain_core, new workers each epoch")(
    functools.partial(_pass, GRAIN_CORE, "heavy", 2, 2, False)
)
second_epoch_cpu_heavy_2_workers.baseline("multiprocessing.Pool(2), second imap")(
    functools.partial(_pass, _POOL, "heavy", 2, 2, False)
)
second_epoch_cpu_heavy_2_workers.baseline("torch DataLoader, persistent_workers=True")(
    functools.partial(_torch, "heavy", 2, True)
)

second_epoch_worker_setup_2_workers = workload(
    "second_epoch_worker_setup_2_workers",
    elements=HEAVY_ELEMENTS,
    description="second epoch, persistent_workers=True, new process: ~1 ms NumPy map by a "
    "transformation whose workers spend ~0.3 s building a table when they unpickle it",
    alternate=True,
)(functools.partial(_pass, GRAIN_CORE, "setup", 2, 2, True))
second_epoch_worker_setup_2_workers.baseline("grain_core, new workers each epoch")(
    functools.partial(_pass, GRAIN_CORE, "setup", 2, 2, False)
)
second_epoch_worker_setup_2_workers.baseline("multiprocessing.Pool(2) set up once, second imap")(
    functools.partial(_pass, _POOL, "setup", 2, 2, False)
)

_IMPORT = """
import sys, time
start = time.perf_counter()
if sys.argv[1] == "numpy":
    import numpy
else:
    import grain_core as grain
    ds = grain.MapDataset.range(1_000).map(lambda x: x + 1).batch(10).to_iter_dataset()
    next(iter(ds))
print(time.perf_counter() - start)
"""


def _import_pass(what: str) -> Callable[[], ReportedSeconds]:
    return child_pass(None, _IMPORT, what)


import_and_first_pipeline = workload(
    "import_and_first_pipeline",
    elements=1,
    description="import grain_core + first batch of a small pipeline, new process",
    alternate=True,
)(functools.partial(_import_pass, "grain_core"))
import_and_first_pipeline.baseline("import numpy alone")(functools.partial(_import_pass, "numpy"))

"""First batch with 2 worker processes (issue 29): the seconds from ``iter()`` to the first
batch, each pass in a new Python process (measured in the child, so interpreter start-up and
building the data are left out), against PyTorch's ``DataLoader`` with 2 forked workers.

* ``first_batch_mnist_2_workers``: 60,000 28x28 uint8 images and int64 labels in memory
  (47 MB), seeded global shuffle, per-element normalise to float32, batches of 128.
* ``first_batch_cpu_heavy_2_workers``: 20,000 elements of about 1 ms of GIL-bound NumPy work
  each, batches of 64.

grain_core's pipeline is built ``SETUP_S`` before ``iter()``, as a training script builds its
model meanwhile (its worker server starts when the pipeline is built); the baseline "iter()
right after building" has no such gap. torch runs where ``GRAIN_BENCH_TORCH_PYTHON`` names a
Python with torch installed (a virtualenv of its own: torch is never a dependency here);
elsewhere that baseline is skipped. elements/s = 1 / seconds.

grain_core's workers compute every result by default, so its first batch comes from them;
``GRAIN_PY_MP_PREFETCH_IN_PROCESS=auto`` in the environment (the children inherit it)
measures the opt-in mode, whose first results are computed in the parent process while it
decides whether the workers pay off (docs/workers.md).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable

from _harness import ReportedSeconds, Unavailable, workload

SETUP_S = 1.0
HEAVY_FIRST_BATCH_ELEMENTS = 20_000

# The children's shared part. Arguments: workload ("mnist", "heavy" or "setup": heavy with a
# worker set-up of about 0.3 s), seconds of set-up
# before iter(), heavy elements, workers, epochs (0: time iter() to the first batch only),
# persistent workers ("1" or "0").
COMMON = """
import sys, time
import numpy as np

def normalise(element):
    return {"image": element["image"].astype(np.float32) / 255.0, "label": element["label"]}

def heavy(x):
    a = np.full(64, float(x))
    for _ in range(150):
        a = np.sin(a) * 0.5 + 1.0
    return a

def lookup_table():
    # About 0.3 s of CPU: what a worker's set-up costs when it loads a vocabulary or a model.
    return np.sort(np.random.default_rng(0).random(4_000_000))

class HeavyWithTable:
    # heavy(x), by a transformation that builds its table where it is unpickled (a worker).
    def __getstate__(self):
        return {}
    def __setstate__(self, state):
        self.table = lookup_table()
    def __call__(self, x):
        return heavy(x)

workload, setup_s, heavy_elements = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
workers, epochs, persistent = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
rng = np.random.default_rng(0)
images = rng.integers(0, 256, (60_000, 28, 28), dtype=np.uint8)
labels = rng.integers(0, 10, 60_000).astype(np.int64)

def check(count):
    expected = len(labels) if workload == "mnist" else heavy_elements
    if count != expected:
        raise AssertionError(f"{count} elements, expected {expected}")

# After the set-up time, times iter() to the first batch (epochs == 0: returns that iterator),
# or each epoch; prints the seconds of the last.
def print_seconds(loader):
    time.sleep(setup_s)
    if not epochs:
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        print(time.perf_counter() - start)
        return it
    for _ in range(epochs):
        start = time.perf_counter()
        count = sum(len(b["label"] if workload == "mnist" else b) for b in loader)
        seconds = time.perf_counter() - start
        check(count)
    print(seconds)
    return None
"""

GRAIN_CORE = (
    COMMON
    + """
import grain_core as grain
if workload == "mnist":
    ds = grain.MapDataset.source({"image": images, "label": labels}).seed(0).shuffle()
    ds = ds.map(normalise).batch(128)
elif workload == "setup":
    ds = grain.MapDataset.range(heavy_elements).map(HeavyWithTable()).batch(64)
else:
    ds = grain.MapDataset.range(heavy_elements).map(heavy).batch(64)
ds = ds.to_iter_dataset()
if workers:
    options = grain.MultiprocessingOptions(num_workers=workers, persistent_workers=persistent)
    ds = ds.mp_prefetch(options)
it = print_seconds(ds)
if it is not None:
    it.close()
"""
)

TORCH = (
    COMMON
    + """
import torch
from torch.utils.data import DataLoader, Dataset

class Mnist(Dataset):
    def __len__(self):
        return len(labels)
    def __getitem__(self, i):
        return normalise({"image": images[i], "label": labels[i]})

class Heavy(Dataset):
    def __len__(self):
        return heavy_elements
    def __getitem__(self, i):
        return heavy(i)

generator = torch.Generator().manual_seed(0)
if workload == "mnist":
    loader = DataLoader(Mnist(), batch_size=128, shuffle=True, generator=generator,
                        num_workers=workers, multiprocessing_context="fork",
                        persistent_workers=persistent)
else:
    loader = DataLoader(Heavy(), batch_size=64, num_workers=workers,
                        multiprocessing_context="fork", persistent_workers=persistent)
it = print_seconds(loader)
del it
"""
)


def child_args(
    workload: str, setup_s: float, heavy_elements: int, workers: int, epochs: int, persistent: bool
) -> tuple[str, ...]:
    """The command-line arguments of a child script (see ``COMMON``)."""
    return (
        workload,
        str(setup_s),
        str(heavy_elements),
        str(workers),
        str(epochs),
        "1" if persistent else "0",
    )


def child_pass(python: str | None, script: str, *args: str) -> Callable[[], ReportedSeconds]:
    """A pass that runs ``script`` with ``args`` in a new process of ``python`` (None: this
    one's) and takes the seconds it prints last."""

    def run() -> ReportedSeconds:
        out = subprocess.run(
            [python or sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            check=True,
        )
        return ReportedSeconds(float(out.stdout.split()[-1]))

    return run


def torch_python() -> str:
    """The Python with torch installed (``GRAIN_BENCH_TORCH_PYTHON``).

    Raises:
      Unavailable: Where none is named.
    """
    python = os.environ.get("GRAIN_BENCH_TORCH_PYTHON")
    if not python:
        raise Unavailable("GRAIN_BENCH_TORCH_PYTHON (a Python with torch) is not set")
    return python


def _first_batch(python: str | None, name: str, setup_s: float) -> Callable[[], ReportedSeconds]:
    script = GRAIN_CORE if python is None else TORCH
    return child_pass(
        python, script, *child_args(name, setup_s, HEAVY_FIRST_BATCH_ELEMENTS, 2, 0, False)
    )


def _torch(name: str) -> Callable[[], ReportedSeconds]:
    return _first_batch(torch_python(), name, SETUP_S)


for _name, _label, _description in (
    ("mnist", "first_batch_mnist_2_workers", "60k x 28x28 uint8 in memory, per-element map"),
    ("heavy", "first_batch_cpu_heavy_2_workers", "~1 ms of NumPy per element, batch 64"),
):
    _bench = workload(
        _label,
        elements=1,
        description=f"iter() to first batch, 2 workers, new process: {_description}",
        alternate=True,
    )(functools.partial(_first_batch, None, _name, SETUP_S))
    _bench.baseline("torch DataLoader, 2 forked workers")(functools.partial(_torch, _name))
    _bench.baseline("grain_core, iter() right after building")(
        functools.partial(_first_batch, None, _name, 0.0)
    )

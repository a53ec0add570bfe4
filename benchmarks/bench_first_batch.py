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

workload, setup_s = sys.argv[1], float(sys.argv[2])
rng = np.random.default_rng(0)
images = rng.integers(0, 256, (60_000, 28, 28), dtype=np.uint8)
labels = rng.integers(0, 10, 60_000).astype(np.int64)
"""

_GRAIN_CORE = (
    COMMON
    + """
import grain_core as grain
if workload == "mnist":
    ds = grain.MapDataset.source({"image": images, "label": labels}).seed(0).shuffle()
    ds = ds.map(normalise).batch(128)
else:
    ds = grain.MapDataset.range(20_000).map(heavy).batch(64)
ds = ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
time.sleep(setup_s)
start = time.perf_counter()
it = iter(ds)
batch = next(it)
print(time.perf_counter() - start)
it.close()
"""
)

_TORCH = (
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
        return 20_000
    def __getitem__(self, i):
        return heavy(i)

generator = torch.Generator().manual_seed(0)
if workload == "mnist":
    loader = DataLoader(Mnist(), batch_size=128, shuffle=True, generator=generator,
                        num_workers=2, multiprocessing_context="fork")
else:
    loader = DataLoader(Heavy(), batch_size=64, num_workers=2, multiprocessing_context="fork")
time.sleep(setup_s)
start = time.perf_counter()
it = iter(loader)
batch = next(it)
print(time.perf_counter() - start)
del it
"""
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


def _torch(name: str) -> Callable[[], ReportedSeconds]:
    return child_pass(torch_python(), _TORCH, name, str(SETUP_S))


for _name, _label, _description in (
    ("mnist", "first_batch_mnist_2_workers", "60k x 28x28 uint8 in memory, per-element map"),
    ("heavy", "first_batch_cpu_heavy_2_workers", "~1 ms of NumPy per element, batch 64"),
):
    _bench = workload(
        _label,
        elements=1,
        description=f"iter() to first batch, 2 workers, new process: {_description}",
        alternate=True,
    )(functools.partial(child_pass, None, _GRAIN_CORE, _name, str(SETUP_S)))
    _bench.baseline("torch DataLoader, 2 forked workers")(functools.partial(_torch, _name))
    _bench.baseline("grain_core, iter() right after building")(
        functools.partial(child_pass, None, _GRAIN_CORE, _name, "0.0")
    )

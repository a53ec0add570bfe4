"""What the default ``ReadOptions`` costs where the work decides (issues 23 and 29).

* ``io_bound_10x1s``: 10 elements that each wait 1 s on I/O (``time.sleep``), read by
  ``to_iter_dataset()`` with the default options, against the ideal: the 10 waits overlapped
  on ``ReadOptions().num_threads`` threads (target: within 1.1x of it, a ratio >= 0.91).
* ``first_batch_fresh_process``: in a new Python process, the time from ``iter()`` to the
  first batch of ``range(1M).shuffle().map(add one).batch(256)`` (measured in the child, so
  interpreter start-up is left out), default options against ``num_threads=0``; one batch
  per pass.
"""

from __future__ import annotations

import concurrent.futures
import functools
import subprocess
import sys
import time
from collections.abc import Callable

from _harness import ReportedSeconds, workload

import grain_core as grain

IO_ELEMENTS = 10
IO_WAIT_S = 1.0


def _wait_on_io(x: int) -> int:
    time.sleep(IO_WAIT_S)
    return x


@workload(
    "io_bound_10x1s",
    elements=IO_ELEMENTS,
    description="10 elements of 1 s I/O wait each, default ReadOptions",
    alternate=True,
)
def io_bound_10x1s() -> Callable[[], None]:
    ds = grain.MapDataset.range(IO_ELEMENTS).map(_wait_on_io)

    def run() -> None:
        with iter(ds.to_iter_dataset()) as it:
            if list(it) != list(range(IO_ELEMENTS)):
                raise AssertionError("wrong elements")

    return run


@io_bound_10x1s.baseline("ideal: the waits overlapped on num_threads threads")
def _ideal() -> Callable[[], None]:
    def run() -> None:
        threads = grain.ReadOptions().num_threads
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            if list(pool.map(_wait_on_io, range(IO_ELEMENTS))) != list(range(IO_ELEMENTS)):
                raise AssertionError("wrong elements")

    return run


_FIRST_BATCH = """
import sys, time
import grain_core as grain
options = grain.ReadOptions(num_threads=0) if sys.argv[1] == "inline" else None
ds = grain.MapDataset.range(1_000_000).seed(0).shuffle().map(lambda x: x + 1).batch(256)
iter_ds = ds.to_iter_dataset(options)
start = time.perf_counter()
it = iter(iter_ds)
batch = next(it)
print(time.perf_counter() - start)
assert len(batch) == 256
"""


def _first_batch(mode: str) -> Callable[[], ReportedSeconds]:
    def run() -> ReportedSeconds:
        out = subprocess.run(
            [sys.executable, "-c", _FIRST_BATCH, mode], capture_output=True, text=True, check=True
        )
        return ReportedSeconds(float(out.stdout))

    return run


first_batch_fresh_process = workload(
    "first_batch_fresh_process",
    elements=1,
    description="iter() to first batch in a new process, range(1M).shuffle.map.batch(256)",
    alternate=True,
)(functools.partial(_first_batch, "default"))
first_batch_fresh_process.baseline("ReadOptions(num_threads=0)")(
    functools.partial(_first_batch, "inline")
)

"""Workload registry and timing for ``benchmarks/run.py``.

A workload is a named *setup* function returning a zero-argument callable that does one
full pass of the work; setup (building data, datasets) is not timed. Baselines doing the
same work are attached to the workload and timed in the same run, so ratios compare like
with like on the same machine at the same moment.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "GRAIN_CORE",
    "WORKLOADS",
    "Measurement",
    "ReportedSeconds",
    "Skipped",
    "Unavailable",
    "Workload",
    "import_google_grain",
    "measure",
    "measure_all",
    "steady_pass",
    "with_config",
    "workload",
]

GRAIN_CORE = "grain_core"

Setup = Callable[[], Callable[[], object]]


@dataclasses.dataclass
class Workload:
    """One benchmark: grain_core's implementation plus baselines doing the same work.

    Attributes:
      name: Unique name, used by ``--only``.
      elements: Elements processed by one pass (for elements/s).
      description: One line for the table.
      implementations: Label -> (setup, module the setup needs or None); grain_core first.
      alternate: Time the implementations' passes in alternation (see :func:`measure_all`).
    """

    name: str
    elements: int
    description: str
    implementations: dict[str, tuple[Setup, str | None]] = dataclasses.field(default_factory=dict)
    alternate: bool = False

    def baseline(self, label: str, *, requires: str | None = None) -> Callable[[Setup], Setup]:
        """Decorator adding a baseline; ``requires`` names a module it needs (else skipped)."""

        def add(setup: Setup) -> Setup:
            if label in self.implementations:
                raise ValueError(f"Workload {self.name!r} already has {label!r}.")
            self.implementations[label] = (setup, requires)
            return setup

        return add


WORKLOADS: dict[str, Workload] = {}


def workload(
    name: str, *, elements: int, description: str, alternate: bool = False
) -> Callable[[Setup], Workload]:
    """Decorator registering ``setup`` as grain_core's implementation of a new workload.

    Args:
      alternate: Time passes of all implementations in alternation instead of one
        implementation after the other. Only for workloads whose passes leave nothing running
        between them (each pass opens and closes its own iterator, or a pool of processes
        waits idle): a steady-state iterator's prefetch threads would keep working while
        another implementation is timed.
    """

    def register(setup: Setup) -> Workload:
        if name in WORKLOADS:
            raise ValueError(f"Workload {name!r} is registered twice.")
        bench = Workload(name, elements, description, {GRAIN_CORE: (setup, None)}, alternate)
        WORKLOADS[name] = bench
        return bench

    return register


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Timings of one implementation of one workload."""

    workload: str
    implementation: str
    elements: int
    seconds: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def elements_per_s(self) -> float:
        return self.elements / self.median_s


class Unavailable(Exception):
    """Raised by a setup whose implementation cannot run here (the message says why); the
    implementation is reported as skipped."""


@dataclasses.dataclass(frozen=True)
class Skipped:
    """An implementation that could not run here, and why."""

    workload: str
    implementation: str
    reason: str


def measure(bench: Workload, label: str, repeats: int) -> Measurement | Skipped:
    """Times ``repeats`` passes of one implementation after one untimed warm-up pass."""
    setup, requires = bench.implementations[label]
    if requires is not None and importlib.util.find_spec(requires) is None:
        return Skipped(bench.name, label, f"{requires} is not installed")
    try:
        run = setup()
    except Unavailable as e:
        return Skipped(bench.name, label, str(e))
    try:
        run()  # Warm-up: lazy tables, thread pools, imports.
        seconds = [_timed(run) for _ in range(repeats)]
    finally:
        _close(run)
    return Measurement(bench.name, label, bench.elements, tuple(seconds))


def measure_all(bench: Workload, repeats: int) -> list[Measurement | Skipped]:
    """Times every implementation of ``bench``.

    With ``bench.alternate`` all are set up and warmed first, then round ``r`` times one pass
    of each, in reverse order on odd rounds: a drift of the machine over the run (frequency,
    memory, other load) then falls on every implementation alike instead of on whichever ran
    last, which matters when the difference measured is a few percent.
    """
    if not bench.alternate:
        return [measure(bench, label, repeats) for label in bench.implementations]
    results: dict[str, Measurement | Skipped] = {}
    runs: dict[str, Callable[[], object]] = {}
    try:
        for label, (setup, requires) in bench.implementations.items():
            if requires is not None and importlib.util.find_spec(requires) is None:
                results[label] = Skipped(bench.name, label, f"{requires} is not installed")
                continue
            try:
                runs[label] = setup()
            except Unavailable as e:
                results[label] = Skipped(bench.name, label, str(e))
                continue
            runs[label]()  # Warm-up.
        seconds: dict[str, list[float]] = {label: [] for label in runs}
        for round_ in range(repeats):
            order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for label in order:
                seconds[label].append(_timed(runs[label]))
    finally:
        for run in runs.values():
            _close(run)
    for label, times in seconds.items():
        results[label] = Measurement(bench.name, label, bench.elements, tuple(times))
    return [results[label] for label in bench.implementations]


class ReportedSeconds(float):
    """What a pass returns when it measured its own time (e.g. inside a child process, leaving
    out the interpreter's start-up); the harness takes it instead of the pass's wall time."""


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    reported = run()
    elapsed = time.perf_counter() - start
    return float(reported) if isinstance(reported, ReportedSeconds) else elapsed


def _close(run: Callable[[], object]) -> None:
    """Calls ``run.close()`` where a setup gave its pass one (passes over a long-lived
    iterator: read threads, worker processes), so nothing an implementation started keeps
    running while the next one is timed; collects the rest."""
    close = getattr(run, "close", None)
    if close is not None:
        close()
    gc.collect()


class _SteadyPass:
    def __init__(self, make_iterator: Callable[[], Iterator[Any]], count: int) -> None:
        self._make_iterator = make_iterator
        self._count = count
        self._iterator = make_iterator()

    def __call__(self) -> None:
        for _ in range(self._count):
            try:
                next(self._iterator)
            except StopIteration:
                self.close()
                self._iterator = self._make_iterator()
                next(self._iterator)

    def close(self) -> None:
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()


def steady_pass(make_iterator: Callable[[], Iterator[Any]], count: int) -> Callable[[], None]:
    """A timed pass that takes the next ``count`` elements of one long-lived iterator.

    Measures steady state (no iterator start-up per pass); a new iterator is made when the
    current one runs out. The harness closes the iterator when the implementation is done.
    """
    return _SteadyPass(make_iterator, count)


def with_config(name: str, value: Any, run: Callable[[], object]) -> Callable[[], object]:
    """``run`` as a pass with grain_core's ``config`` option ``name`` set to ``value`` (the
    previous value restored after each pass), keeping its ``close``."""
    import grain_core  # import cost: only workloads that compare settings need it

    def timed() -> object:
        previous = getattr(grain_core.config, name)
        grain_core.config.update(name, value)
        try:
            return run()
        finally:
            grain_core.config.update(name, previous)

    close = getattr(run, "close", None)
    if close is not None:
        timed.close = close  # type: ignore[attr-defined]
    return timed


def import_google_grain() -> object:
    """Imports Google's ``grain``, with absl flags marked parsed as its workers need."""
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    import grain

    return grain

"""Shared pytest configuration."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator

import cloudpickle
from hypothesis import HealthCheck, settings

settings.register_profile(
    "grain_core", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# CI runs the same examples every time (a property failure there is reproducible from the
# log, never a coin toss that blocks a merge); local runs keep exploring new examples.
settings.register_profile("ci", parent=settings.get_profile("grain_core"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "grain_core")

# Worker processes receive this module's helpers by value (they cannot import conftest).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LogProduced:
    """A map that appends each element it passes to a file: what a worker has produced so far
    (the pipeline reaches a worker as a copy, so a list would stay empty here)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, x: int) -> int:
        with open(self.path, "a") as f:
            f.write(f"{x}\n")
        return x


@contextlib.contextmanager
def fails_after(seconds: int) -> Iterator[None]:
    """Turns a hang (a worker and the parent each waiting for the other) into a failure."""

    def fail(*_: object) -> None:
        raise TimeoutError(
            f"no progress in {seconds} s: the worker and the parent wait on each other"
        )

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

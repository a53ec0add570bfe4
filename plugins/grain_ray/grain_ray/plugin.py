"""The entry-point module: registers the ``ray`` worker backend with grain_core."""

from __future__ import annotations

from collections.abc import Callable

from grain_core import hookimpl
from grain_core.plugins import WorkerBackend
from grain_ray._backend import RayBackend

__all__ = ["register_worker_backends"]


@hookimpl
def register_worker_backends(register: Callable[[WorkerBackend], None]) -> None:
    """Registers ``ray``: one actor per worker, one CPU each (``RayBackend()``)."""
    register(RayBackend())

"""Shared-memory arrays, multiprocessing options and the errors about worker processes
(``grain.multiprocessing``)."""

from __future__ import annotations

from grain_core._ipc.errors import WorkerDiedError, WorkerStalledError
from grain_core._ipc.shm import SharedMemoryArray, SharedMemoryArrayMetadata, SharedMemoryFullError
from grain_core.options import MultiprocessingOptions

__all__ = [
    "MultiprocessingOptions",
    "SharedMemoryArray",
    "SharedMemoryArrayMetadata",
    "SharedMemoryFullError",
    "WorkerDiedError",
    "WorkerStalledError",
]

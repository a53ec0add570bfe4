"""What moving results between processes costs: the model both the engines' in-process
decision (``dataset/mp/in_process.py``) and the profiler's advice on worker processes
(``grain_core.observe.profile``) price worker processes with, so that the two never disagree.

A result computed in a worker costs the consumer, with ``N`` workers on ``K`` cores, at best
``w = max(g + r, (c + s) / N, (u + s + r) / K)`` (``seconds_per_result_with_workers``): ``c``
wall and ``u`` CPU seconds to compute it in one process, ``g`` the consumer's own time between
two results, ``s`` a worker's sending it and ``r`` the parent's receiving it
(``transport_seconds``). Workers pay off only when they promise at most ``MARGIN`` of the
time in one process. The flow control of the worker protocol sends small results several to
a message (``overdraft_room``), so their messages' cost is shared.

The module imports no dataset or engine module: the profiler reads it without loading the
engines.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import numpy as np

from grain_core import _tree
from grain_core._ipc import shm

__all__ = [
    "MARGIN",
    "MESSAGE_S",
    "OVERDRAFT_BYTES",
    "RESULT_S",
    "SMALL_AHEAD",
    "cheapest_transport_seconds",
    "cores_to_run_on",
    "overdraft_room",
    "seconds_per_result_with_workers",
    "transport_seconds",
    "usable_cores",
]

#: Workers run only if they promise to take at most this share of the in-process time.
MARGIN = 0.8
#: Parent seconds per message received (its wake-up, the pipe read, the merge's turn) and per
#: result (the dispatcher's bookkeeping): 67 us per 400 KB batch in shared memory and 2.4 us
#: per small element (64 to a message) measured with 2 workers.
MESSAGE_S = 50e-6
RESULT_S = 2e-6
#: Pickling a result is timed this many times, the least taken: the first copy into fresh
#: memory pays page faults that a worker's recycled shared-memory blocks do not.
_TRANSPORTS_MEASURED = 3

#: The overdraft: elements a worker may send beyond its credits (``per_worker_buffer_size``
#: ahead of the consumer), at most this many and this many bytes pickled.
SMALL_AHEAD = 64
OVERDRAFT_BYTES = 1024 * 1024


def overdraft_room(element_bytes: int) -> int:
    """How many elements of ``element_bytes`` pickled bytes a worker may send beyond its
    credits (the worker and the parent decide alike)."""
    return min(SMALL_AHEAD, OVERDRAFT_BYTES // max(1, element_bytes))


def seconds_per_result_with_workers(
    c: float, g: float, u: float, s: float, r: float, workers: int, cores: float
) -> float:
    """``w`` of the module docstring: the best a result can cost the consumer when
    ``workers`` processes compute them on ``cores`` cores (``K``), from what one costs in one
    process (``c`` wall, ``u`` CPU seconds), the consumer's time between two (``g``) and its
    transport (``s`` sending, ``r`` receiving)."""
    return max(g + r, (c + s) / workers, (u + s + r) / cores)


def cores_to_run_on() -> int:
    """The CPU cores this process may run on (its affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def usable_cores() -> float:
    """The CPU cores this process may use: those it may run on, at most its control group's
    CPU quota (cgroup v2 ``cpu.max``; a quota may give a fraction of a core)."""
    cores = cores_to_run_on()
    try:
        with open("/proc/self/cgroup") as f:
            group = next(line[3:].strip() for line in f if line.startswith("0::"))
        with open(f"/sys/fs/cgroup{group.rstrip('/')}/cpu.max") as f:
            quota, period = f.read().split()
    except (OSError, StopIteration, ValueError):  # no cgroup v2 controller: no quota
        return cores
    if quota == "max":
        return cores
    return max(0.1, min(cores, int(quota) / int(period)))


def transport_seconds(result: Any) -> tuple[float, float]:
    """Seconds a worker spends sending ``result`` and the parent receiving it (``s``, ``r``),
    its copies measured by pickling it here."""
    start = time.perf_counter()
    try:
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - workers cloudpickle it: priced as one message
        return MESSAGE_S, MESSAGE_S + RESULT_S
    dumped = time.perf_counter()
    pickle.loads(data)
    loaded = time.perf_counter()
    # Arrays as large as a worker writes into shared memory go one result to a message and
    # are mapped, not copied, by the parent; smaller results go several to a message.
    in_shared_memory = any(
        isinstance(leaf, np.ndarray) and leaf.nbytes >= shm.DEFAULT_MIN_SHM_SIZE
        for leaf in _tree.flatten(result)
    )
    per_message = 1 if in_shared_memory else overdraft_room(len(data))
    s = dumped - start + MESSAGE_S / per_message
    r = RESULT_S + MESSAGE_S / per_message + (0.0 if in_shared_memory else loaded - dumped)
    return s, r


def cheapest_transport_seconds(result: Any) -> tuple[float, float]:
    """``transport_seconds(result)`` measured a few times, the least of each taken."""
    transports = [transport_seconds(result) for _ in range(_TRANSPORTS_MEASURED)]
    return min(t[0] for t in transports), min(t[1] for t in transports)

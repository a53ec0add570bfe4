"""Cheap pipelines stay in the parent: the dispatching engine (``dispatch``) can compute the
first results of an iterator in the parent process and keep doing so for the whole iterator
when worker processes would not deliver them faster.

Every result of a dispatched pipeline is a function of its position (``positions``), so
the parent can compute it as well as any worker: ``InProcessReader`` reads the positions the
consumer asks for, in its order, and the output and the checkpoints are those of the
workers (the dispatcher keeps the same per-class frontiers either way).

``WorkerPayoff`` decides from what the first results cost, measured here (``record``):

* ``c``: seconds per result computed in this process (the median after the first, which
  pays for warming caches);
* the transport of one result: the worker writes it (``s``: pickling it, which copies its
  arrays as writing them into shared memory does, plus a message's share), the parent
  receives it (``r``: a message's share, the bookkeeping of a result, and unpickling when it
  is not in shared memory);
* ``START_S``: starting and stopping the workers.

With ``N`` workers on ``C`` usable cores a result costs at best
``w = max(r, (c + s) / N, (c + s + r) / C)`` through workers: the parent receives every
result, each worker computes and sends its share, and all of it shares the cores. Workers
run when ``START_S + L * w < MARGIN * L * c`` for the ``L`` results left: ``w`` is what
perfect parallelism would give, which a machine with other work does not, so they must
promise more than break-even. Once they run, ``delivered`` watches the time the consumer
spends getting each result from them: when it is longer than computing it here took, the
workers stop and this process computes the rest.

Off by default (``config.py_mp_prefetch_in_process``: ``"never"``); ``"auto"`` decides as
above, ``"always"`` computes every result here.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import numpy as np

from grain_core import _tree
from grain_core._ipc import shm
from grain_core.dataset.base import DatasetIterator
from grain_core.dataset.mp.positions import DispatchView, read_steps
from grain_core.dataset.mp.protocol import overdraft_room
from grain_core.dataset.options import DatasetOptions
from grain_core.dataset.prefetch import PrefetchIterDataset

__all__ = ["MARGIN", "START_S", "InProcessReader", "WorkerPayoff", "usable_cores"]

#: Seconds to start the workers and stop them again (measured on a 2-core machine: 7 ms to
#: the first result of a ``range`` pipeline with 2 workers, 23 ms for an MNIST-like one whose
#: workers map a 47 MB source; 2-7 ms to stop them).
START_S = 0.025
#: Workers run only if they promise to take at most this share of the in-process time.
MARGIN = 0.8
#: Parent seconds per message received (its wake-up, the pipe read, the merge's turn) and per
#: result (the dispatcher's bookkeeping): 67 us per 400 KB batch in shared memory and 2.4 us
#: per small element (64 to a message) measured with 2 workers.
MESSAGE_S = 50e-6
RESULT_S = 2e-6
#: Results whose transport is measured (the least is taken).
_TRANSPORTS_MEASURED = 3


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class InProcessReader:
    """Computes positions of a dispatched pipeline in this process, as a worker would.

    Reading the positions in increasing order reads ahead as ``to_iter_dataset`` does; any
    other position is reached by restoring the reader's state.

    Args:
      view: The pipeline's ``dispatch_view``.
      options: The ``DatasetOptions`` of the parent's iterator.
    """

    def __init__(self, view: DispatchView, options: DatasetOptions | None) -> None:
        # Holes (None) are returned as a worker returns them: the dispatcher skips them.
        reader = PrefetchIterDataset(
            view.reader.map_parent, read_options=view.reader.read_options, allow_nones=True
        )
        self._reader = iter(reader)
        self._pipeline: DatasetIterator[Any] = read_steps(self._reader, view.steps)
        if options is not None:
            self._pipeline._merge_dataset_options(options)
        self._next = 0  # the position the reader reads next; -1: unknown

    def read(self, position: int) -> Any:
        """The result at ``position``.

        Raises:
          Exception: What computing it raised (computed again when read again).
        """
        if position != self._next:
            self._reader.set_state({"next_index": position})
        self._next = -1
        value = next(self._pipeline)
        self._next = position + 1
        return value

    def close(self) -> None:
        self._pipeline.close()


class WorkerPayoff:
    """Whether ``workers`` worker processes would deliver the rest of an iterator faster than
    this process computing it (see the module docstring).

    Args:
      workers: The number of workers.
      results: The results the iterator has left to deliver.
    """

    def __init__(self, workers: int, results: int) -> None:
        self._workers = workers
        self._results = results
        self._count = 0
        self._first = 0.0
        self._spent = 0.0
        self._transports: list[tuple[float, float]] = []
        self._in_process_s = 0.0  # c: seconds per result computed here
        # Once the workers run: whether their first result came, and the results since and the
        # seconds the consumer spent waiting for them.
        self._started = False
        self._window = [0, 0.0]

    def record(self, seconds: float, result: Any) -> bool | None:
        """Records that ``result`` took ``seconds`` to compute here (reads ahead included:
        blocks of cheap results are read at once, so only a sum of many says what one costs).

        Returns:
          None while still measuring (for ``START_S``, what starting the workers would cost);
          then True when workers pay off, False when this process should compute every
          result.
        """
        self._count += 1
        self._spent += seconds
        self._results -= 1
        if self._count == 1:
            self._first = seconds
        elif len(self._transports) < _TRANSPORTS_MEASURED:
            self._transports.append(_transport_seconds(result))
        if self._spent < START_S:
            return None
        return self._pays_off()

    def delivered(self, seconds: float) -> bool:
        """Records that the consumer spent ``seconds`` getting a result from the workers.

        Returns:
          False when, over the results since the first (which waited for the workers to
          start) that took ``START_S`` together, one took longer than computing it here did:
          this process should compute the rest. Else True.
        """
        if not self._started:
            self._started = True
            return True
        window = self._window
        window[0] += 1
        window[1] += seconds
        if window[1] < START_S:
            return True
        per_result = window[1] / window[0]
        self._window = [0, 0.0]
        return per_result < self._in_process_s

    def _pays_off(self) -> bool:
        if self._count == 1:
            c = self._first
        else:  # the first result pays for warming caches
            c = (self._spent - self._first) / (self._count - 1)
        self._in_process_s = c
        # The least a measurement took: a copy that a page fault or a descheduling slowed
        # down is not what the transport costs.
        s = min((t[0] for t in self._transports), default=0.0)
        r = min((t[1] for t in self._transports), default=0.0)
        n, cores = self._workers, usable_cores()
        w = max(r, (c + s) / n, (c + s + r) / cores)
        return START_S + self._results * w < MARGIN * self._results * c


def _transport_seconds(result: Any) -> tuple[float, float]:
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

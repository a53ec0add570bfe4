"""Computing in the parent, when asked (``MultiprocessingOptions.in_process``): the
dispatching engine can compute the results of an iterator in the parent process instead of
its workers, for the whole iterator (``"always"``) or while worker processes would not deliver
them faster (``"auto"``). By default (``"never"``) the workers asked for compute every result.

Every result of a dispatched pipeline is a function of its position (``positions``), so
the parent can compute it as well as any worker: ``InProcessProducer`` reads the positions the
consumer asks for, in its order, and the output and the checkpoints are those of the
workers (``consumer.ClassConsumer`` keeps the same per-class frontiers either way).
``ParentWatchdog`` warns about a result that takes long here, as the worker watchdog does.

``WorkerPayoff`` decides from what the results after the first (which pays for warming
caches) cost here, each measured from the consumer's call to its result (``record``):

* ``c``: wall seconds per result;
* ``g``: wall seconds the consumer spends between two results (its own work, a training
  step);
* ``u``: this process's CPU seconds per result, computing it and between two (a read that
  waits, for I/O or for a core another task holds, costs wall time but no CPU);
* the transport of one result, priced only when workers could pay off without it: the worker
  writes it (``s``: pickling it, which copies its arrays as writing them into shared memory
  does, plus a message's share), the parent receives it (``r``: a message's share, the
  bookkeeping of a result, and unpickling when it is not in shared memory);
* the cores: ``C`` this process may use (its CPU affinity, at most its control group's CPU
  quota) and ``O`` tasks of others ready to run on them (from ``/proc/loadavg``, the fewer
  of its counts when the trial starts and when it ends);
* ``START_S``: starting and stopping the workers.

In this process a result costs ``c + g``. With ``N`` workers it costs at best
``w = max(g + r, (c + s) / N, (u + s + r) / K)`` (``dataset/transfer_cost.py``, the model
the profiler advises with too): the consumer works and receives
every result, each worker computes and sends its share, and all of it runs on the ``K`` cores
the ``N + 1`` processes get beside the ``O`` other tasks, ``K = min(N + 1, C (N + 1) / (N + 1
+ O))`` (a fair share of the cores for each task ready to run). Workers run when
``START_S + L * w < MARGIN * L * (c + g)`` for the ``L`` results left: ``w`` is what perfect
parallelism would give, so they must promise more than break-even. The decision comes once
the results computed here have taken ``START_S``: choosing wrongly then costs about what
starting the workers would. Once they run, ``delivered`` watches the time the consumer spends
getting each result from them: when it is longer than computing it here took, the workers
stop and this process computes the rest.

``"auto"`` decides as above, ``"never"`` always uses the workers, ``"always"`` computes
every result here.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import weakref
from typing import Any

from grain_core.dataset.iterator import DatasetIterator
from grain_core.dataset.mp.protocol import ELEMENT, ERROR
from grain_core.dataset.options import DatasetOptions
from grain_core.dataset.read_concurrency import READ_THREAD_PREFIX
from grain_core.dataset.transfer_cost import (
    MARGIN,
    RESULT_S,
    cheapest_transport_seconds,
    cores_to_run_on,
    seconds_per_result_with_workers,
    usable_cores,
)

__all__ = [
    "START_S",
    "InProcessProducer",
    "ParentWatchdog",
    "WorkerPayoff",
    "clock",
    "cpu_seconds",
    "others_running",
]

_LOG = logging.getLogger("grain_core")

#: Seconds to start the workers and stop them again (measured on a 2-core machine: 24-26 ms
#: to the first result of an MNIST-like pipeline with 2 workers that map a 47 MB source and
#: 7-9 ms to stop them; 7 ms and 2-7 ms for a ``range`` pipeline). The trial in this process
#: lasts as long.
START_S = 0.035


def clock() -> float:
    """Now, in wall seconds, as ``WorkerPayoff.record`` takes it."""
    return time.perf_counter()


def cpu_seconds() -> float:
    """The CPU seconds this process has used (all its threads)."""
    return time.process_time()


def others_running() -> float:
    """Tasks other than the caller ready to run on this process's cores now (Linux: the
    machine's from ``/proc/loadavg``, in proportion to the cores this process may run on;
    0 where it cannot be read)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0, running - 1) * cores_to_run_on() / (os.cpu_count() or 1)


class InProcessProducer:
    """Computes the positions a ``ClassConsumer`` asks for in this process, as a worker would
    (``consumer.Producer``). Reading the positions in increasing order reads ahead as
    ``to_iter_dataset`` does; any other position is reached by restoring the reader's state.
    An error is filed at its position. The watchdog of worker processes covers each result
    computed here (``ParentWatchdog``).

    Args:
      consumer: The ``ClassConsumer`` (its ``view``, ``count``, ``held`` and options).
    """

    def __init__(self, consumer: Any) -> None:
        # Weakly: the consumer holds its producer, and an iterator dropped unclosed must free
        # both (and stop the workers) without waiting for the cyclic garbage collector.
        self._consumer = weakref.proxy(consumer)
        self._pipeline: DatasetIterator[Any] | None = None
        self._reader: DatasetIterator[Any] | None = None
        self._next = 0  # the position the reader reads next; -1: unknown
        options = consumer.engine.options
        self._watchdog = ParentWatchdog(options.stall_warning_s, options.stall_timeout_s)

    def start(self, options: DatasetOptions) -> None:
        # Holes (None) are returned as a worker returns them: the consumer skips them.
        self._reader, pipeline = self._consumer.view.read_in_parent()
        pipeline._merge_dataset_options(options)
        # In debug mode the consumer's mp_prefetch iterator reports this pipeline (its nodes
        # appear below it, as the workers' do): it is no output of its own.
        pipeline._ctx.output = None
        self._pipeline = pipeline

    def fill(self, cls: int, j: int) -> None:
        consumer = self._consumer
        assert self._reader is not None and self._pipeline is not None
        position = cls + j * consumer.count
        if position != self._next:
            self._reader.set_state({"next_index": position})
        self._next = -1
        kind = ELEMENT
        self._watchdog.begin(f"position {position} of {consumer.reader.map_parent!r}")
        try:
            value = next(self._pipeline)
        except Exception as e:  # noqa: BLE001 - raised to the consumer at its position
            kind, value = ERROR, e
        else:
            self._next = position + 1
        finally:
            self._watchdog.end()
        consumer.held[(cls, j)] = (kind, value, None)

    def take(self, tag: Any, value: Any) -> Any:
        del tag
        return value

    def restart(self) -> None:
        self._consumer.held.clear()

    def stop(self) -> None:
        self._watchdog.close()
        if self._pipeline is not None:
            self._pipeline.close()

    def request_stats(self, worker: int) -> None:
        """Nothing to ask: this process's statistics are the consumer's own."""
        del worker

    def receive_stats(self, worker: int) -> None:
        """Nothing to wait for."""
        del worker


class ParentWatchdog:
    """The watchdog of worker processes for results computed in this process: when one takes
    ``warning_s`` (and each multiple), the ``grain_core`` logger warns with the computing
    thread's stack; past ``timeout_s`` it logs an error (the computation cannot be
    interrupted: the wait goes on). A daemon thread, started by the first result, checks
    every eighth of the smaller threshold, so the report comes at most that late.

    Args:
      warning_s: ``MultiprocessingOptions.stall_warning_s`` (None: no warning).
      timeout_s: ``MultiprocessingOptions.stall_timeout_s`` (None: no error).
    """

    def __init__(self, warning_s: float | None, timeout_s: float | None) -> None:
        thresholds = [t for t in (warning_s, timeout_s) if t is not None]
        self._warning_s = warning_s
        self._timeout_s = timeout_s
        self._check_s = min(thresholds) / 8 if thresholds else None
        # (since, what, thread ident) of the result being computed; None between two.
        self._busy: tuple[float, str, int] | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, what: str) -> None:
        """The calling thread starts computing ``what``."""
        if self._check_s is None:
            return
        self._busy = (time.monotonic(), what, threading.get_ident())
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="grain_core-in-process-watchdog", daemon=True
            )
            self._thread.start()

    def end(self) -> None:
        self._busy = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        assert self._check_s is not None
        current: tuple[float, str, int] | None = None
        warnings_given = 0
        timed_out = False
        while not self._closed.wait(self._check_s):
            busy = self._busy
            if busy is None:
                continue
            if busy is not current:
                current, warnings_given, timed_out = busy, 0, False
            since, what, ident = busy
            waited = time.monotonic() - since
            if not timed_out and self._timeout_s is not None and waited >= self._timeout_s:
                timed_out = True
                _LOG.error("%s", self._report(waited, what, ident, self._timeout_s))
            elif self._warning_s is not None and waited >= self._warning_s * (warnings_given + 1):
                warnings_given = int(waited // self._warning_s)
                _LOG.warning("%s", self._report(waited, what, ident, None))

    def _report(self, waited: float, what: str, ident: int, limit_s: float | None) -> str:
        if limit_s is None:
            verdict = (
                "still computing (MultiprocessingOptions.stall_warning_s sets how often this "
                "warning comes)."
            )
        else:
            verdict = (
                f"past MultiprocessingOptions.stall_timeout_s={limit_s:g}, but a result "
                "computed in this process cannot be interrupted: the wait goes on "
                '(in_process="never" computes it in a worker, where the wait raises '
                "WorkerStalledError)."
            )
        return (
            f"The main process has computed {what} for {waited:.1f} s itself "
            f"(MultiprocessingOptions.in_process): {verdict} Stacks:\n{_stacks(ident)}"
        )


def _stacks(ident: int) -> str:
    """The stack of thread ``ident`` (the consumer's), then those of grain_core's read
    threads, which compute elements for it."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    shown = [ident] + [
        i for i, name in names.items() if i != ident and name.startswith(READ_THREAD_PREFIX)
    ]
    return "".join(
        f"Thread {names.get(i, i)}:\n" + "".join(traceback.format_stack(frames[i]))
        for i in shown
        if i in frames
    )


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
        self._spent = 0.0  # wall seconds of every result computed here
        # Wall and CPU seconds of the first result (asked for right after this is made);
        # wall seconds of the later ones and of the consumer's gaps before them, and the CPU
        # seconds when the first was computed.
        self._first = (0.0, 0.0)
        self._reads = 0.0
        self._gaps = 0.0
        self._ended = 0.0
        self._cpu_mark = cpu_seconds()
        self._others = 0.0  # other tasks ready to run when the first result was computed
        self._in_process_s = 0.0  # c: wall seconds per result computed here
        # Once the workers run: whether their first result came, and the results since and the
        # seconds the consumer spent waiting for them.
        self._started = False
        self._window = [0, 0.0]

    def record(self, started: float, ended: float, result: Any) -> bool | None:
        """Records that the consumer asked for ``result`` at ``started`` and had it at
        ``ended`` (both ``clock()``; reads ahead included: blocks of cheap results are read at
        once, so only a sum of many says what one costs).

        Returns:
          None while still measuring (for ``START_S``, what starting the workers would cost);
          then True when workers pay off, False when this process should compute every
          result.
        """
        self._count += 1
        self._results -= 1
        self._spent += ended - started
        if self._count == 1:
            cpu = cpu_seconds()
            self._first = (ended - started, cpu - self._cpu_mark)
            self._cpu_mark = cpu
            self._others = others_running()
        else:
            self._reads += ended - started
            self._gaps += started - self._ended
        self._ended = ended
        if self._spent < START_S:
            return None
        return self._pays_off(result)

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

    def _pays_off(self, result: Any) -> bool:
        later = self._count - 1
        if later == 0:  # one result took the whole trial
            (c, u), g = self._first, 0.0
        else:
            c, g = self._reads / later, self._gaps / later
            u = (cpu_seconds() - self._cpu_mark) / later
        self._in_process_s = c
        n = self._workers
        here = self._results * (c + g)

        def through_workers(s: float, r: float, cores: float) -> float:
            w = seconds_per_result_with_workers(c, g, u, s, r, n, cores)
            return START_S + self._results * w

        # Reading the machine's load and quota and pickling a result cost more than a cheap
        # result does: each is measured only while the workers could still pay off, first on
        # an idle machine with a free transport.
        if through_workers(0.0, RESULT_S, min(n + 1, cores_to_run_on())) >= MARGIN * here:
            return False
        # A load that lasts shows in both counts; a burst in one is not what the workers would
        # meet for the rest of the iterator (and if they do, ``delivered`` hands back).
        others = min(self._others, others_running())
        cores = min(n + 1, usable_cores() * (n + 1) / (n + 1 + others))
        if through_workers(0.0, RESULT_S, cores) >= MARGIN * here:
            return False
        s, r = cheapest_transport_seconds(result)
        return through_workers(s, r, cores) < MARGIN * here

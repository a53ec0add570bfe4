"""The watchdog of the parent's waits for worker processes: warnings about a worker that sends
nothing for long, with its Python stacks, and the error past the deadline.

Each worker has a pair of pipes for it: the parent asks for the stacks on one, and a thread
of the worker (``serve_stacks``) answers on the other with ``faulthandler``'s dump of all its
threads, while the main thread waits in user code. A request left unanswered for
``STACK_ANSWER_S`` (native code holding the worker's GIL) gets the worker's ``faulthandler``
signalled, once, to write the stacks to stderr instead. ``WorkerPool`` owns one
``StallWatchdog`` and calls ``watched_wait`` in its blocking waits.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from grain_core._ipc.errors import WorkerStalledError

__all__ = ["STACK_ANSWER_S", "StallWatch", "StallWatchdog", "serve_stacks"]

_LOG = logging.getLogger("grain_core")

#: Seconds before a watchdog report that the parent asks the stuck worker for its stacks (at
#: most half the time since the last report); a report without an answer by then has
#: faulthandler write them to stderr instead (the worker's stack thread cannot run while
#: native code holds the GIL). Reports come at their deadlines whatever the answer.
STACK_ANSWER_S = 1.0

#: The signal on which a worker's faulthandler writes its stacks to stderr (None: Windows).
_STACK_SIGNAL: signal.Signals | None = getattr(signal, "SIGUSR1", None)


@dataclasses.dataclass(frozen=True, slots=True)
class StallWatch:
    """What the consumer waits for, for the watchdog's messages about a worker that sends
    nothing.

    Attributes:
      since: ``time.monotonic()`` when the consumer began waiting for it.
      waiting_for: Returns the worker computing it (its index in the pool; None: not known)
        and the element in words ("position 12").
    """

    since: float
    waiting_for: Callable[[], tuple[int | None, str]]


# ------------------------------------------------------------------------------ worker side
def serve_stacks(requests: Any, answers: Any) -> None:
    """In a worker: answers each request of the parent's watchdog with the worker's Python
    stacks (every thread's, from ``faulthandler``), from a thread, so while the main thread is
    stuck in user code that waits (a read, a lock, a sleep); and has faulthandler write them
    to stderr on ``_STACK_SIGNAL``, the fallback when that thread cannot run (native code
    holding the GIL: the signal handler needs no GIL)."""
    if _STACK_SIGNAL is not None:
        faulthandler.register(_STACK_SIGNAL, all_threads=True)

    def serve() -> None:
        while True:
            try:
                requests.recv_bytes()
            except (EOFError, OSError):
                return  # the parent closed the pipe: the pool stops
            with tempfile.TemporaryFile() as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.seek(0)
                text = f.read()
            try:
                answers.send_bytes(text)
            except OSError:
                return

    threading.Thread(target=serve, name="grain_core-stack-dump", daemon=True).start()


# ------------------------------------------------------------------------------ parent side
@dataclasses.dataclass
class _WatchedWorker:
    """One worker as the watchdog knows it: its name in reports, its process, its stack pipes,
    when its unanswered stack request was sent (None: none is), and whether faulthandler was
    signalled for that request."""

    label: str
    process: Any
    requests: Any
    answers: Any
    asked: float | None = None
    signalled: bool = False


class StallWatchdog:
    """The parent's watchdog over a pool's workers.

    Args:
      warning_s: A wait this long (and each multiple of it) logs a warning naming the worker,
        what the consumer waits for and for how long, with the worker's Python stacks. None:
        no warnings.
      timeout_s: After this long the wait raises ``WorkerStalledError`` (the worker keeps
        running). None: wait forever.
      clock: What times a stack request's age (``STACK_ANSWER_S``): ``time.monotonic``, or a
        test's clock that it advances itself.
    """

    def __init__(
        self, warning_s: float | None, timeout_s: float | None, clock: Callable[[], float]
    ) -> None:
        self._warning_s = warning_s
        self._timeout_s = timeout_s
        self._clock = clock
        #: Whether waits are watched at all.
        self.enabled = warning_s is not None or timeout_s is not None
        self.workers: list[_WatchedWorker] = []

    def add_worker(self, label: str, process: Any, requests: Any, answers: Any) -> None:
        """Watches the next worker: ``process``, named ``label`` in reports, whose stack
        thread reads ``requests`` and answers on ``answers`` (the parent's pipe ends)."""
        self.workers.append(_WatchedWorker(label, process, requests, answers))

    def pipes(self) -> list[Any]:
        """The parent's ends of every worker's stack pipes (to close)."""
        return [end for w in self.workers for end in (w.requests, w.answers)]

    def watched_wait(self, wait: Callable[[float | None], bool], watch: StallWatch) -> None:
        """Calls ``wait(seconds)`` until it returns True, warning at each multiple of the
        warning threshold and raising past the deadline, both measured from ``watch.since``.

        The worker's stacks are asked for ahead of each report (``STACK_ANSWER_S`` before it,
        at most half the time since the last one), so that no report waits for them.

        Raises:
          WorkerStalledError: Past the deadline.
        """
        warn_s, limit_s = self._warning_s, self._timeout_s
        warnings_given = 0
        last_report = 0.0
        asked = False  # for the next report
        while True:
            due = [limit_s] if limit_s is not None else []
            if warn_s is not None:
                due.append(warn_s * (warnings_given + 1))
            report_at = min(due)
            ask_at = report_at - min(STACK_ANSWER_S, (report_at - last_report) / 2)
            waited = time.monotonic() - watch.since
            if not asked and waited >= ask_at:
                self.ask_for_stacks(watch)
                asked = True
            if wait(max(0.0, (report_at if asked else ask_at) - waited)):
                return
            waited = time.monotonic() - watch.since
            if waited < report_at:
                continue
            if limit_s is not None and waited >= limit_s:
                raise WorkerStalledError(self.report(watch, waited, limit_s))
            assert warn_s is not None
            warnings_given = int(waited // warn_s)
            last_report, asked = waited, False
            _LOG.warning("%s", self.report(watch, waited, None))

    def ask_for_stacks(self, watch: StallWatch) -> None:
        """Asks the worker computing what ``watch`` waits for for its Python stacks (unless
        an earlier request is still unanswered)."""
        index, _ = watch.waiting_for()
        if index is None or self.workers[index].asked is not None:
            return
        worker = self.workers[index]
        try:
            worker.requests.send_bytes(b"")
        except OSError:  # the worker is ending: the report says so
            return
        worker.asked = self._clock()

    def report(self, watch: StallWatch, waited: float, limit_s: float | None) -> str:
        """The warning (``limit_s`` None) or error about the wait for ``watch``, ``waited``
        seconds long."""
        index, what = watch.waiting_for()
        if index is None:
            who, stacks = "a worker process", ""
        else:
            worker = self.workers[index]
            who = f"worker process {worker.label} (pid {worker.process.pid})"
            stacks = f" Its Python stacks:\n{self._stacks(worker)}"
        if limit_s is None:
            verdict = (
                "still waiting (MultiprocessingOptions.stall_warning_s sets how often this "
                "warning comes; stall_timeout_s makes it an error)."
            )
        else:
            verdict = (
                f"giving up (MultiprocessingOptions.stall_timeout_s={limit_s:g}); the worker "
                "is left running. A pipeline step may be stuck (a deadlock, a read without a "
                "timeout), or one element takes that long: raise stall_timeout_s."
            )
        return f"The main process waited {waited:.1f} s for {what} from {who}: {verdict}{stacks}"

    def _stacks(self, worker: _WatchedWorker) -> str:
        """The worker's Python stacks, its stack thread's latest answer (asked for ahead of the
        report); without one (native code holding the worker's GIL, or no request in time),
        faulthandler writes them to stderr. Never waits."""
        answer = None
        try:
            while worker.answers.poll(0):
                answer = worker.answers.recv_bytes()
                worker.asked = None
                worker.signalled = False
            if answer is not None:
                return str(answer.decode(errors="replace"))
            if _STACK_SIGNAL is None:
                return "(no answer yet)"
            unanswered_s = 0.0 if worker.asked is None else self._clock() - worker.asked
            # Signalled once per request, and only once it has waited STACK_ANSWER_S:
            # faulthandler dumps from inside the signal handler, and a dump landing in the
            # import machinery (a short stall_timeout_s hit again and again while a worker
            # still imports its modules) crashed the worker.
            if unanswered_s >= STACK_ANSWER_S and not worker.signalled:
                os.kill(worker.process.pid, _STACK_SIGNAL)
                worker.signalled = True
        except (EOFError, OSError):
            return "(unavailable: the worker process is ending)"
        return (
            "(no answer yet: native code may hold the worker's GIL; faulthandler writes its "
            f"stacks to stderr once a request has waited {STACK_ANSWER_S:g} s)"
        )

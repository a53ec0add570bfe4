"""Worker processes: how they start, how the parent talks to them, how they stop.

The transport knows no dataset. An engine hands ``WorkerPool`` its worker specs (read here for
their ``index``, ``count`` and ``shm_prefix`` only, forwarded unread otherwise), the entry
point each worker runs, ``entry(spec, control, output)``, and the modules the forkserver
imports once before forking. Each worker has two one-way pipes: control (parent → worker) and
output (worker → parent); messages are pickled bytes whose meaning is the engine's.

Processes start from a dedicated forkserver that has already imported the engine's modules
(NumPy and cloudpickle included), so a worker costs a ``fork`` instead of a fresh
interpreter. Unlike ``multiprocessing``'s own start methods, the worker does not re-run the
parent's ``__main__`` module: the pipeline arrives through cloudpickle, which carries
``__main__`` functions by value, so a training script that imports JAX at the top does not
import it again in every worker. The forkserver starts with the parent's ``sys.path`` (and not
the working directory first, as ``python -c`` would), so workers import exactly the modules
the parent imported: a parent that runs an installed grain_core from inside a source checkout
does not get workers running the checkout's.

The parent waits on the output pipe together with the process sentinel, so a worker that dies is
noticed at once. The worker watches the parent's sentinel in a thread, so it exits as soon as
the parent dies. A watchdog in the parent's waits warns about, and may give up on, a worker
that sends nothing for long, with the worker's Python stacks (``watchdog.py``).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.context as mp_context
import multiprocessing.process
import os
import pickle
import secrets
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any, Protocol

from grain_core._ipc import shm
from grain_core._ipc.errors import WorkerDiedError, unreadable_element_error
from grain_core._ipc.watchdog import StallWatch, StallWatchdog, serve_stacks
from grain_core.config import config

__all__ = [
    "STOP_TIMEOUT_S",
    "PooledWorker",
    "WorkerPool",
    "readiness_check",
    "run_in_every_worker",
    "worker_glibc_tunables",
    "worker_jax_platforms",
]


class PooledWorker(Protocol):
    """What the pool reads of a worker's spec; the rest is the engine's."""

    index: int
    count: int
    shm_prefix: str


#: Environment variable a worker gets for ``JAX_PLATFORMS`` unless the parent sets
#: ``GRAIN_CORE_WORKER_JAX_PLATFORMS``: workers never claim an accelerator by default.
_WORKER_JAX_PLATFORMS_ENV = "GRAIN_CORE_WORKER_JAX_PLATFORMS"


def worker_jax_platforms() -> str:
    """The ``JAX_PLATFORMS`` every worker gets, local or remote: ``cpu`` unless the parent
    sets ``GRAIN_CORE_WORKER_JAX_PLATFORMS``."""
    return os.environ.get(_WORKER_JAX_PLATFORMS_ENV, "cpu")


# ---------------------------------------------------------------------------------- starting
#: glibc's environment variable for its tunables, read once when a program starts.
_GLIBC_TUNABLES = "GLIBC_TUNABLES"
_STREAMING_COPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
#: malloc's thresholds in workers: glibc's own dynamic ones at their ceiling, from the start.
_MALLOC_TUNABLES = {
    "glibc.malloc.mmap_threshold": 32 * 1024 * 1024,
    "glibc.malloc.trim_threshold": 64 * 1024 * 1024,
}


def worker_glibc_tunables(inherited: str | None, streaming_copy_bytes: int) -> str | None:
    """The ``GLIBC_TUNABLES`` the workers' forkserver starts with: ``inherited`` plus the
    threshold above which ``memcpy`` uses streaming (non-temporal) stores, and malloc's
    thresholds (``_MALLOC_TUNABLES``).

    Streaming stores, why: a worker copies each large array into a shared-memory block that
    the parent reads later, from another core. Ordinary stores first read every destination
    line into the cache and evict the pipeline's own data, and leave the lines modified in
    the worker's core, from which the parent's reads must fetch them one by one; streaming
    stores write to memory, which the parent reads at its full speed. 4 MiB batches from 2
    workers, the parent copying each out (as a transfer to a device does): 1.2-1.7x the
    batches of glibc's ordinary stores here. (The parent touching one value per page only,
    ``mp_shm_transport``: 1.4x faster on one host, 0.8-0.9x on another.) glibc's own
    threshold is a fraction of the shared cache, which VMs often report as the whole host's
    (192 and 320 MiB on two hosts here), so it never applies. Smaller copies keep ordinary
    stores: their blocks stay in the cache. 0: glibc's choice.

    malloc's thresholds, why: a worker makes each result's arrays afresh and frees them once
    they are copied into shared memory. glibc returns the top of its heap to the system once
    twice the largest array it has freed lies free there, so a worker making 400 KB batches
    gave its pages back and faulted them in again for every batch (35-60 page faults, a
    quarter of its CPU time per batch, against none with these).

    A tunable the user set wins (either malloc threshold keeps both of glibc's); glibc
    ignores the streaming one on other CPUs. Programs a worker starts inherit the variable.
    """
    wanted: dict[str, int] = {}
    if not (inherited and any(name in inherited for name in _MALLOC_TUNABLES)):
        wanted.update(_MALLOC_TUNABLES)
    if streaming_copy_bytes and not (inherited and _STREAMING_COPY_TUNABLE in inherited):
        wanted[_STREAMING_COPY_TUNABLE] = streaming_copy_bytes
    if not wanted:
        return inherited
    added = ":".join(f"{name}={value:#x}" for name, value in wanted.items())
    return f"{inherited}:{added}" if inherited else added


def _parent_import_path() -> str:
    """The parent's ``sys.path`` as a ``PYTHONPATH`` (an empty entry is its working directory,
    resolved now: the forkserver keeps the directory it starts in, but resolves ``""`` later)."""
    return os.pathsep.join(os.path.abspath(p) if p == "" else p for p in sys.path)


class _WorkerForkServer(forkserver.ForkServer):
    """The forkserver of grain_core's workers: it starts with ``worker_glibc_tunables`` and the
    parent's ``sys.path``, and imports the preload list the first pool asks for."""

    def __init__(self) -> None:
        super().__init__()
        # Two threads starting worker pools at once must not restore each other's variables.
        self._start_lock = threading.Lock()

    def ensure_running(self) -> None:
        pid = getattr(self, "_forkserver_pid", None)
        if pid is not None and (
            not hasattr(os, "waitid")  # no glibc there: the base class restarts it as it is
            or os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        ):
            super().ensure_running()  # running (the check above does not reap it)
            return
        # Not started yet, or it died: it starts with these variables either way. (The
        # server inherits the environment at its start; workers fork from it.)
        with self._start_lock:
            inherited = os.environ.get(_GLIBC_TUNABLES)
            tunables = worker_glibc_tunables(inherited, config.py_mp_worker_streaming_copy_bytes)
            start_env = {
                # ``python -c`` puts the working directory first on the server's path,
                # and the parent's own path is not passed to it before the preload.
                "PYTHONSAFEPATH": "1",
                "PYTHONPATH": _parent_import_path(),
            }
            if tunables is not None and tunables != inherited:
                start_env[_GLIBC_TUNABLES] = tunables
            saved = {name: os.environ.get(name) for name in start_env}
            os.environ.update(start_env)
            try:
                super().ensure_running()
            finally:
                _restore_environ(saved)


def _restore_environ(values: dict[str, str | None]) -> None:
    """Sets each variable to its value in ``values``; None: unset."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _adopt_environ(parent: dict[str, str]) -> None:
    """Makes this worker's environment the parent's, but for glibc's tunables: those the
    forkserver started with are in force in this process, and programs it starts inherit
    them."""
    tunables = os.environ.get(_GLIBC_TUNABLES)
    os.environ.clear()
    os.environ.update(parent)
    _restore_environ({_GLIBC_TUNABLES: tunables})


_FORKSERVER = _WorkerForkServer()


def _forkserver_after_fork_in_child() -> None:
    """A process forked from the parent starts its own forkserver when it starts workers:
    the parent's is not its child (it cannot wait for it), and its copy of the forkserver's
    "alive" pipe would keep the parent's server running after the parent exits."""
    global _FORKSERVER
    alive_fd = getattr(_FORKSERVER, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        try:
            os.close(alive_fd)
        except OSError:
            pass
    _FORKSERVER = _WorkerForkServer()


class _Popen(popen_forkserver.Popen):
    """Starts a process from our forkserver without re-importing the parent's ``__main__``."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_path", None)
        prep_data.pop("init_main_from_name", None)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)  # pyright: ignore[reportArgumentType]  # typeshed names popen_fork.Popen only
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = _FORKSERVER.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        # The child watches this pipe to learn that the parent died.
        parent_w = self.parent_watch_fd = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _WorkerProcess(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)


def _process_class() -> type[multiprocessing.process.BaseProcess]:
    if "forkserver" in multiprocessing.get_all_start_methods():
        return _WorkerProcess
    return multiprocessing.get_context("spawn").Process  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ worker side
@dataclasses.dataclass(frozen=True)
class _ProcessSetup:
    """What a worker process sets up before the engine's entry point runs.

    Attributes:
      environ: The parent's environment when the pool starts. The forkserver keeps the
        environment it started with (for its imports, and as it was then): a variable the
        parent set later (credentials, a storage emulator's endpoint) would not reach workers
        forked from it otherwise.
      jax_platforms: ``JAX_PLATFORMS`` for the worker.
      calls: What ``run_in_every_worker`` registered, called in that order once the worker
        has the parent's environment, before the engine's entry point unpickles anything.
    """

    environ: dict[str, str]
    jax_platforms: str
    calls: tuple[Callable[[], None], ...] = ()


#: What every worker started from now on calls first (``run_in_every_worker``).
_WORKER_CALLS: list[Callable[[], None]] = []


def run_in_every_worker(call: Callable[[], None]) -> None:
    """Has every worker process started from now on call ``call()`` once it has the parent's
    environment, before the engine unpickles the pipeline: set-up that a process does when it
    imports a module, which the forkserver did before the parent asked for it (the forkserver
    keeps the modules it imported then). Registering a call twice registers it once.

    Args:
      call: A function pickled by reference (a module-level function).
    """
    if call not in _WORKER_CALLS:
        _WORKER_CALLS.append(call)


def _start_worker(
    entry: Callable[[Any, Any, Any], None],
    setup: _ProcessSetup,
    spec: PooledWorker,
    control: Any,
    output: Any,
    stack_requests: Any,
    stack_answers: Any,
) -> None:
    """The target of every worker process: sets the process up, then runs ``entry``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
    # A crash in native code (a decoder, a C extension) prints the worker's Python stack to
    # the stderr it shares with the parent, which then names the signal.
    faulthandler.enable()
    serve_stacks(stack_requests, stack_answers)  # for the parent's watchdog
    _adopt_environ(setup.environ)
    os.environ["JAX_PLATFORMS"] = setup.jax_platforms
    for call in setup.calls:
        call()
    shm.set_name_prefix(spec.shm_prefix)
    _watch_parent()
    entry(spec, control, output)


def _watch_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    sentinel = parent.sentinel

    def wait_and_exit() -> None:
        multiprocessing.connection.wait([sentinel])
        # The parent is gone: nobody will read our output. Blocks still in flight are removed
        # by the resource tracker.
        os._exit(0)

    threading.Thread(target=wait_and_exit, name="grain_core-parent-watch", daemon=True).start()


def readiness_check(conn: Any) -> Any:
    """A function telling, without blocking, whether ``conn`` has data to read.

    ``Connection.poll()`` builds and tears down a selector on every call (about 7 us); a
    ``select.poll`` object registered once answers in well under a microsecond, and the check
    runs for every element on both sides of the pipe.
    """
    if not hasattr(select, "poll"):
        return conn.poll
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)

    def ready() -> bool:
        return bool(poller.poll(0))

    return ready


# ------------------------------------------------------------------------------ parent side
class _WorkersPoller:
    """One ``poll`` over every worker's output pipe and process sentinel.

    The dispatching parent asks which workers sent something a few times per element; one
    system call registered once answers for all of them (a check per worker and message cost
    the parent as much CPU as mapping the element's pages).
    """

    def __init__(self, outputs: Sequence[Any], sentinels: Sequence[int]) -> None:
        self._outputs = list(outputs)
        self._sentinels = list(sentinels)
        self._workers: dict[int, tuple[int, bool]] = {}
        self._poller = select.poll() if hasattr(select, "poll") else None
        for index, (conn, sentinel) in enumerate(zip(outputs, sentinels, strict=True)):
            self._workers[conn.fileno()] = (index, True)
            self._workers[sentinel] = (index, False)
            if self._poller is not None:
                self._poller.register(conn.fileno(), select.POLLIN)
                self._poller.register(sentinel, select.POLLIN)

    def poll(self, timeout: float | None) -> tuple[list[int], list[int]]:
        """Workers with output to read (data or its end) and workers that ended, each in index
        order, after waiting up to ``timeout`` seconds (None: forever) for either."""
        if self._poller is None:
            waitables = [*self._outputs, *self._sentinels]
            fired = multiprocessing.connection.wait(waitables, timeout)
            fds = [x if isinstance(x, int) else x.fileno() for x in fired]
        else:
            ms = None if timeout is None else int(timeout * 1000)
            fds = [fd for fd, _ in self._poller.poll(ms)]
        ready: list[int] = []
        ended: list[int] = []
        for fd in fds:
            index, is_output = self._workers[fd]
            (ready if is_output else ended).append(index)
        return sorted(ready), sorted(ended)


#: What a worker killed by a signal most likely ran into, and what to do about it.
_SIGNAL_HINTS = {
    signal.SIGKILL: (
        " A SIGKILL usually means the machine ran out of memory: reduce "
        "per_worker_buffer_size, the number of workers or the element size."
    ),
    signal.SIGSEGV: (
        " The worker crashed in native code (a C extension used by the pipeline); its Python "
        "stack at the crash is on stderr above."
    ),
    signal.SIGBUS: (
        f" A SIGBUS usually means {shm.SHM_DIR} is full (Docker gives containers 64 MiB): "
        "give the container more shared memory (`docker run --shm-size=2g`) or reduce "
        "per_worker_buffer_size or the number of workers."
    ),
}


#: Seconds that stopping a pool gives its workers to exit before they are killed.
STOP_TIMEOUT_S = 5.0


class WorkerPool:
    """The parent's handles on a set of worker processes. Holds no reference to the iterator
    that uses it, so it can be finalised when that iterator is garbage-collected.

    Args:
      specs: One per worker, passed to ``entry`` unread (but for ``PooledWorker``'s fields).
      entry: What each worker runs, ``entry(spec, control, output)``: a module-level function
        (it is pickled by reference). It reads its control messages with
        ``control.recv_bytes()`` and sends with ``output.send_bytes``.
      preload: Modules the forkserver imports before its first fork (used when it starts).
      stall_warning_s: Watchdog: a consumer that waits this long (and each multiple of it)
        for a worker (``recv`` and ``ready_workers`` given a ``StallWatch``) logs a warning
        naming the worker, what it waits for and for how long, with the worker's Python
        stacks. None: no warnings.
      stall_timeout_s: Watchdog: after this long the wait raises ``WorkerStalledError`` (the
        worker keeps running). None: wait forever.
      clock: What times a stack request's age (``watchdog.STACK_ANSWER_S``): ``time.monotonic``, or a
        test's clock that it advances itself.

    Raises:
      ValueError: Inside a worker process (workers do not start workers).
    """

    def __init__(
        self,
        specs: Sequence[PooledWorker],
        entry: Callable[[Any, Any, Any], None],
        preload: Sequence[str] = (),
        stall_warning_s: float | None = None,
        stall_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._closed = False
        self._watchdog = StallWatchdog(stall_warning_s, stall_timeout_s, clock)
        # Held while a thread reads the workers' pipes: a second thread fails at once with a
        # clear error (its poll() of the same pipes would fail with "concurrent poll()
        # invocation", or its reads take the other's messages).
        self._in_use = threading.Lock()
        #: The process whose workers these are; another one is a child forked from it.
        self._owner_pid = os.getpid()
        self._procs: list[Any] = []
        self._controls: list[Any] = []
        self._outputs: list[Any] = []
        self._output_ready: list[Any] = []
        self._prefixes = [spec.shm_prefix for spec in specs]
        self._labels = [f"{spec.index} of {spec.count}" for spec in specs]
        #: Size of the last message ``recv`` read (the parent tells small elements from large
        #: ones as the worker did).
        self.last_message_bytes = 0
        if multiprocessing.current_process().daemon:
            raise ValueError(
                "mp_prefetch cannot start worker processes inside a worker process (an "
                "mp_prefetch or DataLoader with workers inside another one's pipeline). Keep "
                "one at the end of the pipeline; use multithread_prefetch inside."
            )
        process_cls = _process_class()
        if process_cls is _WorkerProcess:
            _FORKSERVER.set_forkserver_preload(list(preload))
        setup = _ProcessSetup(
            environ=dict(os.environ),
            jax_platforms=worker_jax_platforms(),
            calls=tuple(_WORKER_CALLS),
        )
        try:
            for spec in specs:
                control_r, control_w = multiprocessing.Pipe(duplex=False)
                output_r, output_w = multiprocessing.Pipe(duplex=False)
                requests_r, requests_w = multiprocessing.Pipe(duplex=False)
                answers_r, answers_w = multiprocessing.Pipe(duplex=False)
                proc = process_cls(
                    target=_start_worker,
                    args=(entry, setup, spec, control_r, output_w, requests_r, answers_w),
                    name=f"grain_core-worker-{spec.index}",
                    daemon=True,
                )
                proc.start()
                for conn in (control_r, output_w, requests_r, answers_w):
                    conn.close()
                self._watchdog.add_worker(
                    f"{spec.index} of {spec.count}", proc, requests_w, answers_r
                )
                self._procs.append(proc)
                self._controls.append(control_w)
                self._outputs.append(output_r)
                self._output_ready.append(readiness_check(output_r))
        except BaseException:
            self.shutdown()
            raise
        self._poller: _WorkersPoller | _EndedWorkers = _WorkersPoller(
            self._outputs, [proc.sentinel for proc in self._procs]
        )
        _LIVE_POOLS.add(self)

    @staticmethod
    def start_server(preload: Sequence[str]) -> None:
        """Starts the forkserver that pools fork their workers from, unless it runs: it
        imports ``preload`` while the caller goes on (this returns once the server process is
        spawned, a fork and exec that copies no thread of the caller). Nothing happens where
        workers start otherwise (no forkserver) or inside a worker."""
        if _process_class() is not _WorkerProcess or multiprocessing.current_process().daemon:
            return
        _FORKSERVER.set_forkserver_preload(list(preload))
        _FORKSERVER.ensure_running()

    @staticmethod
    def new_prefix(index: int) -> str:
        """A shared-memory name prefix unique to one worker of one pool."""
        return f"gc{os.getpid():x}{secrets.token_hex(4)}w{index}_"

    def send(self, index: int, message: tuple[Any, ...]) -> None:
        """Sends a control message (a dead worker is reported by the next ``recv``)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._controls[index].send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass

    def ready_workers(
        self, timeout: float | None = 0.0, watch: StallWatch | None = None
    ) -> list[int]:
        """The workers with a message waiting, in index order; waits up to ``timeout`` seconds
        (None: until there is one) when there is none.

        Args:
          timeout: Seconds to wait at most; None: until a worker sends something.
          watch: What an endless wait (``timeout`` None) waits for: the watchdog warns and
            raises about it.

        Raises:
          WorkerDiedError: A worker ended with no message left to read.
          WorkerStalledError: Past the stall deadline.
          RuntimeError: Another thread is in ``recv`` or ``ready_workers`` of this pool.
        """
        if not self._in_use.acquire(blocking=False):
            raise _used_concurrently()
        try:
            return self._ready_workers(timeout, watch)
        finally:
            self._in_use.release()

    def _ready_workers(self, timeout: float | None, watch: StallWatch | None) -> list[int]:
        if timeout is None and watch is not None and self._watchdog.enabled:
            polled: list[tuple[list[int], list[int]]] = []

            def wait(seconds: float | None) -> bool:
                polled[:] = [self._poller.poll(seconds)]
                return any(polled[0])

            self._watchdog.watched_wait(wait, watch)
            ready, ended = polled[0]
        else:
            ready, ended = self._poller.poll(timeout)
        for index in ended:
            if index not in ready:
                raise self._died(index)
        return ready

    def recv(
        self,
        index: int,
        ready: bool = False,
        waiting_for: Callable[[], tuple[int | None, str]] | None = None,
    ) -> tuple[Any, ...]:
        """Returns the next message of worker ``index``, waiting for it.

        Args:
          index: The worker.
          ready: ``ready_workers`` just listed the worker: a message (or the end of the pipe)
            is there, no need to check.
          waiting_for: What the wait is for (a ``StallWatch``'s, from the moment it starts):
            the watchdog warns and raises about it.

        Raises:
          WorkerDiedError: If the worker process ended.
          WorkerStalledError: Past the stall deadline.
          UnreadableElementError: If the message cannot be unpickled.
          RuntimeError: Another thread is in ``recv`` or ``ready_workers`` of this pool.
        """
        if not self._in_use.acquire(blocking=False):
            raise _used_concurrently()
        try:
            return self._recv(index, ready, waiting_for)
        finally:
            self._in_use.release()

    def _recv(
        self, index: int, ready: bool, waiting_for: Callable[[], tuple[int | None, str]] | None
    ) -> tuple[Any, ...]:
        conn = self._outputs[index]
        if not ready and not self._output_ready[index]():
            waitables = [conn, self._procs[index].sentinel]
            if waiting_for is not None and self._watchdog.enabled:
                self._watchdog.watched_wait(
                    lambda seconds: bool(multiprocessing.connection.wait(waitables, seconds)),
                    StallWatch(time.monotonic(), waiting_for),
                )
            else:
                multiprocessing.connection.wait(waitables)
            if not self._output_ready[index]():
                # Ended with nothing left to read; no end of file comes while a process the
                # worker started holds its end of the pipe.
                raise self._died(index)
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            raise self._died(index) from None
        self.last_message_bytes = len(data)
        try:
            return pickle.loads(data)  # type: ignore[no-any-return]
        except Exception as e:
            raise unreadable_element_error(self._labels[index], e) from e

    def running(self) -> bool:
        """Whether every worker runs and this process may use them (it started them, and the
        pool is not shut down): a pool kept between iterators is reused only then."""
        return (
            not self._closed
            and self._owner_pid == os.getpid()
            and all(proc.exitcode is None for proc in self._procs)
        )

    def check_owner(self) -> None:
        """Checks that this process started the workers.

        Raises:
          WorkerDiedError: In a process forked from the one that started them.
        """
        if self._owner_pid != os.getpid():
            raise self._died(0)

    def _died(self, index: int) -> WorkerDiedError:
        proc = self._procs[index]
        if self._owner_pid != os.getpid():
            return WorkerDiedError(
                f"Worker process {self._labels[index]} (pid {proc.pid}) belongs to process "
                f"{self._owner_pid}, which forked this process: a forked process cannot use "
                "its parent's iterator. Create a new iterator in this process (it starts its "
                "own workers)."
            )
        proc.join(timeout=5)
        # Its blocks stay until shutdown: elements it sent before may not be mapped yet (the
        # dispatching parent holds results ahead of the consumer).
        code = proc.exitcode
        how = f"exit code {code}"
        hint = ""
        if code is not None and code < 0:
            try:
                how += f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
            hint = _SIGNAL_HINTS.get(-code, "")
        return WorkerDiedError(
            f"Worker process {self._labels[index]} (pid {proc.pid}) was terminated "
            f"unexpectedly with {how}.{hint}"
        )

    def shutdown(self) -> None:
        """Stops every worker, frees shared memory left in flight. Idempotent.

        Workers get ``STOP_TIMEOUT_S`` in all to exit (one busy in a long user function is
        killed after it), not that long each."""
        if self._closed:
            return
        self._closed = True
        for conn in self._controls:
            conn.close()  # the worker's next read of its control pipe ends it
        self._drain_until_exit(time.monotonic() + STOP_TIMEOUT_S)
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for index, proc in enumerate(self._procs):
            proc.join(timeout=5)
            shm.unlink_prefix(self._prefixes[index])
        for conn in (*self._outputs, *self._watchdog.pipes()):
            conn.close()
        for proc in self._procs:
            if proc.exitcode is not None:
                proc.close()

    def _leave_to_parent(self) -> None:
        """Makes this pool inert in a process forked from its owner: the workers, their pipes
        and shared memory stay the parent's. The child closes only its copies of the pipes (so
        a worker still sees its control pipe close, and the parent's death, when the parent
        stops or dies while the child lives on), never stops, kills, reaps or reads from a
        worker, and never unlinks a block; using the pool raises ``_died``'s error."""
        if self._closed:
            return
        self._closed = True
        self._in_use = threading.Lock()  # a thread of the parent may have held it
        for proc in self._procs:
            # multiprocessing's exit hook in the child would otherwise terminate and join
            # every "child" it lists, the parent's workers included (and read their exit
            # status from the parent's sentinel pipe). There is no public way to forget one.
            multiprocessing.process._children.discard(proc)  # type: ignore[attr-defined]
            for fd in (proc.sentinel, getattr(proc._popen, "parent_watch_fd", None)):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        for conn in (*self._controls, *self._outputs, *self._watchdog.pipes()):
            conn.close()
        # Every later wait answers at once: each worker "ended", i.e. ``_died``'s error.
        self._output_ready = [_always_ready] * len(self._outputs)
        self._poller = _EndedWorkers(len(self._outputs))

    def _drain_until_exit(self, deadline: float) -> None:
        # A worker blocked writing a large message exits only once that message is read.
        running = dict(zip(self._outputs, self._procs, strict=True))
        while running:
            for conn, proc in list(running.items()):
                if proc.exitcode is not None:
                    del running[conn]
            remaining = deadline - time.monotonic()
            if not running or remaining <= 0:
                return
            waitables = [*running, *(proc.sentinel for proc in running.values())]
            ready: list[Any] = multiprocessing.connection.wait(waitables, timeout=remaining)
            for conn in ready:
                if conn not in running:
                    continue  # a sentinel: exitcode tells on the next round
                try:
                    conn.recv_bytes()
                except (EOFError, OSError):
                    running[conn].join(timeout=max(deadline - time.monotonic(), 0))
                    del running[conn]


def _used_concurrently() -> RuntimeError:
    return RuntimeError(
        "Two threads used one iterator over worker processes at once: grain_core iterators "
        "are not thread-safe. Give each thread its own iterator, or guard the shared one "
        "with a lock (next(), get_state() and set_state() alike)."
    )


def _always_ready() -> bool:
    return True


class _EndedWorkers:
    """The poller of a pool left to the parent after a fork: every worker has ended."""

    def __init__(self, count: int) -> None:
        self._all = list(range(count))

    def poll(self, timeout: float | None) -> tuple[list[int], list[int]]:
        return [], self._all


#: Pools with workers of this process: a forked child makes each inert (``_leave_to_parent``).
_LIVE_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    _forkserver_after_fork_in_child()
    for pool in list(_LIVE_POOLS):
        pool._leave_to_parent()
    _LIVE_POOLS.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)

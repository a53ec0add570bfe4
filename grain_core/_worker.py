"""Worker processes of ``mp_prefetch``: how they start, what they run, how they stop.

Processes start from a dedicated forkserver that has already imported ``grain_core`` (NumPy and
cloudpickle included), so a worker costs a ``fork`` instead of a fresh interpreter. Unlike
``multiprocessing``'s own start methods, the worker does not re-run the parent's ``__main__``
module: the pipeline arrives through cloudpickle, which carries ``__main__`` functions by value,
so a training script that imports JAX at the top does not import it again in every worker.

Protocol, one pair of pipes per worker (no polling anywhere):

* control (parent → worker): ``("credit", k, names)`` allows ``k`` more elements and hands back
  shared-memory blocks the parent no longer uses (the worker reuses them); ``("set_state",
  generation, state, credits, names)`` restores the worker pipeline without restarting the
  process (``names``: the blocks of the elements sent before, which the parent dropped);
  ``("stop",)``. The parent grants ``per_worker_buffer_size`` credits and returns one for
  each element it hands out. An element that needs no shared memory may also go without a
  credit, instead of waiting for the parent's wake-up after each, while the worker's
  *overdraft* (elements sent beyond its credits, which the next credits cover first) stays
  within ``SMALL_AHEAD`` elements and ``OVERDRAFT_BYTES`` pickled; any other element waits
  for a credit (a buffer of 0: every element does). As credits go back in batches, a worker
  about to wait for one says so, once, with its credits then: ``(generation, WANTS_CREDIT,
  credits, None, (), ())``.
* output (worker → parent): ``(generation, kind, element, state, shm_names, dropped)`` where
  ``kind`` is ``ELEMENT``, ``END`` or ``ERROR`` and ``dropped`` names blocks the worker freed
  (the parent forgets its mappings of them); ``state`` is the worker pipeline's state right after producing
  the element, so the parent never has to ask for it. Elements that need no shared memory go
  as ``PICKLED_ELEMENTS``, a list of ``(element, state)`` pairs pickled one by one (so each
  one's size is known), several to a message while the next is expected within ``_GROUP_S``.
  Messages of an older generation (produced before a ``set_state``) are discarded by the
  parent, their shared memory freed.
* dispatching workers (``grain_core.dataset.mp_dispatch``) take ``("assign", generation,
  runs, credits, names)`` instead of credits and ``set_state``, and send
  ``(generation, kind, element, cpu_total, shm_names, dropped)`` with the worker's CPU seconds
  so far instead of a state: the parent knows which position each result is. Results already
  read that need no shared memory go several to a message: kind ``ELEMENTS`` with a list of
  elements (one message, one system call each way, instead of one per element); credits and
  the overdraft as above.
* statistics (worker → parent, only when the pipeline tracks ``STAGE_TIMING``):
  ``(STATS_GENERATION, STATS, snapshot, None, (), ())`` with the first element, then at most
  every ``STATS_INTERVAL_S``, before ``END``/``ERROR``, and when the worker waits for the parent
  with elements not reported (after ``STATS_WAITING_INTERVAL_S`` without a message). They take
  no credit, and their generation never matches, so the parent's element path does not look at
  them.
* warnings (worker → parent): ``(STATS_GENERATION, WARNING, (category, text, filename,
  lineno), None, (), ())`` for each warning the worker's filters let through, sent before the
  worker's next message or before it waits; the parent issues it again under its own filters
  (``pytest.warns``, ``-W error``, ``logging.captureWarnings`` see it) instead of the worker
  printing it to stderr.

The parent waits on the output pipe together with the process sentinel, so a worker that dies is
noticed at once. The worker waits on its control pipe and watches the parent's sentinel in a
thread, so it exits as soon as the parent dies.
"""

from __future__ import annotations

import collections
import copyreg
import faulthandler
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import select
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Sequence
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

from grain_core import _shm

__all__ = [
    "ELEMENT",
    "ELEMENTS",
    "END",
    "ERROR",
    "OVERDRAFT_BYTES",
    "PICKLED_ELEMENTS",
    "SMALL_AHEAD",
    "STATS",
    "STATS_GENERATION",
    "STATS_INTERVAL_S",
    "STATS_WAITING_INTERVAL_S",
    "WANTS_CREDIT",
    "WARNING",
    "UnreadableElementError",
    "WorkerDiedError",
    "WorkerPool",
    "WorkerSpec",
    "overdraft_room",
    "unreadable_element_error",
    "worker_glibc_tunables",
]

ELEMENT, END, ERROR, STATS, ELEMENTS, WARNING, PICKLED_ELEMENTS, WANTS_CREDIT = range(8)
#: The overdraft: elements a worker may send beyond its credits (``per_worker_buffer_size``
#: ahead of the consumer), at most this many and this many bytes pickled.
SMALL_AHEAD = 64
OVERDRAFT_BYTES = 1024 * 1024
#: Types whose values pickle to a few bytes: no pickle is needed to know they are small.
_FIXED_SIZE_TYPES = frozenset({int, float, bool, complex, type(None)})
#: Seconds a worker may spend gathering elements that need no shared memory into one message
#: (the first of them waits that long for the others at most).
_GROUP_S = 0.0005


def overdraft_room(element_bytes: int) -> int:
    """How many elements of ``element_bytes`` pickled bytes a worker may send beyond its
    credits (the worker and the parent decide alike)."""
    return min(SMALL_AHEAD, OVERDRAFT_BYTES // max(1, element_bytes))


def credit_batch(buffer_size: int, room: int = 0) -> int:
    """How many credits a parent returns in one message to a worker with
    ``per_worker_buffer_size`` ``buffer_size`` whose elements may overdraw by ``room``
    (``overdraft_room``; 0 for elements in shared memory): half the buffer, or half the
    overdraft, which carries the worker meanwhile, and at least one. (A message per element
    halved the parent's rate of small elements; a quarter of the overdraft at a time cost
    both engines 15-20%.)"""
    return max(1, buffer_size // 2, room // 2)


#: Generation of statistics messages: no ``set_state`` generation (they count up from 0).
STATS_GENERATION = -1
#: Seconds between two statistics messages of a worker while it produces elements.
STATS_INTERVAL_S = 1.0
#: Seconds since the last statistics message after which a worker about to wait sends one.
STATS_WAITING_INTERVAL_S = 0.02

#: Environment variable a worker gets for ``JAX_PLATFORMS`` unless the parent sets
#: ``GRAIN_CORE_WORKER_JAX_PLATFORMS``: workers never claim an accelerator by default.
_WORKER_JAX_PLATFORMS_ENV = "GRAIN_CORE_WORKER_JAX_PLATFORMS"

# ---------------------------------------------------------------------------------- starting
#: glibc's environment variable for its tunables, read once when a program starts.
_GLIBC_TUNABLES = "GLIBC_TUNABLES"
_STREAMING_COPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"


def worker_glibc_tunables(inherited: str | None, streaming_copy_bytes: int) -> str | None:
    """The ``GLIBC_TUNABLES`` the workers' forkserver starts with: ``inherited`` plus the
    threshold above which ``memcpy`` uses streaming (non-temporal) stores.

    Why: a worker copies each large array into a shared-memory block that the parent reads
    later, from another core. Ordinary stores first read every destination line into the
    cache and evict the pipeline's own data, and leave the lines modified in the worker's
    core, from which the parent's reads must fetch them one by one; streaming stores write
    to memory, which the parent reads at its full speed. 4 MiB batches from 2 workers, the
    parent copying each out (as a transfer to a device does): 1.2-1.7x the batches of
    glibc's ordinary stores here. (The parent touching one value per page only,
    ``mp_shm_transport``: 1.4x faster on one host, 0.8-0.9x on another.) glibc's own
    threshold is a fraction of the shared cache, which VMs often report as the whole host's
    (192 and 320 MiB on two hosts here), so it never applies. Smaller copies keep ordinary
    stores: their blocks stay in the cache. A threshold the user set wins; glibc
    ignores the tunable on other CPUs. Programs a worker starts inherit the variable.
    """
    if streaming_copy_bytes == 0 or (inherited and _STREAMING_COPY_TUNABLE in inherited):
        return inherited
    tunable = f"{_STREAMING_COPY_TUNABLE}={streaming_copy_bytes:#x}"
    return f"{inherited}:{tunable}" if inherited else tunable


class _WorkerForkServer(forkserver.ForkServer):
    """The forkserver of grain_core's workers; it starts with ``worker_glibc_tunables``."""

    def __init__(self) -> None:
        super().__init__()
        # Two threads starting worker pools at once must not restore each other's variable.
        self._start_lock = threading.Lock()

    def ensure_running(self) -> None:
        pid = getattr(self, "_forkserver_pid", None)
        if pid is not None and (
            not hasattr(os, "waitid")  # no glibc there: the base class restarts it as it is
            or os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        ):
            super().ensure_running()  # running (the check above does not reap it)
            return
        # Not started yet, or it died: it starts with the tunable either way.
        from grain_core.config import config

        with self._start_lock:
            inherited = os.environ.get(_GLIBC_TUNABLES)
            tunables = worker_glibc_tunables(inherited, config.py_mp_worker_streaming_copy_bytes)
            if tunables is None or tunables == inherited:
                super().ensure_running()
                return
            # The server process inherits the environment at its start; workers fork from it.
            os.environ[_GLIBC_TUNABLES] = tunables
            try:
                super().ensure_running()
            finally:
                if inherited is None:
                    del os.environ[_GLIBC_TUNABLES]
                else:
                    os.environ[_GLIBC_TUNABLES] = inherited


_FORKSERVER = _WorkerForkServer()
# What every worker runs, imported once before the forks rather than in each worker.
_FORKSERVER.set_forkserver_preload(
    ["grain_core.dataset.mp_prefetch", "grain_core.dataset.mp_dispatch", "cloudpickle"]
)


class _Popen(popen_forkserver.Popen):
    """Starts a process from our forkserver without re-importing the parent's ``__main__``."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_path", None)
        prep_data.pop("init_main_from_name", None)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = _FORKSERVER.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        # The child watches this pipe to learn that the parent died.
        parent_w = os.dup(w)
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
class WorkerSpec:
    """What one worker needs: its index, the pickled pipeline and how to build its iterator.

    Attributes:
      index / count: This worker's index and the number of workers.
      init_fn: cloudpickled ``worker_init_fn`` (or None), run before the pipeline is unpickled.
      dataset: cloudpickled pipeline (the same bytes for every worker).
      sequential_slice: Contiguous instead of strided slices.
      state: Worker pipeline state to start from (None: the beginning).
      plugins: Plugin names loaded in the parent (None: the parent had not loaded plugins).
      options: ``DatasetOptions`` of the parent's iterator, merged into the worker's.
      shm_prefix: Name prefix of this worker's shared-memory blocks.
      pool_size: Free blocks of one size the worker keeps for reuse.
      dispatch: The worker computes the positions the parent assigns (``mp_dispatch``)
        instead of running its strided share of the pipeline.
      buffer_size: Large elements the worker may have in flight (``per_worker_buffer_size``).
    """

    def __init__(
        self,
        *,
        index: int,
        count: int,
        init_fn: bytes | None,
        dataset: bytes,
        sequential_slice: bool,
        state: Any,
        plugins: list[str] | None,
        options: Any,
        shm_prefix: str,
        pool_size: int,
        dispatch: bool = False,
        buffer_size: int = 1,
    ) -> None:
        self.index = index
        self.count = count
        self.init_fn = init_fn
        self.dataset = dataset
        self.sequential_slice = sequential_slice
        self.state = state
        self.plugins = plugins
        self.options = options
        self.shm_prefix = shm_prefix
        self.pool_size = pool_size
        self.dispatch = dispatch
        self.buffer_size = buffer_size
        self.jax_platforms = os.environ.get(_WORKER_JAX_PLATFORMS_ENV, "cpu")


def _error_message(error: BaseException) -> tuple[bytes | None, str, str, str]:
    tb = "".join(traceback.format_exception(error))
    name = f"{type(error).__module__}.{type(error).__qualname__}"
    return _pickled_error(error), name, str(error), tb


def _pickled_error(error: BaseException) -> bytes | None:
    """``error`` pickled so that the parent gets its type back: as it is; else rebuilt without
    its ``__init__`` (one whose parameters are not its ``args``), with its attributes, then
    without them; None if even its type cannot travel (it goes as text)."""
    import cloudpickle

    for candidate in (error, _Uninitialised(error, True), _Uninitialised(error, False)):
        try:
            data: bytes = cloudpickle.dumps(candidate)
            pickle.loads(data)
        except Exception:  # noqa: BLE001 - the next, plainer form
            continue
        return data
    return None


class _Uninitialised:
    """Pickles as its exception rebuilt from its type and ``args`` without calling ``__init__``
    (and its attributes, with ``attributes``)."""

    def __init__(self, error: BaseException, attributes: bool) -> None:
        self.error = error
        self.attributes = attributes

    def __reduce__(self) -> tuple[Any, ...]:
        error = self.error
        state = dict(vars(error)) if self.attributes else {}
        return (_uninitialised_error, (type(error), error.args, state))


def _uninitialised_error(
    cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]
) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


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


def worker_main(spec: WorkerSpec, control: Any, output: Any) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
    # A crash in native code (a decoder, a C extension) prints the worker's Python stack to
    # the stderr it shares with the parent, which then names the signal.
    faulthandler.enable()
    os.environ["JAX_PLATFORMS"] = spec.jax_platforms
    if spec.plugins is not None:
        from grain_core import plugins

        os.environ[plugins.PLUGINS_ENV] = ",".join(spec.plugins)
        plugins.reset()
    _shm.set_name_prefix(spec.shm_prefix)
    _shm.enable_block_pool(spec.pool_size)
    _register_numpy_scalar_reducers()
    from grain_core.dataset.prefetch import read_inline_while_cpu_bound

    read_inline_while_cpu_bound()
    _watch_parent()
    loop = _DispatchWorkerLoop if spec.dispatch else _WorkerLoop
    loop(spec, control, output).run()


def _register_numpy_scalar_reducers() -> None:
    """Pickles NumPy number scalars as their type and Python value in this process.

    NumPy's own reduction pickles the scalar's dtype object with it: 5.8 us to pickle and 3.3
    to unpickle an ``np.int64`` in a message, against 2.0 and 2.2 this way (elements are often
    scalars, a label or an id). The value round-trips exactly: ``item()`` is lossless for these
    types but for the bits of a NaN, which go as bytes (``longdouble`` is left out, it has no
    lossless Python value).
    """
    import numpy as np

    for cls in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
    ):  # fmt: skip
        copyreg.pickle(cls, _reduce_numpy_scalar)


def _reduce_numpy_scalar(value: Any) -> tuple[Any, tuple[Any, ...]]:
    item = value.item()
    if item != item:  # a NaN: a Python float would make a signalling one quiet
        return _numpy_scalar_from_bytes, (value.dtype.str, value.tobytes())
    return type(value), (item,)


def _numpy_scalar_from_bytes(dtype: str, data: bytes) -> Any:
    import numpy as np

    return np.frombuffer(data, dtype)[0]


class _WorkerLoop:
    def __init__(self, spec: WorkerSpec, control: Any, output: Any) -> None:
        self._spec = spec
        self._control = control
        self._output = output
        self._generation = 0
        self._credits = 0
        self._finished = False
        self._it: Any = None
        self._build_error: BaseException | None = None
        self._min_shm_size = _shm.DEFAULT_MIN_SHM_SIZE
        self._tracking = False
        self._next_report = 0.0
        self._unreported = False  # elements were sent since the last statistics message
        self._control_ready = _readiness_check(control)
        # Warnings from any thread of the worker, sent by the main thread (the only writer).
        self._warnings: collections.deque[tuple[Any, ...]] = collections.deque()
        warnings.showwarning = self._queue_warning
        # The overdraft: pickled sizes of the elements sent beyond the credits, oldest first
        # (the next credits cover them first); and an element made that neither a credit nor
        # the overdraft could send yet: the element, its blocks, its pickled size (None: in
        # shared memory, or it cannot be pickled).
        self._overdraft: collections.deque[int] = collections.deque()
        self._overdraft_bytes = 0
        self._waiting: tuple[Any, list[str], int | None] | None = None
        self._asked = False  # WANTS_CREDIT sent, no credit since

    def run(self) -> None:
        keep_sent = False
        try:
            self._build()
            while True:
                if not self._can_produce():
                    if not self._control_ready() and self._read_ahead():
                        continue
                    if self._warnings:
                        self._send_warnings()
                    self._ask_for_credit()
                    if self._tracking:
                        self._report_before_waiting()
                    if not self._handle(pickle.loads(self._control.recv_bytes())):
                        return
                    continue
                while self._control_ready():
                    if not self._handle(pickle.loads(self._control.recv_bytes())):
                        return
                if self._can_produce():
                    self._produce()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # The parent closed our pipes: it is gone or shutting down.
        except BaseException:
            # Out of the loop (SystemExit or KeyboardInterrupt in user code): the parent reads
            # what was sent before, and removes those blocks once it sees this process end.
            keep_sent = True
            raise
        finally:
            if self._it is not None:
                self._it.close()
            _shm.unlink_pool(keep_sent)

    def _build(self) -> None:
        import cloudpickle  # noqa: F401 - needed to unpickle by-value functions

        spec = self._spec
        try:
            if spec.init_fn is not None:
                pickle.loads(spec.init_fn)(spec.index, spec.count)
            self._build_pipeline(pickle.loads(spec.dataset))
            self._min_shm_size = _min_shm_size(self._pipeline())
        except Exception as e:  # noqa: BLE001 - reported to the parent on its next request
            self._build_error = e
            return
        from grain_core.dataset.stats import is_tracking

        if is_tracking(self._pipeline()):
            # Chosen once: an untracked pipeline runs the plain _produce, with no check.
            self._tracking = True
            self._produce = self._produce_and_report  # type: ignore[method-assign]

    def _build_pipeline(self, ds: Any) -> None:
        from grain_core.dataset.mp_prefetch import build_worker_iterator

        spec = self._spec
        self._it = build_worker_iterator(
            ds, spec.index, spec.count, spec.sequential_slice, spec.options
        )
        if spec.state is not None:
            self._it.set_state(spec.state)

    def _can_produce(self) -> bool:
        if self._waiting is not None:
            return self._credits > 0 or self._overdraws(self._waiting[2])
        return self._has_work() and (self._credits > 0 or self._may_overdraw())

    def _has_work(self) -> bool:
        return not self._finished

    def _may_overdraw(self) -> bool:
        """Whether another small element may go beyond the credits: small elements need not
        wait for the parent's wake-up after each (``per_worker_buffer_size`` 0 keeps meaning
        "on request only")."""
        return (
            self._spec.buffer_size > 0
            and len(self._overdraft) < SMALL_AHEAD
            and self._overdraft_bytes < OVERDRAFT_BYTES
        )

    def _overdraws(self, size: int | None) -> bool:
        """Whether an element of ``size`` pickled bytes (None: in shared memory, or it cannot
        be pickled) may go beyond the credits now."""
        return (
            size is not None
            and self._may_overdraw()
            and self._overdraft_bytes + size <= OVERDRAFT_BYTES
        )

    def _take_credit(self, size: int | None) -> bool:
        """Spends a credit on an element of ``size`` pickled bytes, or overdraws one; False:
        the element waits for a credit."""
        if self._credits <= 0:
            if not self._overdraws(size):
                return False
            assert size is not None
            self._overdraft.append(size)
            self._overdraft_bytes += size
        self._credits -= 1
        return True

    def _ask_for_credit(self) -> None:
        """Before waiting: tells the parent, once, that only a credit lets the worker go on
        (an element too big for the overdraft, or the overdraft full), as the parent grants
        credits in batches."""
        if (
            self._credits <= 0
            and not self._asked
            and self._has_work()
            and self._spec.buffer_size > 0
        ):
            self._send((self._generation, WANTS_CREDIT, self._credits, None, (), ()))
            self._asked = True

    def _add_credits(self, credits: int) -> None:
        if credits > 0:
            self._asked = False
        self._credits += credits
        for _ in range(min(credits, len(self._overdraft))):
            self._overdraft_bytes -= self._overdraft.popleft()

    def _reset_credits(self, credits: int) -> None:
        """A new generation: ``credits``, no overdraft, and the element waiting is dropped
        (its blocks go back to the pool)."""
        self._credits = credits
        self._asked = False
        self._overdraft.clear()
        self._overdraft_bytes = 0
        if self._waiting is not None:
            _shm.release_blocks(self._waiting[1])
            self._waiting = None

    def _read_ahead(self) -> bool:
        """Computes ahead while it may not send; returns whether it did (the pipeline's own
        read-ahead does it here)."""
        return False

    def _pipeline(self) -> Any:
        """The iterator whose stage statistics are reported."""
        return self._it

    def _handle(self, message: tuple[Any, ...]) -> bool:
        kind = message[0]
        if kind == "credit":
            self._add_credits(message[1])
            _shm.release_blocks(message[2])
        elif kind == "set_state":
            _, self._generation, state, credits, names = message
            _shm.release_blocks(names)
            self._reset_credits(credits)
            self._finished = False
            if self._it is not None:
                try:
                    self._it.set_state(state)
                except Exception as e:  # noqa: BLE001 - reported on the next request
                    self._send_error(e)
                    self._finish_with_error()
        elif kind == "stop":
            return False
        return True

    def _send(self, message: tuple[Any, ...]) -> None:
        self._write(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _write(self, data: bytes) -> None:
        if self._warnings:
            self._send_warnings()
        self._output.send_bytes(data)

    def _write_element(self, data: bytes) -> None:
        self._write(data)
        self._unreported = True  # statistics are due before the worker next waits

    def _queue_warning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        self._warnings.append((category, str(message), filename, lineno))

    def _send_warnings(self) -> None:
        while self._warnings:
            warning = self._warnings.popleft()
            try:
                data = _dumps_element((STATS_GENERATION, WARNING, warning, None, (), ()))
            except Exception:  # noqa: BLE001 - a category that cannot travel: its name does
                category, text, filename, lineno = warning
                fallback = (RuntimeWarning, f"{category.__name__}: {text}", filename, lineno)
                data = _dumps_element((STATS_GENERATION, WARNING, fallback, None, (), ()))
            self._output.send_bytes(data)

    def _send_error(self, error: BaseException, dropped: Sequence[str] = ()) -> None:
        """Sends ``error``, and ``dropped``: blocks freed that a message which could not be
        sent was to name (the parent forgets them with any message)."""
        self._report_stats()
        self._send((self._generation, ERROR, _error_message(error), None, (), dropped))

    def _finish_with_error(self) -> None:
        # The stream stops at its error; the parent re-raises it until the next set_state.
        self._finished = True
        self._credits = max(self._credits - 1, 0)

    def _send_element(
        self, value: Any, state: Any, names: list[str], dropped: Sequence[str] = ()
    ) -> int | None:
        """Sends one element whose arrays are in blocks ``names``, with the blocks this worker
        freed (``dropped`` and those since the last message, named only now).

        Returns:
          The message's size, or None when ``value`` could not be pickled: that was sent as
          an error in its place.
        """
        dropped = [*dropped, *_shm.take_dropped()]
        message = (self._generation, ELEMENT, value, state, names, dropped)
        try:
            data = _dumps_element(message)
        except Exception as failure:  # noqa: BLE001 - sent as the element's error
            _shm.release_blocks(names)
            self._send_unpicklable(failure, dropped)
            return None
        self._write_element(data)
        return len(data)

    def _send_unpicklable(self, failure: Exception, dropped: Sequence[str] = ()) -> None:
        """Sends, in an element's place, the error that it could not be pickled."""
        error = TypeError(
            f"Worker {self._spec.index} produced an element that cannot be pickled and "
            f"therefore cannot be sent to the main process: {type(failure).__name__}: "
            f"{failure}. Convert it to NumPy arrays / plain Python values in the pipeline."
        )
        error.__cause__ = failure
        self._send_error(error, dropped)

    def _produce(self) -> None:
        if self._build_error is not None:
            self._send_error(self._build_error)
            self._finish_with_error()
            return
        it = self._it
        # Elements that need no shared memory go several to a message while the next one is
        # expected within _GROUP_S of the first (the last one's time foretells it): a message
        # costs both sides a system call, and often a wake-up, per element. Each is pickled
        # alone, so its size is known for the overdraft.
        blobs: list[bytes] = []
        deadline = time.perf_counter() + _GROUP_S
        while True:
            began = time.perf_counter()
            if self._waiting is not None:  # _can_produce found it may go now
                pending, self._waiting = self._waiting, None
            else:
                try:
                    element = next(it)
                except StopIteration:
                    self._send_blobs(blobs)
                    self._report_stats()
                    self._send((self._generation, END, None, it.get_state(), (), ()))
                    self._finished = True
                    self._credits -= 1
                    return
                except Exception as e:  # noqa: BLE001 - re-raised in the parent
                    self._send_blobs(blobs)
                    self._send_error(e)
                    self._finish_with_error()
                    return
                state = it.get_state()
                tree, names = _shm.copy_to_shm(element, self._min_shm_size)
                if names:
                    pending = ((tree, state), names, None)
                else:
                    try:
                        blob = _dumps_element((tree, state))
                    except Exception as failure:  # noqa: BLE001 - sent as its error, in its place
                        self._send_blobs(blobs)
                        self._send_unpicklable(failure)
                        self._finish_with_error()
                        return
                    pending = (blob, [], len(blob))
            payload, names, size = pending
            if names:
                self._send_blobs(blobs)
                if self._take_credit(None):
                    tree, state = payload
                    self._send_in_shm(tree, state, names)
                else:
                    self._waiting = pending
                return
            if not self._take_credit(size):
                self._send_blobs(blobs)
                self._waiting = pending
                return
            blobs.append(payload)
            now = time.perf_counter()
            if not (self._credits > 0 or self._may_overdraw()) or 2 * now - began >= deadline:
                self._send_blobs(blobs)
                return

    def _send_in_shm(self, tree: Any, state: Any, names: list[str]) -> None:
        """Sends an element whose arrays are in blocks ``names`` (encoded only now, so the
        blocks freed meanwhile go with it); the stream ends at one that cannot be pickled."""
        if self._send_element(tree, state, names) is None:
            self._finish_with_error()

    def _send_blobs(self, blobs: list[bytes]) -> None:
        """Sends pickled ``(element, state)`` pairs in one message, and the blocks this worker
        freed."""
        if blobs:
            message: tuple[Any, ...] = (
                self._generation,
                PICKLED_ELEMENTS,
                blobs,
                None,
                [],
                _shm.take_dropped(),
            )
            self._write_element(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _produce_and_report(self) -> None:
        type(self)._produce(self)
        if not self._finished and time.monotonic() >= self._next_report:
            self._report_stats()

    def _report_before_waiting(self) -> None:
        # Waiting for credits or work may last (a dispatching worker never ends, and the last
        # elements of an epoch are followed by no request): elements not reported yet are, once
        # STATS_WAITING_INTERVAL_S passed since the last report and no message came meanwhile.
        if not self._unreported:
            return
        wait = self._next_report - STATS_INTERVAL_S + STATS_WAITING_INTERVAL_S - time.monotonic()
        if wait > 0 and self._control.poll(wait):
            return  # the worker goes on
        self._report_stats()

    def _report_stats(self) -> None:
        """Sends the pipeline's stage statistics, if it tracks them (before END and ERROR)."""
        if not self._tracking:
            return
        from grain_core.dataset.stats import worker_stage_snapshot

        self._send((STATS_GENERATION, STATS, worker_stage_snapshot(self._pipeline()), None, (), ()))
        self._next_report = time.monotonic() + STATS_INTERVAL_S
        self._unreported = False


class _DispatchWorkerLoop(_WorkerLoop):
    """A worker of the dispatching engine (``grain_core.dataset.mp_dispatch``).

    It computes the runs of positions the parent assigns, in assignment order, and sends each
    element with the CPU seconds the worker has used so far instead of a state (the parent knows every position). An
    error is sent for its position and the worker goes on with the next one: another class's
    positions queued behind it are still needed.

    It computes the positions assigned ahead (``PositionReader``: in its main thread while
    reads are CPU-bound, also while it waits for credits; on read threads while they wait on
    I/O); results are sent while it has credits, so the shared memory in flight stays bounded
    however long the runs, and small ones also on overdraft (``per_worker_buffer_size`` 0:
    never).

    Control: ``("assign", generation, runs, credits, names)`` adds runs ``(class, first slice
    index, count)`` and credits and hands back blocks; a new generation first drops the runs
    not yet computed and the credits left.
    """

    def __init__(self, spec: WorkerSpec, control: Any, output: Any) -> None:
        super().__init__(spec, control, output)
        self._reader: Any = None
        self._pending = 0
        self._cpu_start = time.process_time()
        self._result_bytes = 0  # pickled, per result of the last message without blocks

    def _build_pipeline(self, ds: Any) -> None:
        from grain_core.dataset.mp_dispatch import PositionReader

        spec = self._spec
        self._reader = self._it = PositionReader(ds, spec.index, spec.count, spec.options)
        self._cpu_start = time.process_time()  # start-up is not the cost of an element

    def _pipeline(self) -> Any:
        return None if self._reader is None else self._reader.pipeline

    def _has_work(self) -> bool:
        return self._pending > 0

    def _ask_for_credit(self) -> None:
        """The parent sends credits through the positions it waits for (``mp_dispatch``)."""

    def _read_ahead(self) -> bool:
        # Positions assigned, no credit to send them: compute them now, as read threads would.
        return self._pending > 0 and self._reader is not None and self._reader.read_ahead()

    def _handle(self, message: tuple[Any, ...]) -> bool:
        if message[0] != "assign":
            return message[0] != "stop"
        _, generation, runs, credits, names = message
        _shm.release_blocks(names)
        if generation != self._generation:
            self._generation = generation
            self._pending = 0
            self._reset_credits(0)
            if self._reader is not None:
                self._reader.reset()
        self._add_credits(credits)
        if runs:
            self._pending += sum(run[2] for run in runs)
            if self._reader is not None:
                self._reader.assign(runs)
        return True

    def _produce(self) -> None:
        if self._build_error is not None:
            self._pending -= 1
            self._take_credit(0)
            self._send_error(self._build_error)
            return
        # Elements read already (ahead, or in the block of the last one), that need no shared
        # memory, go together (for _GROUP_S at most): small elements cost the parent a message
        # each.
        group: list[Any] = []
        deadline = time.perf_counter() + _GROUP_S
        waiting, self._waiting = self._waiting, None
        while True:
            if waiting is None:
                self._pending -= 1
                try:
                    element = self._reader.next()
                except Exception as e:  # noqa: BLE001 - re-raised in the parent at its position
                    self._take_credit(0)
                    self._send_group(group)
                    self._send_error(e)
                    return
                tree, names = _shm.copy_to_shm(element, self._min_shm_size)
                # Its size matters only for an overdraft.
                size = 0 if self._credits > 0 else self._size_for_overdraft(tree, names)
                if not self._take_credit(size):
                    self._waiting = (tree, names, size)
                    self._send_group(group)
                    return
            else:  # _can_produce found it may go now
                (tree, names, size), waiting = waiting, None
                self._take_credit(size)
            if names:
                self._send_group(group)
                self._send_result(tree, self._cpu_seconds(), names)
                return
            group.append(tree)
            if not (
                self._pending > 0
                and (self._credits > 0 or self._may_overdraw())
                and self._reader.ready()
                and time.perf_counter() < deadline
            ):
                self._send_group(group)
                return

    def _cpu_seconds(self) -> float:
        # The process's CPU time so far, read threads included: what the parent sizes this
        # worker's commitments by.
        return time.process_time() - self._cpu_start

    def _send_group(self, group: list[Any]) -> None:
        """Sends the elements of ``group`` (none in shared memory) in one message, or one
        message each when one of them cannot be pickled (that one is sent as its error)."""
        if not group:
            return
        cpu_seconds = self._cpu_seconds()
        dropped: Sequence[str] = _shm.take_dropped()
        if len(group) > 1:
            message: tuple[Any, ...] = (self._generation, ELEMENTS, group, cpu_seconds, [], dropped)
            try:
                data = _dumps_element(message)
            except Exception:  # noqa: BLE001 - one of them cannot be pickled: each alone below
                pass
            else:
                self._write_element(data)
                self._result_bytes = len(data) // len(group)
                return
        for element in group:  # one, or one of them cannot be pickled
            self._send_result(element, cpu_seconds, [], dropped)
            dropped = ()

    def _send_result(
        self, tree: Any, cpu_seconds: float, names: list[str], dropped: Sequence[str] = ()
    ) -> None:
        """Sends one result (see ``_send_element``); one that cannot be pickled is sent as its
        error and the worker goes on with the next position."""
        size = self._send_element(tree, cpu_seconds, names, dropped)
        if size is not None and not names:
            self._result_bytes = size

    def _size_for_overdraft(self, tree: Any, names: list[str]) -> int | None:
        """The pickled size of result ``tree``; None (it waits for a credit) if its arrays
        are in blocks ``names``, it cannot be pickled, or the last results were too big to
        overdraw a few (such results are not pickled twice)."""
        if names or self._result_bytes > OVERDRAFT_BYTES // 4:
            return None
        if type(tree) in _FIXED_SIZE_TYPES:
            return 0
        try:
            return len(pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001 - it is sent when a credit comes, and fails there
            return None


def _readiness_check(conn: Any) -> Any:
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


def _dumps_element(message: tuple[Any, ...]) -> bytes:
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - lambdas and local classes need cloudpickle
        import cloudpickle

        return cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[no-any-return]


def _min_shm_size(it: Any) -> int:
    options = it._ctx.dataset_options
    if "min_shm_size" in getattr(options, "_explicit", ()):
        return int(options.min_shm_size)
    return _shm.DEFAULT_MIN_SHM_SIZE


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
        f" A SIGBUS usually means {_shm._SHM_DIR} is full (Docker gives containers 64 MiB): "
        "give the container more shared memory (`docker run --shm-size=2g`) or reduce "
        "per_worker_buffer_size or the number of workers."
    ),
}


#: Seconds that stopping a pool gives its workers to exit before they are killed.
_STOP_TIMEOUT_S = 5.0


class WorkerDiedError(RuntimeError):
    """A worker process ended without being asked to."""


class UnreadableElementError(RuntimeError):
    """A worker sent an element that cannot be unpickled in the parent: the message, and any
    elements with it, are lost, so the iterator stops at it until ``set_state``."""


def unreadable_element_error(worker: str, error: Exception) -> UnreadableElementError:
    """The error for worker ``worker``'s message that unpickling failed on with ``error``."""
    return UnreadableElementError(
        f"Worker process {worker} sent an element that cannot be unpickled in the main "
        f"process: {type(error).__name__}: {error}. The iterator stops here (restore a "
        "checkpoint with set_state to go on). Elements must be rebuilt in the main process "
        "from their pickle: NumPy arrays and plain Python values always can be."
    )


class WorkerPool:
    """The parent's handles on a set of worker processes. Holds no reference to the iterator
    that uses it, so it can be finalised when that iterator is garbage-collected."""

    def __init__(self, specs: Sequence[WorkerSpec]) -> None:
        self._closed = False
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
        try:
            for spec in specs:
                control_r, control_w = multiprocessing.Pipe(duplex=False)
                output_r, output_w = multiprocessing.Pipe(duplex=False)
                proc = process_cls(
                    target=worker_main,
                    args=(spec, control_r, output_w),
                    name=f"grain_core-worker-{spec.index}",
                    daemon=True,
                )
                proc.start()
                control_r.close()
                output_w.close()
                self._procs.append(proc)
                self._controls.append(control_w)
                self._outputs.append(output_r)
                self._output_ready.append(_readiness_check(output_r))
        except BaseException:
            self.shutdown()
            raise
        self._poller = _WorkersPoller(self._outputs, [proc.sentinel for proc in self._procs])

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

    def ready_workers(self, timeout: float | None = 0.0) -> list[int]:
        """The workers with a message waiting, in index order; waits up to ``timeout`` seconds
        (None: until there is one) when there is none.

        Raises:
          WorkerDiedError: A worker ended with no message left to read.
        """
        ready, ended = self._poller.poll(timeout)
        for index in ended:
            if index not in ready:
                raise self._died(index)
        return ready

    def recv(self, index: int, ready: bool = False) -> tuple[Any, ...]:
        """Returns the next message of worker ``index``, waiting for it.

        Args:
          index: The worker.
          ready: ``ready_workers`` just listed the worker: a message (or the end of the pipe)
            is there, no need to check.

        Raises:
          WorkerDiedError: If the worker process ended.
          UnreadableElementError: If the message cannot be unpickled.
        """
        conn = self._outputs[index]
        if not ready and not self._output_ready[index]():
            multiprocessing.connection.wait([conn, self._procs[index].sentinel])
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

    def _died(self, index: int) -> WorkerDiedError:
        proc = self._procs[index]
        proc.join(timeout=5)
        code = proc.exitcode
        _shm.unlink_prefix(self._prefixes[index])
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

        Workers get ``_STOP_TIMEOUT_S`` in all to exit (one busy in a long user function is
        killed after it), not that long each."""
        if self._closed:
            return
        self._closed = True
        for index in range(len(self._controls)):
            self.send(index, ("stop",))
        self._drain_until_exit(time.monotonic() + _STOP_TIMEOUT_S)
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for index, proc in enumerate(self._procs):
            proc.join(timeout=5)
            _shm.unlink_prefix(self._prefixes[index])
        for conn in (*self._controls, *self._outputs):
            conn.close()
        for proc in self._procs:
            if proc.exitcode is not None:
                proc.close()

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

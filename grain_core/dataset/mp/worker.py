"""The worker side shared by both ``mp_prefetch`` engines: what a worker is given, how its
process is set up, and the loop that sends elements against credits.

An engine starts its workers with ``start_workers``, naming its entry point
(``rotation.worker_main`` or ``dispatch_worker.worker_main``), which runs ``run_worker`` with its
subclass of ``WorkerLoop``. The loop owns what both engines do alike: credits and the
overdraft (``protocol``), sending elements (in shared memory or pickled), errors, warnings and
stage statistics (before an error or the end, and whenever the parent asks: ``STATS_REQUEST``
is answered by every worker, tracking or not, so the parent can wait for the answer). A
traced worker (``STAGE_TRACING``) also records spans of its own: each message it writes to the
parent (``SEND_SPAN``, category ``transport``) and each wait for a control message, a credit
or work (``WAIT_SPAN``, category ``wait``), on the clock and in the ring buffer of its stages'
spans (``PipelineObserver.span_wrapper``), so they travel with its statistics, an opaque
payload (``PipelineObserver.worker_snapshot``). The engine's subclass says what producing means and which control messages
it takes.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from grain_core import plugins
from grain_core._ipc import shm
from grain_core._ipc.errors import error_payload
from grain_core._ipc.pool import WorkerPool, readiness_check
from grain_core.dataset.iterator import pipeline_observer
from grain_core.dataset.mp.pickling import (
    EngineInput,
    PipelineNodes,
    dumps,
    dumps_message,
    register_numpy_scalar_reducers,
)
from grain_core.dataset.mp.protocol import (
    SHARED_AHEAD_BYTES,
    STATS_REQUEST,
    element_message,
    error_message,
    stats_message,
    warning_message,
)
from grain_core.dataset.read_concurrency import read_inline_while_cpu_bound
from grain_core.dataset.transfer_cost import OVERDRAFT_BYTES, SMALL_AHEAD
from grain_core.options import MultiprocessingOptions

__all__ = [
    "GROUP_S",
    "WarmWorkers",
    "WorkerLease",
    "WorkerLoop",
    "WorkerSpec",
    "lease_workers",
    "release_workers",
    "run_worker",
    "start_worker_server",
    "start_workers",
]

#: What the workers' forkserver imports once, before its first fork: both engines' worker
#: sides (and through them NumPy and the dataset layer), and cloudpickle.
WORKER_PRELOAD = ("grain_core.dataset.mp.rotation", "grain_core.dataset.mp.dispatch", "cloudpickle")

#: Seconds a worker may spend gathering elements that need no shared memory into one message
#: (the first of them waits that long for the others at most).
GROUP_S = 0.0005
#: Trace span names of a worker's own work: writing a message, waiting for the parent.
SEND_SPAN = "send to the main process"
WAIT_SPAN = "wait for the main process"


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
      nodes: What builds the worker's nodes from the pipeline (``EngineInput.nodes``).
      shm_prefix: Name prefix of this worker's shared-memory blocks.
      pool_size: Free blocks of one size the worker keeps for reuse.
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
        nodes: PipelineNodes,
        shm_prefix: str,
        pool_size: int,
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
        self.nodes = nodes
        self.shm_prefix = shm_prefix
        self.pool_size = pool_size
        self.buffer_size = buffer_size

    @classmethod
    def for_engine(
        cls,
        engine: EngineInput,
        index: int,
        count: int,
        *,
        options: Any,
        plugins: list[str] | None,
        results_in_flight: int,
        buffer_size: int,
        sequential_slice: bool = False,
        state: Any = None,
    ) -> WorkerSpec:
        """The spec of worker ``index`` of ``count`` running ``engine``'s pipeline: its
        payload, its own block prefix, and free blocks for ``results_in_flight`` results (two
        each, and two more).

        Args:
          engine: The engines' input (its payload is pickled once, for every worker).
          index / count: This worker's index and the number of workers.
          options: As the attribute.
          plugins: As the attribute.
          results_in_flight: The results the parent lets this worker have in flight.
          buffer_size: As the attribute.
          sequential_slice: As the attribute.
          state: As the attribute.
        """
        dataset, init_fn = engine.payload()
        return cls(
            index=index,
            count=count,
            init_fn=init_fn,
            dataset=dataset,
            sequential_slice=sequential_slice,
            state=state,
            plugins=plugins,
            options=options,
            nodes=engine.nodes,
            shm_prefix=WorkerPool.new_prefix(index),
            pool_size=2 * results_in_flight + 2,
            buffer_size=buffer_size,
        )


def start_worker_server() -> None:
    """Starts the workers' server now, if it is not running: it imports ``WORKER_PRELOAD``
    while this process goes on, so the first workers fork from a ready server instead of
    waiting for a new interpreter's imports (0.4-0.5 s)."""
    WorkerPool.start_server(WORKER_PRELOAD)


def start_workers(
    specs: Sequence[WorkerSpec],
    entry: Callable[[WorkerSpec, Any, Any], None],
    options: MultiprocessingOptions,
) -> WorkerPool:
    """Starts one worker process per spec, each running ``entry`` (an engine's
    ``worker_main``), watched as ``options`` say (``stall_warning_s``, ``stall_timeout_s``)."""
    return WorkerPool(
        specs,
        entry,
        WORKER_PRELOAD,
        stall_warning_s=options.stall_warning_s,
        stall_timeout_s=options.stall_timeout_s,
    )


#: Generations an iterator may use before the next iterator over the same workers starts:
#: each iterator numbers its generations from its own multiple of this, so the messages of an
#: iterator that came before are told apart (and dropped) however often it was restored.
_GENERATIONS_PER_LEASE = 1 << 32


@dataclasses.dataclass(eq=False)
class WorkerLease:
    """Running worker processes lent to one iterator.

    Attributes:
      pool: The processes.
      key: What the workers were started for (engine, worker options): another iterator
        reuses them only for an equal key.
      recycled: Per worker, the parent's side of its block pool (kept with the workers: an
        array the consumer still holds hands its block back to them when it is collected).
      first_generation: The first generation of the iterator holding the lease; a new one
        ``reused`` workers have not heard of, so their work of the last iterator is dropped.
      reused: The workers ran for an iterator before this one.
    """

    pool: WorkerPool
    key: object
    recycled: list[shm.RecycledBlocks]
    first_generation: int = 0
    reused: bool = False


class WarmWorkers:
    """The idle workers of one pipeline, kept between its iterators
    (``MultiprocessingOptions.persistent_workers``). Thread-safe."""

    def __init__(self) -> None:
        self._idle: list[WorkerLease] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self, key: object) -> WorkerLease | None:
        """Idle running workers started for ``key``, lent to a new iterator (None: none)."""
        with self._lock:
            leases, self._idle = self._idle, []
            found = None
            for lease in leases:
                if not lease.pool.running():
                    lease.pool.shutdown()
                elif found is None and lease.key == key:
                    found = lease
                else:
                    self._idle.append(lease)
        if found is not None:
            found.first_generation += _GENERATIONS_PER_LEASE
            found.reused = True
        return found

    def keep(self, lease: WorkerLease) -> None:
        """Keeps ``lease``'s workers for the next iterator; stops them if they cannot be
        reused (one ended, this process does not own them, or ``close`` was called)."""
        with self._lock:
            if not self._closed and lease.pool.running():
                self._idle.append(lease)
                return
        lease.pool.shutdown()

    def close(self) -> None:
        """Stops the idle workers, and those lent out when they come back. Idempotent."""
        with self._lock:
            self._closed = True
            leases, self._idle = self._idle, []
        for lease in leases:
            lease.pool.shutdown()


def lease_workers(
    warm: WarmWorkers | None,
    key: object,
    make_specs: Callable[[], Sequence[WorkerSpec]],
    entry: Callable[[WorkerSpec, Any, Any], None],
    options: MultiprocessingOptions,
) -> WorkerLease:
    """Worker processes for one iterator: idle ones ``warm`` keeps for ``key``, else new ones
    started from ``make_specs()`` running ``entry`` (see ``start_workers``)."""
    lease = None if warm is None else warm.take(key)
    if lease is None:
        specs = make_specs()
        pool = start_workers(specs, entry, options)
        lease = WorkerLease(pool, key, [shm.RecycledBlocks() for _ in specs])
    return lease


def release_workers(
    warm: WarmWorkers | None,
    lease: WorkerLease,
    held: Callable[[], Iterable[tuple[int, list[str]]]] | None = None,
) -> None:
    """The iterator holding ``lease`` ends: its workers stop, or wait in ``warm`` for the
    next one. ``held()`` names the blocks of results it received and never handed out, by
    worker: they go back to their workers with the next iterator's first message.
    """
    if warm is None:
        lease.pool.shutdown()
        return
    if held is not None:
        for worker, names in held():
            lease.recycled[worker].released.extend(names)
    warm.keep(lease)


def run_worker(
    loop_class: Callable[[WorkerSpec, Any, Any], WorkerLoop],
    spec: WorkerSpec,
    control: Any,
    output: Any,
) -> None:
    """Sets up a worker process for the pipeline (the parent's plugins, the block pool, the
    element pickling) and runs ``loop_class``'s loop until the parent stops it."""
    if spec.plugins is not None:
        os.environ[plugins.PLUGINS_ENV] = ",".join(spec.plugins)
        plugins.reset()
    shm.enable_block_pool(spec.pool_size, 2 * SHARED_AHEAD_BYTES)
    register_numpy_scalar_reducers()
    read_inline_while_cpu_bound()
    loop_class(spec, control, output).run()


class WorkerLoop:
    """A worker's loop: reads control messages, produces elements while it has credits (or
    the overdraft allows), and sends them. Subclasses (one per engine) build the pipeline,
    produce, and handle their control messages."""

    def __init__(self, spec: WorkerSpec, control: Any, output: Any) -> None:
        self._spec = spec
        self._control = control
        self._output = output
        self._generation = 0
        self._credits = 0
        self._finished = False
        self._it: Any = None
        self._build_error: BaseException | None = None
        self._min_shm_size = shm.DEFAULT_MIN_SHM_SIZE
        self._control_ready = readiness_check(control)
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
        self._asked = False  # the worker asked for a credit, none came since

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
                    self._take(self._wait_for_control())
                    continue
                while self._control_ready():
                    self._take(pickle.loads(self._control.recv_bytes()))
                if self._can_produce():
                    self._produce()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # The parent closed our pipes: it stops this worker, or it is gone.
        except BaseException:
            # Out of the loop (SystemExit or KeyboardInterrupt in user code): the parent reads
            # what was sent before, and removes those blocks once it sees this process end.
            keep_sent = True
            raise
        finally:
            if self._it is not None:
                self._it.close()
            shm.unlink_pool(keep_sent)

    def _build(self) -> None:
        spec = self._spec
        try:
            if spec.init_fn is not None:
                pickle.loads(spec.init_fn)(spec.index, spec.count)
            self._build_pipeline(pickle.loads(spec.dataset))
            self._min_shm_size = _min_shm_size(self._pipeline())
        except Exception as e:  # noqa: BLE001 - reported to the parent on its next request
            self._build_error = e
            return
        wrap = pipeline_observer().span_wrapper(self._pipeline())
        if wrap is not None:
            # Chosen once: an untraced worker runs the plain methods, with no check.
            self._write = wrap(self._write, SEND_SPAN, "transport")  # type: ignore[method-assign]
            self._receive_control = wrap(self._receive_control, WAIT_SPAN, "wait")  # type: ignore[method-assign]

    def _build_pipeline(self, ds: Any) -> None:
        """Builds the engine's iterator over the unpickled pipeline ``ds``."""
        raise NotImplementedError

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
        """Before waiting: tells the parent that only a credit lets the worker go on, for
        engines whose parent needs telling."""

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
            shm.release_blocks(self._waiting[1])
            self._waiting = None

    def _read_ahead(self) -> bool:
        """Computes ahead while it may not send; returns whether it did (the pipeline's own
        read-ahead does it here)."""
        return False

    def _pipeline(self) -> Any:
        """The iterator whose stage statistics are reported."""
        return self._it

    def _take(self, message: tuple[Any, ...]) -> None:
        if message[0] == STATS_REQUEST:
            self._send_stats(message[1])
        else:
            self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> None:
        """Takes control message ``message`` of the engine's kinds."""
        raise NotImplementedError

    def _send(self, message: tuple[Any, ...]) -> None:
        self._write(dumps(message))

    def _write(self, data: bytes) -> None:
        if self._warnings:
            self._send_warnings()
        self._output.send_bytes(data)

    def _wait_for_control(self) -> tuple[Any, ...]:
        """Waits for the parent's next control message."""
        return pickle.loads(self._receive_control())  # type: ignore[no-any-return]

    def _receive_control(self) -> bytes:
        return self._control.recv_bytes()

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
                data = dumps_message(warning_message(*warning))
            except Exception:  # noqa: BLE001 - a category that cannot travel: its name does
                category, text, filename, lineno = warning
                fallback = f"{category.__name__}: {text}"
                data = dumps_message(warning_message(RuntimeWarning, fallback, filename, lineno))
            self._output.send_bytes(data)

    def _send_error(self, error: BaseException, dropped: Sequence[str] = ()) -> None:
        """Sends ``error``, and ``dropped``: blocks freed that a message which could not be
        sent was to name (the parent forgets them with any message)."""
        self._send_stats()
        self._send(error_message(self._generation, error_payload(error), dropped))

    def _send_element(
        self, value: Any, extra: Any, names: list[str], dropped: Sequence[str] = ()
    ) -> int | None:
        """Sends one element whose arrays are in blocks ``names``, with the engine's ``extra``
        (``protocol.element_message``) and the blocks this worker freed (``dropped`` and those
        since the last message, named only now).

        Returns:
          The message's size, or None when ``value`` could not be pickled: that was sent as
          an error in its place.
        """
        dropped = [*dropped, *shm.take_dropped()]
        message = element_message(self._generation, value, extra, names, dropped)
        try:
            data = dumps_message(message)
        except Exception as failure:  # noqa: BLE001 - sent as the element's error
            shm.release_blocks(names)
            self._send_unpicklable(failure, dropped)
            return None
        self._write(data)
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
        """Produces and sends what the credits (or the overdraft) allow now."""
        raise NotImplementedError

    def _send_stats(self, answers: int | None = None) -> None:
        """Sends the pipeline's stage statistics: unasked (before END and ERROR) if it tracks
        them, and always in answer to request number ``answers`` (None if it does not track
        them), which the parent waits for."""
        snapshot = pipeline_observer().worker_snapshot(self._pipeline())
        if snapshot is not None or answers is not None:
            self._send(stats_message(snapshot, answers))


def _min_shm_size(it: Any) -> int:
    options = it._ctx.dataset_options
    if "min_shm_size" in getattr(options, "_explicit", ()):
        return int(options.min_shm_size)
    return shm.DEFAULT_MIN_SHM_SIZE

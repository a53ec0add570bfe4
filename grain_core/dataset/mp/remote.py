"""Dispatch on a worker backend other than local processes (``MultiprocessingOptions.backend``,
e.g. Ray actors from the ``grainpipe-ray`` plugin): blocks of positions go to the backend's
workers as tasks, their results come back by position.

The output and the state are those of ``dispatch.py`` (strict rotation over ``N`` strided
classes, class ``c``'s state the ``{"next_index": j}`` its worker would report), so checkpoints
restore across backends and worker counts as local ones do; ``N`` is ``num_workers``, however
many workers the backend runs.

* A task is a block of positions in the consumer's order, as runs ``(class, first slice index,
  count)``, sized from the CPU time the last ones cost (about ``_TASK_TARGET_S`` each, one
  position at first): a task's round trip through a backend costs far more than a pipe's.
* Each worker has up to ``_TASKS_PER_WORKER`` tasks queued (one computing, the next waiting),
  so it never idles for the parent's round trip; positions are handed out at most a window
  ahead of the consumer, which bounds the results held.
* A worker computes its tasks in order (``BlockComputer``: the local dispatching worker's
  reader, without shared memory) and returns each task's results with the errors in place
  (type and traceback, raised when the consumer reaches that position).
* A worker that is lost (``WorkerLostError``) has its unfinished tasks handed to the others:
  the results are filed by position, so none is lost or repeated. With every worker lost the
  iterator raises ``WorkerDiedError`` naming them.
* A restored state starts a new generation: tasks of older ones are dropped when they finish.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import time
import weakref
from typing import Any

from grain_core import plugins
from grain_core._ipc.errors import ErrorPayload, WorkerDiedError, error_payload, remote_error
from grain_core._ipc.pool import worker_jax_platforms
from grain_core.dataset.base import IterDataset
from grain_core.dataset.mp.consumer import ClassConsumer
from grain_core.dataset.mp.positions import PositionReader, dispatch_obstacle
from grain_core.dataset.mp.protocol import ELEMENT, ERROR
from grain_core.dataset.options import DatasetOptions
from grain_core.dataset.read_concurrency import read_inline_while_cpu_bound
from grain_core.options import MultiprocessingOptions
from grain_core.plugins import WorkerBackend, WorkerGroup, WorkerJob, WorkerLostError

__all__ = [
    "BackendWorkers",
    "BlockComputer",
    "BlockWorker",
    "check_remote_pipeline",
    "worker_backend",
]

_logger = logging.getLogger("grain_core")

#: CPU seconds of work per task once the cost of a position is known: a task costs the
#: backend a round trip (about a millisecond on Ray) that this amortises.
_TASK_TARGET_S = 0.02
#: Tasks queued on one worker: the one it computes and the next, so that it does not wait for
#: the parent between two.
_TASKS_PER_WORKER = 2
#: Weight of the newest task's CPU time per position in the running average.
_TIME_WEIGHT = 0.3

#: A task's result: the values in the task's order (None where an error is), the errors by
#: their place in the task, and the CPU seconds the task cost its worker.
TaskResult = tuple[list[Any], dict[int, ErrorPayload], float]


def worker_backend(options: MultiprocessingOptions) -> WorkerBackend | None:
    """The backend ``options`` names, or None for local worker processes.

    Raises:
      MissingPluginError / UnknownPluginObjectError: No installed plugin provides that name.
      TypeError: ``options.backend`` is neither a name nor a ``WorkerBackend``.
    """
    backend = options.backend
    if isinstance(backend, str):
        return None if backend == "local" else plugins.get_worker_backend(backend)
    if not isinstance(backend, WorkerBackend):
        raise TypeError(
            "MultiprocessingOptions.backend must be a worker backend name or a "
            f"grain_core.plugins.WorkerBackend (name, description, start), got {backend!r}."
        )
    return backend


def check_remote_pipeline(
    ds: IterDataset[Any], backend: WorkerBackend, has_init_fn: bool, sequential_slice: bool
) -> None:
    """Refuses what workers on ``backend`` cannot run as local ones would.

    Raises:
      ValueError: ``ds`` is not computed by position (the message names the node), or a
        ``worker_init_fn`` or ``sequential_slice`` was given.
    """
    where = f"mp_prefetch on worker backend {backend.name!r}"
    if has_init_fn:
        raise ValueError(
            f"{where} takes no worker_init_fn: any worker computes any position there. Set "
            "workers up in the pipeline (a map's transformation runs in the worker), or use "
            'backend="local".'
        )
    if sequential_slice:
        raise ValueError(f'{where} does not take sequential_slice=True; use backend="local".')
    obstacle = dispatch_obstacle(ds)
    if obstacle is not None:
        raise ValueError(
            f"{where} needs a pipeline whose elements are functions of their position, and "
            f"this one is not: {obstacle}. Move filters and other stream steps before "
            '`to_iter_dataset()` or after `mp_prefetch`, or use backend="local".'
        )


# ---------------------------------------------------------------------------- worker side
class BlockWorker:
    """``WorkerJob.make_worker``: the pipeline, pickled once, and what a worker needs to build
    its ``BlockComputer``.

    Args:
      dataset: The cloudpickled pipeline given to ``mp_prefetch``.
      classes: ``num_workers`` (the strided classes of the output).
      options: The parent iterator's ``DatasetOptions``.
      plugin_names: Plugin names loaded in the parent (None: it had loaded none).
    """

    def __init__(
        self,
        dataset: bytes,
        classes: int,
        options: DatasetOptions | None,
        plugin_names: list[str] | None,
    ) -> None:
        self.dataset = dataset
        self.classes = classes
        self.options = options
        self.plugin_names = plugin_names

    def __call__(self, index: int, count: int) -> BlockComputer:
        return BlockComputer(self, index, count)


class BlockComputer:
    """One remote worker's reader of the positions of its tasks (see ``BlockWorker``)."""

    def __init__(self, worker: BlockWorker, index: int, count: int) -> None:
        if worker.plugin_names is not None:
            os.environ[plugins.PLUGINS_ENV] = ",".join(worker.plugin_names)
            plugins.reset()
        read_inline_while_cpu_bound()
        self._reader: PositionReader | None = None
        self._build_error: BaseException | None = None
        try:
            self._reader = PositionReader(
                pickle.loads(worker.dataset),
                index,
                worker.classes,
                worker.options,
                shared_memory=False,
            )
        except Exception as e:  # noqa: BLE001 - reported at every position of every task
            self._build_error = e

    def __call__(self, runs: list[tuple[int, int, int]]) -> TaskResult:
        """Computes the positions of ``runs`` ``(class, first slice index, count)``, in order."""
        start = time.process_time()
        total = sum(run[2] for run in runs)
        if self._reader is None:
            assert self._build_error is not None
            payload = error_payload(self._build_error)
            return [None] * total, dict.fromkeys(range(total), payload), 0.0
        reader = self._reader
        reader.assign(runs)
        values: list[Any] = []
        errors: dict[int, ErrorPayload] = {}
        for k in range(total):
            try:
                values.append(reader.next())
            except Exception as e:  # noqa: BLE001 - raised in the parent at its position
                values.append(None)
                errors[k] = error_payload(e)
        return values, errors, time.process_time() - start


# ---------------------------------------------------------------------------- parent side
class BackendWorkers:
    """The producer on a worker backend's workers (``consumer.Producer``): the tasks each
    worker has, results filed in the consumer's ``held`` by ``(class, slice index)``. Holds no
    iterator, so an unclosed one is collected and the workers released.

    Args:
      consumer: The ``ClassConsumer`` (its pipeline, options, frontiers and held results).
      backend: Where the workers run.
    """

    def __init__(self, consumer: ClassConsumer, backend: WorkerBackend) -> None:
        # Weakly: the consumer holds its producer, and an iterator dropped unclosed must free
        # both (and stop the workers) without waiting for the cyclic garbage collector.
        self._consumer = weakref.proxy(consumer)
        self._backend = backend
        self._count = n = consumer.count
        self._max_task = max(1, consumer.reader.read_options.prefetch_buffer_size)
        self._assigned = [0] * n  # per class: next slice index not yet in a task
        # ticket -> (worker, generation, runs); per worker, tasks queued on it.
        self._tasks: dict[int, tuple[int, int, list[tuple[int, int, int]]]] = {}
        self._queued: collections.Counter[int] = collections.Counter()
        self._orphans: collections.deque[list[tuple[int, int, int]]] = collections.deque()
        self._lost: list[str] = []  # why workers were lost, as the backend said
        self._started: list[int] = []
        self._task_size = 1  # positions per task: one until their cost is known
        self._cpu_per_position = 0.0
        self._generation = 0
        self._restarted = False
        self._group: WorkerGroup | None = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------- the producer
    def start(self, options: DatasetOptions) -> None:
        """Starts the workers and gives them their first tasks.

        Raises:
          TypeError: The backend's ``start`` returned no ``WorkerGroup``.
          Exception: What the backend raised starting its workers.
        """
        dataset, _ = self._consumer.engine.payload()
        job = WorkerJob(
            num_workers=self._count,
            make_worker=BlockWorker(dataset, self._count, options, plugins.loaded_plugin_names()),
            environ={"JAX_PLATFORMS": worker_jax_platforms()},
        )
        group = self._backend.start(job)
        if not isinstance(group, WorkerGroup):
            raise TypeError(
                f"Worker backend {self._backend.name!r} started {group!r}, which is not a "
                "grain_core.plugins.WorkerGroup."
            )
        self._group = group
        self._finalizer = weakref.finalize(self, group.close)
        self._started = group.workers()
        self._forget_work()

    def stop(self) -> None:
        """Releases the workers."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = self._group = None
            self._tasks.clear()
            self._queued.clear()

    def take(self, tag: Any, value: Any) -> Any:
        del tag
        return value

    def restart(self) -> None:
        self._restarted = True  # tasks are re-planned on the next fill, once for all classes

    def request_stats(self, worker: int) -> None:
        """Remote workers send no stage statistics: nothing to ask for."""
        del worker

    def receive_stats(self, worker: int) -> None:
        """Remote workers send no stage statistics: nothing to wait for."""
        del worker

    def fill(self, cls: int, j: int) -> None:
        """Hands out tasks, waits for at least one to finish and files what finished."""
        del cls, j  # tasks go in the consumer's order: what it waits for is in the first
        group = self._group
        assert group is not None
        if self._restarted:
            self._generation += 1
            self._consumer.held.clear()
            self._forget_work()
        self._assign()
        if not self._tasks:
            raise AssertionError("the position the consumer waits for is in no task")
        for ticket, result in group.wait(timeout=None):
            self._file(ticket, result)
        self._assign()

    def _forget_work(self) -> None:
        """No position is in a task of this generation: they start from the consumer's."""
        self._restarted = False
        self._orphans.clear()
        self._assigned = list(self._consumer.frontier)

    def _assign(self) -> None:
        """Gives each worker with room a task, in turns, until none has room or nothing is
        left within the window. Tasks of lost workers go first."""
        group = self._group
        assert group is not None
        workers = group.workers()
        if not workers:
            self._every_worker_lost()
        window = -(-self._task_size * (_TASKS_PER_WORKER * len(workers) + 1) // self._count) + 1
        while True:
            gave = False
            for worker in sorted(workers, key=self._queued.__getitem__):
                if self._queued[worker] >= _TASKS_PER_WORKER:
                    continue
                runs = self._orphans.popleft() if self._orphans else self._next_task(window)
                if not runs:
                    return
                ticket = group.submit(worker, runs)
                self._tasks[ticket] = (worker, self._generation, runs)
                self._queued[worker] += 1
                gave = True
            if not gave:
                return

    def _next_task(self, window: int) -> list[tuple[int, int, int]]:
        """The next ``_task_size`` positions in the consumer's order (class by class within a
        row of slice indices), at most ``window`` ahead of the consumer in each class."""
        consumer = self._consumer
        limits = [
            min(consumer.lengths[c], consumer.frontier[c] + window) for c in range(self._count)
        ]
        assigned = self._assigned
        counts = [0] * self._count
        first = list(assigned)
        size = self._task_size
        while size > 0:
            open_classes = [c for c in range(self._count) if assigned[c] < limits[c]]
            if not open_classes:
                break
            row = min(assigned[c] for c in open_classes)
            behind = [c for c in open_classes if assigned[c] == row]
            if len(behind) < len(open_classes) or size < len(open_classes):
                take = behind[:size]  # finish the row the others are past, class by class
                rows = 1
            else:
                take = open_classes
                rows = min(size // len(take), min(limits[c] - assigned[c] for c in take))
            for c in take:
                assigned[c] += rows
                counts[c] += rows
            size -= rows * len(take)
        return [(c, first[c], counts[c]) for c in range(self._count) if counts[c]]

    def _file(self, ticket: int, result: Any) -> None:
        """Files the results of task ``ticket`` by position (or hands it to the other workers
        when its worker was lost)."""
        assert self._group is not None
        worker, generation, runs = self._tasks.pop(ticket)
        self._queued[worker] -= 1
        if isinstance(result, WorkerLostError):
            if str(result) not in self._lost:
                self._lost.append(str(result))
                _logger.warning("%s; its positions go to the other workers.", result)
            if generation == self._generation:
                self._orphans.append(runs)
            if not self._group.workers():
                self._every_worker_lost()
            return
        if generation != self._generation:
            return
        where = self._group.describe(worker)
        positions = [(c, j) for c, first, count in runs for j in range(first, first + count)]
        held = self._consumer.held
        if isinstance(result, BaseException):
            result.add_note(f"Raised by {where} computing positions {runs} (class, first, count).")
            for position in positions:
                held[position] = (ERROR, result, None)
            return
        values, errors, cpu_seconds = result
        for k, position in enumerate(positions):
            payload = errors.get(k)
            if payload is None:
                held[position] = (ELEMENT, values[k], None)
            else:
                error = remote_error(payload, worker, self._count, where=where)
                held[position] = (ERROR, error, None)
        self._learn(cpu_seconds / max(1, len(positions)))

    def _learn(self, cpu_seconds: float) -> None:
        """Sizes tasks to about ``_TASK_TARGET_S`` of CPU work from what positions cost."""
        average = self._cpu_per_position
        average = (
            cpu_seconds if average == 0.0 else average + _TIME_WEIGHT * (cpu_seconds - average)
        )
        self._cpu_per_position = average
        fit = self._max_task if average <= 0.0 else int(_TASK_TARGET_S / average)
        self._task_size = max(1, min(self._max_task, fit))

    def _every_worker_lost(self) -> None:
        assert self._group is not None
        described = [self._group.describe(w) for w in self._started]
        lost = "; ".join(self._lost + [d for d in described if not any(d in x for x in self._lost)])
        raise WorkerDiedError(
            f"Every worker of backend {self._backend.name!r} is gone ({lost}). Nothing was "
            "lost or repeated before this: restore the last checkpoint in a new iterator (it "
            "starts new workers) to go on."
        )

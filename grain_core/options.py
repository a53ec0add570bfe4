"""Per-process read and multiprocessing options (``grain.ReadOptions``, ``MultiprocessingOptions``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from grain_core._checks import non_negative_int

__all__ = ["IN_PROCESS_MODES", "MultiprocessingOptions", "ReadOptions"]

#: Where a dispatched ``mp_prefetch`` pipeline may be computed (``MultiprocessingOptions.
#: in_process``, ``config.py_mp_prefetch_in_process``).
IN_PROCESS_MODES = ("never", "auto", "always")

_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ReadOptions:
    """How ``MapDataset.to_iter_dataset`` reads elements in one process.

    Attributes:
      num_threads: the most threads reading elements in parallel (0: read in the consumer
        thread); how many read adapts to what raises the delivery rate. In ``mp_prefetch``
        workers reads start in the consumer thread and move to threads only while they wait on
        I/O. Order never depends on this value.
      prefetch_buffer_size: elements read ahead of the consumer (0: no read-ahead).

    Raises:
      ValueError: if either value is negative.
    """

    num_threads: int = 16
    prefetch_buffer_size: int = 500

    def __post_init__(self) -> None:
        non_negative_int("ReadOptions.num_threads", self.num_threads)
        non_negative_int("ReadOptions.prefetch_buffer_size", self.prefetch_buffer_size)
        if 0 < self.prefetch_buffer_size < self.num_threads:
            # Logged, as Grain logs it (users' log monitoring matches the text).
            _LOG.warning(
                "ReadOptions.prefetch_buffer_size=%d is smaller than num_threads=%d: at most "
                "prefetch_buffer_size reads run at once.",
                self.prefetch_buffer_size,
                self.num_threads,
            )


@dataclasses.dataclass(slots=True)
class MultiprocessingOptions:
    """Worker processes for ``IterDataset.mp_prefetch`` and ``DataLoader``.

    Attributes:
      num_workers: worker processes (0: run in the calling process).
      per_worker_buffer_size: final elements each worker may produce ahead of the consumer.
        Elements with no array in shared memory may run up to 64 further ahead, 1 MiB
        pickled at most (a worker waiting for the consumer after each would cost a wake-up
        per element); 0 means no read-ahead at all.
      enable_profiling: accepted for API compatibility; use ``DatasetOptions`` execution
        tracking for per-stage timing.
      backend: where the workers run: ``"local"`` (processes on this host), the name of a
        worker backend a plugin registers (``"ray"``: Ray actors, from ``grainpipe-ray``), or
        a ``grain_core.plugins.WorkerBackend`` object (e.g. ``grain_ray.RayBackend(...)``
        with placement options). Output and checkpoints are the same on every backend;
        ``num_workers`` still says how the output is laid out.
      stall_warning_s: the watchdog's warning (local workers): when the consumer has waited
        this many seconds (and again at each multiple) for an element a worker computes, the
        ``grain_core`` logger warns, naming the worker, the element and how long, with the
        worker's Python stacks. None: no warning.
      stall_timeout_s: the watchdog's deadline (local workers): after this many seconds the
        wait raises ``grain_core.multiprocessing.WorkerStalledError`` (a ``RuntimeError``)
        with the same report; the worker is left running. None (the default): wait forever.
      in_process: whether a pipeline the dispatching engine takes may be computed in this
        process instead of the workers: ``"never"`` (workers, as asked), ``"auto"`` (here
        while the workers would not deliver faster), ``"always"``; None (the default):
        ``grain_core.config.py_mp_prefetch_in_process`` (``"never"`` unless set).
        ``grain.experimental.pick_performance_config`` chooses ``"auto"``. What computing
        here gives up: docs/workers.md.
      persistent_workers: keep the worker processes (local workers) running when an
        iterator is closed or collected (a ``for`` loop's, when the loop ends), for the next
        iterator over the same dataset (the next epoch): it starts without starting
        processes, and gives the same output as new workers. They stop when the dataset
        (or ``DataLoader``) is closed or collected. As PyTorch's
        ``DataLoader(persistent_workers=True)``; False (the default): each iterator starts
        and stops its own.

    Raises:
      ValueError: if a count is negative, ``backend`` is an empty name, a stall threshold
        is not a positive number, or ``in_process`` is not one of its values.
    """

    num_workers: int = 0
    per_worker_buffer_size: int = 1
    enable_profiling: bool = False
    backend: str | Any = "local"
    stall_warning_s: float | None = 30.0
    stall_timeout_s: float | None = None
    in_process: str | None = None
    persistent_workers: bool = False

    def __post_init__(self) -> None:
        non_negative_int("MultiprocessingOptions.num_workers", self.num_workers)
        non_negative_int(
            "MultiprocessingOptions.per_worker_buffer_size", self.per_worker_buffer_size
        )
        if self.backend == "":
            raise ValueError(
                'MultiprocessingOptions.backend must be "local", a worker backend name or '
                "a WorkerBackend object, got an empty name."
            )
        if self.in_process not in (None, *IN_PROCESS_MODES):
            raise ValueError(
                f"MultiprocessingOptions.in_process must be one of {IN_PROCESS_MODES} or None, "
                f"got {self.in_process!r}."
            )
        for name in ("stall_warning_s", "stall_timeout_s"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 < value < float("inf")
            ):
                raise ValueError(
                    f"MultiprocessingOptions.{name} must be a positive number of seconds or "
                    f"None, got {value!r}."
                )

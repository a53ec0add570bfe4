"""The running actors of one ``mp_prefetch`` iterator, as grain_core's parent drives them."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions

from grain_core.plugins import WorkerJob, WorkerLostError

__all__ = ["RayWorkerGroup"]


class _BlockActor:
    """One worker: builds its reader of positions once, then computes the tasks it is given in
    the order they were submitted (an actor runs one method call at a time)."""

    def __init__(
        self,
        environ: dict[str, str],
        make_worker: Callable[[int, int], Callable[[Any], Any]],
        index: int,
        count: int,
    ) -> None:
        # Set before the pipeline is unpickled, in a process of its own (Ray starts one per
        # actor). A runtime_env with these variables would do the same at the cost of a
        # worker process started apart from Ray's pool: 4 s more per start here.
        os.environ.update(environ)
        self._compute = make_worker(index, count)

    def where(self) -> tuple[str, str, int]:
        """Node id, node address and process id, for messages."""
        node_id = ray.get_runtime_context().get_node_id()
        return node_id, ray.util.get_node_ip_address(), os.getpid()

    def compute(self, task: Any) -> Any:
        return self._compute(task)


class RayWorkerGroup:
    """``count`` actors running ``job``; a ``grain_core.plugins.WorkerGroup``.

    Args:
      job: What to run (``make_worker`` is put in the object store once and each actor
        receives it from there).
      count: Actors to start.
      actor_options: ``ray.remote`` options of each actor (CPUs, resources).
      start_timeout_s: Seconds the actors may take to start.

    Raises:
      RuntimeError: The actors did not start in time, or one failed to start.
    """

    def __init__(
        self, job: WorkerJob, count: int, actor_options: dict[str, Any], start_timeout_s: float
    ) -> None:
        if not ray.is_initialized():
            ray.init()  # Ray's rules: RAY_ADDRESS, else a running local instance, else a new one
        self._count = count
        self._closed = False
        self._tickets = itertools.count()
        self._pending: dict[Any, tuple[int, int]] = {}  # object ref -> (ticket, actor)
        self._places: list[str] = [f"Ray actor {i} of {count}" for i in range(count)]
        actor_class = ray.remote(_BlockActor).options(
            max_restarts=0, max_concurrency=1, **actor_options
        )
        self._worker_ref = ray.put(job.make_worker)
        self._actors: list[Any] = [
            actor_class.remote(dict(job.environ), self._worker_ref, index, count)
            for index in range(count)
        ]
        self._alive = set(range(count))
        try:
            self._locate(start_timeout_s, actor_options)
        except BaseException:
            self.close()
            raise

    def _locate(self, timeout: float, actor_options: dict[str, Any]) -> None:
        refs: list[Any] = [actor.where.remote() for actor in self._actors]
        try:
            places = ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            wanted = {"CPU": actor_options.get("num_cpus"), **actor_options.get("resources", {})}
            raise RuntimeError(
                f"{self._count} Ray actors needing {wanted} each did not start within "
                f"{timeout:g} s; the cluster has {ray.available_resources()} available of "
                f"{ray.cluster_resources()}. Ask for fewer actors or CPUs per actor "
                "(grain_ray.RayBackend), or add nodes."
            ) from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"A Ray actor failed to start: {_first_line(e)}") from e
        for index, (node_id, address, pid) in enumerate(places):
            self._places[index] = (
                f"Ray actor {index} of {self._count} "
                f"({self._actors[index]._actor_id.hex()[:12]}, pid {pid}) "
                f"on node {address} ({node_id[:12]})"
            )

    @property
    def actors(self) -> list[Any]:
        """The actor handles, by worker index (lost ones included)."""
        return list(self._actors)

    def workers(self) -> list[int]:
        return sorted(self._alive)

    def submit(self, worker: int, task: Any) -> int:
        ticket = next(self._tickets)
        self._pending[self._actors[worker].compute.remote(task)] = (ticket, worker)
        return ticket

    def wait(self, timeout: float | None) -> list[tuple[int, Any]]:
        refs = list(self._pending)
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:  # and whatever else has finished meanwhile
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        finished = []
        for ref in ready:
            ticket, worker = self._pending.pop(ref)
            finished.append((ticket, self._result(ref, worker)))
        return finished

    def _result(self, ref: Any, worker: int) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._alive.discard(worker)
            return WorkerLostError(f"{self._places[worker]} died: {_first_line(e)}")
        except ray.exceptions.ObjectLostError as e:
            return WorkerLostError(f"A result of {self._places[worker]} was lost: {_first_line(e)}")
        except ray.exceptions.RayTaskError as e:
            return e.as_instanceof_cause()

    def describe(self, worker: int) -> str:
        return self._places[worker]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if not ray.is_initialized():
            return  # Ray was shut down first: the actors went with it
        for actor in self._actors:
            ray.kill(actor)
        del self._worker_ref


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

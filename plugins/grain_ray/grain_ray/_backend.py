"""``RayBackend``: where and how many actors run a pipeline's workers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from grain_core.plugins import WorkerGroup, WorkerJob

__all__ = ["RayBackend"]


class RayBackend:
    """Ray actors as the workers of ``mp_prefetch`` (``MultiprocessingOptions(backend=...)``).

    The actors join the Ray instance this process is connected to: the one ``ray.init(...)``
    started or connected to, else the one ``RAY_ADDRESS`` names, else a new local one (Ray's
    own rules for ``ray.init()``). Each actor receives the pickled pipeline once, computes the
    blocks of positions the parent hands it, and returns their results through Ray's object
    store (NumPy arrays arrive as read-only views of it, without a copy, when large).
    Actors start with ``JAX_PLATFORMS=cpu`` (``GRAIN_CORE_WORKER_JAX_PLATFORMS`` overrides
    it, as for local workers).

    Args:
      num_actors: Actors to start (None: ``num_workers``). The output depends on
        ``num_workers`` only.
      num_cpus: CPUs Ray reserves for each actor.
      resources: Further Ray resources each actor needs (``{"preprocessing": 1}``), which
        place it on nodes that have them.
      start_timeout_s: Seconds the actors may take to start (placement included) before
        ``iter()`` fails with what the cluster offers; a cluster that cannot place them
        would otherwise wait for ever.

    Raises:
      ValueError: On a count below one or a negative resource.
    """

    name = "ray"
    description = "Ray actors, on any node of a Ray cluster (grainpipe-ray)"

    def __init__(
        self,
        num_actors: int | None = None,
        *,
        num_cpus: float = 1.0,
        resources: Mapping[str, float] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if num_actors is not None and num_actors < 1:
            raise ValueError(f"RayBackend needs num_actors >= 1 (or None), got {num_actors}.")
        if not num_cpus >= 0 or math.isinf(num_cpus):
            raise ValueError(f"RayBackend needs a finite num_cpus >= 0, got {num_cpus}.")
        resources = dict(resources or {})
        for key, amount in resources.items():
            if not amount >= 0:
                raise ValueError(f"RayBackend resource {key!r} must be >= 0, got {amount}.")
        if not start_timeout_s > 0:
            raise ValueError(f"RayBackend needs start_timeout_s > 0, got {start_timeout_s}.")
        self.num_actors = num_actors
        self.num_cpus = num_cpus
        self.resources = resources
        self.start_timeout_s = start_timeout_s

    def start(self, job: WorkerJob) -> WorkerGroup:
        """Starts the actors of ``job`` and waits until each has built its pipeline reader.

        Raises:
          RuntimeError: The actors could not be placed or started in ``start_timeout_s``, or
            one failed to start (the message says why and what the cluster offers).
        """
        from grain_ray._group import RayWorkerGroup  # import cost: Ray takes a second or more

        count = job.num_workers if self.num_actors is None else self.num_actors
        return RayWorkerGroup(job, count, self._actor_options(), self.start_timeout_s)

    def _actor_options(self) -> dict[str, Any]:
        return {"num_cpus": self.num_cpus, "resources": dict(self.resources)}

    def __repr__(self) -> str:
        return (
            f"RayBackend(num_actors={self.num_actors}, num_cpus={self.num_cpus}, "
            f"resources={self.resources})"
        )

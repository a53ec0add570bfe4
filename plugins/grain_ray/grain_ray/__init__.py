"""grainpipe-ray: Ray actors as grain_core's workers.

``MultiprocessingOptions(num_workers=N, backend="ray")`` (or ``DataLoader(...,
worker_backend="ray")``) runs the workers of ``mp_prefetch`` as ``N`` Ray actors of one CPU
each; ``backend=RayBackend(num_actors=..., num_cpus=..., resources=...)`` places them
otherwise. The output and the checkpoints are those of ``N`` local workers. See
``docs/ray.md``.
"""

from __future__ import annotations

from grain_ray._backend import RayBackend

__all__ = ["RayBackend"]

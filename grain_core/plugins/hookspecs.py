"""The hooks a grain_core plugin implements.

Each hook receives a ``register`` callback and calls it once per object it provides::

    from grain_core import hookimpl
    from grain_core.plugins import FormatSpec

    @hookimpl
    def register_formats(register):
        register(FormatSpec(name="jsonl", suffixes=(".jsonl",), source=JsonlDataSource))
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from grain_core.plugins._specs import FormatSpec, ShardingPolicy, ShuffleStrategy, WorkerBackend

__all__ = [
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "register_formats",
    "register_sharding_policies",
    "register_shuffle_strategies",
    "register_worker_backends",
]

PROJECT_NAME = "grain_core"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_formats(register: Callable[[FormatSpec], None]) -> None:
    """Registers file formats by calling ``register(FormatSpec(...))`` for each."""


@hookspec
def register_shuffle_strategies(register: Callable[[ShuffleStrategy], None]) -> None:
    """Registers shuffle strategies by calling ``register(strategy)`` for each."""


@hookspec
def register_sharding_policies(register: Callable[[ShardingPolicy], None]) -> None:
    """Registers sharding policies by calling ``register(policy)`` for each."""


@hookspec
def register_worker_backends(register: Callable[[WorkerBackend], None]) -> None:
    """Registers worker backends for ``mp_prefetch`` by calling ``register(backend)`` for each."""

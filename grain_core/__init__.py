"""grain_core: deterministic, resumable, pluggable data loading for JAX.

``import grain_core as grain`` gives the names of Google Grain's ``grain`` namespace. They are
imported on first use: every worker process imports this package, and most of it is not what
a worker runs.

``grain_core.install_as_grain()`` makes ``import grain`` itself resolve to grain_core, for
frameworks that import ``grain`` (Keras, MaxText); processes started after it (whose
environment has ``GRAIN_CORE_AS_GRAIN=1``) install it when they import this package.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from grain_core._version import __version__ as __version__
from grain_core._version import __version_info__ as __version_info__

# Imported now: ``grain_core.config`` is this object, not the submodule of the same name.
from grain_core.config import config

if TYPE_CHECKING:
    from grain_core import (
        checkpoint,
        constants,
        experimental,
        multiprocessing,
        samplers,
        sharding,
        sources,
        transforms,
    )
    from grain_core.data_loader import DataLoader, DataLoaderIterator, load
    from grain_core.dataset.base import IterDataset, MapDataset
    from grain_core.dataset.iterator import DatasetIterator
    from grain_core.grain_alias import install_as_grain
    from grain_core.options import MultiprocessingOptions, ReadOptions
    from grain_core.plugins import hookimpl
    from grain_core.record import Record, RecordMetadata

__all__ = [
    "DataLoader",
    "DataLoaderIterator",
    "DatasetIterator",
    "IterDataset",
    "MapDataset",
    "MultiprocessingOptions",
    "ReadOptions",
    "Record",
    "RecordMetadata",
    "checkpoint",
    "config",
    "constants",
    "experimental",
    "hookimpl",
    "install_as_grain",
    "load",
    "multiprocessing",
    "samplers",
    "sharding",
    "sources",
    "transforms",
]

_SUBMODULES = frozenset(
    {
        "checkpoint",
        "constants",
        "experimental",
        "multiprocessing",
        "samplers",
        "sharding",
        "sources",
        "transforms",
    }
)
_DEFINED_IN = {
    "DataLoader": "grain_core.data_loader",
    "DataLoaderIterator": "grain_core.data_loader",
    "load": "grain_core.data_loader",
    "DatasetIterator": "grain_core.dataset.base",
    "IterDataset": "grain_core.dataset.base",
    "MapDataset": "grain_core.dataset.base",
    "MultiprocessingOptions": "grain_core.options",
    "ReadOptions": "grain_core.options",
    "hookimpl": "grain_core.plugins",
    "install_as_grain": "grain_core.grain_alias",
    "Record": "grain_core.record",
    "RecordMetadata": "grain_core.record",
}

# A process started by one that called install_as_grain() (a worker, a spawned process):
# pipelines that name grain's modules unpickle here too.
if os.environ.get("GRAIN_CORE_AS_GRAIN") == "1":
    from grain_core.grain_alias import install_as_grain as _install_as_grain  # only where asked

    _install_as_grain()


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

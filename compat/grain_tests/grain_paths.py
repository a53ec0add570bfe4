"""pytest plugin: runs Grain's own test modules on grain_core.

``grain_core.install_as_grain()`` serves Grain's public module paths. Grain's tests also
import private paths (``grain._src.python.dataset.transformations.batch`` ...) that no client
should: this plugin serves those for the test run only (found by a finder on
``sys.meta_path``, so a test may reload them), each a module whose attributes are looked up by
name in the grain_core modules listed for it (then in every grain_core module below), with the
few names that differ spelled out in ``RENAMED`` (one of them, ``multiprocess_prefetch``, is
Grain's argument list for the same public call). Test helper modules that
Grain ships beside its tests (``testing_util``, ``grain._src.core.pytest``) run from the wheel.

Loaded by ``run.py`` with ``-p grain_paths``; it also marks the expected failures of
``expected_failures.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

import grain_core

__all__ = ["PRIVATE_MODULES", "RENAMED", "WHEEL_HELPERS", "multiprocess_prefetch"]

#: The extracted wheel (``run.py`` sets it): helper modules and test data come from there.
WHEEL_ROOT = Path(os.environ.get("GRAIN_TESTS_WHEEL_ROOT", "."))

_DATASET = "grain._src.python.dataset"
_TRANSFORMATIONS = f"{_DATASET}.transformations"

#: Grain's private module -> the grain_core modules searched first for its names.
PRIVATE_MODULES: dict[str, tuple[str, ...]] = {
    "grain._src.core.config": ("grain_core.config",),
    "grain._src.core.sharding": ("grain_core.sharding",),
    "grain._src.core.transforms": ("grain_core.transforms",),
    "grain._src.core.tree_lib": ("grain_core._tree",),
    "grain._src.core.traceback_util": ("grain_core.config",),
    "grain._src.python.options": ("grain_core.options",),
    "grain._src.python.record": ("grain_core.record",),
    "grain._src.python.samplers": ("grain_core.samplers",),
    "grain._src.python.data_sources": ("grain_core.sources",),
    "grain._src.python.data_loader": ("grain_core.data_loader",),
    "grain._src.python.load": ("grain_core.data_loader",),
    "grain._src.python.operations": ("grain_core.python",),
    "grain._src.python.checkpoint_handlers": ("grain_core.checkpoint",),
    "grain._src.python.testing.experimental": ("grain_core.testing",),
    f"{_DATASET}.base": ("grain_core.dataset.base", "grain_core.dataset.options"),
    f"{_DATASET}.dataset": ("grain_core.dataset.base", "grain_core.dataset.ops.seed"),
    f"{_DATASET}.elastic_iterator": ("grain_core.dataset.elastic",),
    f"{_DATASET}.stats": ("grain_core.dataset.stats",),
    f"{_DATASET}.sources.parquet_dataset": ("grain_parquet",),
    f"{_DATASET}.sources.tfrecord_dataset": ("grain_tfrecord",),
    f"{_TRANSFORMATIONS}.autotune": ("grain_core.dataset.autotune",),
    f"{_TRANSFORMATIONS}.batch": ("grain_core.dataset.ops.batch",),
    f"{_TRANSFORMATIONS}.cache": ("grain_core.dataset.ops.cache",),
    f"{_TRANSFORMATIONS}.filter": ("grain_core.dataset.ops.map",),
    f"{_TRANSFORMATIONS}.flatmap": ("grain_core.dataset.ops.flatmap",),
    f"{_TRANSFORMATIONS}.interleave": ("grain_core.dataset.ops.interleave",),
    f"{_TRANSFORMATIONS}.limit": ("grain_core.dataset.ops.limit",),
    f"{_TRANSFORMATIONS}.map": ("grain_core.dataset.ops.map",),
    f"{_TRANSFORMATIONS}.mix": ("grain_core.dataset.ops.mix",),
    f"{_TRANSFORMATIONS}.packing": ("grain_core.dataset.ops.packing",),
    f"{_TRANSFORMATIONS}.packing_concat_then_split": (
        "grain_core.dataset.ops.packing_concat_split",
    ),
    f"{_TRANSFORMATIONS}.packing_packed_batch": ("grain_core.dataset.ops.packing",),
    f"{_TRANSFORMATIONS}.prefetch": ("grain_core.dataset.prefetch",),
    f"{_TRANSFORMATIONS}.prefetch_autotune": ("grain_core.dataset.autotune",),
    f"{_TRANSFORMATIONS}.process_prefetch": ("grain_core.dataset.mp",),
    f"{_TRANSFORMATIONS}.rebatch": ("grain_core.dataset.ops.rebatch",),
    f"{_TRANSFORMATIONS}.repeat": ("grain_core.dataset.ops.repeat",),
    f"{_TRANSFORMATIONS}.shuffle": ("grain_core.dataset.ops.shuffle",),
    f"{_TRANSFORMATIONS}.slice": ("grain_core.dataset.ops.slice",),
    f"{_TRANSFORMATIONS}.source": ("grain_core.dataset.source",),
    f"{_TRANSFORMATIONS}.zip": ("grain_core.dataset.ops.zip",),
    "grain._src.python.experimental.example_packing.packing": ("grain_core.python.experimental",),
}

#: Names that Grain spells differently: (Grain module, Grain name) -> "module:name".
RENAMED: dict[tuple[str, str], str] = {
    (
        "grain._src.core.transforms",
        "get_pretty_transform_name",
    ): "grain_core.dataset.base:transform_name",
    (f"{_TRANSFORMATIONS}.batch", "BatchFn"): "grain_core.capabilities:BatchFunctionOutputSpec",
    (
        f"{_TRANSFORMATIONS}.packing_packed_batch",
        "get_non_sequence_meta_features",
    ): "grain_core.dataset.ops.packing:non_sequence_meta_features",
    (
        f"{_TRANSFORMATIONS}.process_prefetch",
        "multiprocess_prefetch",
    ): "grain_paths:multiprocess_prefetch",
}


def multiprocess_prefetch(
    ds: Any,
    num_workers: int = 0,
    buffer_size: int = 1,
    worker_init_fn: Callable[[int, int], None] | None = None,
    sequential_slice: bool = False,
) -> Any:
    """Grain's function behind ``IterDataset.mp_prefetch``, which takes the options' two fields
    as arguments: the same call through grain_core's public ``mp_prefetch``."""
    options = grain_core.MultiprocessingOptions(
        num_workers=num_workers, per_worker_buffer_size=buffer_size
    )
    return ds.mp_prefetch(options, worker_init_fn, sequential_slice=sequential_slice)


#: A mapped module by the last part of its name, as Grain's modules name one another (the
#: first listed where two share it).
_MODULE_BY_BASENAME = {name.rpartition(".")[2]: name for name in reversed(PRIVATE_MODULES)}

#: Grain's test helpers, run from the wheel against the mapped modules.
WHEEL_HELPERS = (
    "grain.proto.execution_summary_pb2",
    "grain._src.core.pytest",
    f"{_TRANSFORMATIONS}.testing_util",
)

#: Searched after a module's own list: grain_core's public modules, then its dataset layer.
_FALLBACK = (
    "grain_core",
    "grain_core.experimental",
    "grain_core.python",
    "grain_core.transforms",
    "grain_core.sources",
    "grain_core.samplers",
    "grain_core.options",
    "grain_core.testing",
    "grain_core.dataset.base",
    "grain_core.dataset.options",
)


class _MappedModule(types.ModuleType):
    """A Grain private module whose attributes are grain_core's names, found on first use."""

    def __init__(self, name: str, search: Iterable[str]) -> None:
        super().__init__(name, f"Grain's {name}, served from grain_core for its tests.")
        self._grain_search = tuple(dict.fromkeys((*search, *_FALLBACK)))
        self._grain_found: set[str] = set()

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        renamed = RENAMED.get((self.__name__, attr))
        if renamed is not None:
            module, _, name = renamed.partition(":")
            value = getattr(importlib.import_module(module), name)
        else:
            value = _find(attr, self._grain_search, self.__name__)
        setattr(self, attr, value)
        self._grain_found.add(attr)
        return value

    def forget(self) -> None:
        """Drops the names found so far (a reload): they are looked up again on next use."""
        for attr in self._grain_found:
            delattr(self, attr)
        self._grain_found.clear()


class _MappedLoader(importlib.abc.Loader):
    """Makes the ``_MappedModule`` of a Grain private path; a reload (Grain's tests reload
    ``batch`` and ``tree_lib`` around a test without JAX) starts its look-ups afresh."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _MappedModule(spec.name, PRIVATE_MODULES[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        if isinstance(module, _MappedModule):
            module.forget()


def _find(attr: str, modules: Iterable[str], grain_module: str) -> Any:
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attr):
            return getattr(module, attr)
    # Grain's modules import one another (``batch.tree_lib``): a mapped module of that name.
    imported = _MODULE_BY_BASENAME.get(attr)
    if imported is not None:
        return importlib.import_module(imported)
    return _missing(f"{grain_module}.{attr}")


def _missing(name: str) -> type:
    """A stand-in for a name grain_core does not serve: the tests that use it fail (and say
    which name), the others in its module still run."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"grain_core serves no {name}")

    return type(name.rpartition(".")[2], (), {"__new__": refuse, "__getattr__": refuse})


def _package(name: str) -> types.ModuleType:
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(_package(parent), child, module)
    return module


class _GrainTestFinder:
    """Finds Grain's private paths (mapped) and its test helpers (from the extracted wheel),
    ahead of the alias's finder."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in PRIVATE_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _MAPPED_LOADER)
        if fullname not in WHEEL_HELPERS:
            return None
        location = WHEEL_ROOT / (fullname.replace(".", "/") + ".py")
        return importlib.util.spec_from_file_location(fullname, location)


_MAPPED_LOADER = _MappedLoader()


def install_private_paths() -> None:
    """Serves Grain's private paths that its tests import (after the public alias); once per
    process."""
    if any(isinstance(f, _GrainTestFinder) for f in sys.meta_path):
        return
    grain_core.install_as_grain()
    import grain  # the alias: grain_core

    for name in (*PRIVATE_MODULES, *WHEEL_HELPERS):
        _package(name.rpartition(".")[0])
    sys.meta_path.insert(0, _GrainTestFinder())
    for name in PRIVATE_MODULES:
        importlib.import_module(name)
    if importlib.util.find_spec("jax") is not None:
        # Grain's tree library imports JAX where it is installed, and its tests read
        # ``sys.modules["jax"]`` to run each case with and without it.
        importlib.import_module("jax")
    del grain


def pytest_configure(config: pytest.Config) -> None:
    from absl import flags  # optional dependency: Grain's tests use absl
    from absl.testing import absltest  # noqa: F401  # optional dependency: defines --test_srcdir

    install_private_paths()
    flags.FLAGS.mark_as_parsed()


@pytest.fixture(autouse=True)
def _grain_test_srcdir() -> None:
    """Grain's modules point ``--test_srcdir`` at ``grain.__file__``'s folder in their
    ``setup_module``; under the alias that is grain_core's, so point it back at the wheel's."""
    from absl import flags  # optional dependency: Grain's tests use absl

    flags.FLAGS.test_srcdir = str(WHEEL_ROOT / "grain" / "_src" / "python")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from expected_failures import EXPECTED_FAILURES  # beside this plugin

    for item in items:
        reason = EXPECTED_FAILURES.get(item.nodeid.removeprefix("suite/"))
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))

"""``install_as_grain()``: code and frameworks that ``import grain`` get grain_core.

A finder on ``sys.meta_path`` answers for the name ``grain`` and every ``grain.*`` name: the
public modules of Google Grain's namespace resolve to grain_core's modules of the same role,
the few private module paths that real clients import resolve to working equivalents, and any
other ``grain.*`` name raises ``ImportError`` naming it (not ``ModuleNotFoundError``, which
``from grain._src.x import y`` would swallow into a message that does not say why). Nothing is imported before a
client asks for it, so installing the alias costs nothing at start-up. ``docs/compatibility.md``
lists the provided paths and the reasons.

Calling it also sets ``GRAIN_CORE_AS_GRAIN=1`` in the environment, which makes importing
``grain_core`` install the alias in the processes this one starts (grain_core's workers,
``spawn`` processes, subprocesses), so that a pipeline naming ``grain`` unpickles there too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec

__all__ = ["ALIAS_ENV", "install_as_grain"]

#: Set to ``1`` by :func:`install_as_grain`; importing grain_core then installs the alias.
ALIAS_ENV = "GRAIN_CORE_AS_GRAIN"

_DOCS = "docs/compatibility.md"


def _tfrecord_dataset_module(name: str) -> types.ModuleType:
    """Grain's private TFRecord module, from the TFRecord plugin: MaxText subclasses its reader
    and iterator (to read ``gs://`` blobs with its own client)."""
    try:
        # An optional dependency (a plugin distribution), imported only when this path is.
        grain_tfrecord = importlib.import_module("grain_tfrecord")
    except ModuleNotFoundError as err:
        if err.name != "grain_tfrecord":
            raise
        from grain_core import plugins  # import cost: only for the error

        raise ImportError(
            f"{name} is provided by the grainpipe-tfrecord plugin, which is not installed: "
            f"{plugins.plugin_install_command('grain_tfrecord')}",
            name=name,
        ) from err
    module = types.ModuleType(name, "Grain's TFRecord module path, served by grain_tfrecord.")
    module._TFRecordReader = grain_tfrecord.TFRecordReader  # type: ignore[attr-defined]
    module._TFRecordDatasetIterator = grain_tfrecord.TFRecordReaderIterator  # type: ignore[attr-defined]
    module.TFRecordIterDataset = grain_tfrecord.TFRecordIterDataset  # type: ignore[attr-defined]
    return module


#: Grain's module paths -> the grain_core module that serves each (a module name), or a
#: function building the module (for paths whose names come from a plugin).
MODULES: dict[str, str | Callable[[str], types.ModuleType]] = {
    "grain": "grain_core",
    "grain.checkpoint": "grain_core.checkpoint",
    "grain.constants": "grain_core.constants",
    "grain.experimental": "grain_core.experimental",
    "grain.multiprocessing": "grain_core.multiprocessing",
    "grain.python": "grain_core.python",
    "grain.python.experimental": "grain_core.python.experimental",
    "grain.samplers": "grain_core.samplers",
    "grain.sharding": "grain_core.sharding",
    "grain.sources": "grain_core.sources",
    "grain.transforms": "grain_core.transforms",
    # Private paths that clients import. Keras 3's Grain adapter: SharedMemoryArrayMetadata
    # (at its old path, then its new one).
    "grain._src.python.shared_memory_array": "grain_core.multiprocessing",
    "grain._src.python.ipc.shared_memory_array": "grain_core.multiprocessing",
    # MaxText: _TFRecordReader and _TFRecordDatasetIterator, subclassed.
    "grain._src.python.dataset.sources.tfrecord_dataset": _tfrecord_dataset_module,
}

#: The packages above the private paths: empty packages that hold only the provided paths.
_PRIVATE_PACKAGES = frozenset(
    name.rsplit(".", depth)[0]
    for name in MODULES
    if name.startswith("grain._src.")
    for depth in range(1, name.count("."))
)


class _GrainAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads every ``grain`` / ``grain.*`` module from :data:`MODULES`."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> ModuleSpec | None:
        """Returns the spec of an aliased module; None for names outside ``grain``.

        Raises:
          ImportError: For a ``grain.*`` name that grain_core does not provide.
        """
        if fullname != "grain" and not fullname.startswith("grain."):
            return None
        if fullname not in MODULES and fullname not in _PRIVATE_PACKAGES:
            raise ImportError(
                f"grain_core.install_as_grain() does not provide the module {fullname!r}: "
                f"grain_core serves grain's public modules and the private paths listed in "
                f"{_DOCS} (import the public name instead, or ask for the path to be added)",
                name=fullname,
            )
        return importlib.util.spec_from_loader(
            fullname, self, is_package=fullname in _PRIVATE_PACKAGES
        )

    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        # The default module; exec_module replaces it in sys.modules with the served one.
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        """Puts the module that serves ``module``'s name in ``sys.modules`` in its place (the
        import system then returns that one); a private package stays as it is, empty."""
        name = module.__name__
        provider = MODULES.get(name)
        if provider is None:
            module.__doc__ = f"Holds the private grain paths grain_core provides ({_DOCS})."
            return
        served = provider(name) if callable(provider) else importlib.import_module(provider)
        sys.modules[name] = served


def _installed_finder() -> _GrainAliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _GrainAliasFinder)), None)


def install_as_grain() -> None:
    """Makes ``import grain`` (and ``grain.python``, ``grain.experimental``, … and the private
    paths Keras and MaxText import) resolve to grain_core, in this process and in the
    processes it starts. Call it before anything imports ``grain``; calling it again does
    nothing.

    Raises:
      RuntimeError: If Google Grain (a module ``grain``) is already imported, naming it.
    """
    if _installed_finder() is None:
        loaded = [name for name in sys.modules if name == "grain" or name.startswith("grain.")]
        if loaded:
            module = sys.modules[min(loaded, key=len)]
            origin = getattr(module, "__file__", None) or repr(module)
            raise RuntimeError(
                f"grain_core.install_as_grain(): the module {module.__name__!r} ({origin}) "
                "is already imported, so 'import grain' cannot be grain_core in this process. "
                "Call install_as_grain() before anything imports grain (first thing in the "
                f"program; for worker processes see {_DOCS})."
            )
        # First: a real grain installed on sys.path must not be found instead.
        sys.meta_path.insert(0, _GrainAliasFinder())
    os.environ[ALIAS_ENV] = "1"
    # Workers forked from a forkserver that imported grain_core before this call never see
    # the variable at import: they call this themselves. A forkserver exists only if the
    # worker pool is imported; one started later imports grain_core with the variable set.
    pool = sys.modules.get("grain_core._ipc.pool")
    if pool is not None:
        pool.run_in_every_worker(install_as_grain)

"""Saving and restoring iterator positions (``grain.checkpoint``): the handler and Orbax glue.

Each process writes ``process_{i}-of-{n}.json`` (``i, n`` from JAX when it is initialised,
else ``0, 1``) into the checkpoint directory, a local path or a URL (``s3://``, ``gs://``:
see :mod:`grain_core.storage`). Files are written atomically (locally: temporary file, fsync,
rename; on object stores: one whole-object upload), so a crash during a save leaves the old
or the new checkpoint, never a truncated one; an ``ElasticIterator``'s save of several files
is committed by its process file, written last, which records the save's step (restoring part
of a save, or process files of different steps, is refused). The state codec and the file I/O live in ``_checkpoint_io``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from grain_core._checkpoint_io import restore_item, save_item

__all__ = ["CheckpointHandler"]


class CheckpointHandler:
    """Saves and restores a ``DatasetIterator`` (or ``DataLoaderIterator``) to a directory.

    Compatible with Orbax's ``CheckpointHandler`` interface (``save``/``restore`` with ``item``
    or ``args``).
    """

    def save(self, directory: Any, item: Any = None, args: Any = None) -> None:
        """Saves ``item`` (or ``args.item``) into ``directory``.

        Raises:
          OSError: If a file cannot be written, naming it.
        """
        save_item(directory, item if item is not None else args.item)

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        """Restores ``item`` in place from ``directory`` and starts its prefetch.

        Raises:
          ValueError: if the file is missing, truncated or not JSON, or holds the state of
            another kind of iterator.
        """
        item = item if item is not None else args.item
        restore_item(directory, item, start_prefetch=True)
        return item

    def structure(self) -> None:
        return None

    def metadata(self, directory: Any) -> None:
        return None

    def finalize(self, directory: Any) -> None:
        return None

    def close(self) -> None:
        return None

    @classmethod
    def typestr(cls) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def _orbax_args() -> dict[str, type]:
    """Defines ``CheckpointSave``/``CheckpointRestore`` as Orbax ``CheckpointArgs`` (on first use,
    so that importing grain_core never imports Orbax and JAX)."""
    import orbax.checkpoint as ocp  # optional dependency

    # Orbax takes any class with its handler's methods; CheckpointHandler does not subclass
    # Orbax's, so that importing grain_core never imports Orbax (pyright wants the subclass).
    @ocp.args.register_with_handler(CheckpointHandler, for_save=True)  # pyright: ignore[reportArgumentType]
    @dataclasses.dataclass
    class CheckpointSave(ocp.args.CheckpointArgs):  # type: ignore[misc, name-defined]
        """Orbax argument: save ``item`` (a dataset or DataLoader iterator)."""

        item: Any

    @ocp.args.register_with_handler(CheckpointHandler, for_restore=True)  # pyright: ignore[reportArgumentType]
    @dataclasses.dataclass
    class CheckpointRestore(ocp.args.CheckpointArgs):  # type: ignore[misc, name-defined]
        """Orbax argument: restore ``item`` in place."""

        item: Any

    for cls in (CheckpointSave, CheckpointRestore):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {"CheckpointSave": CheckpointSave, "CheckpointRestore": CheckpointRestore}


def __getattr__(name: str) -> Any:
    if name in ("CheckpointSave", "CheckpointRestore"):
        try:
            return _orbax_args()[name]
        except ImportError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)

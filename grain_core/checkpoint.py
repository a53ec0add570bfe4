"""Saving and restoring iterator positions (``grain.checkpoint``): the handler and Orbax glue.

Each process writes ``process_{i}-of-{n}.json`` (``i, n`` from JAX when it is initialised,
else ``0, 1``) into the checkpoint directory, a local path or a URL (``s3://``, ``gs://``:
see :mod:`grain_core.storage`). Files are written atomically (locally: temporary file, fsync,
rename; on object stores: one whole-object upload), so a crash during a save leaves the old
or the new checkpoint, never a truncated one; an ``ElasticIterator``'s save of several files
is committed by its process file, written last, which records the save's step (restoring part
of a save, or process files of different steps, is refused). The file I/O lives in
``_checkpoint_io``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from grain_core._checkpoint_io import (
    load_json,
    process_file_name,
    read_process_file,
    write_process_file,
)
from grain_core.capabilities import ShardStateCheckpointing
from grain_core.storage import join

__all__ = ["CheckpointHandler"]


def _saves_shard_states(item: Any) -> bool:
    return isinstance(item, ShardStateCheckpointing) and item.checkpoints_shard_states


class CheckpointHandler:
    """Saves and restores a ``DatasetIterator`` (or ``DataLoaderIterator``) to a directory.

    Compatible with Orbax's ``CheckpointHandler`` interface (``save``/``restore`` with ``item``
    or ``args``).
    """

    def save(self, directory: Any, item: Any = None, args: Any = None) -> None:
        item = item if item is not None else args.item
        if _saves_shard_states(item):  # elastic IterDataset mode
            from grain_core.dataset.elastic import write_shard_state_files  # import cost

            write_shard_state_files(directory, item)
            return
        state = item.get_state()
        text = state.decode() if isinstance(state, bytes) else json.dumps(state, indent=4)
        write_process_file(directory, text)

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        """Restores ``item`` in place from ``directory`` and starts its prefetch.

        Raises:
          ValueError: if the file is missing, truncated or not JSON, or holds the state of
            another kind of iterator.
        """
        item = item if item is not None else args.item
        if _saves_shard_states(item):  # elastic IterDataset mode
            from grain_core.dataset.elastic import restore_shard_state_files  # import cost

            restore_shard_state_files(directory, item)
            item.start_prefetch()
            return item
        text = read_process_file(directory, any_process=_same_state_everywhere(item))
        path = join(directory, process_file_name())
        state = load_json(text, path)
        try:
            item.set_state(text.encode() if _takes_bytes(item) else state)
        except ValueError as e:
            e.add_note(f"Restoring from checkpoint file {path}.")
            raise
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(
                f"Checkpoint file {path} does not hold a state of this {type(item).__name__} "
                f"({type(e).__name__}: {e}): it was saved from another pipeline or another "
                "kind of iterator (a DataLoader's, or one with another worker count)."
            ) from e
        item.start_prefetch()
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


def _same_state_everywhere(item: Any) -> bool:
    # An ElasticIterator over a MapDataset has the same state on every shard, so a checkpoint
    # of any process restores any number of processes.
    from grain_core.dataset.elastic import ElasticIterator  # import cost

    return isinstance(item, ElasticIterator)


def _takes_bytes(item: Any) -> bool:
    from grain_core.dataset.base import DatasetIterator  # import cost

    return not isinstance(item, DatasetIterator)


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

"""Saving and restoring iterator positions (``grain.checkpoint``).

Each process writes ``process_{i}-of-{n}.json`` (``i, n`` from JAX when it is initialised,
else ``0, 1``). Files are written atomically: temporary file, fsync, rename, fsync of the
directory, so a crash during a save never leaves a truncated checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

__all__ = ["CheckpointHandler", "process_file_name", "read_process_file", "write_process_file"]


def _process_index_and_count() -> tuple[int, int]:
    jax = sys.modules.get("jax")
    if jax is None:
        return 0, 1
    return jax.process_index(), jax.process_count()


def process_file_name() -> str:
    """File name of this process's checkpoint, ``process_{i}-of-{n}.json``."""
    i, n = _process_index_and_count()
    return f"process_{i}-of-{n}.json"


def atomic_write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` so that readers see the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_process_file(directory: Any, text: str) -> Path:
    """Atomically writes this process's checkpoint file into ``directory``."""
    path = Path(os.fspath(directory)) / process_file_name()
    atomic_write_text(path, text)
    return path


def read_process_file(directory: Any, *, any_process: bool = False) -> str:
    """Reads this process's checkpoint file from ``directory``.

    Args:
      directory: The checkpoint directory.
      any_process: If this process's file is missing, read another process's file (for states
        that are the same on every process, such as an ``ElasticIterator`` over a MapDataset).

    Raises:
      ValueError: if the file does not exist.
    """
    path = Path(os.fspath(directory)) / process_file_name()
    if not path.exists():
        files = sorted(path.parent.glob("process_*-of-*.json"))
        if any_process and files:
            return _read_text(files[0])
        names = (p.stem.rsplit("-of-", 1)[1] for p in files)
        written = sorted({int(n) for n in names if n.isdigit()})
        count = _process_index_and_count()[1]
        if written and count not in written:
            raise ValueError(
                f"File {path} does not exist: the checkpoint in {path.parent} was written by "
                f"{' / '.join(map(str, written))} processes, and this run has {count}. Restore "
                "with the same number of processes, or checkpoint a "
                "grain_core.experimental.ElasticIterator over a MapDataset, which restores under "
                "any process count."
            )
        raise ValueError(
            f"File {path} does not exist. The checkpoint was not written by this process "
            "(check the directory and the JAX process count)."
        )
    return _read_text(path)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"Checkpoint file {path} is not UTF-8 text ({e}); it is corrupt or not a "
            "grain_core checkpoint. Restore an earlier checkpoint."
        ) from e


def save_coroutine(directory: Any, text: str) -> Coroutine[Any, Any, None]:
    """Orbax v1 ``save``: a coroutine that waits for ``directory`` and writes ``text`` to it.

    The text is captured by the caller at call time, so later iteration does not change it.
    """

    async def _write() -> None:
        import asyncio  # here: importing it costs ~60 ms, and only Orbax saves need it

        # Orbax passes a PathAwaitingCreation: not a path itself; awaiting it gives the path.
        target = directory
        await_creation = getattr(directory, "await_creation", None)
        if await_creation is not None:
            created = await await_creation()
            if created is not None:
                target = created
        await asyncio.to_thread(write_process_file, target, text)

    return _write()


def load_coroutine(directory: Any, apply: Callable[[str], None]) -> Coroutine[Any, Any, None]:
    """Orbax v1 ``load``: a coroutine that reads this process's file and calls ``apply(text)``."""

    async def _read() -> None:
        import asyncio

        apply(await asyncio.to_thread(read_process_file, directory))

    return _read()


class CheckpointHandler:
    """Saves and restores a ``DatasetIterator`` (or ``DataLoaderIterator``) to a directory.

    Compatible with Orbax's ``CheckpointHandler`` interface (``save``/``restore`` with ``item``
    or ``args``).
    """

    def save(self, directory: Any, item: Any = None, args: Any = None) -> None:
        item = item if item is not None else args.item
        if getattr(item, "checkpoints_shard_states", False):  # elastic IterDataset mode
            from grain_core.dataset.elastic import write_shard_state_files

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
        if getattr(item, "checkpoints_shard_states", False):  # elastic IterDataset mode
            from grain_core.dataset.elastic import restore_shard_state_files

            restore_shard_state_files(directory, item)
            item.start_prefetch()
            return item
        text = read_process_file(directory, any_process=_same_state_everywhere(item))
        path = Path(os.fspath(directory)) / process_file_name()
        try:
            state = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"Checkpoint file {path} is not valid JSON ({e}); it is truncated or corrupt. "
                "Restore an earlier checkpoint."
            ) from e
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
    from grain_core.dataset.elastic import ElasticIterator

    return isinstance(item, ElasticIterator)


def _takes_bytes(item: Any) -> bool:
    from grain_core.dataset.base import DatasetIterator

    return not isinstance(item, DatasetIterator)


@functools.cache
def _orbax_args() -> dict[str, type]:
    """Defines ``CheckpointSave``/``CheckpointRestore`` as Orbax ``CheckpointArgs`` (on first use,
    so that importing grain_core never imports Orbax and JAX)."""
    import orbax.checkpoint as ocp

    @ocp.args.register_with_handler(CheckpointHandler, for_save=True)
    @dataclasses.dataclass
    class CheckpointSave(ocp.args.CheckpointArgs):  # type: ignore[misc, name-defined]
        """Orbax argument: save ``item`` (a dataset or DataLoader iterator)."""

        item: Any

    @ocp.args.register_with_handler(CheckpointHandler, for_restore=True)
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

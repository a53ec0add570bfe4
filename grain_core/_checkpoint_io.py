"""Checkpoint files: the names, and their atomic writes and checked reads, on any storage.

Below both the dataset layer (whose iterators save themselves under Orbax) and
``CheckpointHandler``: it knows file names and text, not iterators. Each process writes
``process_{i}-of-{n}.json`` (``i, n`` from JAX when it is initialised, else ``0, 1``); an
``ElasticIterator`` over an IterDataset writes ``shard_state_{k}.json`` per input dataset.
Directories are local paths or URLs (see :mod:`grain_core.storage`); every file is written
atomically, so a crash during a save leaves each file old or new, never truncated.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from grain_core import storage

__all__ = [
    "load_coroutine",
    "process_file_name",
    "read_process_file",
    "read_shard_process_file",
    "read_shard_state_file",
    "read_shard_state_files",
    "save_coroutine",
    "shard_file",
    "write_process_file",
    "write_shard_state_files",
    "written_process_counts",
]


def _process_index_and_count() -> tuple[int, int]:
    jax = sys.modules.get("jax")
    if jax is None:
        return 0, 1
    return jax.process_index(), jax.process_count()


def process_file_name(shard: tuple[int, int] | None = None) -> str:
    """File name of a checkpoint, ``process_{i}-of-{n}.json``.

    Args:
      shard: ``(i, n)`` of the writer (an ``ElasticIterator``'s shard); default: this process
        of the JAX processes.
    """
    i, n = shard if shard is not None else _process_index_and_count()
    return f"process_{i}-of-{n}.json"


def write_process_file(directory: Any, text: str, shard: tuple[int, int] | None = None) -> str:
    """Atomically writes a process's checkpoint file (``shard``: see ``process_file_name``)
    into ``directory``; returns its path.

    Raises:
      OSError: If it cannot be written (disk full, read-only), naming the directory.
    """
    path = storage.join(directory, process_file_name(shard))
    storage.write_bytes(path, text.encode())
    return path


def read_process_file(directory: Any, *, any_process: bool = False) -> str:
    """Reads this process's checkpoint file from ``directory``.

    Args:
      directory: The checkpoint directory (local path or URL).
      any_process: If this process's file is missing, read another process's file (for states
        that are the same on every process, such as an ``ElasticIterator`` over a MapDataset).

    Raises:
      ValueError: If the file does not exist or is not UTF-8 text, naming it.
    """
    path = storage.join(directory, process_file_name())
    try:
        return _read_text(path)
    except FileNotFoundError:
        pass
    files = _process_files(directory)
    if any_process and files:
        return _read_text(files[0])
    written = sorted(written_process_counts(directory))
    count = _process_index_and_count()[1]
    if written and count not in written:
        raise ValueError(
            f"File {path} does not exist: the checkpoint in {directory} was written by "
            f"{' / '.join(map(str, written))} processes, and this run has {count}. Restore "
            "with the same number of processes, or checkpoint a "
            "grain_core.experimental.ElasticIterator over a MapDataset, which restores under "
            "any process count."
        )
    raise ValueError(
        f"File {path} does not exist. The checkpoint was not written by this process "
        "(check the directory and the JAX process count)."
    )


def read_shard_process_file(directory: Any, shard: tuple[int, int]) -> str | None:
    """The text of shard ``(i, n)``'s ``process_{i}-of-{n}.json``, or None if it is missing.

    Raises:
      ValueError: If the file is not UTF-8 text, naming it.
    """
    try:
        return _read_text(storage.join(directory, process_file_name(shard)))
    except FileNotFoundError:
        return None


def _process_files(directory: Any) -> list[str]:
    return storage.glob(storage.join(directory, "process_*-of-*.json"), allow_empty=True)


def written_process_counts(directory: Any) -> set[int]:
    """The ``n`` of every ``process_{i}-of-{n}.json`` file in ``directory``."""
    names = (f.rsplit("-of-", 1)[1].removesuffix(".json") for f in _process_files(directory))
    return {int(n) for n in names if n.isdigit()}


def _read_text(path: str) -> str:
    data = storage.read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"Checkpoint file {path} is not UTF-8 text ({e}); it is corrupt or not a "
            "grain_core checkpoint. Restore an earlier checkpoint."
        ) from e


def shard_file(directory: Any, key: int) -> str:
    """Path of the state file of input dataset ``key`` in ``directory``."""
    return storage.join(directory, f"shard_state_{key}.json")


def read_shard_state_file(directory: Any, key: int) -> str | None:
    """The text of ``shard_state_{key}.json``, or None if it is missing.

    Raises:
      ValueError: If the file is not UTF-8 text, naming it.
    """
    try:
        return _read_text(shard_file(directory, key))
    except FileNotFoundError:
        return None


def write_shard_state_files(directory: Any, texts: Mapping[int, str]) -> None:
    """Writes ``shard_state_{k}.json`` holding ``texts[k]`` for every ``k``, each atomically."""
    for key, text in texts.items():
        storage.write_bytes(shard_file(directory, key), text.encode())


def read_shard_state_files(directory: Any, first: int, step: int) -> dict[int, str]:
    """Reads ``shard_state_{k}.json`` for ``k = first, first + step, ...`` until one is missing.

    Raises:
      ValueError: If a file is not UTF-8 text, naming it.
    """
    texts: dict[int, str] = {}
    key = first
    while True:
        try:
            texts[key] = _read_text(shard_file(directory, key))
        except FileNotFoundError:
            return texts
        key += step


def save_coroutine(directory: Any, text: str) -> Coroutine[Any, Any, None]:
    """Orbax v1 ``save``: a coroutine that waits for ``directory`` and writes ``text`` to it.

    The text is captured by the caller at call time, so later iteration does not change it.
    """

    async def _write() -> None:
        import asyncio  # import cost: ~60 ms, and only Orbax saves need it

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
        import asyncio  # import cost: ~60 ms, and only Orbax restores need it

        apply(await asyncio.to_thread(read_process_file, directory))

    return _read()

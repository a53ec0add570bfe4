"""Checkpoint files: the one codec of an iterator state, the names, atomic writes and checked
reads on any storage, and saving and restoring an iterator.

Below both the dataset layer (whose iterators save themselves under Orbax) and
``CheckpointHandler``: it knows file names, text and the capabilities an iterator declares
(``grain_core.capabilities``: a bytes state, the same state on every process, shard-state
files), not iterator classes. A state is written as JSON indented by four spaces (as Google
Grain writes it); a bytes state is that text already. Each process writes
``process_{i}-of-{n}.json`` (``i, n`` from JAX when it is initialised, else ``0, 1``); an
``ElasticIterator`` over an IterDataset writes ``shard_state_{k}.json`` per input dataset.
Directories are local paths or URLs (see :mod:`grain_core.storage`); every file is written
atomically, so a crash during a save leaves each file old or new, never truncated.

A save of several files has one commit point: an ``ElasticIterator``'s process file, written
after its shard-state files, lists the SHA-256 of each of them. A shard-state file that no
process file lists, or whose content is not the one listed, belongs to a save that did not
finish, and restoring from it is refused (naming the directory and the file) instead of
combining files of two moments. Checkpoints without such a list (written by Google Grain or
earlier versions) restore as before, but shard-state files without any process file are
refused.

Saves of several processes into one directory share an identity without talking to each
other: each process file records the save's step (global batches handed out, the same on every
shard of one save) and whether the shard's input ran out; process files of different steps
(a crash let some processes finish a save and not the others) are refused, except a shard
that ran out earlier, whose state no longer changes. A MapDataset ``ElasticIterator``'s
state is the same on every process, so its process files must be equal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final

from grain_core import storage
from grain_core.capabilities import BytesState, SameStateEverywhere, ShardStateCheckpointing

__all__ = [
    "SavePosition",
    "decode_state",
    "encode_state",
    "load_coroutine",
    "process_file_name",
    "read_process_file",
    "read_shard_process_state",
    "read_shard_states",
    "restore_and_start",
    "restore_item",
    "save_coroutine",
    "save_item",
    "shard_file",
    "start_when_restored",
    "write_process_file",
    "write_shard_checkpoint",
    "written_process_counts",
]

# The key of a process file's commit record: ``{"<k>": sha256 of shard_state_<k>.json}`` for
# every shard-state file of the same save. The rest of the file is the iterator's state.
_SHARD_DIGESTS: Final = "shard_state_sha256"
# The key of the save's identity, which every shard of one save computes alike without talking
# to the others: ``{"step": global batches handed out, "ended": whether the input ran out}``.
_SAVE_POSITION: Final = "save_position"


@dataclasses.dataclass(frozen=True)
class SavePosition:
    """Where an ``ElasticIterator`` shard was when it saved: the save's identity.

    Every shard of one save has handed out the same number of global batches (``step``),
    except a shard whose input ran out (``ended``) earlier, whose state no longer changes.
    """

    step: int
    ended: bool


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
      any_process: The state is the same on every process (an ``ElasticIterator`` over a
        MapDataset): if this process's file is missing, read another process's file; and
        refuse a directory whose process files of that process count hold different states
        (saves of different steps).

    Raises:
      ValueError: If the file does not exist or is not UTF-8 text, naming it; with
        ``any_process``, if the process files disagree, naming the directory and two files.
    """
    path = storage.join(directory, process_file_name())
    try:
        text = _read_text(path)
    except FileNotFoundError:
        files = _process_files(directory)
        if not (any_process and files):
            raise _missing_process_file(directory, path) from None
        path = files[0]
        text = _read_text(path)
    if any_process:
        _check_same_state(directory, path, text)
    return text


def _missing_process_file(directory: Any, path: str) -> ValueError:
    written = sorted(written_process_counts(directory))
    count = _process_index_and_count()[1]
    if written and count not in written:
        return ValueError(
            f"File {path} does not exist: the checkpoint in {directory} was written by "
            f"{' / '.join(map(str, written))} processes, and this run has {count}. Restore "
            "with the same number of processes, or checkpoint a "
            "grain_core.experimental.ElasticIterator over a MapDataset, which restores under "
            "any process count."
        )
    return ValueError(
        f"File {path} does not exist. The checkpoint was not written by this process "
        "(check the directory and the JAX process count)."
    )


def _check_same_state(directory: Any, path: str, text: str) -> None:
    """Refuses a directory whose process files of the same process count as ``path`` (holding
    ``text``) hold other states: they are of saves of different steps.

    Raises:
      ValueError: Naming the directory and the two files.
    """
    count = path.rsplit("-of-", 1)[1]
    state = _decode_file(text, path)
    for other in _process_files(directory):
        if other == path or other.rsplit("-of-", 1)[1] != count:
            continue
        try:
            other_state = _decode_file(_read_text(other), other)
        except FileNotFoundError:
            continue
        if other_state != state:
            raise ValueError(
                f"The checkpoint in {directory} mixes saves of different steps: "
                f"{path.rsplit('/', 1)[-1]} and {other.rsplit('/', 1)[-1]} hold different "
                "states, which every process of one save shares (a save of all processes "
                "did not finish). Restore an earlier checkpoint, and save each step to a "
                "directory of its own."
            )


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


def encode_state(state: Mapping[str, Any] | bytes) -> str:
    """The checkpoint text of an iterator's ``state``: a dict as JSON indented by four spaces,
    a bytes state (which is that text already) decoded."""
    if isinstance(state, bytes):
        return state.decode()
    return json.dumps(state, indent=4)


def decode_state(text: str | bytes, source: str) -> Any:
    """Parses checkpoint text (``encode_state``'s, or Google Grain's) read from ``source``.

    Args:
      text: The text, or its UTF-8 bytes.
      source: What held it, for the error: ``"Checkpoint file <path>"``, ``"DataLoader state"``.

    Raises:
      ValueError: If it is not valid UTF-8 JSON, naming ``source``.
    """
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{source} is not valid JSON ({e}); it is truncated or corrupt. "
            "Restore an earlier checkpoint."
        ) from e


def _decode_file(text: str, path: str) -> Any:
    return decode_state(text, f"Checkpoint file {path}")


def _shard_file_name(key: int | str) -> str:
    return f"shard_state_{key}.json"


def shard_file(directory: Any, key: int) -> str:
    """Path of the state file of input dataset ``key`` in ``directory``."""
    return storage.join(directory, _shard_file_name(key))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_shard_checkpoint(
    directory: Any,
    shard: tuple[int, int],
    state: Mapping[str, Any],
    shard_states: Mapping[int, Mapping[str, Any]],
    position: SavePosition,
) -> None:
    """Writes an ``ElasticIterator`` shard's save: ``shard_state_{k}.json`` holding
    ``shard_states[k]`` for every ``k``, then (the commit point) ``process_{i}-of-{n}.json``
    holding ``state``, the digest of each shard-state file and the save's ``position``. Each
    file is atomic.

    Raises:
      OSError: If a file cannot be written, naming it (the save is then incomplete, and
        restoring it is refused until a save of the directory completes).
    """
    shard_texts = {key: encode_state(s) for key, s in shard_states.items()}
    for key, text in shard_texts.items():
        storage.write_bytes(shard_file(directory, key), text.encode())
    record = {
        **state,
        _SHARD_DIGESTS: {str(k): _digest(t) for k, t in shard_texts.items()},
        _SAVE_POSITION: dataclasses.asdict(position),
    }
    write_process_file(directory, encode_state(record), shard)


def read_shard_process_state(directory: Any, shard: tuple[int, int]) -> tuple[Any, int] | None:
    """The state in shard ``(i, n)``'s ``process_{i}-of-{n}.json`` (without its commit
    record) and the step of the save, or None if the file is missing. The process files of
    the other shards of ``n`` are read too, and must be of the same save.

    Raises:
      ValueError: If a file is not UTF-8 JSON, naming it; if another shard's process file is
        missing or of another save (see ``read_shard_states``), naming the directory and files.
    """
    path = storage.join(directory, process_file_name(shard))
    try:
        record = _decode_file(_read_text(path), path)
    except FileNotFoundError:
        return None
    # A shard restores from its own file alone (shards may save to directories of their own),
    # so only the other shards' files that are there are checked.
    records = _process_records(directory, shard[1], missing_ok=True)
    step = _save_step(directory, records)
    if isinstance(record, dict):
        record.pop(_SHARD_DIGESTS, None)
        record.pop(_SAVE_POSITION, None)
    return record, step


def _process_records(directory: Any, count: int, *, missing_ok: bool = False) -> dict[str, Any]:
    """The parsed process files of the ``count`` shards of a save, by file name (with
    ``missing_ok``, those that exist).

    Raises:
      ValueError: If one is missing (without ``missing_ok``) or not UTF-8 JSON, naming the
        directory and the file.
    """
    records = {}
    for index in range(count):
        name = process_file_name((index, count))
        path = storage.join(directory, name)
        try:
            records[name] = _decode_file(_read_text(path), path)
        except FileNotFoundError:
            if missing_ok:
                continue
            raise ValueError(
                f"The checkpoint in {directory} is incomplete: {name} is missing (shard "
                f"{index} of {count} did not finish its save). Restore an earlier checkpoint."
            ) from None
    return records


def _save_step(directory: Any, records: Mapping[str, Any]) -> int:
    """The step of the save whose process files are ``records``: the one step of the shards
    whose input had not run out, which those that ran out did not pass (their state is the
    same at every later step). Files without a position (Google Grain's, earlier versions')
    count as step 0 when all are such.

    Raises:
      ValueError: If the files are of different saves, naming the directory and two files.
    """
    positions = {
        name: record.get(_SAVE_POSITION) if isinstance(record, dict) else None
        for name, record in records.items()
    }
    without = sorted(name for name, p in positions.items() if p is None)
    if len(without) == len(positions):
        return 0
    if without:
        with_one = next(name for name, p in positions.items() if p is not None)
        raise ValueError(
            f"The checkpoint in {directory} mixes saves: {with_one} records the step of its "
            f"save and {without[0]} does not (an earlier version wrote it). Restore from a "
            "directory that one save wrote, or save each step to a directory of its own."
        )
    steps = {
        name: (int(p["step"]), bool(p["ended"])) for name, p in positions.items() if p is not None
    }
    running = {name: step for name, (step, ended) in steps.items() if not ended}
    step = max(running.values()) if running else max(s for s, _ in steps.values())
    for name, (saved, ended) in steps.items():
        if saved == step or (ended and saved < step):
            continue
        latest = next(n for n, s in running.items() if s == step)
        raise ValueError(
            f"The checkpoint in {directory} mixes saves of different steps: {latest} was "
            f"saved after {step} steps and {name} after {saved} (a save of all shards did not "
            "finish). Restore an earlier checkpoint, and save each step to a directory of its "
            "own."
        )
    return step


def read_shard_states(
    directory: Any, shard: tuple[int, int], wanted: Callable[[int, int], bool]
) -> tuple[dict[int, Any], int]:
    """The saved states of the input datasets ``k`` for which ``wanted(k, n)`` holds (``n``:
    the number of shards that saved), from the complete save in ``directory``, and the step of
    that save.

    The save is complete when the process file of every saving shard exists, all of them
    record the same step (a shard whose input ran out may record an earlier one), and every
    shard-state file read has the digest its shard's process file lists (files that no
    process file lists are not read). A checkpoint without digests (Google Grain's, earlier
    versions') is read as it is.

    Args:
      directory: The checkpoint directory.
      shard: ``(i, n)`` of the restoring shard, for messages.
      wanted: Which inputs to read.

    Raises:
      ValueError: If the directory holds no checkpoint, only part of one, or files of several
        saves, naming the directory and the missing or mismatched file; if a file is not UTF-8
        JSON, naming it.
    """
    counts = written_process_counts(directory)
    if not counts:
        orphans = _shard_state_keys(directory)
        if orphans:
            raise ValueError(
                f"The checkpoint in {directory} is incomplete: it has "
                f"{_shard_file_name(orphans[0])} but no process_*-of-*.json file, "
                "which a save writes last. The save was interrupted; restore an earlier "
                "checkpoint."
            )
        raise ValueError(
            f"{directory} holds no ElasticIterator checkpoint: neither "
            f"{process_file_name(shard)} nor shard_state_*.json files. Check the directory."
        )
    if len(counts) > 1:
        raise ValueError(
            f"The checkpoint in {directory} mixes saves of "
            f"{' and '.join(map(str, sorted(counts)))} shards (process_*-of-*.json files): "
            "restore from a directory that one save wrote."
        )
    (count,) = counts
    records = _process_records(directory, count)
    step = _save_step(directory, records)
    listed: dict[int, tuple[str, str]] = {}  # key -> (digest, the process file listing it)
    legacy = []
    for name, record in records.items():
        digests = record.get(_SHARD_DIGESTS) if isinstance(record, dict) else None
        if digests is None:
            legacy.append(name)
        else:
            listed.update({int(k): (d, name) for k, d in digests.items()})
    if legacy and listed:
        raise ValueError(
            f"The checkpoint in {directory} mixes saves: {legacy[0]} lists no shard-state "
            "files, other process files do. Restore from a directory that one save wrote."
        )
    keys = _shard_state_keys(directory) if legacy else sorted(listed)
    states = {}
    for key in keys:
        if not wanted(key, count):
            continue
        path = shard_file(directory, key)
        try:
            text = _read_text(path)
        except FileNotFoundError:
            if legacy:  # removed since the directory was listed: as if it had not been there
                continue
            raise ValueError(
                f"The checkpoint in {directory} is incomplete: {path} is missing, which "
                f"{listed[key][1]} lists. Restore an earlier checkpoint."
            ) from None
        if not legacy and _digest(text) != listed[key][0]:
            raise ValueError(
                f"The checkpoint in {directory} mixes two saves: {path} is not the file that "
                f"{listed[key][1]} lists (its content differs); a later save was interrupted. "
                "Restore an earlier checkpoint."
            )
        states[key] = _decode_file(text, path)
    return states, step


def _shard_state_keys(directory: Any) -> list[int]:
    """The ``k`` of every ``shard_state_{k}.json`` in ``directory``, sorted."""
    names = storage.glob(storage.join(directory, _shard_file_name("*")), allow_empty=True)
    keys = (n.rsplit("shard_state_", 1)[1].removesuffix(".json") for n in names)
    return sorted(int(k) for k in keys if k.isdigit())


def save_item(directory: Any, item: Any) -> None:
    """Saves iterator ``item`` into ``directory``: its shard-state files and process file when
    it checkpoints shard states, else this process's file holding its state.

    Raises:
      OSError: If a file cannot be written, naming it.
    """
    if _checkpoints_shard_states(item):
        item.save_shard_checkpoint(directory)
        return
    write_process_file(directory, encode_state(item.get_state()))


def restore_item(directory: Any, item: Any, *, start_prefetch: bool = False) -> None:
    """Restores iterator ``item`` in place from ``directory`` (see ``save_item``); an iterator
    with the same state on every process restores from any process's file.

    Args:
      directory: The checkpoint directory (a local path or URL).
      item: The iterator to restore.
      start_prefetch: Also start the background work of the iterators restored, in the same
        walk of the iterator tree (see ``restore_and_start``).

    Raises:
      ValueError: If the file is missing, truncated or not JSON, or holds the state of another
        kind of iterator, naming the file.
    """

    def restore() -> None:
        if _checkpoints_shard_states(item):
            item.restore_shard_checkpoint(directory)
            return
        same = isinstance(item, SameStateEverywhere) and item.state_same_on_every_process
        _set_state(item, read_process_file(directory, any_process=same), directory)

    if start_prefetch:
        restore_and_start(restore)
    else:
        restore()


class _RestoreStarts(threading.local):
    """The background work queued by the iterators that the restore running on this thread
    has set so far; ``None`` outside a restore that starts it."""

    queue: list[Callable[[], None]] | None = None


_RESTORE_STARTS = _RestoreStarts()


def restore_and_start(restore: Callable[[], None]) -> None:
    """Runs ``restore`` (``set_state`` calls that walk an iterator tree), then starts the
    background work that the iterators it set queued with ``start_when_restored``, in the
    order they queued it: the tree is walked once, and nothing starts before every iterator
    has its state (inputs of one engine start from all their positions)."""
    outer = _RESTORE_STARTS.queue
    starts: list[Callable[[], None]] = []
    _RESTORE_STARTS.queue = starts
    try:
        restore()
    finally:
        _RESTORE_STARTS.queue = outer
    for start in starts:
        start()


def start_when_restored(start: Callable[[], None]) -> bool:
    """Queues ``start`` (an iterator's own background work, at the end of its ``set_state``)
    to run when the restore that is setting its state ends, if that restore starts background
    work (``restore_and_start``); returns whether it did."""
    starts = _RESTORE_STARTS.queue
    if starts is None:
        return False
    starts.append(start)
    return True


def _checkpoints_shard_states(item: Any) -> bool:
    return isinstance(item, ShardStateCheckpointing) and item.checkpoints_shard_states


def _set_state(item: Any, text: str, directory: Any) -> None:
    """Sets ``item``'s state to ``text``, read from ``directory``: its bytes for an iterator
    with a bytes state, else the decoded dict.

    Raises:
      ValueError: If ``text`` is not JSON or not a state of this iterator, naming the file.
    """
    path = storage.join(directory, process_file_name())
    state = _decode_file(text, path)
    try:
        item.set_state(
            text.encode() if isinstance(item, BytesState) and item.state_is_bytes else state
        )
    except ValueError as e:
        e.add_note(f"Restoring from checkpoint file {path}.")
        raise
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(
            f"Checkpoint file {path} does not hold a state of this {type(item).__name__} "
            f"({type(e).__name__}: {e}): it was saved from another pipeline or another "
            "kind of iterator (a DataLoader's, or one with another worker count)."
        ) from e


def save_coroutine(directory: Any, item: Any) -> Coroutine[Any, Any, None]:
    """Orbax v1 ``save`` of iterator ``item``: a coroutine that waits for ``directory`` and
    writes this process's file holding ``item``'s state.

    The state is taken at call time, so later iteration does not change what is written.
    """
    text = encode_state(item.get_state())

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


def load_coroutine(directory: Any, item: Any) -> Coroutine[Any, Any, None]:
    """Orbax v1 ``load`` of iterator ``item``: a coroutine that reads this process's file and
    restores ``item`` from it.

    Raises:
      ValueError: (when awaited) as ``restore_item`` does.
    """

    async def _read() -> None:
        import asyncio  # import cost: ~60 ms, and only Orbax restores need it

        _set_state(item, await asyncio.to_thread(read_process_file, directory), directory)

    return _read()

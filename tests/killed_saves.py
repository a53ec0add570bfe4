"""Shared checks of ``ElasticIterator`` checkpoints whose save was killed part-way, on a local
disk or an object store: a restore gives the old state, the new state or a clear error."""

from __future__ import annotations

import itertools
from typing import Any
from unittest import mock

import numpy as np

from grain_core import MapDataset, storage
from grain_core.checkpoint import CheckpointHandler
from grain_core.experimental import ElasticIterator, InterleaveIterDataset
from grain_core.sharding import ShardOptions

__all__ = [
    "GLOBAL_BATCH",
    "INPUTS",
    "Killed",
    "check_old_new_or_refused",
    "make",
    "restore_all",
    "save_killed_at",
]

# Six inputs of 3 to 8 elements, read two at a time.
INPUTS = [list(range(100 * k, 100 * k + 3 + k)) for k in range(6)]
# A multiple of every shard count the checks use (1 to 3).
GLOBAL_BATCH = 6


class Killed(BaseException):
    """Stands for the process dying: nothing after it runs, nothing is cleaned up."""


def make(index: int, count: int) -> ElasticIterator:
    """Shard ``index`` of ``count`` of an ElasticIterator over ``INPUTS``."""
    inputs = [MapDataset.source(f) for f in INPUTS]
    return ElasticIterator(
        InterleaveIterDataset(inputs, cycle_length=2), GLOBAL_BATCH, ShardOptions(index, count)
    )


def _values(it: ElasticIterator, steps: int | None) -> list[int]:
    return [x for batch in itertools.islice(it, steps) for x in np.asarray(batch).ravel().tolist()]


def save_killed_at(
    directory: str, count: int, steps: int, kill_at: int, cut: float | None = None
) -> list[int]:
    """Runs ``count`` shards ``steps`` steps each and saves them one after another into
    ``directory``, as if the saving processes died at file write ``kill_at`` (counted over all
    of them): with ``cut`` not None, locally after that fraction of the file's bytes reached its
    temporary file. Returns the elements the shards handed out.

    Raises:
      Killed: If the save was killed.
    """
    writes = 0
    write_bytes = storage.write_bytes

    def write(path: Any, data: bytes, storage_options: Any = None) -> None:
        nonlocal writes
        if writes == kill_at:
            if cut is not None and not storage.is_url(path):
                writer = storage.AtomicWriter(path)
                writer.file.write(data[: int(len(data) * cut)])
                writer.file.close()  # the writer's lock goes with its process
            raise Killed
        writes += 1
        write_bytes(path, data, storage_options)

    handed_out = []
    with mock.patch.object(storage, "write_bytes", write):
        for index in range(count):
            it = make(index, count)
            handed_out += _values(it, steps)
            CheckpointHandler().save(directory, it)
    return handed_out


def restore_all(directory: str, count: int) -> list[int] | ValueError:
    """The elements that ``count`` shards restored from ``directory`` hand out, or the error
    of the first shard that refuses the checkpoint."""
    rest: list[int] = []
    for index in range(count):
        it = make(index, count)
        try:
            CheckpointHandler().restore(directory, it)
        except ValueError as e:
            return e
        rest += _values(it, None)
    return rest


def check_old_new_or_refused(
    directory: str, count: int, old: list[int] | None, new: list[int], case: str
) -> None:
    """Asserts that restoring ``directory`` with ``count`` shards continues after the elements
    ``old`` (None: there was no checkpoint) or ``new`` were handed out, or raises a
    ``ValueError`` naming the directory; never anything else (``case`` describes the save in
    the failure message)."""
    everything = sorted(x for f in INPUTS for x in f)
    rest = restore_all(directory, count)
    if isinstance(rest, ValueError):
        assert str(directory) in str(rest), (case, rest)
        return
    continuations = [sorted(seen + rest) for seen in (old, new) if seen is not None]
    assert everything in continuations, (case, rest)

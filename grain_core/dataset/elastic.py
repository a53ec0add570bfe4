"""``ElasticIterator``: batching and sharding owned by the iterator, so a checkpoint restores
under a different number of shards.

* MapDataset mode: the state is one number, the global index ``g`` of the next element,
  identical on every shard after the same number of steps. Step ``t`` reads the global batch
  ``ds[g + t*B : g + (t+1)*B]`` (``B = global_batch_size``); shard ``s`` of ``S`` takes its
  ``s``-th block of ``B // S`` consecutive elements, so the shards' batches, joined in shard
  order, are the global batch whatever ``S`` is: a restore under any shard count continues the
  identical global stream (same elements, same order, every step). Only whole global batches
  are read (a final partial one is dropped on every shard alike).
* IterDataset mode (experimental): the pipeline is sliced at its interleave (or another
  sliceable node) so shard ``s`` reads input datasets ``s, s + S, ...``.

  - Same shard count: ``get_state()`` is the whole pipeline's state (window shuffle, packing
    and prefetch positions included); restoring it continues exactly. ``CheckpointHandler``
    writes it to ``process_{s}-of-{S}.json`` and restores it when the shard count matches.
  - Another shard count: progress is saved per input dataset (``get_shard_states``, files
    ``shard_state_{k}.json``), taken at the consumer's position, and redistributed. This is
    exact -- every element not yet handed out is read once, none twice -- when no iterator
    between the output and the sliced node holds elements it has partly handed out (a window
    shuffle in mid-window, a packer in mid-group, a flat_map or rebatch in mid-input; also
    ``repeat`` past its first epoch, ``limit`` after it counted). Otherwise the input states
    carry ``"held"``, naming the shard and that node, and restoring them under another shard
    count raises ``ValueError`` with that text: those elements exist only in that shard's
    buffer. Counters that only number elements (``map_with_index``, ``random_map``, a
    packer's bin-shuffle counter) restart at 0. The order after a change of ``S`` is not the
    order of an uninterrupted run.

  When the sliceable node is a file reader rather than an ``InterleaveIterDataset`` (no
  interleave remains to read inputs concurrently: multi-file Parquet or TFRecord read their
  files on the consumer thread) and ``read_options.num_threads = T > 1``, the shard's pipeline
  is split by threads: copy ``t`` reads the shard's inputs ``t, t + T, ...`` on its own thread
  and an interleave merges the ``T`` copies in rotation. Shard states stay per input dataset:
  input ``j`` of copy ``t`` is the shard's input ``j * T + t``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grain_core import _checkpoint_io
from grain_core.capabilities import InPlaceSliceable, ShardStateOwner, WorkerSliceable
from grain_core.dataset.base import DatasetIterator, IterDataset, MapDataset
from grain_core.dataset.ops.interleave import (
    InterleaveDatasetIterator,
    InterleaveIterDataset,
    interleave_state,
)
from grain_core.dataset.ops.map import FilterMapDataset
from grain_core.dataset.ops.mix import MixedIterDataset
from grain_core.dataset.ops.zip import ZipIterDataset
from grain_core.dataset.prefetch import PrefetchIterDataset
from grain_core.dataset.worker_slicing import slice_for_worker
from grain_core.options import MultiprocessingOptions, ReadOptions
from grain_core.sharding import ShardOptions

__all__ = ["ElasticIterator"]


class ElasticIterator(DatasetIterator[Any]):
    """Iterates global batches of ``ds`` split over ``shard_options.shard_count`` shards.

    Args:
      ds: an unbatched, unsharded ``MapDataset`` (deterministic elasticity) or ``IterDataset``
        (experimental, see module docstring).
      global_batch_size: elements per step over all shards; each shard yields batches of
        ``global_batch_size // shard_count``.
      shard_options: this process's shard.
      read_options: for ``to_iter_dataset`` (MapDataset mode); in IterDataset mode
        ``num_threads > 1`` splits a file reader's inputs over that many threads.
      multiprocessing_options: run each shard's pipeline in worker processes (MapDataset mode).

    Raises:
      ValueError: if the graph contains ``filter`` (MapDataset), zip/mix/``to_iter_dataset`` above
        the slice point (IterDataset mode), or ``global_batch_size`` is not a positive multiple of
        the shard count.
      NotImplementedError: for worker processes in IterDataset mode.
    """

    def __init__(
        self,
        ds: MapDataset[Any] | IterDataset[Any],
        global_batch_size: int,
        shard_options: ShardOptions,
        *,
        read_options: ReadOptions | None = None,
        multiprocessing_options: MultiprocessingOptions | None = None,
    ) -> None:
        super().__init__()
        count = shard_options.shard_count
        if global_batch_size <= 0 or global_batch_size % count:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a positive multiple of the "
                f"shard count ({count}) so every shard yields batches of the same size."
            )
        _reject_filter(ds)
        if isinstance(ds, IterDataset):
            if multiprocessing_options is not None and multiprocessing_options.num_workers > 0:
                raise NotImplementedError(
                    "ElasticIterator over an IterDataset does not support worker processes yet; "
                    "pass a MapDataset, or multiprocessing_options=None."
                )
            _check_iter_graph(ds)
        self._ds = ds
        self._global_batch_size = global_batch_size
        self._shard_options = shard_options
        self._read_options = read_options or ReadOptions()
        self._mp_options = multiprocessing_options
        self._global_next_index = 0
        # Whether ``next`` found the input at its end (a checkpoint's save position).
        self._ended = False
        self._iterator: DatasetIterator[Any] | None = None
        # IterDataset mode: this shard's pipeline, and with a split by threads copy t of it.
        self._shard_ds: IterDataset[Any] | None = None
        self._thread_copies: list[IterDataset[Any]] = []

    @property
    def shard_options(self) -> ShardOptions:
        return self._shard_options

    @property
    def checkpoints_shard_states(self) -> bool:
        """Whether ``CheckpointHandler`` saves this iterator with per-dataset shard-state files."""
        return isinstance(self._ds, IterDataset)

    @property
    def state_same_on_every_process(self) -> bool:
        """Whether this iterator's state is the same on every shard (``SameStateEverywhere``):
        in MapDataset mode, so any shard's checkpoint file restores any shard."""
        return isinstance(self._ds, MapDataset)

    def save_shard_checkpoint(self, directory: Any) -> None:
        """Saves this shard's files into ``directory`` (see ``_write_shard_state_files``)."""
        _write_shard_state_files(directory, self)

    def restore_shard_checkpoint(self, directory: Any) -> None:
        """Restores from ``directory`` (see ``_restore_shard_state_files``)."""
        _restore_shard_state_files(directory, self)

    @property
    def base_iterator(self) -> DatasetIterator[Any]:
        """This shard's pipeline iterator, built on first use."""
        self._check_open()
        if self._iterator is None:
            self._iterator = iter(self._shard_dataset())
        return self._iterator

    def _shard_dataset(self) -> IterDataset[Any]:
        index, count = self._shard_options.shard_index, self._shard_options.shard_count
        per_shard = self._global_batch_size // count
        if isinstance(self._ds, MapDataset):
            rest = self._ds.slice(slice(self._global_next_index, None))
            steps = len(rest) // self._global_batch_size
            # Block k of per_shard elements is block k % count of step k // count's global batch.
            blocks: MapDataset[Any] = rest.batch(per_shard, drop_remainder=True)
            it_ds = blocks.slice(slice(index, steps * count, count)).to_iter_dataset(
                self._read_options
            )
            if self._mp_options is not None:
                it_ds = it_ds.mp_prefetch(self._mp_options)
            return it_ds
        if self._shard_ds is None:
            shard = slice_for_worker(self._ds, index, count)
            threads = self._read_options.num_threads
            # Only file readers are split: a MapDataset read by ``to_iter_dataset`` has read
            # threads of its own (``_sliceable_nodes`` finds none there).
            readers = _sliceable_nodes(shard)
            if (
                threads > 1
                and readers
                and not any(isinstance(node, InterleaveIterDataset) for node in readers)
            ):
                self._thread_copies = [slice_for_worker(shard, t, threads) for t in range(threads)]
                shard = InterleaveIterDataset(
                    self._thread_copies, cycle_length=threads, num_make_iter_threads=threads
                )
            self._shard_ds = shard.batch(per_shard, drop_remainder=False)
        return self._shard_ds

    def __next__(self) -> Any:
        try:
            x = next(self.base_iterator)
        except StopIteration:
            self._ended = True
            raise
        self._global_next_index += self._global_batch_size
        return x

    def start_prefetch(self) -> None:
        if not self._closed:
            self.base_iterator.start_prefetch()

    # ---------------------------------------------------------------------- state
    def get_state(self) -> dict[str, Any]:
        if isinstance(self._ds, MapDataset):
            return {"global_next_index": self._global_next_index}
        return self.base_iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        if isinstance(self._ds, MapDataset):
            self._global_next_index = self._state_int(state, "global_next_index")
            self._drop_iterator()
            self._start_when_restored()
        else:
            self.base_iterator.set_state(state)
            self._ended = False

    def _drop_iterator(self) -> None:
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None

    def _check_shard_states_mode(self) -> None:
        if isinstance(self._ds, MapDataset):
            raise ValueError(
                "Shard states exist in IterDataset mode only; a MapDataset ElasticIterator's "
                "get_state() already restores under any shard count."
            )

    def _thread_interleave(self) -> InterleaveDatasetIterator:
        """The interleave over the thread copies (split by threads)."""
        return next(
            it for it in _iterators(self.base_iterator) if isinstance(it, InterleaveDatasetIterator)
        )

    def get_shard_states(self) -> dict[int, dict[str, Any]]:
        """Progress per input dataset at the consumer's position, keyed by the input's index in
        the unsharded dataset list: ``{"exhausted": 0|1, "state": s}``, plus ``"held"`` (why
        it cannot move to another shard count) when an iterator above the sliced node holds
        elements it has partly handed out.

        Raises:
          ValueError: in MapDataset mode, or without an interleave in the pipeline.
        """
        self._check_shard_states_mode()
        base = self.base_iterator
        if not self._thread_copies:
            local, held = _consumed_progress(self._shard_dataset(), base.get_state())
            return self._global_keys(local, held, 0, 1)
        # Split by threads: the merging interleave's states of the copies are consumed
        # positions; each copy's own pipeline is read out on a scratch iterator.
        out: dict[int, dict[str, Any]] = {}
        threads = len(self._thread_copies)
        copies = self._thread_interleave().get_shard_states()
        for t, (copy_ds, entry) in enumerate(zip(self._thread_copies, copies, strict=True)):
            local, held = _consumed_progress(copy_ds, entry["state"])
            out.update(self._global_keys(local, held, t, threads))
        return out

    def _global_keys(
        self, local: list[dict[str, Any]], held: list[str], thread: int, threads: int
    ) -> dict[int, dict[str, Any]]:
        index, count = self._shard_options.shard_index, self._shard_options.shard_count
        if held:
            note = f"shard {index} of {count}: {'; '.join(held)}"
            local = [{**entry, "held": note} for entry in local]
        return {(j * threads + thread) * count + index: s for j, s in enumerate(local)}

    def set_shard_states(self, shard_states: Mapping[Any, dict[str, Any]]) -> None:
        """Restores progress saved by any shard topology (string keys accepted, as from JSON).

        Input datasets without an entry start from their beginning.

        Raises:
          ValueError: in MapDataset mode, without an interleave in the pipeline, or if an entry
            is ``"held"``: elements of its shard's buffers would be lost.
        """
        self._check_shard_states_mode()
        states = {int(k): v for k, v in shard_states.items()}
        _refuse_held(states.values(), self._shard_options.shard_count)
        self._ended = False
        base = self.base_iterator
        if not self._thread_copies:
            owner, _ = _owner_below(base)
            owner.set_shard_states(self._local_states(owner, states, 0, 1))
            return
        threads = len(self._thread_copies)
        copy_states = []
        for t, copy_ds in enumerate(self._thread_copies):
            with iter(copy_ds) as scratch:
                owner, _ = _owner_below(scratch)
                owner.set_shard_states(self._local_states(owner, states, t, threads))
                copy_states.append(scratch.get_state())
        self._thread_interleave().set_state(interleave_state(copy_states))

    def _local_states(
        self, owner: Any, states: dict[int, dict[str, Any]], thread: int, threads: int
    ) -> list[dict[str, Any]]:
        keys = self._global_keys(owner.get_shard_states(), [], thread, threads)
        fresh = {"exhausted": 0, "state": None}
        return [states.get(key, fresh) for key in keys]

    def close(self) -> None:
        if self._closed:
            return
        self._drop_iterator()
        super().close()

    def __repr__(self) -> str:
        return (
            f"ElasticIterator(global_batch_size={self._global_batch_size}, "
            f"shard_options={self._shard_options})"
        )


def _iterators(it: DatasetIterator[Any]) -> Any:
    """``it`` and its parent iterators, nearest first."""
    queue: list[Any] = [it]
    while queue:
        current = queue.pop(0)
        yield current
        queue.extend(getattr(current, "_parents", ()))


def _owner_below(top: DatasetIterator[Any]) -> tuple[Any, list[str]]:
    """The iterator nearest ``top`` that keeps progress per input dataset, and what the
    iterators above it hold (``_progress_held``).

    Raises:
      ValueError: if no such iterator is below ``top``.
    """
    held: list[str] = []
    current: Any = top
    while not isinstance(current, ShardStateOwner):
        reason = current._progress_held()
        if reason is not None:
            held.append(reason)
        parents = getattr(current, "_parents", ())
        if not parents:
            raise ValueError(
                "This ElasticIterator's pipeline has no interleave (or other iterator with "
                "shard states) to redistribute; use get_state()/set_state()."
            )
        current = parents[0]
    return current, held


def _consumed_progress(
    ds: IterDataset[Any], state: dict[str, Any] | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Per-input progress of ``ds``'s sliced node when its pipeline is at ``state``, and what
    the iterators above that node hold there.

    Buffering iterators keep their parent's state at the start of what they buffer, and
    prefetching ones the state as of the last element handed out, so a scratch pipeline restored
    to ``state`` stands where the consumer is; the live one may have read ahead.
    """
    with iter(ds) as scratch:
        if state is not None:
            scratch.set_state(state)
        owner, held = _owner_below(scratch)
        return owner.get_shard_states(), held


def _refuse_held(entries: Any, shard_count: int) -> None:
    """Raises ``ValueError`` naming what holds elements if any entry is ``"held"``."""
    notes = sorted({entry["held"] for entry in entries if entry.get("held")})
    if notes:
        raise ValueError(
            f"Cannot move this checkpoint's progress to {shard_count} shard(s): when it was "
            f"saved, {'; '.join(notes)}. Those elements were read from the inputs and exist only "
            "in that shard's buffer, so they would be lost. Restore with the shard count that "
            "saved the checkpoint (its process_*-of-*.json files), or save when no such buffer "
            "is part-way through (e.g. after a whole window of a window shuffle)."
        )


def _sliceable_nodes(ds: IterDataset[Any]) -> list[Any]:
    """The first sliceable node on every path from ``ds`` towards its sources."""
    found, stack = [], [ds]
    while stack:
        node = stack.pop()
        if isinstance(node, (WorkerSliceable, InPlaceSliceable)):
            found.append(node)
        else:
            stack.extend(p for p in node._parents if isinstance(p, IterDataset))
    return found


def _walk(ds: Any) -> Any:
    stack, seen = [ds], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(getattr(node, "_parents", ()))


def _reject_filter(ds: Any) -> None:
    for node in _walk(ds):
        if isinstance(node, FilterMapDataset):
            raise ValueError(
                "ElasticIterator does not support `filter` transformation: a filtered MapDataset "
                "has holes, so global indices no longer map to elements. Filter after the "
                "ElasticIterator, or filter the source offline."
            )


def _check_iter_graph(ds: IterDataset[Any]) -> None:
    """Rejects zip, mix and ``to_iter_dataset`` between the output and the slice point."""
    stack: list[Any] = [ds]
    while stack:
        node = stack.pop()
        if isinstance(node, (ZipIterDataset, MixedIterDataset, PrefetchIterDataset)):
            raise ValueError(
                "ElasticIterator does not support zip, mix or prefetch transformation yet "
                f"(found {node!r} above the interleave). Build the IterDataset from an "
                "InterleaveIterDataset over per-file datasets, or pass a MapDataset."
            )
        if isinstance(node, (WorkerSliceable, InPlaceSliceable)):
            continue
        stack.extend(p for p in node._parents if isinstance(p, IterDataset))


# -------------------------------------------------------------------- checkpoint files
def _shard(options: ShardOptions) -> tuple[int, int]:
    return options.shard_index, options.shard_count


def _write_shard_state_files(directory: Any, iterator: ElasticIterator) -> None:
    """Writes ``shard_state_{k}.json`` for every input dataset ``k`` of this shard, then this
    shard's pipeline state (``process_{s}-of-{S}.json``, the save's commit point: see
    ``_checkpoint_io.write_shard_checkpoint``), with the number of global batches handed out,
    which identifies the save on every shard."""
    steps = iterator._global_next_index // iterator._global_batch_size
    _checkpoint_io.write_shard_checkpoint(
        directory,
        _shard(iterator.shard_options),
        iterator.get_state(),
        iterator.get_shard_states(),
        _checkpoint_io.SavePosition(steps, iterator._ended),
    )


def _restore_shard_state_files(directory: Any, iterator: ElasticIterator) -> None:
    """Restores this shard's pipeline state if the checkpoint has one for this shard count
    (exact, buffers included); else reads this shard's inputs ``k = shard_index, shard_index +
    shard_count, ...`` of the complete save in the directory and redistributes them. Either
    way the process files of every shard that saved must be of one save (one step).

    Raises:
      ValueError: if the directory holds no checkpoint, part of one or files of several saves
        (naming the directory and the file); if a file is not valid JSON, naming it; if a
        shard that saved the checkpoint held elements that another shard count cannot take
        over (see ``set_shard_states``).
    """
    options = iterator.shard_options
    shard = _shard(options)
    saved = _checkpoint_io.read_shard_process_state(directory, shard)
    if saved is not None:
        state, step = saved
        iterator.set_state(state)
    else:
        index, count = shard
        # Input k < n was saved by shard k of n: reading those too, every shard refuses what
        # any saving shard held, not only the shards that read its inputs.
        read, step = _checkpoint_io.read_shard_states(
            directory, shard, lambda k, saved_count: k % count == index or k < saved_count
        )
        _refuse_held(read.values(), count)
        iterator.set_shard_states({k: s for k, s in read.items() if k % count == index})
    iterator._global_next_index = step * iterator._global_batch_size

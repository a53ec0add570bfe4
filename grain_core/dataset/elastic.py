"""``ElasticIterator``: batching and sharding owned by the iterator, so a checkpoint restores
under a different number of shards.

* MapDataset mode: the state is one number, the global index of the next element, identical on
  every shard after the same number of steps. Shard ``s`` of ``S`` reads
  ``ds[g + s :: S]`` in batches of ``global_batch_size // S``; any shard's state restores any
  topology, and the union of what the shards read is the same for every ``S``.
* IterDataset mode (experimental): the pipeline is sliced at its interleave (or another
  sliceable node) so shard ``s`` reads input datasets ``s, s + S, ...``; progress is saved per
  input dataset (``get_shard_states``) and redistributed when ``S`` changes. The order after a
  change of ``S`` is not the order of an uninterrupted run.

  When the sliceable node is a file reader rather than an ``InterleaveIterDataset`` (no
  interleave remains to read inputs concurrently: multi-file Parquet or TFRecord read their
  files on the consumer thread) and ``read_options.num_threads = T > 1``, the shard's pipeline
  is split by threads: copy ``t`` reads the shard's inputs ``t, t + T, ...`` on its own thread
  and an interleave merges the ``T`` copies in rotation. Shard states stay per input dataset:
  input ``j`` of copy ``t`` is the shard's input ``j * T + t``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from grain_core import _checkpoint_io
from grain_core.capabilities import InPlaceSliceable, ShardStateOwner, WorkerSliceable
from grain_core.dataset.base import DatasetIterator, IterDataset, MapDataset
from grain_core.dataset.interleave import (
    InterleaveDatasetIterator,
    InterleaveIterDataset,
    interleave_input_states,
    interleave_state,
)
from grain_core.dataset.map import FilterMapDataset
from grain_core.dataset.mix import MixedIterDataset
from grain_core.dataset.prefetch import PrefetchIterDataset
from grain_core.dataset.worker_slicing import slice_for_worker
from grain_core.dataset.zip import ZipIterDataset
from grain_core.options import MultiprocessingOptions, ReadOptions
from grain_core.sharding import ShardOptions

__all__ = ["ElasticIterator", "restore_shard_state_files", "write_shard_state_files"]


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
        self._iterator: DatasetIterator[Any] | None = None
        # IterDataset mode, split by threads: copy t of the shard's pipeline.
        self._thread_copies: list[IterDataset[Any]] = []

    @property
    def shard_options(self) -> ShardOptions:
        return self._shard_options

    @property
    def checkpoints_shard_states(self) -> bool:
        """Whether ``CheckpointHandler`` saves this iterator as per-dataset shard-state files."""
        return isinstance(self._ds, IterDataset)

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
            start = self._global_next_index + index
            ds = self._ds.slice(slice(start, None, count))
            it_ds: IterDataset[Any] = ds.batch(per_shard, drop_remainder=True).to_iter_dataset(
                self._read_options
            )
            if self._mp_options is not None:
                it_ds = it_ds.mp_prefetch(self._mp_options)
            return it_ds
        shard = slice_for_worker(self._ds, index, count)
        threads = self._read_options.num_threads
        if threads > 1 and not any(
            isinstance(node, InterleaveIterDataset) for node in _sliceable_nodes(shard)
        ):
            self._thread_copies = [slice_for_worker(shard, t, threads) for t in range(threads)]
            shard = InterleaveIterDataset(
                self._thread_copies, cycle_length=threads, num_make_iter_threads=threads
            )
        return shard.batch(per_shard, drop_remainder=False)

    def __next__(self) -> Any:
        x = next(self.base_iterator)
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
            self._global_next_index = int(state["global_next_index"])
            self._drop_iterator()
        else:
            self.base_iterator.set_state(state)

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
        """Progress per input dataset, keyed by its index in the unsharded dataset list.

        Raises:
          ValueError: in MapDataset mode, or without an interleave in the pipeline.
        """
        self._check_shard_states_mode()
        base = self.base_iterator
        if not self._thread_copies:
            return self._global_keys(_shard_state_owner(base).get_shard_states(), 0, 1)
        # Split by threads: the copies read ahead, so their consumed positions come from the
        # merging interleave's state, converted to per-input states on scratch iterators.
        merge_state = self._thread_interleave().get_state()
        out: dict[int, dict[str, Any]] = {}
        threads = len(self._thread_copies)
        for t, copy_ds in enumerate(self._thread_copies):
            with iter(copy_ds) as scratch:
                copy_state = interleave_input_states(merge_state)[t]
                if copy_state is not None:
                    scratch.set_state(copy_state)
                local = _shard_state_owner(scratch).get_shard_states()
            out.update(self._global_keys(local, t, threads))
        return out

    def _global_keys(
        self, local: list[dict[str, Any]], thread: int, threads: int
    ) -> dict[int, dict[str, Any]]:
        index, count = self._shard_options.shard_index, self._shard_options.shard_count
        return {(j * threads + thread) * count + index: s for j, s in enumerate(local)}

    def set_shard_states(self, shard_states: Mapping[Any, dict[str, Any]]) -> None:
        """Restores progress saved by any shard topology (string keys accepted, as from JSON).

        Input datasets without an entry start from their beginning.

        Raises:
          ValueError: in MapDataset mode, or without an interleave in the pipeline.
        """
        self._check_shard_states_mode()
        states = {int(k): v for k, v in shard_states.items()}
        base = self.base_iterator
        if not self._thread_copies:
            owner = _shard_state_owner(base)
            owner.set_shard_states(self._local_states(owner, states, 0, 1))
            return
        threads = len(self._thread_copies)
        copy_states = []
        for t, copy_ds in enumerate(self._thread_copies):
            with iter(copy_ds) as scratch:
                owner = _shard_state_owner(scratch)
                owner.set_shard_states(self._local_states(owner, states, t, threads))
                copy_states.append(scratch.get_state())
        self._thread_interleave().set_state(interleave_state(copy_states))

    def _local_states(
        self, owner: Any, states: dict[int, dict[str, Any]], thread: int, threads: int
    ) -> list[dict[str, Any]]:
        keys = self._global_keys(owner.get_shard_states(), thread, threads)
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


def _shard_state_owner(it: DatasetIterator[Any]) -> Any:
    """The iterator nearest the output that keeps progress per input dataset."""
    for current in _iterators(it):
        if isinstance(current, ShardStateOwner):
            return current
    raise ValueError(
        "This ElasticIterator's pipeline has no interleave (or other iterator with shard "
        "states) to redistribute; use get_state()/set_state()."
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
def write_shard_state_files(directory: Any, iterator: ElasticIterator) -> None:
    """Writes ``shard_state_{k}.json`` for every input dataset ``k`` of this shard, atomically."""
    _checkpoint_io.write_shard_state_files(
        directory,
        {key: json.dumps(state, indent=4) for key, state in iterator.get_shard_states().items()},
    )


def restore_shard_state_files(directory: Any, iterator: ElasticIterator) -> None:
    """Reads this shard's files ``k = shard_index, shard_index + shard_count, ...`` (until one is
    missing) and restores them.

    Raises:
      ValueError: if a file is not valid JSON, naming it.
    """
    options = iterator.shard_options
    texts = _checkpoint_io.read_shard_state_files(
        directory, options.shard_index, options.shard_count
    )
    states: dict[int, dict[str, Any]] = {}
    for key, text in texts.items():
        try:
            states[key] = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"Shard state file {_checkpoint_io.shard_file(directory, key)} is not valid "
                f"JSON ({e}); it is truncated or corrupt. Restore an earlier checkpoint."
            ) from e
    iterator.set_shard_states(states)

"""Round-robin interleaving of many datasets (``grain.experimental.InterleaveIterDataset``).

The hot path is a plain round-robin ``next()`` over the iterators held by the cycle's slots.
Background threads are started only where they can help (Grain's thread layout is not part
of its contract):

* an ``IterDataset`` input is read ahead on its own thread (``iter_buffer_size`` elements) unless
  it comes from ``to_iter_dataset`` — that reader already reads ahead on its own thread pool, and
  a second thread per input only adds a hand-off per element (Grain pays ~100 µs per element for
  it). ``iter_buffer_size=0`` never starts input threads.
* iterators of upcoming datasets are created ahead on ``num_make_iter_threads`` threads only when
  there are more datasets than slots (otherwise every iterator is created once, up front).

An input whose iterator has ``next_block`` (``SupportsNextBlock``: file readers, ``to_iter_dataset``)
is read a block at a time: the slot keeps the rest of the block, and the round-robin takes its
elements from there, one ``next`` on a list iterator per element instead of a call through the
input's iterator chain. The slot's checkpoint state is the block's state after the elements
taken, so order and states are those of reading one element at a time. Such an input gets no
read-ahead thread either: it reads in blocks already, and a thread would add a hand-off per
element.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import operator
from collections.abc import Iterator, Sequence
from typing import Any, Final

from grain_core._checkpoint_io import restore_and_start, start_when_restored
from grain_core._checks import as_flag, non_negative_int, positive_int
from grain_core.capabilities import SupportsNextBlock
from grain_core.dataset.base import (
    DatasetIterator,
    ElementBlock,
    IteratorContext,
    IterDataset,
    MapDataset,
)
from grain_core.dataset.element_spec import first_dataset_spec
from grain_core.dataset.prefetch import PrefetchIterDataset, ThreadPrefetchDatasetIterator

__all__ = [
    "InterleaveDatasetIterator",
    "InterleaveIterDataset",
    "interleave_input_states",
    "interleave_next_input",
    "interleave_state",
]


def interleave_state(input_states: Sequence[Any], next_input: int = 0) -> dict[str, Any]:
    """The state of an interleave whose ``len(input_states)`` inputs are all open, none
    exhausted, input ``i`` at ``input_states[i]``, the next element from input ``next_input``
    (what the DataLoader and ``ElasticIterator`` restore merges of worker streams with)."""
    return {
        "next_index_in_cycle": next_input,
        "next_index_in_datasets": len(input_states),
        "iterators_in_use_indices": list(range(len(input_states))),
        "iterators_in_use_states": list(input_states),
        "exhausted": [0] * len(input_states),
        "future_states": {},
    }


def interleave_input_states(state: dict[str, Any]) -> list[Any]:
    """The state of each open input (slot) in interleave state ``state``."""
    return list(state["iterators_in_use_states"])


def interleave_next_input(state: dict[str, Any]) -> int:
    """The slot the next element comes from in interleave state ``state``."""
    return int(state["next_index_in_cycle"])


# Most elements a slot takes from a block-reading input at once (inputs hand out at most what
# they have read already, usually less).
_BLOCK_SIZE: Final = 4096
# What ``next(iterator, _NOTHING)`` returns at the end of a slot's block.
_NOTHING: Final = object()
_NO_ELEMENTS: Iterator[Any] = iter(())


class InterleaveIterDataset(IterDataset[Any]):
    """Interleaves ``datasets`` round-robin, ``cycle_length`` of them open at a time.

    Args:
      datasets: a sequence of ``IterDataset``/``MapDataset``, or a lazy ``MapDataset`` whose
        elements are datasets (e.g. ``MapDataset.source(files).shuffle().map(make_ds)``).
      cycle_length: number of datasets read concurrently. ``1`` chains them.
      num_make_iter_threads: threads creating iterators of upcoming datasets ahead of time.
      make_iter_buffer_size: how many upcoming iterators are created ahead.
      iter_buffer_size: elements each ``IterDataset`` input reads ahead on a background thread
        (0: read on the consumer thread). Output order never depends on it.

    Raises:
      ValueError: if ``cycle_length`` or a thread/buffer count is out of range.
    """

    element_spec_rule = first_dataset_spec

    def __init__(
        self,
        datasets: Sequence[IterDataset[Any] | MapDataset[Any]] | MapDataset[Any],
        *,
        cycle_length: int,
        num_make_iter_threads: int = 1,
        make_iter_buffer_size: int = 1,
        iter_buffer_size: int = 1,
    ) -> None:
        if isinstance(datasets, MapDataset):
            super().__init__(datasets)
            self._lazy = True
        else:
            super().__init__(list(datasets))
            self._lazy = False
        positive_int("cycle_length", cycle_length)
        positive_int("num_make_iter_threads", num_make_iter_threads)
        positive_int("make_iter_buffer_size", make_iter_buffer_size)
        non_negative_int("iter_buffer_size", iter_buffer_size)
        self.cycle_length = cycle_length
        self.num_make_iter_threads = num_make_iter_threads
        self.make_iter_buffer_size = make_iter_buffer_size
        self.iter_buffer_size = iter_buffer_size

    @property
    def datasets(self) -> Sequence[Any]:
        """The interleaved datasets: a tuple, or the lazy ``MapDataset`` of datasets."""
        return self._parents[0] if self._lazy else self._parents

    def with_datasets(
        self, datasets: Sequence[IterDataset[Any] | MapDataset[Any]] | MapDataset[Any]
    ) -> InterleaveIterDataset:
        """Returns the same interleave over other datasets; ``self`` is not modified."""
        return InterleaveIterDataset(
            datasets,
            cycle_length=self.cycle_length,
            num_make_iter_threads=self.num_make_iter_threads,
            make_iter_buffer_size=self.make_iter_buffer_size,
            iter_buffer_size=self.iter_buffer_size,
        )

    def with_slice(self, sl: slice) -> InterleaveIterDataset:
        """Returns the interleave over ``datasets[sl]`` (worker and shard slicing)."""
        datasets: Any = self.datasets
        return self.with_datasets(datasets.slice(sl) if self._lazy else datasets[sl])

    def set_slice(self, sl: slice) -> None:
        """Slices ``datasets`` in place (Grain compatibility; prefer :meth:`with_slice`)."""
        datasets: Any = self.datasets
        self._parents = (datasets.slice(sl),) if self._lazy else tuple(datasets[sl])

    def __iter__(self) -> InterleaveDatasetIterator:
        return InterleaveDatasetIterator(self)

    def __repr__(self) -> str:
        return (
            f"InterleaveIterDataset(num_datasets={len(self.datasets)}, "
            f"cycle_length={self.cycle_length}, iter_buffer_size={self.iter_buffer_size})"
        )


def _read_ahead_is_useful(ds: Any) -> bool:
    """Whether an input benefits from a per-input thread (see the module docstring)."""
    return isinstance(ds, IterDataset) and not isinstance(ds, PrefetchIterDataset)


def _dataset_key(name: str, key: Any) -> int:
    """A dataset index used as a state key: JSON makes it a string of digits."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return non_negative_int(f"{name} key", key)


class InterleaveDatasetIterator(DatasetIterator[Any]):
    """Round-robin over the slots' iterators; state as Grain's interleave.

    Each slot holds the dataset index it reads, its iterator (created on demand, kept after
    exhaustion until the slot is reused so ``set_state`` can rewind it instead of rebuilding —
    this keeps worker processes alive across epochs), and whether it is exhausted.
    """

    def __init__(self, ds: InterleaveIterDataset) -> None:
        super().__init__()
        self._datasets = ds.datasets
        self._num_datasets = len(self._datasets)
        self._cycle_length = min(ds.cycle_length, self._num_datasets)
        self._iter_buffer_size = ds.iter_buffer_size
        self._num_make_iter_threads = ds.num_make_iter_threads
        self._make_ahead = (
            ds.make_iter_buffer_size if self._num_datasets > self._cycle_length else 0
        )
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._made_ahead: dict[int, concurrent.futures.Future[DatasetIterator[Any]]] = {}
        c = self._cycle_length
        self._indices = list(range(c))
        self._iters: list[DatasetIterator[Any] | None] = [None] * c
        # Per slot: whether its iterator has next_block, the block it is handing out and the
        # rest of that block's elements (one empty slot without inputs: `next` reads slot 0).
        self._blockwise = [False] * c
        self._blocks: list[ElementBlock[Any] | None] = [None] * c
        self._buffered: list[Iterator[Any]] = [_NO_ELEMENTS] * max(c, 1)
        # State to apply when a slot's iterator is created; for exhausted slots, the final state.
        self._slot_states: list[dict[str, Any] | None] = [None] * c
        self._exhausted = [False] * c
        self._num_active = c
        self._cycle_index = 0
        self._next_index_in_datasets = c
        self._future_states: dict[int, dict[str, Any] | None] = {}
        self._started = False

    # ------------------------------------------------------------------ iterators
    def _create(self, index: int) -> DatasetIterator[Any]:
        ds = self._datasets[index]
        if isinstance(ds, MapDataset):
            return iter(ds.to_iter_dataset())
        if not isinstance(ds, IterDataset):
            raise TypeError(
                f"InterleaveIterDataset input {index} is {type(ds).__name__}; expected an "
                "IterDataset or a MapDataset."
            )
        it = iter(ds)
        if (
            self._iter_buffer_size > 0
            and _read_ahead_is_useful(ds)
            and not isinstance(it, SupportsNextBlock)
        ):
            return ThreadPrefetchDatasetIterator(it, self._iter_buffer_size)
        return it

    def _adopt(self, it: DatasetIterator[Any]) -> DatasetIterator[Any]:
        """Joins a sub-iterator to this pipeline's context (options flow both ways)."""
        sub_ctx: IteratorContext | None = getattr(it, "_ctx", None)
        if sub_ctx is not None:
            sub_ctx.mp_context = self._ctx.mp_context
            self._ctx.merge(sub_ctx)
            it._share_ctx(self._ctx)
        return it

    def _share_ctx(self, ctx: IteratorContext) -> None:
        super()._share_ctx(ctx)
        for it in self._iters:
            if it is not None:
                it._share_ctx(ctx)

    def _take_iterator(self, index: int) -> DatasetIterator[Any]:
        future = self._made_ahead.pop(index, None)
        it = future.result() if future is not None else self._create(index)
        self._schedule_ahead()
        return self._adopt(it)

    def _schedule_ahead(self) -> None:
        if not self._make_ahead or self._closed:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._num_make_iter_threads, thread_name_prefix="grain_core-interleave-make"
            )
        start = self._next_index_in_datasets
        for index in range(start, min(start + self._make_ahead, self._num_datasets)):
            if index not in self._made_ahead and self._future_states.get(index, {}) is not None:
                self._made_ahead[index] = self._pool.submit(self._create, index)

    def _materialise(self, slot: int) -> DatasetIterator[Any]:
        it = self._take_iterator(self._indices[slot])
        state = self._slot_states[slot]
        if state is not None:
            it.set_state(state)
            self._slot_states[slot] = None
        self._install(slot, it)
        return it

    def _install(self, slot: int, it: DatasetIterator[Any] | None) -> None:
        """Makes ``it`` the slot's iterator, with no block taken from it yet."""
        self._iters[slot] = it
        self._blockwise[slot] = isinstance(it, SupportsNextBlock)
        self._drop_block(slot)

    def _drop_block(self, slot: int) -> None:
        self._blocks[slot] = None
        self._buffered[slot] = _NO_ELEMENTS

    def _slot_state(self, slot: int, it: DatasetIterator[Any]) -> dict[str, Any]:
        """The state of the slot's input after the elements handed out (not those buffered)."""
        block = self._blocks[slot]
        if block is None:
            return it.get_state()
        return block.state_after(len(block) - operator.length_hint(self._buffered[slot]))

    def _settle(self, slot: int) -> DatasetIterator[Any]:
        """Moves the slot's iterator back to the elements handed out and drops its block."""
        it = self._iters[slot] or self._materialise(slot)
        if self._blocks[slot] is not None:
            it.set_state(self._slot_state(slot, it))
            self._drop_block(slot)
        return it

    def _open(self, slot: int, index: int) -> None:
        """Puts dataset ``index`` into ``slot`` (its previous iterator is done)."""
        old = self._iters[slot]
        if old is not None:
            old.close()
        self._install(slot, None)
        self._indices[slot] = index
        self._next_index_in_datasets = index + 1
        if index in self._future_states:
            state = self._future_states.pop(index)
            self._slot_states[slot] = state
            if state is None:  # parked by set_shard_states as already exhausted
                self._schedule_ahead()
                return
        else:
            self._slot_states[slot] = None
        self._exhausted[slot] = False
        self._num_active += 1
        self._materialise(slot)

    def _retire(self, slot: int) -> None:
        it = self._iters[slot]
        self._slot_states[slot] = it.get_state() if it is not None else None
        self._drop_block(slot)
        self._exhausted[slot] = True
        self._num_active -= 1

    # ------------------------------------------------------------------- hot path
    def __next__(self) -> Any:
        slot = self._cycle_index
        x = next(self._buffered[slot], _NOTHING)
        if x is _NOTHING:
            return self._next_unbuffered()
        self._cycle_index = slot + 1 if slot + 1 < self._cycle_length else 0
        return x

    def _next_unbuffered(self) -> Any:
        """``next`` when the current slot has no block elements left to hand out."""
        if not self._started:
            self._check_open()
            self.start_prefetch()
            if not self._cycle_length:
                raise StopIteration
        iters = self._iters
        exhausted = self._exhausted
        while True:
            slot = self._cycle_index
            if not exhausted[slot]:
                x = next(self._buffered[slot], _NOTHING)
                if x is _NOTHING:
                    x = self._next_from_input(slot, iters[slot] or self._materialise(slot))
                if x is not _NOTHING:
                    self._cycle_index = slot + 1 if slot + 1 < self._cycle_length else 0
                    return x
                self._retire(slot)
            elif self._next_index_in_datasets < self._num_datasets:
                self._open(slot, self._next_index_in_datasets)
                continue
            elif self._num_active == 0:
                raise StopIteration
            self._cycle_index = slot + 1 if slot + 1 < self._cycle_length else 0

    def _next_from_input(self, slot: int, it: DatasetIterator[Any]) -> Any:
        """The slot's next element read from its iterator (a new block for a block reader);
        ``_NOTHING`` when the input is exhausted."""
        if not self._blockwise[slot]:
            return next(it, _NOTHING)
        block = it.next_block(_BLOCK_SIZE)  # type: ignore[attr-defined]
        if not block.elements:
            return _NOTHING
        self._blocks[slot] = block
        buffered = self._buffered[slot] = iter(block.elements)
        return next(buffered)

    def start_prefetch(self) -> None:
        """Creates the active slots' iterators and starts their background reading."""
        self._start_slots(started=None)

    def _start_slots(self, started: set[int] | None) -> None:
        """``start_prefetch``, or with ``started`` the start that ends a restore: the iterators
        of slots in ``started`` were restored and started by it, and an iterator created with
        a slot's state is restored and started in one walk too.

        Args:
          started: The slots whose iterators the restore set and started; ``None`` outside a
            restore.
        """
        if self._closed:
            return
        self._started = self._cycle_length > 0
        pending = [s for s in range(self._cycle_length) if not self._exhausted[s]]
        pending = [s for s in pending if self._iters[s] is None]
        if started is not None:
            started = started | {s for s in pending if self._slot_states[s] is not None}
            restore_and_start(lambda: self._create_slots(pending))
        elif self._num_make_iter_threads > 1 and len(pending) > 1:
            self._create_concurrently(pending)
        for slot in range(self._cycle_length):
            if not self._exhausted[slot]:
                it = self._iters[slot] or self._materialise(slot)
                if started is None or slot not in started:
                    it.start_prefetch()
        self._schedule_ahead()

    def _create_slots(self, slots: list[int]) -> None:
        """Creates the iterators of ``slots``, concurrently where the dataset says so."""
        if self._num_make_iter_threads > 1 and len(slots) > 1:
            self._create_concurrently(slots)
            return
        for slot in slots:
            self._materialise(slot)

    def _create_concurrently(self, slots: list[int]) -> None:
        with concurrent.futures.ThreadPoolExecutor(
            min(self._num_make_iter_threads, len(slots)),
            thread_name_prefix="grain_core-interleave-make",
        ) as pool:
            for slot in slots:
                index = self._indices[slot]
                if index not in self._made_ahead:
                    self._made_ahead[index] = pool.submit(self._create, index)
            for slot in slots:
                self._materialise(slot)

    # ---------------------------------------------------------------------- state
    def get_state(self) -> dict[str, Any]:
        states = []
        for slot in range(self._cycle_length):
            if self._exhausted[slot]:
                states.append(copy.deepcopy(self._slot_states[slot]))
            else:
                it = self._iters[slot] or self._materialise(slot)
                states.append(self._slot_state(slot, it))
        return {
            "next_index_in_cycle": self._cycle_index,
            "next_index_in_datasets": self._next_index_in_datasets,
            "iterators_in_use_indices": list(self._indices),
            "iterators_in_use_states": states,
            "exhausted": [int(e) for e in self._exhausted],
            "future_states": {str(k): copy.deepcopy(v) for k, v in self._future_states.items()},
        }

    def set_state(self, state: dict[str, Any]) -> None:
        c = self._cycle_length
        name = self._state_name
        indices = [
            non_negative_int(f"{name('iterators_in_use_indices')}[{slot}]", i)
            for slot, i in enumerate(state["iterators_in_use_indices"])
        ]
        states = list(state["iterators_in_use_states"])
        exhausted = [
            as_flag(f"{name('exhausted')}[{slot}]", e) for slot, e in enumerate(state["exhausted"])
        ]
        if not len(indices) == len(states) == len(exhausted) == c:
            raise ValueError(
                f"Interleave checkpoint has {len(indices)} slots but this pipeline has "
                f"cycle_length {c} over {self._num_datasets} datasets: the checkpoint belongs to "
                "a different pipeline."
            )
        next_in_datasets = self._state_int(state, "next_index_in_datasets")
        cycle_index = self._state_int(state, "next_index_in_cycle")
        if (
            not 0 <= next_in_datasets <= self._num_datasets
            or not 0 <= cycle_index < max(c, 1)
            or any(i >= self._num_datasets for i in indices)
        ):
            raise ValueError(
                f"Interleave checkpoint position (dataset {next_in_datasets}, slot {cycle_index}, "
                f"datasets in use {indices}) is out of range for {self._num_datasets} datasets "
                f"and cycle_length {c}."
            )
        live = {self._indices[s]: it for s, it in enumerate(self._iters) if it is not None}
        for slot in range(c):
            self._install(slot, None)
        reused: set[int] = set()
        for slot, (index, sub_state, done) in enumerate(
            zip(indices, states, exhausted, strict=True)
        ):
            it = live.pop(index, None)
            if it is not None and not done and sub_state is not None:
                it.set_state(sub_state)  # reuse: no iterator (or worker process) is rebuilt
                self._install(slot, it)
                self._slot_states[slot] = None
                reused.add(slot)
            else:
                if it is not None:
                    live[index] = it
                self._slot_states[slot] = copy.deepcopy(sub_state)
        for it in live.values():
            it.close()
        self._indices = indices
        self._exhausted = exhausted
        self._num_active = exhausted.count(False)
        self._cycle_index = cycle_index
        self._next_index_in_datasets = next_in_datasets
        self._future_states = {
            _dataset_key(name("future_states"), k): copy.deepcopy(v)
            for k, v in state.get("future_states", {}).items()
        }
        for index in [i for i in self._made_ahead if i < next_in_datasets]:
            self._close_future(self._made_ahead.pop(index))
        start_when_restored(functools.partial(self._start_slots, reused))

    # ------------------------------------------------------------- elastic helpers
    def get_shard_states(self) -> list[dict[str, Any]]:
        """Progress per input dataset: ``{"exhausted": 0|1, "state": state | None}``."""
        out: list[dict[str, Any]] = [
            {"exhausted": int(k < self._next_index_in_datasets), "state": None}
            for k in range(self._num_datasets)
        ]
        current = self.get_state()
        for index, sub_state, done in zip(
            self._indices, current["iterators_in_use_states"], current["exhausted"], strict=True
        ):
            out[index] = {"exhausted": done, "state": sub_state}
        for index, sub_state in self._future_states.items():
            out[index] = {"exhausted": int(sub_state is None), "state": copy.deepcopy(sub_state)}
        return out

    def set_shard_states(self, shard_states: Sequence[dict[str, Any]]) -> None:
        """Restores per-dataset progress from :meth:`get_shard_states` of any topology.

        The first ``cycle_length`` unfinished datasets take the slots; the states of later
        datasets are parked in ``future_states`` until their turn.

        Raises:
          ValueError: if the number of entries differs from the number of datasets.
        """
        if len(shard_states) != self._num_datasets:
            raise ValueError(
                f"Got {len(shard_states)} shard states for {self._num_datasets} datasets."
            )
        c = self._cycle_length
        unfinished = [k for k, s in enumerate(shard_states) if not s["exhausted"]]
        finished = [k for k, s in enumerate(shard_states) if s["exhausted"]]
        in_slots = unfinished[:c]
        filler = finished[: c - len(in_slots)]
        slots = in_slots + filler
        next_in_datasets = (in_slots[-1] + 1) if in_slots else self._num_datasets
        future: dict[str, Any] = {}
        for k in range(next_in_datasets, self._num_datasets):
            entry = shard_states[k]
            if entry["exhausted"]:
                future[str(k)] = None
            elif entry["state"] is not None:
                future[str(k)] = entry["state"]
        self.set_state(
            {
                "next_index_in_cycle": 0,
                "next_index_in_datasets": next_in_datasets,
                "iterators_in_use_indices": slots,
                "iterators_in_use_states": [shard_states[k]["state"] for k in slots],
                "exhausted": [int(k in filler) for k in slots],
                "future_states": future,
            }
        )

    # ----------------------------------------------------------------- next index
    def _single_input(self) -> DatasetIterator[Any]:
        if self._num_datasets != 1:
            raise NotImplementedError(
                "get_next_index/set_next_index on an interleave needs exactly one input "
                f"dataset; this one has {self._num_datasets}."
            )
        return self._settle(0)

    def _get_next_index(self) -> int:
        return self._single_input()._get_next_index()

    def _set_next_index(self, index: int) -> None:
        it = self._single_input()
        it._set_next_index(index)
        if self._exhausted[0]:
            self._exhausted[0] = False
            self._num_active = 1

    # ---------------------------------------------------------------------- close
    @staticmethod
    def _close_future(future: concurrent.futures.Future[DatasetIterator[Any]]) -> None:
        if not future.cancel():
            try:
                future.result().close()
            except Exception:  # noqa: BLE001 - the error belongs to an iterator never used
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._started = False  # the next `next` reaches _check_open
        for future in self._made_ahead.values():
            self._close_future(future)
        self._made_ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for it in self._iters:
            if it is not None:
                it.close()
        for slot in range(self._cycle_length):
            self._install(slot, None)

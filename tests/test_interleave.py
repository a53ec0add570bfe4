"""Tests of grain_core.dataset.ops.interleave."""

from __future__ import annotations

import json
from typing import Any

import pytest
from block_reading import assert_blocks_read_as_elements, block_inputs, element_by_element
from hypothesis import given, settings
from hypothesis import strategies as st

from grain_core.capabilities import SupportsNextBlock
from grain_core.dataset.base import DatasetIterator, IterDataset, MapDataset
from grain_core.dataset.ops.interleave import InterleaveIterDataset
from grain_core.experimental import DatasetOptions, WithOptionsIterDataset
from grain_core.testing import assert_equal_output_after_checkpoint, check_iterator_conformance

GOLDEN_INPUTS = [[1], [2, 2], [3, 3, 3], [4] * 4, [5] * 5]
GOLDEN = {
    1: [1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5],
    2: [1, 2, 2, 3, 3, 4, 3, 4, 4, 5, 4, 5, 5, 5, 5],
    3: [1, 2, 3, 2, 3, 4, 3, 4, 5, 4, 5, 4, 5, 5, 5],
}


def _iter_ds(values: list[Any]) -> IterDataset[Any]:
    return MapDataset.source(values).to_iter_dataset()


class _ListIterDataset(IterDataset[Any]):
    """An IterDataset that is not a to_iter_dataset reader (gets a read-ahead thread)."""

    def __init__(self, values: list[Any]) -> None:
        super().__init__()
        self.values = values

    def __iter__(self) -> DatasetIterator[Any]:
        return _ListIterator(self.values)


class _ListIterator(DatasetIterator[Any]):
    def __init__(self, values: list[Any]) -> None:
        super().__init__()
        self._values = values
        self._pos = 0

    def __next__(self) -> Any:
        if self._pos >= len(self._values):
            raise StopIteration
        self._pos += 1
        return self._values[self._pos - 1]

    def get_state(self) -> dict[str, Any]:
        return {"pos": self._pos}

    def set_state(self, state: dict[str, Any]) -> None:
        self._pos = state["pos"]


@pytest.mark.parametrize("cycle_length", [1, 2, 3])
def test_golden_sequences(cycle_length: int) -> None:
    ds = InterleaveIterDataset([_iter_ds(v) for v in GOLDEN_INPUTS], cycle_length=cycle_length)
    assert list(ds) == GOLDEN[cycle_length]


@pytest.mark.parametrize("cycle_length", [5, 6, 100])
def test_cycle_at_least_len_is_uniform_mixing_past_exhaustion(cycle_length: int) -> None:
    ds = InterleaveIterDataset([_iter_ds(v) for v in GOLDEN_INPUTS], cycle_length=cycle_length)
    assert list(ds) == [1, 2, 3, 4, 5, 2, 3, 4, 5, 3, 4, 5, 4, 5, 5]


def test_golden_with_empty_inputs() -> None:
    inputs = [[1, 1, 1], [], [3, 3, 3, 3], [4, 4], []]
    ds = InterleaveIterDataset([_iter_ds(v) for v in inputs], cycle_length=3)
    assert list(ds) == [1, 3, 1, 4, 3, 1, 4, 3, 3]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"iter_buffer_size": 0},
        {"iter_buffer_size": 3},
        {"num_make_iter_threads": 3, "make_iter_buffer_size": 2},
    ],
)
@pytest.mark.parametrize("make", [_iter_ds, _ListIterDataset, MapDataset.source])
def test_golden_independent_of_threads_and_input_kind(kwargs: dict[str, int], make: Any) -> None:
    for cycle_length, expected in GOLDEN.items():
        ds = InterleaveIterDataset(
            [make(v) for v in GOLDEN_INPUTS], cycle_length=cycle_length, **kwargs
        )
        assert list(ds) == expected


def test_lazy_map_dataset_of_datasets() -> None:
    datasets = MapDataset.source(GOLDEN_INPUTS).map(_ListIterDataset)
    ds = InterleaveIterDataset(datasets, cycle_length=2, num_make_iter_threads=2)
    assert list(ds) == GOLDEN[2]
    assert list(ds.with_slice(slice(1, None, 2))) == [2, 4, 2, 4, 4, 4]


@pytest.mark.parametrize("cycle_length", [1, 2, 3, 7])
@pytest.mark.parametrize("iter_buffer_size", [0, 2])
def test_checkpoint_at_every_position(cycle_length: int, iter_buffer_size: int) -> None:
    def make() -> IterDataset[Any]:
        inputs = [[10 * k + j for j in range(k)] for k in range(6)]
        return InterleaveIterDataset(
            [_ListIterDataset(v) for v in inputs],
            cycle_length=cycle_length,
            iter_buffer_size=iter_buffer_size,
            make_iter_buffer_size=2,
        )

    out = check_iterator_conformance(make, positions=range(16))
    assert sorted(out) == sorted(10 * k + j for k in range(6) for j in range(k))
    assert_equal_output_after_checkpoint(make())


def test_state_dict_exact() -> None:
    ds = InterleaveIterDataset([_iter_ds(v) for v in GOLDEN_INPUTS], cycle_length=2)
    it = iter(ds)
    assert it.get_state() == {
        "next_index_in_cycle": 0,
        "next_index_in_datasets": 2,
        "iterators_in_use_indices": [0, 1],
        "iterators_in_use_states": [{"next_index": 0}, {"next_index": 0}],
        "exhausted": [0, 0],
        "future_states": {},
    }
    assert [next(it) for _ in range(3)] == [1, 2, 2]
    assert it.get_state() == {
        "next_index_in_cycle": 0,
        "next_index_in_datasets": 2,
        "iterators_in_use_indices": [0, 1],
        "iterators_in_use_states": [{"next_index": 1}, {"next_index": 2}],
        "exhausted": [1, 0],
        "future_states": {},
    }
    assert next(it) == 3
    state = it.get_state()
    assert state["iterators_in_use_indices"] == [2, 1]
    assert state["next_index_in_datasets"] == 3
    assert state["next_index_in_cycle"] == 1
    assert json.loads(json.dumps(state)) == state


def test_get_state_returns_new_dict() -> None:
    it = iter(InterleaveIterDataset([_iter_ds([1, 2])], cycle_length=1))
    a = it.get_state()
    a["iterators_in_use_states"][0]["next_index"] = 99
    assert it.get_state()["iterators_in_use_states"][0]["next_index"] == 0


def test_set_state_reuses_live_iterators() -> None:
    ds = InterleaveIterDataset([_ListIterDataset([1, 2, 3]), _ListIterDataset([4])], cycle_length=2)
    it = iter(ds)
    start = it.get_state()
    assert list(it) == [1, 4, 2, 3]
    live = list(it._iters)
    it.set_state(start)
    assert list(it._iters) == live
    assert list(it) == [1, 4, 2, 3]


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_cycle_length(bad: int) -> None:
    with pytest.raises(ValueError, match="cycle_length must be a positive integer"):
        InterleaveIterDataset([_iter_ds([1])], cycle_length=bad)


def test_bad_buffer_arguments() -> None:
    with pytest.raises(ValueError, match="iter_buffer_size"):
        InterleaveIterDataset([_iter_ds([1])], cycle_length=1, iter_buffer_size=-1)
    with pytest.raises(ValueError, match="num_make_iter_threads"):
        InterleaveIterDataset([_iter_ds([1])], cycle_length=1, num_make_iter_threads=0)
    with pytest.raises(ValueError, match="make_iter_buffer_size"):
        InterleaveIterDataset([_iter_ds([1])], cycle_length=1, make_iter_buffer_size=0)


def test_bad_input_type_names_the_input() -> None:
    with pytest.raises(TypeError, match="input 1 is list"):
        list(InterleaveIterDataset([_iter_ds([1]), [2]], cycle_length=2))  # type: ignore[list-item]


def test_wrong_checkpoint_is_rejected() -> None:
    it = iter(InterleaveIterDataset([_iter_ds([1]), _iter_ds([2])], cycle_length=2))
    state = it.get_state()
    state["iterators_in_use_indices"] = [0]
    with pytest.raises(ValueError, match="different pipeline"):
        it.set_state(state)


def test_no_inputs() -> None:
    it = iter(InterleaveIterDataset([], cycle_length=3))
    assert list(it) == []
    assert it.get_state()["iterators_in_use_indices"] == []


def test_slicing_does_not_mutate() -> None:
    ds = InterleaveIterDataset([_iter_ds(v) for v in GOLDEN_INPUTS], cycle_length=2)
    worker = ds.with_slice(slice(0, None, 2))
    assert list(worker) == [1, 3, 3, 5, 3, 5, 5, 5, 5]
    assert list(ds) == GOLDEN[2]
    ds.set_slice(slice(3, None))
    assert list(ds) == [4, 5, 4, 5, 4, 5, 4, 5, 5]


def test_next_index_single_input_only() -> None:
    it = iter(InterleaveIterDataset([_iter_ds(list(range(10)))], cycle_length=4))
    from grain_core.experimental import get_next_index, set_next_index

    assert next(it) == 0
    assert get_next_index(it) == 1
    set_next_index(it, 7)
    assert list(it) == [7, 8, 9]
    set_next_index(it, 2)
    assert next(it) == 2
    multi = iter(InterleaveIterDataset([_iter_ds([1]), _iter_ds([2])], cycle_length=2))
    with pytest.raises(NotImplementedError, match="exactly one input"):
        get_next_index(multi)


def test_shard_states_round_trip_and_future_states() -> None:
    inputs = [[k * 10 + j for j in range(k + 1)] for k in range(5)]

    def make(cycle_length: int) -> InterleaveIterDataset:
        return InterleaveIterDataset(
            [_ListIterDataset(v) for v in inputs], cycle_length=cycle_length
        )

    it = iter(make(2))
    seen = [next(it) for _ in range(5)]
    shards = it.get_shard_states()
    assert len(shards) == 5
    assert seen == [0, 10, 11, 20, 21]
    assert shards[:3] == [
        {"exhausted": 1, "state": None},
        {"exhausted": 1, "state": {"pos": 2}},
        {"exhausted": 0, "state": {"pos": 2}},
    ]
    restored = iter(make(1))
    restored.set_shard_states(json.loads(json.dumps(shards)))
    rest = list(restored)
    assert sorted(seen + rest) == sorted(x for v in inputs for x in v)
    # A state parked in future_states survives get_state/set_state.
    late = iter(make(1))
    late_shards = [{"exhausted": 0, "state": None} for _ in inputs]
    late_shards[3] = {"exhausted": 0, "state": {"pos": 2}}
    late_shards[1] = {"exhausted": 1, "state": None}
    late.set_shard_states(late_shards)
    assert late.get_state()["future_states"] == {"1": None, "3": {"pos": 2}}
    assert list(late) == [0, 20, 21, 22, 32, 33, 40, 41, 42, 43, 44]


def test_options_after_interleave_reach_sub_iterators() -> None:
    inputs = [_ListIterDataset([1, 2]).filter(lambda x: x > 100), _ListIterDataset([3])]
    ds = InterleaveIterDataset(inputs, cycle_length=2, iter_buffer_size=0)
    ds = WithOptionsIterDataset(ds, DatasetOptions(filter_raise_threshold_ratio=0.5))
    it = iter(ds)
    next(it)
    sub = it._iters[0] if hasattr(it, "_iters") else None
    assert sub is not None
    assert sub._ctx.dataset_options.filter_raise_threshold_ratio == 0.5


def test_close_is_idempotent_and_stops_iteration() -> None:
    it = iter(InterleaveIterDataset([_ListIterDataset([1, 2])], cycle_length=1, iter_buffer_size=2))
    assert next(it) == 1
    it.close()
    it.close()
    with pytest.raises(ValueError, match="closed iterator"):
        next(it)


@pytest.mark.parametrize("key", ["2.7", "-1", -1, 2.7])
def test_a_future_state_key_that_is_not_a_dataset_index_is_refused(key: Any) -> None:
    ds = InterleaveIterDataset([MapDataset.range(3) for _ in range(4)], cycle_length=2)
    it = iter(ds)
    state = it.get_state()
    state["future_states"] = {key: None}
    with pytest.raises((TypeError, ValueError), match="checkpoint `future_states` key"):
        iter(ds).set_state(state)
    state["future_states"] = {"3": None}
    restored = iter(ds)
    restored.set_state(state)
    assert sorted(restored) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # dataset 3 parked as exhausted


# ------------------------------------------------------------------ block reading
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    cycle_length=st.integers(1, 4),
    bad=st.one_of(st.none(), st.integers(0, 120)),
    restore_at=st.integers(0, 150),
)
@settings(max_examples=40, deadline=None)
def test_block_inputs_give_the_elements_errors_and_states_of_next(
    sizes: list[int], cycle_length: int, bad: int | None, restore_at: int
) -> None:
    blockwise = InterleaveIterDataset(block_inputs(sizes, bad), cycle_length=cycle_length)
    reference = InterleaveIterDataset(
        [ds.map(element_by_element) for ds in block_inputs(sizes, bad)],
        cycle_length=cycle_length,
        iter_buffer_size=0,
    )
    assert isinstance(iter(block_inputs([3], None)[0]), SupportsNextBlock)
    assert_blocks_read_as_elements(blockwise, reference, restore_at)

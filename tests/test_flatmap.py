"""Tests for grain_core.dataset.ops.flatmap; differences from Grain in docs/compatibility.md."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence
from typing import Any

import cloudpickle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_core as grain
from grain_core import transforms
from grain_core.dataset.base import INFINITE
from grain_core.experimental import FlatMapIterDataset, FlatMapMapDataset, FlatMapTransform
from grain_core.testing import assert_equal_output_after_checkpoint, check_iterator_conformance


class Repeat(FlatMapTransform):
    """``x`` repeated ``x % modulus`` times; counts calls to prove splits are computed once."""

    def __init__(self, max_fan_out: int = 3, modulus: int = 3) -> None:
        self.max_fan_out = max_fan_out
        self.modulus = modulus
        self.calls: list[Any] = []
        self._lock = threading.Lock()

    def flat_map(self, element: Any) -> Sequence[Any]:
        with self._lock:
            self.calls.append(element)
        return [element] * (element % self.modulus)

    def __reduce__(self) -> Any:
        return (Repeat, (self.max_fan_out, self.modulus))


class Split(FlatMapTransform):
    max_fan_out = 4

    def flat_map(self, element: Any) -> Any:
        # A generator: non-sequence results are listed.
        return (f"{element}-{k}" for k in range(element % 5))


# ------------------------------------------------------------------------------- map version
def test_map_length_and_holes_match_grain() -> None:
    ds = FlatMapMapDataset(grain.MapDataset.range(6), Repeat())
    assert len(ds) == 18
    holes = [None, None]
    assert [ds[i] for i in range(18)] == [
        *[None] * 3,
        1,
        *holes,
        2,
        2,
        None,
        *[None] * 3,
        4,
        *holes,
        5,
        5,
        None,
    ]
    assert list(ds) == [1, 2, 2, 4, 5, 5]


def test_map_length_is_capped_for_infinite_parents() -> None:
    ds = FlatMapMapDataset(grain.MapDataset.range(4).repeat(), Repeat())
    assert len(ds) == INFINITE


def test_map_fan_out_after_repeat_reads_later_epochs() -> None:
    ds = FlatMapMapDataset(grain.MapDataset.range(3).repeat(2), Repeat())
    assert len(ds) == 18
    assert list(ds) == [1, 2, 2, 1, 2, 2]


def test_map_splits_computed_once_per_input_when_iterating() -> None:
    transform = Repeat(max_fan_out=4)
    ds = FlatMapMapDataset(grain.MapDataset.range(50), transform)
    out = list(ds.to_iter_dataset(grain.ReadOptions(num_threads=0)))
    assert out == [x for x in range(50) for _ in range(x % 3)]
    assert sorted(transform.calls) == list(range(50))


def test_map_splits_computed_once_with_reader_threads() -> None:
    transform = Repeat(max_fan_out=5)
    ds = FlatMapMapDataset(grain.MapDataset.range(200), transform)
    out = list(ds.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)))
    assert out == [x for x in range(200) for _ in range(x % 3)]
    # Each block computes its inputs once; a block edge shared with a neighbour read at the
    # same moment by another thread may be computed twice, never once per slot (5x).
    assert len(transform.calls) < 1.2 * 200


def test_map_single_reads_reuse_the_last_input() -> None:
    transform = Repeat(max_fan_out=3)
    ds = FlatMapMapDataset(grain.MapDataset.range(4), transform)
    assert [ds[i] for i in range(12)] == [*[None] * 3, 1, None, None, 2, 2, None, *[None] * 3]
    assert transform.calls == [0, 1, 2, 3]


@settings(max_examples=40, deadline=None)
@given(indices=st.lists(st.integers(0, 80), max_size=30), fan_out=st.integers(1, 6))
def test_map_batched_reads_equal_single_reads(indices: list[int], fan_out: int) -> None:
    ds = FlatMapMapDataset(grain.MapDataset.range(10), Repeat(fan_out, modulus=fan_out + 1))
    fresh = FlatMapMapDataset(grain.MapDataset.range(10), Repeat(fan_out, modulus=fan_out + 1))
    assert ds._getitems(indices) == [fresh[i] for i in indices]


def test_map_parent_holes_become_holes() -> None:
    parent = grain.MapDataset.range(6).filter(lambda x: x != 2)
    ds = FlatMapMapDataset(parent, Repeat())
    assert list(ds) == [1, 4, 5, 5]
    assert ds._getitems(range(6, 9)) == [None, None, None]


def test_map_too_many_splits_raises() -> None:
    ds = FlatMapMapDataset(grain.MapDataset.range(6), Repeat(max_fan_out=1))
    assert ds[1] == 1
    with pytest.raises(
        ValueError, match=r"produced 2 elements from input 2, more than its max_fan_out=1"
    ):
        ds[2]
    with pytest.raises(ValueError, match="max_fan_out=1"):
        list(ds.to_iter_dataset(grain.ReadOptions(num_threads=0)))


@pytest.mark.parametrize("fan_out", [0, -1])
def test_map_invalid_max_fan_out(fan_out: int) -> None:
    with pytest.raises(ValueError, match="max_fan_out must be a positive integer"):
        FlatMapMapDataset(grain.MapDataset.range(3), Repeat(max_fan_out=fan_out))


def test_map_needs_max_fan_out() -> None:
    with pytest.raises(ValueError, match="needs the transform's `max_fan_out`"):
        FlatMapMapDataset(grain.MapDataset.range(3), lambda x: [x])


def test_map_creates_holes_so_map_batch_refuses_it() -> None:
    ds = FlatMapMapDataset(grain.MapDataset.range(3), Repeat())
    assert FlatMapMapDataset.creates_holes
    with pytest.raises(ValueError, match="^`MapDataset.batch` can not follow `FlatMapMapDataset`"):
        ds.batch(2)
    assert [b.tolist() for b in ds.to_iter_dataset().batch(2)] == [[1, 2], [2]]


def test_map_generator_results_are_listed() -> None:
    assert list(FlatMapMapDataset(grain.MapDataset.range(4), Split())) == [
        "1-0",
        "2-0",
        "2-1",
        "3-0",
        "3-1",
        "3-2",
    ]


def test_map_pickles_without_its_cache() -> None:
    ds = FlatMapMapDataset(grain.MapDataset.range(5), Repeat())
    list(ds)
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, pickle.loads)):
        copy = loads(dumps(ds))
        assert list(copy) == list(ds)


def test_map_apply_dispatches_flat_map() -> None:
    ds = grain.MapDataset.range(4).apply(Repeat())
    assert isinstance(ds, FlatMapMapDataset)
    it_ds = grain.MapDataset.range(4).to_iter_dataset().apply([Repeat()])
    assert isinstance(it_ds, FlatMapIterDataset)
    assert list(ds) == list(it_ds) == [1, 2, 2]


def test_map_conformance() -> None:
    check_iterator_conformance(
        lambda: FlatMapMapDataset(grain.MapDataset.range(12), Repeat()), positions=range(0, 13, 3)
    )


# ------------------------------------------------------------------------------ iter version
def _iter_ds(n: int = 6, transform: Any = None) -> FlatMapIterDataset:
    return FlatMapIterDataset(grain.MapDataset.range(n).to_iter_dataset(), transform or Repeat())


def test_iter_output_and_state_match_grain() -> None:
    it = iter(_iter_ds())
    assert next(it) == 1
    assert next(it) == 2
    assert it.get_state() == {"parent": {"next_index": 2}, "next_index_in_buffer": 1}
    assert list(it) == [2, 4, 5, 5]


def test_iter_state_after_a_finished_input_points_past_it() -> None:
    it = iter(_iter_ds())
    next(it)
    assert it.get_state() == {"parent": {"next_index": 2}, "next_index_in_buffer": 0}


def test_iter_restores_a_used_up_input_as_grain_names_it() -> None:
    # Google Grain's state after the last split of an input still names that input, with the
    # offset equal to its number of splits (input 1 has one split here).
    fresh = iter(_iter_ds())
    fresh.set_state({"parent": {"next_index": 1}, "next_index_in_buffer": 1})
    assert list(fresh) == [2, 2, 4, 5, 5]


def test_iter_restores_on_fresh_iterator_recomputing_one_input() -> None:
    transform = Repeat()
    it = iter(_iter_ds(transform=transform))
    next(it)
    next(it)
    state = it.get_state()
    transform.calls.clear()
    fresh = iter(_iter_ds(transform=transform))
    fresh.set_state(state)
    assert transform.calls == [2]
    assert list(fresh) == [2, 4, 5, 5]


def test_iter_conformance_every_position() -> None:
    check_iterator_conformance(lambda: _iter_ds(10), positions=range(10))
    assert_equal_output_after_checkpoint(_iter_ds(10))


def test_iter_conformance_with_filter_and_generators() -> None:
    def make() -> Any:
        parent = grain.MapDataset.range(20).to_iter_dataset().filter(lambda x: x % 4 != 1)
        return FlatMapIterDataset(parent, Split())

    out = check_iterator_conformance(make, positions=[0, 1, 5, 17])
    assert out[:4] == ["2-0", "2-1", "3-0", "3-1"]


def test_iter_enforces_max_fan_out() -> None:
    with pytest.raises(ValueError, match="more than its max_fan_out=1"):
        list(_iter_ds(transform=Repeat(max_fan_out=1)))


def test_iter_accepts_plain_callables_without_fan_out() -> None:
    ds = FlatMapIterDataset(grain.MapDataset.range(3).to_iter_dataset(), lambda x: range(x))
    assert list(ds) == [0, 0, 1]


def test_iter_empty_parent_and_empty_splits() -> None:
    assert list(_iter_ds(0)) == []
    assert list(FlatMapIterDataset(grain.MapDataset.range(9).to_iter_dataset(), Repeat(3, 1))) == []


def test_iter_inconsistent_checkpoint_raises() -> None:
    it = iter(_iter_ds())
    with pytest.raises(ValueError, match="different pipeline"):
        it.set_state({"parent": {"next_index": 1}, "next_index_in_buffer": 2})


def test_iter_closed_iterator_raises() -> None:
    it = iter(_iter_ds())
    it.close()
    with pytest.raises(ValueError, match="closed iterator"):
        next(it)


def test_transform_class_alias() -> None:
    assert FlatMapTransform is transforms.FlatMap


class StopAtTwo(FlatMapTransform):
    max_fan_out = 2

    def flat_map(self, element: Any) -> Sequence[Any]:
        if element == 2:
            raise StopIteration
        return [element, element]


@pytest.mark.parametrize("iterate", [True, False], ids=["iter", "map"])
def test_stop_iteration_in_flat_map_is_an_error(iterate: bool) -> None:
    ds = grain.MapDataset.range(4)
    if iterate:
        flat: Any = FlatMapIterDataset(ds.to_iter_dataset(), StopAtTwo())
    else:
        flat = FlatMapMapDataset(ds, StopAtTwo()).to_iter_dataset()
    with pytest.raises(RuntimeError, match="raised StopIteration"):
        list(flat)

"""Tests of grain_core.dataset.ops.repeat: MapDataset.repeat and RepeatIterDataset."""

from __future__ import annotations

import sys
from typing import Any

import pytest

import grain_core as grain
from grain_core import MapDataset
from grain_core.dataset.ops.interleave import InterleaveIterDataset
from grain_core.experimental import RepeatIterDataset
from grain_core.testing import assert_equal_output_after_checkpoint, check_iterator_conformance

MD = grain.MapDataset


def test_repeat_lengths():
    assert len(MD.range(3).repeat(4)) == 12
    assert len(MD.range(3).repeat()) == sys.maxsize
    assert len(MD.range(0).repeat(3)) == 0
    assert list(MD.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("epochs", [0, -1])
def test_repeat_rejects_non_positive_epochs(epochs):
    with pytest.raises(ValueError, match="num_epochs"):
        MD.range(3).repeat(epochs)


def test_repeat_of_infinite_dataset_is_refused():
    with pytest.raises(ValueError, match="infinite"):
        MD.range(3).repeat().repeat()


def test_repeat_of_shuffle_reshuffles_each_epoch():
    ds = MD.range(50).seed(0).shuffle().repeat(2)
    values = list(ds)
    assert values[:50] != values[50:]
    again = MD.range(50).seed(0).shuffle().repeat(2, reseed_each_epoch=False)
    assert list(again)[:50] == list(again)[50:]
    assert again._getitems([0, 50]) == [again[0], again[50]]


def test_epochs_are_identical() -> None:
    ds = (
        MapDataset.range(4)
        .to_iter_dataset()
        .random_map(lambda x, rng: x * 100 + int(rng.integers(100)), seed=1)
    )
    once = list(ds)
    assert list(RepeatIterDataset(ds, 3)) == once * 3


def test_infinite_repeat() -> None:
    it = iter(RepeatIterDataset(MapDataset.range(3).to_iter_dataset()))
    assert [next(it) for _ in range(10)] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("num_epochs", [None, 1, 5])
def test_empty_parent_yields_nothing(num_epochs: int | None) -> None:
    assert list(RepeatIterDataset(MapDataset.range(0).to_iter_dataset(), num_epochs)) == []


@pytest.mark.parametrize("num_epochs", [0, -2])
def test_num_epochs_must_be_positive(num_epochs: int) -> None:
    with pytest.raises(ValueError, match="num_epochs must be a positive integer"):
        RepeatIterDataset(MapDataset.range(3).to_iter_dataset(), num_epochs)


def test_state_and_conformance() -> None:
    ds = RepeatIterDataset(MapDataset.range(3).to_iter_dataset().batch(2), 3)
    it = iter(ds)
    for _ in range(3):
        next(it)
    assert it.get_state() == {"parent": {"next_index": 2}, "epoch": 1}
    out = check_iterator_conformance(ds, positions=range(7))
    assert [b.tolist() for b in out] == [[0, 1], [2]] * 3
    assert_equal_output_after_checkpoint(ds)


def test_keeps_interleave_sub_iterators_alive_across_epochs() -> None:
    inputs = [MapDataset.range(k, k + 3).to_iter_dataset() for k in (0, 10)]
    ds = RepeatIterDataset(InterleaveIterDataset(inputs, cycle_length=2), 2)
    it = iter(ds)
    first = [next(it) for _ in range(6)]
    interleave: Any = it._parents[0]
    subs = list(interleave._iters)
    assert [next(it) for _ in range(6)] == first == [0, 10, 1, 11, 2, 12]
    assert list(interleave._iters) == subs
    assert list(it) == []


@pytest.mark.parametrize("rotating", [False, True], ids=["dispatched", "rotating"])
def test_keeps_worker_processes_alive_across_epochs(rotating: bool) -> None:
    import multiprocessing

    from grain_core import MultiprocessingOptions

    ds = MapDataset.range(6).to_iter_dataset()
    if rotating:  # an IterDataset map after the slice point: strict rotation
        ds = ds.map(lambda x: x)
    it = iter(RepeatIterDataset(ds.mp_prefetch(MultiprocessingOptions(num_workers=2)), 3))
    assert [next(it) for _ in range(6)] == list(range(6))
    workers = {p.pid for p in multiprocessing.active_children()}
    assert len(workers) >= 2
    assert list(it) == list(range(6)) * 2
    assert workers <= {p.pid for p in multiprocessing.active_children()}
    it.close()

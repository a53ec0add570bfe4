"""Tests of grain_core.dataset.ops.limit."""

from __future__ import annotations

import pytest

from grain_core import MapDataset
from grain_core.experimental import LimitIterDataset, get_next_index, set_next_index
from grain_core.testing import assert_equal_output_after_checkpoint, check_iterator_conformance


def test_limit_outputs() -> None:
    ds = MapDataset.range(10).to_iter_dataset()
    assert list(LimitIterDataset(ds, 3)) == [0, 1, 2]
    assert list(LimitIterDataset(ds, 10)) == list(range(10))
    assert list(LimitIterDataset(ds, 50)) == list(range(10))


def test_limit_across_epochs_and_after_batch() -> None:
    ds = MapDataset.range(4).repeat(3).to_iter_dataset()
    assert list(LimitIterDataset(ds, 6)) == [0, 1, 2, 3, 0, 1]
    batched = MapDataset.range(10).to_iter_dataset().batch(3)
    assert [b.tolist() for b in LimitIterDataset(batched, 2)] == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("count", [0, -1])
def test_count_must_be_positive(count: int) -> None:
    with pytest.raises(ValueError, match="count must be a positive integer, got"):
        LimitIterDataset(MapDataset.range(3).to_iter_dataset(), count)


def test_state_and_conformance() -> None:
    ds = LimitIterDataset(MapDataset.range(20).to_iter_dataset(), 7)
    it = iter(ds)
    next(it)
    assert it.get_state() == {"parent": {"next_index": 1}, "count_elements_read": 1}
    assert check_iterator_conformance(ds, positions=range(8)) == list(range(7))
    assert_equal_output_after_checkpoint(ds)


def test_next_index() -> None:
    it = iter(LimitIterDataset(MapDataset.range(20).to_iter_dataset(), 5))
    next(it)
    assert get_next_index(it) == 1
    set_next_index(it, 3)
    assert list(it) == [3, 4]
    with pytest.raises(ValueError, match="non-negative"):
        set_next_index(it, -1)

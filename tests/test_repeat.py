from __future__ import annotations

import sys

import pytest

import grain_core as grain

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

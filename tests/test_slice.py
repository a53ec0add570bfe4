from __future__ import annotations

import numpy as np
import pytest

import grain_core as grain
from grain_core.dataset.ops.slice import SliceMapDataset

MD = grain.MapDataset


def test_slices_and_composition():
    ds = MD.range(10)
    assert list(ds[2:8:2]) == [2, 4, 6]
    assert list(ds[1:][::2]) == [1, 3, 5, 7, 9]
    assert list(ds[::-1]) == list(range(9, -1, -1))
    assert len(ds[20:]) == 0 and list(ds[20:]) == []
    assert list(ds[1::3]) == [1, 4, 7]


def test_slice_beyond_length_reads_next_parent_epoch():
    ds = MD.range(10).seed(0).shuffle()[0:5]
    assert ds[5] == ds.parents[0][10]
    assert ds._getitems([5, 6]) == [ds[5], ds[6]]


def test_sharding_idiom_partitions_the_dataset():
    ds = MD.range(11)
    shards = [list(ds[i::3]) for i in range(3)]
    assert sorted(sum(shards, [])) == list(range(11))


def test_reindex_with_sequences_and_datasets():
    ds = MD.range(100, 110)
    assert list(ds.slice([3, 0, 3])) == [103, 100, 103]
    re = ds.slice(MD.range(4).map(lambda i: 9 - i))
    assert list(re) == [109, 108, 107, 106]
    assert re[4] == ds[19]  # second epoch of both
    assert ds.slice(np.array([1, 2]))._getitems([2, 3]) == [101, 102]


def test_slice_rejects_other_types():
    with pytest.raises(ValueError, match="slice"):
        MD.range(3).slice(3)


def test_reindex_repr_is_short():
    assert "100 indices" in repr(MD.range(200).slice(list(range(100))))
    assert repr(MD.range(5).slice([1, 2])) == "ReindexMapDataset(indices=[1, 2])"


def test_a_non_slice_is_refused_with_grains_text() -> None:
    # Users match on Grain's phrase, "sl is not a slice: <class 'int'>".
    with pytest.raises(ValueError, match=r"sl is not a slice: <class 'int'> \(got 5\)"):
        SliceMapDataset(grain.MapDataset.range(10), 5)  # type: ignore[arg-type]

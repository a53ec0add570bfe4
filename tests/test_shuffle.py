from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import grain_core as grain

MD = grain.MapDataset


def test_shuffle_golden_cross_version():
    ds = MD.range(10).seed(42).shuffle()
    assert list(ds) == [1, 7, 6, 9, 0, 8, 4, 5, 3, 2]
    assert ds._getitems(range(10)) == [1, 7, 6, 9, 0, 8, 4, 5, 3, 2]


def test_shuffle_explicit_seed_and_epochs_differ():
    ds = MD.range(100).shuffle(seed=5).repeat(2)
    first, second = [ds[i] for i in range(100)], [ds[i] for i in range(100, 200)]
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != second
    assert ds._getitems(range(95, 105)) == [ds[i] for i in range(95, 105)]


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_shuffle_seed_range(seed):
    with pytest.raises(ValueError):
        MD.range(3).shuffle(seed=seed)


@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
def test_shuffle_is_a_permutation(n, seed):
    ds = MD.range(n).shuffle(seed=seed)
    assert sorted(ds._getitems(np.arange(n))) == list(range(n))


@pytest.mark.parametrize("n", [2**16 - 1, 2**16, 2**16 + 1, 2**18 + 1])
def test_shuffle_is_a_permutation_at_power_of_two_edges(n):
    values = np.asarray(MD.range(n).shuffle(seed=11)._getitems(np.arange(n)))
    assert np.array_equal(np.sort(values), np.arange(n))


def test_shuffle_holes_move_with_elements():
    ds = MD.range(20).filter(lambda x: x % 2 == 0).shuffle(seed=1)
    assert sorted(x for x in ds) == list(range(0, 20, 2))
    assert sum(ds[i] is None for i in range(20)) == 10


@pytest.mark.parametrize("n", [7, 2**16 + 3, 2**20 + 3])
def test_blocks_of_consecutive_indices_equal_single_reads(n):
    # Blocks within an epoch are permuted as one slice, those across an epoch's end index by
    # index; both are the elements read one at a time.
    ds = MD.range(n).seed(9).shuffle()
    for start, stop in [(0, 5), (n - 3, n), (n - 2, n + 3), (n + 1, n + 6), (3 * n - 1, 3 * n)]:
        assert ds._getitems(range(start, stop)) == [ds[i] for i in range(start, stop)]
    assert ds._getitems(range(4, 4)) == []
    assert ds._getitems(range(0, 6, 2)) == [ds[i] for i in range(0, 6, 2)]

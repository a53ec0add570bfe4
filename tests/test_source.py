from __future__ import annotations

import numpy as np
import pytest

import grain_core as grain

MD = grain.MapDataset


class CountingSource:
    """A source that records how it was read (one call per block, or one per index)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.single_reads = 0
        self.block_reads: list[list[int]] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.single_reads += 1
        return i * 10

    def __getitems__(self, keys: list[int]) -> list[int]:
        self.block_reads.append(list(keys))
        return [k * 10 for k in keys]


def test_source_reads_modulo_length():
    ds = MD.source([1, 2, 3])
    assert len(ds) == 3
    assert [ds[i] for i in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert ds._getitems([5, 0, 4]) == [3, 1, 2]


def test_source_uses_batched_read_once_per_block():
    src = CountingSource(1000)
    ds = MD.source(src).seed(0).shuffle().map(lambda x: x + 1).batch(100)
    batch = ds[3]
    assert src.single_reads == 0
    assert len(src.block_reads) == 1 and len(src.block_reads[0]) == 100
    assert sorted(batch.tolist()) == sorted(k * 10 + 1 for k in src.block_reads[0])


def test_source_of_source_dataset_and_numpy_array():
    assert list(MD.source(MD.range(3))) == [0, 1, 2]
    arr = np.arange(4) * 2
    assert list(MD.source(arr)) == [0, 2, 4, 6]
    assert "ndarray(len=4)" in repr(MD.source(arr))


def test_empty_source_reads_raise_index_error():
    ds = MD.source([])
    assert len(ds) == 0 and list(ds) == []
    with pytest.raises(IndexError):
        ds[0]


@pytest.mark.parametrize(
    "args, expected",
    [((5,), [0, 1, 2, 3, 4]), ((2, 5), [2, 3, 4]), ((10, 0, -3), [10, 7, 4, 1]), ((3, 3), [])],
)
def test_range_follows_python_range(args, expected):
    ds = MD.range(*args)
    assert list(ds) == expected
    assert len(ds) == len(expected)
    if expected:
        assert ds[len(expected)] == expected[0]
        assert ds._getitems(list(range(len(expected)))) == expected


def test_range_reads_synchronously_by_default():
    it = iter(MD.range(5).to_iter_dataset())
    assert not it._threaded
    assert it._chunk_cap > 1  # values are read in blocks, not one call per element
    assert repr(MD.range(1, 4)) == "RangeMapDataset(start=1, stop=4, step=1)"

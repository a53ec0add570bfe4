"""Tests of grain_core.dataset.next_index."""

from __future__ import annotations

import pytest

from grain_core import MapDataset
from grain_core.experimental import (
    InterleaveIterDataset,
    LimitIterDataset,
    ThreadPrefetchIterDataset,
    get_next_index,
    set_next_index,
)


def test_through_source_map_random_map_limit_prefetch_and_interleave() -> None:
    ds = MapDataset.range(50).to_iter_dataset().map(lambda x: x + 1)
    ds = ds.random_map(lambda x, rng: x, seed=3)
    ds = ThreadPrefetchIterDataset(LimitIterDataset(ds, 40), prefetch_buffer_size=4)
    ds = InterleaveIterDataset([ds], cycle_length=2)
    it = iter(ds)
    assert [next(it) for _ in range(3)] == [1, 2, 3]
    assert get_next_index(it) == 3
    set_next_index(it, 30)
    assert next(it) == 31
    assert get_next_index(it) == 31
    set_next_index(it, 0)
    assert next(it) == 1


def test_jump_without_processing_data() -> None:
    calls = []
    ds = MapDataset.range(1000).map(lambda x: calls.append(x) or x).to_iter_dataset()
    it = iter(ds)
    set_next_index(it, 900)
    assert next(it) == 900
    assert min(calls) >= 900


def test_pipelines_that_cannot_jump() -> None:
    it = iter(MapDataset.range(10).to_iter_dataset().filter(lambda x: x % 2))
    with pytest.raises(NotImplementedError, match="cannot"):
        set_next_index(it, 3)
    with pytest.raises(NotImplementedError, match="cannot"):
        get_next_index(it)
    with pytest.raises(ValueError, match="non-negative"):
        set_next_index(iter(MapDataset.range(3).to_iter_dataset()), -1)

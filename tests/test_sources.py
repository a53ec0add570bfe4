from __future__ import annotations

import multiprocessing
import pickle

import pytest

import grain_core as grain
from grain_core.sources import RandomAccessDataSource, RangeDataSource, SharedMemoryDataSource
from grain_core.testing import check_random_access_source


def test_range_data_source_contract():
    src = RangeDataSource(2, 11, 3)
    assert len(src) == 3 and [src[i] for i in range(3)] == [2, 5, 8]
    assert repr(src) == "RangeDataSource(start=2, stop=11, step=3)"
    check_random_access_source(src)
    assert isinstance(src, RandomAccessDataSource)
    with pytest.raises(IndexError):
        src[3]
    with pytest.raises(AssertionError):
        RangeDataSource(0, 3, 0)


def _read_in_child(src, q):
    q.put([src[i] for i in range(len(src))])


def test_shared_memory_source_is_shared_across_processes():
    src = SharedMemoryDataSource([1, "two", 3.0, b"four", None])
    try:
        check_random_access_source(src)
        assert repr(src) == "SharedMemoryDataSource(len=5)"
        assert str(src).startswith("InMemoryDataSource(name=")
        copy = pickle.loads(pickle.dumps(src))
        assert copy.shm.name == src.shm.name
        copy.close()
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_read_in_child, args=(src, q))
        p.start()
        assert q.get(timeout=60) == [1, "two", 3.0, b"four", None]
        p.join(30)
        assert list(grain.MapDataset.source(src)) == [1, "two", 3.0, b"four"]
    finally:
        src.close()
        src.unlink()


def test_shared_memory_source_needs_elements_or_name():
    with pytest.raises(ValueError, match="Elements or name"):
        SharedMemoryDataSource()


def test_plain_lists_satisfy_the_protocol():
    assert isinstance([1, 2], RandomAccessDataSource)


def test_record_keys_array_takes_integers_only():
    import numpy as np

    from grain_core.sources import record_keys_array

    for keys in ([1, 2], range(1, 3), np.array([1, 2], np.uint8), [np.int32(1), 2]):
        out = record_keys_array(keys)
        assert out.dtype == np.int64 and out.tolist() == [1, 2]
    assert record_keys_array([]).tolist() == []
    for bad in ([1.9], np.array([2.5]), ["3"], [True]):
        with pytest.raises(TypeError, match="Record keys must be integers"):
            record_keys_array(bad)

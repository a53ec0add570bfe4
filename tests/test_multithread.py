"""Tests of grain_core.dataset.multithread."""

from __future__ import annotations

import threading

import pytest

from grain_core import MapDataset, ReadOptions
from grain_core.experimental import multithread_prefetch
from grain_core.testing import assert_equal_output_after_checkpoint, check_iterator_conformance


def _pipeline():  # noqa: ANN202 - small helper
    return MapDataset.range(20).to_iter_dataset(ReadOptions(num_threads=0)).map(lambda x: x * 3)


def test_zero_threads_returns_dataset() -> None:
    ds = _pipeline()
    assert multithread_prefetch(ds, 0, 4) is ds


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("buffer_size", [0, 1, 4])
def test_order_equals_single_thread_for_one_to_one_transforms(
    num_threads: int, buffer_size: int
) -> None:
    ds = multithread_prefetch(_pipeline(), num_threads, buffer_size)
    assert list(ds) == [x * 3 for x in range(20)]


def test_runs_on_background_threads() -> None:
    seen: set[str] = set()

    def record(x: int) -> int:
        seen.add(threading.current_thread().name)
        return x

    ds = MapDataset.range(8).to_iter_dataset(ReadOptions(num_threads=0)).map(record)
    assert list(multithread_prefetch(ds, 2, 2)) == list(range(8))
    assert threading.current_thread().name not in seen


def test_batch_inside_threads_depends_on_thread_count() -> None:
    ds = MapDataset.range(8).to_iter_dataset().batch(2)
    out = [b.tolist() for b in multithread_prefetch(ds, 2, 1)]
    assert out == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_sequential_slice() -> None:
    ds = MapDataset.range(15).to_iter_dataset()
    assert list(multithread_prefetch(ds, 4, 1, sequential_slice=True)) == [
        0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11,
    ]  # fmt: skip


def test_checkpointing() -> None:
    ds = multithread_prefetch(_pipeline(), 3, 2)
    check_iterator_conformance(ds, positions=[0, 1, 7, 19, 20])
    assert_equal_output_after_checkpoint(multithread_prefetch(_pipeline(), 2, 0))


def test_errors_surface_in_consumer() -> None:
    def boom(x: int) -> int:
        if x == 5:
            raise RuntimeError("bad element 5")
        return x

    ds = MapDataset.range(10).to_iter_dataset().map(boom)
    with pytest.raises(RuntimeError, match="bad element 5"):
        list(multithread_prefetch(ds, 2, 2))


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="num_threads"):
        multithread_prefetch(_pipeline(), -1, 1)
    with pytest.raises(ValueError, match="buffer_size"):
        multithread_prefetch(_pipeline(), 2, -1)

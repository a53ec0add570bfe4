"""Tests of grain_core.dataset.multithread."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grain_core import DatasetIterator, IterDataset, MapDataset, ReadOptions
from grain_core.dataset.ops.interleave import InterleaveIterDataset
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


def _random_stream_pipeline(size: int, seed: int) -> IterDataset[Any]:
    """Iter-level steps that number the elements they pull (random_map, map_with_index)."""
    return (
        MapDataset.range(size)
        .to_iter_dataset(ReadOptions(num_threads=0))
        .random_map(lambda x, rng: (x, int(rng.integers(1 << 62))), seed=seed)
        .map_with_index(lambda i, x: (i, *x))
    )


@settings(max_examples=30, deadline=None)
@given(
    num_threads=st.integers(1, 6),
    buffer_size=st.integers(0, 3),
    size=st.integers(0, 40),
    seed=st.integers(0, 2**32 - 1),
    copy_per_thread=st.booleans(),
)
def test_each_element_gets_its_single_threaded_random_stream(
    num_threads: int, buffer_size: int, size: int, seed: int, copy_per_thread: bool
) -> None:
    expected = list(_random_stream_pipeline(size, seed))
    ds = multithread_prefetch(
        _random_stream_pipeline(size, seed),
        num_threads,
        buffer_size,
        copy_per_thread=copy_per_thread,
    )
    assert list(ds) == expected


@settings(max_examples=20, deadline=None)
@given(num_inputs=st.integers(1, 5), cycle_length=st.integers(1, 5), seed=st.integers(0, 99))
def test_interleave_read_threads_keep_each_inputs_random_stream(
    num_inputs: int, cycle_length: int, seed: int
) -> None:
    def interleaved(iter_buffer_size: int) -> list[Any]:
        inputs = [_random_stream_pipeline(7, seed + i) for i in range(num_inputs)]
        return list(
            InterleaveIterDataset(
                inputs, cycle_length=cycle_length, iter_buffer_size=iter_buffer_size
            )
        )

    assert interleaved(iter_buffer_size=2) == interleaved(iter_buffer_size=0)


def test_thread_share_sees_its_worker_identity() -> None:
    class Recording(DatasetIterator[Any]):
        def __next__(self) -> Any:
            mp = self._ctx.mp_context
            return (next(self._parent), mp.process_index, mp.process_count)

        def get_state(self) -> dict[str, Any]:
            return self._parent.get_state()

        def set_state(self, state: dict[str, Any]) -> None:
            self._parent.set_state(state)

    class RecordingDataset(IterDataset[Any]):
        def __iter__(self) -> DatasetIterator[Any]:
            return Recording(iter(self._parent))

    ds = RecordingDataset(MapDataset.range(6).to_iter_dataset())
    assert list(multithread_prefetch(ds, 3, 1)) == [(x, x % 3, 3) for x in range(6)]

"""Tests for grain_core.dataset.ops.rebatch: RebatchIterDataset and batch_and_pad."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_core as grain
from grain_core.experimental import RebatchIterDataset, batch_and_pad
from grain_core.testing import (
    assert_equal_output_after_checkpoint,
    assert_trees_equal,
    check_iterator_conformance,
)


def _batched(n: int, input_batch: int, drop_remainder: bool = False) -> Any:
    return (
        grain.MapDataset.range(n)
        .to_iter_dataset()
        .batch(input_batch, drop_remainder=drop_remainder)
    )


def _lists(ds: Any) -> list[list[int]]:
    return [b.tolist() for b in ds]


# --------------------------------------------------------------------------------- rebatch
def test_rebatch_crosses_input_boundaries_and_keeps_remainder() -> None:
    assert _lists(RebatchIterDataset(_batched(10, 3), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_rebatch_drop_remainder() -> None:
    assert _lists(RebatchIterDataset(_batched(10, 3), 4, drop_remainder=True)) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    assert _lists(RebatchIterDataset(_batched(8, 3), 4, drop_remainder=True)) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def test_rebatch_splits_large_inputs() -> None:
    assert _lists(RebatchIterDataset(_batched(7, 7), 2)) == [[0, 1], [2, 3], [4, 5], [6]]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 40),
    input_batch=st.integers(1, 9),
    batch_size=st.integers(1, 12),
    drop_remainder=st.booleans(),
)
def test_rebatch_equals_unbatch_then_batch(
    n: int, input_batch: int, batch_size: int, drop_remainder: bool
) -> None:
    out = _lists(RebatchIterDataset(_batched(n, input_batch), batch_size, drop_remainder))
    rows = list(range(n))
    expected = [rows[i : i + batch_size] for i in range(0, n, batch_size)]
    if drop_remainder and expected and len(expected[-1]) < batch_size:
        expected.pop()
    assert out == expected


def test_rebatch_nested_structures_and_trailing_dims() -> None:
    parent = (
        grain.MapDataset.range(5)
        .map(lambda x: {"a": x, "b": (np.full((2,), x, dtype=np.float32),)})
        .to_iter_dataset()
        .batch(2)
    )
    out = list(RebatchIterDataset(parent, 3))
    assert len(out) == 2
    assert_trees_equal(
        out[0],
        {
            "a": np.array([0, 1, 2]),
            "b": (np.repeat(np.arange(3, dtype=np.float32), 2).reshape(3, 2),),
        },
    )
    assert out[1]["b"][0].shape == (2, 2)


def test_rebatch_scalars_in_1d_batches() -> None:
    parent = grain.MapDataset.source([1.5, 2.5, 3.5]).to_iter_dataset().batch(2)
    out = list(RebatchIterDataset(parent, 3))
    assert_trees_equal(out, [np.array([1.5, 2.5, 3.5])])


def test_rebatch_state_matches_grain() -> None:
    it = iter(RebatchIterDataset(_batched(10, 3), 4))
    next(it)
    assert it.get_state() == {"parent": {"next_index": 3}, "batch_idx": 1}
    next(it)
    assert it.get_state() == {"parent": {"next_index": 6}, "batch_idx": 2}


def test_rebatch_state_at_input_boundary_points_past_it() -> None:
    it = iter(RebatchIterDataset(_batched(12, 3), 3))
    next(it)
    assert it.get_state() == {"parent": {"next_index": 3}, "batch_idx": 0}


@pytest.mark.parametrize(
    "state, rest",
    [
        ({"parent": {"next_index": 4}, "batch_idx": 2}, [[6]]),  # after input [4, 5]
        ({"parent": {"next_index": 7}, "batch_idx": 1}, []),  # at the end
    ],
    ids=["input_boundary", "end"],
)
def test_rebatch_restores_grains_states_at_boundaries(state: dict[str, Any], rest: list) -> None:
    # Google Grain 0.2.18 names the input batch just used up (and, at the end, its parent's
    # end with the last batch's rows); grain_core names the next input batch.
    ds = RebatchIterDataset(grain.MapDataset.range(7).to_iter_dataset().batch(2), batch_size=3)
    it = iter(ds)
    it.set_state(state)
    assert [b.tolist() for b in it] == rest


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_rebatch_conformance(drop_remainder: bool) -> None:
    def make() -> Any:
        return RebatchIterDataset(_batched(17, 3), 4, drop_remainder)

    check_iterator_conformance(make, positions=range(5 if drop_remainder else 6))
    assert_equal_output_after_checkpoint(make())


def test_rebatch_stop_iteration_repeats() -> None:
    it = iter(RebatchIterDataset(_batched(3, 2), 2, drop_remainder=True))
    assert _lists(it) == [[0, 1]]
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("batch_size", [0, -2])
def test_rebatch_invalid_batch_size(batch_size: int) -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        RebatchIterDataset(_batched(4, 2), batch_size)


def test_rebatch_empty_input_batch_raises() -> None:
    parent = grain.MapDataset.source([np.zeros((0, 2))]).to_iter_dataset()
    with pytest.raises(ValueError, match="starting batch size of 0 is not supported"):
        list(RebatchIterDataset(parent, 2))


def test_rebatch_unbatched_input_raises() -> None:
    parent = grain.MapDataset.range(3).to_iter_dataset()
    with pytest.raises(ValueError, match="needs batched inputs"):
        list(RebatchIterDataset(parent, 2))


def test_rebatch_mismatched_leading_dims_raise() -> None:
    parent = grain.MapDataset.source([{"a": np.zeros(2), "b": np.zeros(3)}]).to_iter_dataset()
    with pytest.raises(ValueError, match="different leading dimensions"):
        list(RebatchIterDataset(parent, 2))


def test_rebatch_inconsistent_checkpoint_raises() -> None:
    it = iter(RebatchIterDataset(_batched(6, 3), 2))
    with pytest.raises(ValueError, match="different pipeline"):
        it.set_state({"parent": {"next_index": 3}, "batch_idx": 4})


def test_rebatch_closed_iterator_raises() -> None:
    it = iter(RebatchIterDataset(_batched(6, 3), 2))
    it.close()
    with pytest.raises(ValueError, match="closed iterator"):
        next(it)


# ---------------------------------------------------------------------------- batch_and_pad
def test_batch_and_pad_spec_example() -> None:
    fn = functools.partial(batch_and_pad, batch_size=3)
    assert _lists(grain.MapDataset.range(1, 5).batch(3, batch_fn=fn)) == [[1, 2, 3], [4, 0, 0]]


def test_batch_and_pad_pads_each_leaf_with_its_dtype_and_shape() -> None:
    values = [{"x": np.ones((2,), np.float32), "y": np.int8(3)}]
    out = batch_and_pad(values, batch_size=3, pad_value=-1)
    assert_trees_equal(
        out,
        {
            "x": np.array([[1, 1], [-1, -1], [-1, -1]], dtype=np.float32),
            "y": np.array([3, -1, -1], dtype=np.int8),
        },
    )


def test_batch_and_pad_full_batch_is_make_batch() -> None:
    assert_trees_equal(batch_and_pad([1, 2], batch_size=2), np.array([1, 2]))


def test_batch_and_pad_errors() -> None:
    with pytest.raises(ValueError, match="0 values"):
        batch_and_pad([], batch_size=2)
    with pytest.raises(ValueError, match="more than batch_size=2"):
        batch_and_pad([1, 2, 3], batch_size=2)

"""The shared argument checks: what passes, and the error and message for what does not."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import grain_core as grain
from grain_core._checks import as_flag, as_int, non_negative_int, positive_int
from grain_core.experimental import RebatchIterDataset


@given(st.integers())
def test_integers_come_back_as_int(value: int) -> None:
    assert as_int("n", value) == value
    assert type(as_int("n", np.int64(value % 2**62))) is int


@pytest.mark.parametrize("value", [1.0, "3", None, True, np.float32(2)])
def test_non_integers_are_a_type_error(value: Any) -> None:
    with pytest.raises(TypeError, match="n must be an integer, got"):
        as_int("n", value)


@pytest.mark.parametrize(
    ("check", "bad", "message"),
    [
        (positive_int, 0, "n must be a positive integer, got 0."),
        (positive_int, -3, "n must be a positive integer, got -3."),
        (non_negative_int, -1, "n must be non-negative, got -1."),
    ],
)
def test_out_of_range_is_a_value_error(check: Any, bad: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check("n", bad)


def test_bounds_are_inclusive() -> None:
    assert positive_int("n", 1) == 1
    assert non_negative_int("n", 0) == 0


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda v: grain.MapDataset.range(4).batch(v), "batch_size"),
        (lambda v: grain.transforms.Batch(v), "batch_size"),
        (lambda v: grain.ReadOptions(num_threads=v), "ReadOptions.num_threads"),
        (lambda v: grain.MultiprocessingOptions(num_workers=v), "num_workers"),
        (lambda v: grain.sharding.ShardOptions(0, v), "shard_count"),
        (lambda v: grain.MapDataset.range(3).repeat(v), "num_epochs"),
        (lambda v: grain.samplers.IndexSampler(3, num_epochs=v), "num_epochs"),
        (
            lambda v: RebatchIterDataset(grain.MapDataset.range(4).to_iter_dataset(), v),
            "batch_size",
        ),
    ],
)
def test_public_arguments_share_the_checks(make: Any, name: str) -> None:
    """Each public count rejects a bool as a type error and a negative count by name."""
    with pytest.raises(TypeError, match=f"{name} must be an integer, got a bool"):
        make(True)
    with pytest.raises(ValueError, match=name):
        make(-1)


@pytest.mark.parametrize(("value", "flag"), [(True, True), (False, False), (1, True), (0, False)])
def test_flags_are_bools_or_0_and_1(value: Any, flag: bool) -> None:
    assert as_flag("f", value) is flag
    assert as_flag("f", np.int64(value)) is flag


@pytest.mark.parametrize("value", [2, -1, 0.0, 1.0, "1", None])
def test_other_flags_are_a_type_error(value: Any) -> None:
    with pytest.raises(TypeError, match=r"f must be a bool or 0/1, got"):
        as_flag("f", value)

"""Tests for grain_core.sharding (spec section 5)."""

from __future__ import annotations

import dataclasses
import logging
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grain_core.sharding import (
    NoSharding,
    ShardByJaxProcess,
    ShardOptions,
    even_split,
    jax_process_index_and_count,
)


@pytest.mark.parametrize(
    ("index", "count", "message"),
    [
        (0, 0, "shard_count must be a positive integer"),
        (0, -2, "shard_count must be a positive integer"),
        (-1, 3, r"shard_index must be in \[0, shard_count - 1\] = \[0, 2\], got -1"),
        (3, 3, r"= \[0, 2\], got 3"),
    ],
)
def test_invalid_shard_options_raise_value_error(index: int, count: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardOptions(index, count)


@pytest.mark.parametrize("bad", [1.0, "1", None, True])
def test_non_integer_shard_fields_raise_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="shard_count must be an integer"):
        ShardOptions(0, bad)  # type: ignore[arg-type]


def test_numpy_integers_are_normalised_to_int() -> None:
    options = ShardOptions(np.int64(1), np.int32(4))  # type: ignore[arg-type]
    assert type(options.shard_index) is int and type(options.shard_count) is int
    assert options == ShardOptions(1, 4)


def test_shard_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ShardOptions(0, 1).shard_index = 1  # type: ignore[misc]


def test_no_sharding_is_one_shard() -> None:
    options = NoSharding()
    assert isinstance(options, ShardOptions)
    assert (options.shard_index, options.shard_count, options.drop_remainder) == (0, 1, False)
    assert repr(options) == "NoSharding(shard_index=0, shard_count=1, drop_remainder=False)"


def test_shard_by_jax_process_reads_jax() -> None:
    jax = pytest.importorskip("jax")
    options = ShardByJaxProcess(drop_remainder=True)
    assert options.shard_index == jax.process_index()
    assert options.shard_count == jax.process_count()
    assert options.drop_remainder is True


def test_shard_by_jax_process_without_jax_is_single_shard(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)  # makes `import jax` raise ImportError
    options = ShardByJaxProcess()
    assert (options.shard_index, options.shard_count) == (0, 1)
    assert "JAX is not installed" in caplog.text
    assert "pip install jax" in caplog.text


def test_required_jax_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)
    with pytest.raises(ImportError, match=r"pip install jax"):
        jax_process_index_and_count(required=True)


@pytest.mark.parametrize(
    ("n", "count", "drop", "blocks"),
    [
        # Spec section 4.3 golden: 8 records over 3 shards -> [0,3), [3,6), [6,8).
        (8, 3, False, [(0, 3), (3, 6), (6, 8)]),
        (8, 3, True, [(0, 2), (2, 4), (4, 6)]),
        (9, 3, False, [(0, 3), (3, 6), (6, 9)]),
        (2, 4, False, [(0, 1), (1, 2), (2, 2), (2, 2)]),
        (0, 2, False, [(0, 0), (0, 0)]),
    ],
)
def test_even_split_golden(n: int, count: int, drop: bool, blocks: list[tuple[int, int]]) -> None:
    assert [even_split(n, ShardOptions(i, count, drop)) for i in range(count)] == blocks


@given(n=st.integers(0, 10_000), count=st.integers(1, 64))
def test_even_split_partitions_every_element_once(n: int, count: int) -> None:
    blocks = [even_split(n, ShardOptions(i, count)) for i in range(count)]
    covered = [k for start, end in blocks for k in range(start, end)]
    assert covered == list(range(n))
    sizes = {end - start for start, end in blocks}
    assert max(sizes) - min(sizes) <= 1


@given(n=st.integers(0, 10_000), count=st.integers(1, 64))
def test_even_split_with_drop_remainder_gives_equal_blocks(n: int, count: int) -> None:
    blocks = [even_split(n, ShardOptions(i, count, drop_remainder=True)) for i in range(count)]
    assert {end - start for start, end in blocks} == {n // count}
    assert blocks[-1][1] == n - n % count


def test_even_split_logs_dropped_remainder(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="grain_core.sharding"):
        even_split(10, ShardOptions(0, 3, drop_remainder=True))
    assert "Dropping 1 of 10 examples" in caplog.text


def test_even_split_rejects_negative_length() -> None:
    with pytest.raises(ValueError, match="num_examples must be non-negative, got -1"):
        even_split(-1, NoSharding())

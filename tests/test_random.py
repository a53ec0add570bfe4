"""Tests for grain_core.random: Grain goldens, permutation properties, Philox resets, errors."""

from __future__ import annotations

import math
import pickle
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grain_core import random as grain_random
from grain_core.random import (
    RngPool,
    derive_seed,
    index_shuffle,
    index_shuffle_array,
    index_shuffle_range,
    reset_philox,
    validate_seed,
)

SHUFFLE_GOLDENS = [
    (9, 0, [0, 4, 6, 7, 8, 3, 1, 9, 5, 2]),
    (9, 1, [5, 7, 6, 0, 4, 8, 9, 2, 1, 3]),
    (9, 3329053876, [1, 7, 6, 9, 0, 8, 4, 5, 3, 2]),
    (4, 32, [2, 4, 3, 0, 1]),
    (4, 33, [0, 2, 4, 1, 3]),
]
RANDOM_MAP_GOLDEN = [0, 6, 9, 5, 10, 14, 14, 13, 15, 13]


def _is_permutation(values: np.ndarray, length: int) -> bool:
    return bool(np.array_equal(np.sort(values), np.arange(length)))


# ------------------------------------------------------------------ index_shuffle goldens


@pytest.mark.parametrize(("max_index", "seed", "expected"), SHUFFLE_GOLDENS)
def test_index_shuffle_matches_grain_goldens(
    max_index: int, seed: int, expected: list[int]
) -> None:
    assert [index_shuffle(i, max_index, seed) for i in range(max_index + 1)] == expected
    assert index_shuffle_array(np.arange(max_index + 1), max_index, seed).tolist() == expected


def test_index_shuffle_large_domain_golden() -> None:
    expected = [866271, 800351, 992510, 927102, 620510]
    assert [index_shuffle(i, 999_999, 7) for i in range(5)] == expected
    assert index_shuffle_array(np.arange(5), 999_999, 7).tolist() == expected


def test_shuffle_golden_via_derived_seed() -> None:
    seed = derive_seed([(42, 1)])
    assert seed is not None
    assert [index_shuffle(i, 9, seed) for i in range(10)] == [1, 7, 6, 9, 0, 8, 4, 5, 3, 2]


def test_block_size_is_grains_except_where_grain_is_not_bijective() -> None:
    def grain_bits(max_index: int) -> int:
        bits = math.ceil(math.log2(max_index))
        return max(bits + (bits & 1), 16)

    candidates = {1, 2, 3, 9, 999, 999_999, 10**12}
    for k in range(1, 48):
        candidates.update({2**k - 1, 2**k, 2**k + 1})
    for max_index in sorted(candidates):
        expected = grain_bits(max_index)
        # Grain drops max_index's top bit here (see docs/compatibility.md).
        if max_index == 2**expected:
            expected += 2
        assert grain_random._block_bits(max_index) == expected, max_index
        assert max_index < 2 ** grain_random._block_bits(max_index)


@pytest.mark.parametrize("max_index", [300, 40_000])
def test_small_domain_table_equals_direct_cycle_walk(max_index: int) -> None:
    seed = 2024
    half_bits = grain_random._block_bits(max_index) // 2
    keys = grain_random._round_keys(seed, 4, half_bits)

    def walk(x: int) -> int:
        x = grain_random._encrypt(x, half_bits, keys)
        while x > max_index:
            x = grain_random._encrypt(x, half_bits, keys)
        return x

    sample = range(0, max_index + 1, max(1, max_index // 300))
    assert [index_shuffle(i, max_index, seed) for i in sample] == [walk(i) for i in sample]


# ------------------------------------------------------------------ permutation properties


# Lengths 2**k + 1 with even k >= 16, where Grain's own map is not a bijection.
GRAIN_DEFECT_LENGTHS = (65_537, 262_145, 1_048_577)


@pytest.mark.parametrize("k", range(1, 21))
def test_index_shuffle_array_is_permutation_around_powers_of_two(k: int) -> None:
    for length in {2**k - 1, 2**k, 2**k + 1} - set(GRAIN_DEFECT_LENGTHS):
        shuffled = index_shuffle_array(np.arange(length), length - 1, seed=k)
        assert _is_permutation(shuffled, length), length


@pytest.mark.parametrize("length", GRAIN_DEFECT_LENGTHS)
def test_lengths_where_grain_is_not_bijective_are_permutations(length: int) -> None:
    shuffled = index_shuffle_array(np.arange(length), length - 1, seed=3)
    assert _is_permutation(shuffled, length)
    assert index_shuffle(length - 1, length - 1, 3) == int(shuffled[-1])


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 300_000), seed=st.integers(0, 2**32 - 1))
def test_index_shuffle_array_is_permutation_for_random_lengths(length: int, seed: int) -> None:
    assert _is_permutation(index_shuffle_array(np.arange(length), length - 1, seed), length)


def test_other_round_counts() -> None:
    length = 70_001
    shuffled = index_shuffle_array(np.arange(length), length - 1, 11, rounds=6)
    assert _is_permutation(shuffled, length)
    assert index_shuffle(123, length - 1, 11, rounds=6) == int(shuffled[123])
    assert not np.array_equal(shuffled, index_shuffle_array(np.arange(length), length - 1, 11))
    sample = np.arange(0, 2**40, 2**33)
    assert index_shuffle_array(sample, 2**40 - 1, 11, rounds=1024).tolist() == [
        index_shuffle(int(i), 2**40 - 1, 11, rounds=1024) for i in sample
    ]


@settings(max_examples=60, deadline=None)
@given(
    max_index=st.one_of(st.integers(0, 2**17), st.integers(0, 2**63 - 1)),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_scalar_equals_vectorised(max_index: int, seed: int, data: st.DataObject) -> None:
    indices = data.draw(st.lists(st.integers(0, max_index), min_size=1, max_size=20))
    scalar = [index_shuffle(i, max_index, seed) for i in indices]
    assert (
        index_shuffle_array(np.array(indices, dtype=np.int64), max_index, seed).tolist() == scalar
    )
    assert all(0 <= value <= max_index for value in scalar)


@settings(max_examples=8, deadline=None)
@given(length=st.integers(2**16 + 2, 2**20), seed=st.integers(0, 2**32 - 1))
def test_large_domains_switch_to_a_table_of_the_same_permutation(length: int, seed: int) -> None:
    # Batches of a pass over the data: walked until they add up to 1/128 of the block, then
    # gathered from the table built at that point; the same permutation throughout.
    tables = grain_random._LargeTables()
    key = (length - 1, seed, 4)
    block = 1 << grain_random._block_bits(length - 1)
    saved, grain_random._large_tables = grain_random._large_tables, tables
    try:
        positions = np.random.default_rng(seed).permutation(length)[: 2 * block // 128 + 512]
        out, built_after = [], None
        for start in range(0, len(positions), 256):
            out.append(index_shuffle_array(positions[start : start + 256], length - 1, seed))
            if built_after is None and key in tables._tables:
                built_after = start + 256
    finally:
        grain_random._large_tables = saved
    assert built_after is not None and built_after * 128 >= block
    assert built_after * 128 < block + 256 * 128
    got = np.concatenate(out)
    assert got.dtype == np.int64
    sample = range(0, len(positions), 97)
    assert [int(got[i]) for i in sample] == [
        index_shuffle(int(positions[i]), length - 1, seed) for i in sample
    ]


def test_scalar_lookups_switch_to_the_table_too() -> None:
    # ds[i] one element at a time over a shuffled source: walked until the lookups add up to
    # 1/128 of the block, then read from the same table the batched reads use.
    max_index, seed = 199_999, 17
    half_bits = grain_random._block_bits(max_index) // 2
    keys = grain_random._round_keys(seed, 4, half_bits)
    positions = np.arange(0, max_index + 1, 97, dtype=np.uint64)
    expected = grain_random._walk_array(positions, max_index, half_bits, keys).tolist()
    tables = grain_random._LargeTables()
    saved, grain_random._large_tables = grain_random._large_tables, tables
    try:
        got = [index_shuffle(i, max_index, seed) for i in range(0, max_index + 1, 97)]
        built = (max_index, seed, 4) in tables._tables
    finally:
        grain_random._large_tables = saved
    assert built and len(got) * 128 >= 1 << grain_random._block_bits(max_index)
    assert got == expected


def test_index_shuffle_array_keeps_shape_and_accepts_unsigned() -> None:
    grid = np.arange(12, dtype=np.uint16).reshape(3, 4)
    out = index_shuffle_array(grid, 11, 5)
    assert out.shape == (3, 4) and out.dtype == np.int64
    assert out.ravel().tolist() == [index_shuffle(i, 11, 5) for i in range(12)]
    assert index_shuffle_array(np.array([], dtype=np.int64), 11, 5).size == 0


@settings(max_examples=40, deadline=None)
@given(
    max_index=st.one_of(
        st.integers(0, 2**16 - 1), st.integers(2**16, 2**20 - 1), st.integers(2**20, 2**63 - 1)
    ),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_index_shuffle_range_equals_the_array_of_its_range(
    max_index: int, seed: int, data: st.DataObject
) -> None:
    # Small tables, large domains (walked, then a table) and larger ones (always walked).
    start = data.draw(st.integers(0, max_index))
    stop = data.draw(st.integers(start, min(max_index + 1, start + 300)))
    got = index_shuffle_range(start, stop, max_index, seed)
    assert got.dtype == np.int64 and got.shape == (stop - start,)
    expected = index_shuffle_array(np.arange(start, stop, dtype=np.int64), max_index, seed)
    assert got.tolist() == expected.tolist()


def test_index_shuffle_range_from_a_large_table_is_a_copy() -> None:
    tables = grain_random._LargeTables()
    saved, grain_random._large_tables = grain_random._large_tables, tables
    try:
        length = 2**16 + 3
        whole = index_shuffle_range(0, length, length - 1, 4)  # enough asked: table built
        assert (length - 1, 4, 4) in tables._tables
        part = index_shuffle_range(10, 20, length - 1, 4)
    finally:
        grain_random._large_tables = saved
    assert _is_permutation(whole, length) and part.tolist() == whole[10:20].tolist()
    part[:] = 0  # the caller's own array: the cached table is unchanged
    assert index_shuffle_array(np.arange(10, 20), length - 1, 4).tolist() == whole[10:20].tolist()


@pytest.mark.parametrize(("start", "stop"), [(-1, 3), (3, 2), (0, 11)])
def test_index_shuffle_range_out_of_range(start: int, stop: int) -> None:
    with pytest.raises(ValueError, match="start and stop must satisfy"):
        index_shuffle_range(start, stop, 9, 1)


def test_largest_domain_scalar() -> None:
    top = 2**64 - 1
    values = {index_shuffle(i, top, 9) for i in (0, 1, top)}
    assert len(values) == 3 and all(0 <= v <= top for v in values)


def test_max_index_zero() -> None:
    assert index_shuffle(0, 0, 5) == 0
    assert index_shuffle_array(np.zeros(3, dtype=np.int64), 0, 5).tolist() == [0, 0, 0]
    assert index_shuffle_range(0, 1, 0, 5).tolist() == [0]


# ------------------------------------------------------------------ index_shuffle errors


@pytest.mark.parametrize("rounds", [0, 2, 3, 5, 1025, 1026])
def test_bad_rounds(rounds: int) -> None:
    with pytest.raises(ValueError, match="rounds must be an even integer between 4 and 1024"):
        index_shuffle(0, 9, 1, rounds=rounds)
    with pytest.raises(ValueError, match="rounds must be an even integer between 4 and 1024"):
        index_shuffle_array(np.arange(3), 9, 1, rounds=rounds)


@pytest.mark.parametrize(
    ("index", "max_index"), [(-1, 9), (10, 9), (1, 0), (0, -1), (2**20, 2**20 - 1)]
)
def test_index_out_of_range(index: int, max_index: int) -> None:
    with pytest.raises(ValueError, match=r"index must be in \[0, max_index\]"):
        index_shuffle(index, max_index, 1)


def test_array_index_out_of_range_names_position() -> None:
    with pytest.raises(ValueError, match=r"got 10 at position 2"):
        index_shuffle_array(np.array([0, 3, 10, 1]), 9, 1)
    with pytest.raises(ValueError, match=r"got -1 at position 0"):
        index_shuffle_array(np.array([-1]), 99_999, 1)


def test_bad_argument_types_and_ranges() -> None:
    with pytest.raises(TypeError):
        index_shuffle(1.0, 9, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="integer array"):
        index_shuffle_array(np.array([0.0, 1.0]), 9, 1)
    with pytest.raises(ValueError, match="seed must be in"):
        index_shuffle(0, 9, 2**32)
    with pytest.raises(ValueError, match="max_index must be in"):
        index_shuffle(0, 2**64, 1)
    with pytest.raises(ValueError, match="max_index must be in"):
        index_shuffle_array(np.arange(2), 2**63, 1)


# ------------------------------------------------------------------ seeds


@pytest.mark.parametrize(
    ("pairs", "expected"),
    [
        ([(42, 1)], 3329053876),
        ([(41, 1)], 1669946257),
        ([(7, 1)], 369571992),
        ([(7, 2)], 1009178997),
    ],
)
def test_derive_seed_goldens(pairs: list[tuple[int, int]], expected: int) -> None:
    derived = derive_seed(pairs)
    assert derived == expected and type(derived) is int


def test_derive_seed_combines_and_handles_empty() -> None:
    assert derive_seed([]) is None
    combined = derive_seed([(7, 1), (42, 2)])
    expected = int(np.random.SeedSequence([7, 1, 42, 2]).generate_state(1, dtype=np.uint32)[0])
    assert combined == expected


def test_validate_seed() -> None:
    assert validate_seed(0, "`shuffle`") == 0
    assert validate_seed(np.uint32(2**32 - 1), "`shuffle`") == 2**32 - 1
    assert type(validate_seed(np.int64(5), "x")) is int
    with pytest.raises(ValueError, match=r"`shuffle` seed must be in \[0, 2\*\*32\), got -1"):
        validate_seed(-1, "`shuffle`")
    with pytest.raises(ValueError, match=r"got 4294967296"):
        validate_seed(2**32, "`random_map`")
    for bad in (1.5, "3", None, True):
        with pytest.raises(TypeError, match="`random_map` seed must be an integer"):
            validate_seed(bad, "`random_map`")
    assert validate_seed(2**70, "`random_map`", below_2_32=False) == 2**70
    with pytest.raises(ValueError, match="`random_map` seed must be non-negative, got -1"):
        validate_seed(-1, "`random_map`", below_2_32=False)


# ------------------------------------------------------------------ Philox


def test_random_map_golden_with_pool_and_reset() -> None:
    seed = derive_seed([(41, 1)])
    assert seed is not None
    pool = RngPool(seed)
    values = []
    for i in range(10):
        rng = pool.acquire_rng(i)
        values.append(i + int(rng.integers(0, 10)))
        pool.release_rng(rng)
    assert values == RANDOM_MAP_GOLDEN

    rng = np.random.Generator(np.random.Philox(seed))
    rng.random(7)  # dirty the state: the reset must not depend on history
    direct = []
    for i in range(10):
        reset_philox(rng, i)
        direct.append(i + int(rng.integers(0, 10)))
    assert direct == RANDOM_MAP_GOLDEN


def test_reset_philox_state_and_op_seed() -> None:
    rng = np.random.Generator(np.random.Philox(5))
    rng.integers(0, 2**32, size=3, dtype=np.uint32)  # leaves has_uint32/buffer_pos dirty
    reset_philox(rng, 2**64 - 1, op_seed=3)
    state = rng.bit_generator.state
    assert state["state"]["counter"].tolist() == [0, 0, 3, 2**64 - 1]
    assert state["buffer"].tolist() == [0, 0, 0, 0]
    assert (state["buffer_pos"], state["has_uint32"], state["uinteger"]) == (4, 0, 0)
    assert state["state"]["key"].tolist() == np.random.Philox(5).state["state"]["key"].tolist()
    first = rng.random(4)
    reset_philox(rng, 2**64 - 1, op_seed=3)
    assert np.array_equal(rng.random(4), first)
    reset_philox(rng, 2**64 - 1, op_seed=4)
    assert not np.array_equal(rng.random(4), first)


def test_raw_and_setter_resets_agree() -> None:
    raw = np.random.Generator(np.random.Philox(9))
    setter = np.random.Generator(np.random.Philox(9))
    for rng in (raw, setter):
        rng.integers(0, 2**32, size=5, dtype=np.uint32)
    grain_random._reset_bit_generator(raw.bit_generator, 17, 2)
    grain_random._setter_reset(setter.bit_generator, 17, 2)
    raw_state, setter_state = raw.bit_generator.state, setter.bit_generator.state
    assert raw_state["state"]["counter"].tolist() == setter_state["state"]["counter"].tolist()
    assert raw_state["buffer"].tolist() == setter_state["buffer"].tolist()
    assert raw.integers(0, 2**62, size=9).tolist() == setter.integers(0, 2**62, size=9).tolist()


def test_reset_philox_errors() -> None:
    with pytest.raises(TypeError, match="Philox"):
        reset_philox(np.random.default_rng(0), 0)
    rng = np.random.Generator(np.random.Philox(1))
    for index, op_seed in ((-1, 0), (2**64, 0), (0, -1)):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
            reset_philox(rng, index, op_seed)


def test_rng_pool_pickles_to_fresh_pool_and_reuses_generators() -> None:
    pool = RngPool(1669946257)
    rng = pool.acquire_rng(3)
    pool.release_rng(rng)
    assert pool.acquire_rng(4) is rng
    pool.release_rng(rng)
    clone = pickle.loads(pickle.dumps(pool))
    assert isinstance(clone, RngPool) and clone.seed == pool.seed
    assert clone._free == []
    fresh = clone.acquire_rng(5, op_seed=1)
    assert fresh.bit_generator.state["state"]["counter"].tolist() == [0, 0, 1, 5]


def test_rng_pool_is_thread_safe() -> None:
    pool = RngPool(7)
    expected = [int(pool.acquire_rng(i).integers(0, 2**62)) for i in range(50)]
    in_use: set[int] = set()
    guard = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        for i in range(50):
            rng = pool.acquire_rng(i)
            with guard:
                if id(rng) in in_use:
                    errors.append("generator handed out twice")
                in_use.add(id(rng))
            value = int(rng.integers(0, 2**62))
            with guard:
                in_use.discard(id(rng))
            pool.release_rng(rng)
            if value != expected[i]:
                errors.append(f"index {i}: {value} != {expected[i]}")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []


def test_rng_pool_validation_and_failed_acquire_returns_generator() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        RngPool(-1)
    with pytest.raises(TypeError):
        RngPool(1.5)  # type: ignore[arg-type]
    pool = RngPool(2)
    with pytest.raises(ValueError):
        pool.acquire_rng(-1)
    assert len(pool._free) == 1

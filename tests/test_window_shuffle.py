"""Tests for grain_core.dataset.ops.window_shuffle; differences from Grain in docs/compatibility.md."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_core as grain
from grain_core import random as grain_random
from grain_core.experimental import WindowShuffleIterDataset, WindowShuffleMapDataset
from grain_core.plugins import get_shuffle_strategy
from grain_core.testing import assert_equal_output_after_checkpoint, check_iterator_conformance

# Produced by Google grain 0.2.18 for the same pipelines (full windows; several epochs).
GRAIN_MAP_RANGE12_W4_SEED3 = [2, 3, 0, 1, 5, 4, 6, 7, 9, 8, 10, 11, 2, 1, 0, 3, 6, 4, 7, 5, 9, 11, 8, 10]  # fmt: skip
GRAIN_ITER_RANGE10_W4_SEED3 = [1, 0, 3, 2, 7, 6, 4, 5, 8, 9]


def _map_ds(n: int = 10, window: int = 4, seed: int | None = 3) -> WindowShuffleMapDataset:
    return WindowShuffleMapDataset(grain.MapDataset.range(n), window_size=window, seed=seed)


def _iter_ds(n: int = 10, window: int = 4, seed: int | None = 3) -> WindowShuffleIterDataset:
    return WindowShuffleIterDataset(
        grain.MapDataset.range(n).to_iter_dataset(), window_size=window, seed=seed
    )


# ------------------------------------------------------------------------------- map version
def test_map_matches_grain_golden_over_two_epochs() -> None:
    ds = _map_ds(12, 4, 3)
    assert len(ds) == 12
    assert [ds[i] for i in range(24)] == GRAIN_MAP_RANGE12_W4_SEED3
    assert ds._getitems(range(24)) == GRAIN_MAP_RANGE12_W4_SEED3


def test_map_full_windows_follow_the_spec_formula() -> None:
    ds = _map_ds(20, 5, 7)
    for i in range(20):
        w, j = divmod(i, 5)
        assert ds[i] == w * 5 + grain_random.index_shuffle(j, 4, 7 + w)


@pytest.mark.parametrize(("n", "window"), [(10, 4), (7, 7), (7, 10), (1, 3), (13, 5), (9, 1)])
def test_map_partial_last_window_is_a_permutation_of_exactly_its_elements(
    n: int, window: int
) -> None:
    ds = WindowShuffleMapDataset(
        grain.MapDataset.source(list(range(n))), window_size=window, seed=0
    )
    for epoch in range(3):
        values = [ds[epoch * n + i] for i in range(n)]
        assert sorted(values) == list(range(n))
        for start in range(0, n, window):
            assert sorted(values[start : start + window]) == list(
                range(start, min(n, start + window))
            )


def test_map_epochs_use_different_permutations() -> None:
    ds = _map_ds(100, 100, 1)
    assert ds._getitems(range(100)) != ds._getitems(range(100, 200))


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 40),
    window=st.integers(4, 20),
    seed=st.sampled_from([0, 2**32 - 1]),
    indices=st.lists(st.integers(0, 80), max_size=30),
)
def test_map_batched_reads_equal_single_reads(
    n: int, window: int, seed: int, indices: list[int]
) -> None:
    ds = WindowShuffleMapDataset(grain.MapDataset.range(n), window_size=window, seed=seed)
    assert ds._getitems(indices) == [ds[i] for i in indices]
    assert ds._getitems(np.asarray(indices, dtype=np.int64)) == [ds[i] for i in indices]


def test_map_default_seed_comes_from_seed_call() -> None:
    seeded = WindowShuffleMapDataset(grain.MapDataset.range(20).seed(5), window_size=20)
    again = WindowShuffleMapDataset(grain.MapDataset.range(20).seed(5), window_size=20)
    other = WindowShuffleMapDataset(grain.MapDataset.range(20).seed(6), window_size=20)
    assert list(seeded) == list(again)
    assert list(seeded) != list(other)
    explicit = WindowShuffleMapDataset(grain.MapDataset.range(20).seed(5), window_size=20, seed=1)
    assert list(explicit) == list(_map_ds(20, 20, 1))


def test_map_without_any_seed_raises() -> None:
    with pytest.raises(ValueError, match="requires a seed"):
        WindowShuffleMapDataset(grain.MapDataset.range(5), window_size=2)


@pytest.mark.parametrize("window", [0, -3])
def test_non_positive_window_size_raises(window: int) -> None:
    with pytest.raises(ValueError, match="window_size must be a positive integer"):
        _map_ds(window=window)
    with pytest.raises(ValueError, match="window_size must be a positive integer"):
        _iter_ds(window=window)


@pytest.mark.parametrize("window", [2.5, "4", True])
def test_non_integer_window_size_raises(window: object) -> None:
    with pytest.raises((TypeError, ValueError), match="window_size"):
        WindowShuffleMapDataset(grain.MapDataset.range(5), window_size=window, seed=0)  # type: ignore[arg-type]


def test_map_empty_dataset() -> None:
    ds = WindowShuffleMapDataset(grain.MapDataset.range(0), window_size=3, seed=0)
    assert len(ds) == 0
    assert list(ds) == []
    with pytest.raises(IndexError):
        ds[0]


def test_map_slice_returns_a_dataset() -> None:
    ds = _map_ds(12, 4, 3)
    assert list(ds[2:6]) == GRAIN_MAP_RANGE12_W4_SEED3[2:6]


def test_map_conformance_through_to_iter_dataset() -> None:
    out = check_iterator_conformance(lambda: _map_ds(23, 10, 9), positions=[0, 9, 10, 11, 22, 23])
    assert sorted(out) == list(range(23))


def test_registered_window_shuffle_strategy() -> None:
    strategy = get_shuffle_strategy("window")
    ds = strategy.apply(grain.MapDataset.range(12), seed=3, window_size=4)
    assert isinstance(ds, WindowShuffleMapDataset)
    assert list(ds) == GRAIN_MAP_RANGE12_W4_SEED3[:12]


# ------------------------------------------------------------------------------ iter version
def test_iter_matches_grain_golden_including_partial_window() -> None:
    assert list(_iter_ds(10, 4, 3)) == GRAIN_ITER_RANGE10_W4_SEED3


@pytest.mark.parametrize(("n", "window"), [(10, 4), (12, 4), (3, 8), (1, 1), (17, 5)])
def test_iter_emits_each_window_as_a_permutation(n: int, window: int) -> None:
    out = list(_iter_ds(n, window, 11))
    assert sorted(out) == list(range(n))
    for start in range(0, n, window):
        assert sorted(out[start : start + window]) == list(range(start, min(n, start + window)))


def test_iter_emits_from_the_back_of_the_permuted_window() -> None:
    out = list(_iter_ds(8, 8, 21))
    perm = grain_random.index_shuffle_array(np.arange(8), 7, 21).tolist()
    assert out == perm[::-1]


def test_iter_windows_use_different_seeds() -> None:
    out = list(_iter_ds(400, 100, 0))
    offsets = [[x - 100 * w for x in out[100 * w : 100 * (w + 1)]] for w in range(4)]
    assert len({tuple(o) for o in offsets}) == 4


def test_iter_state_format_and_restore_on_fresh_iterator() -> None:
    it = iter(_iter_ds(12, 4, 3))
    next(it)
    next(it)
    state = it.get_state()
    assert state == {
        "parent_window_start_state": {"next_index": 0},
        "window_index": 0,
        "pos_in_window": 2,
    }
    rest = list(it)
    fresh = iter(_iter_ds(12, 4, 3))
    fresh.set_state(state)
    assert fresh.get_state() == state
    assert list(fresh) == rest


def test_iter_state_at_window_boundary_points_at_next_window() -> None:
    it = iter(_iter_ds(12, 4, 3))
    for _ in range(4):
        next(it)
    assert it.get_state() == {
        "parent_window_start_state": {"next_index": 4},
        "window_index": 1,
        "pos_in_window": 0,
    }


@pytest.mark.parametrize(
    "state, rest",
    [
        ({"parent_window_start_state": {"next_index": 0}, "window_index": 1, "pos_in_window": 4},
         [7, 6, 4, 5, 10, 8, 9]),
        ({"parent_window_start_state": {"next_index": 8}, "window_index": 3, "pos_in_window": 3},
         []),
    ],
    ids=["window_boundary", "end"],
)  # fmt: skip
def test_iter_restores_grains_states_after_a_window(state: dict, rest: list) -> None:
    # Google Grain 0.2.18 names the window just used up, with window_index already the next.
    ds = WindowShuffleIterDataset(
        grain.MapDataset.range(11).to_iter_dataset(), window_size=4, seed=3
    )
    it = iter(ds)
    it.set_state(state)
    assert list(it) == rest


def test_iter_conformance_every_position() -> None:
    check_iterator_conformance(lambda: _iter_ds(11, 4, 5), positions=range(12))
    assert_equal_output_after_checkpoint(_iter_ds(11, 4, 5))


def test_iter_conformance_over_a_transformed_parent() -> None:
    def make() -> WindowShuffleIterDataset:
        parent = grain.MapDataset.range(30).seed(1).shuffle().to_iter_dataset().map(lambda x: x * 3)
        return WindowShuffleIterDataset(parent, window_size=7)

    out = check_iterator_conformance(make, positions=[0, 6, 7, 13, 29, 30])
    assert sorted(out) == [3 * i for i in range(30)]


def test_iter_stop_iteration_repeats() -> None:
    it = iter(_iter_ds(3, 2, 0))
    assert len(list(it)) == 3
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_iter_default_seed_and_missing_seed() -> None:
    parent = grain.MapDataset.range(20).to_iter_dataset()
    a = list(WindowShuffleIterDataset(parent.seed(8), window_size=20))
    b = list(WindowShuffleIterDataset(parent.seed(8), window_size=20))
    c = list(WindowShuffleIterDataset(parent.seed(9), window_size=20))
    assert a == b != c
    with pytest.raises(ValueError, match="requires a seed"):
        WindowShuffleIterDataset(parent, window_size=3)


def test_iter_restore_with_inconsistent_checkpoint_raises() -> None:
    it = iter(_iter_ds(5, 4, 0))
    with pytest.raises(ValueError, match="different pipeline"):
        it.set_state(
            {"parent_window_start_state": {"next_index": 4}, "window_index": 1, "pos_in_window": 3}
        )


def test_iter_closed_iterator_raises() -> None:
    it = iter(_iter_ds(10, 4, 0))
    next(it)
    it.close()
    with pytest.raises(ValueError, match="closed iterator"):
        next(it)

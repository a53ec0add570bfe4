"""Tests of grain_core.dataset.ops.cache."""

from __future__ import annotations

import pytest

from grain_core import MapDataset, MultiprocessingOptions
from grain_core.experimental import CacheIterDataset, LimitIterDataset, RepeatIterDataset
from grain_core.testing import assert_equal_output_after_checkpoint, check_iterator_conformance


class _Counting:
    """Counts how often the parent's elements are computed."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: int) -> int:
        self.calls += 1
        return x * 2


def test_later_epochs_come_from_memory() -> None:
    fn = _Counting()
    src = MapDataset.range(5).to_iter_dataset(_read_options()).map(fn)
    ds = RepeatIterDataset(CacheIterDataset(src), 3)
    assert list(ds) == [0, 2, 4, 6, 8] * 3
    assert fn.calls == 5


def _read_options():  # noqa: ANN202 - tiny helper
    from grain_core import ReadOptions

    return ReadOptions(num_threads=0)


def test_state_dict() -> None:
    it = iter(CacheIterDataset(MapDataset.range(3).to_iter_dataset()))
    next(it)
    assert it.get_state() == {"parent": {"next_index": 1}, "position": 1, "cache_filled": False}


def test_conformance_single_pass_and_repeated() -> None:
    base = MapDataset.range(6).to_iter_dataset()
    assert check_iterator_conformance(CacheIterDataset(base), positions=range(7)) == list(range(6))
    repeated = RepeatIterDataset(CacheIterDataset(base), 3)
    assert check_iterator_conformance(repeated, positions=range(19)) == list(range(6)) * 3
    assert_equal_output_after_checkpoint(repeated)


def test_restore_in_fresh_iterator_rebuilds_cache() -> None:
    fn = _Counting()
    ds = RepeatIterDataset(
        CacheIterDataset(MapDataset.range(4).to_iter_dataset(_read_options()).map(fn)), 3
    )
    it = iter(ds)
    for _ in range(6):
        next(it)
    state = it.get_state()
    calls = fn.calls
    fresh = iter(ds)
    fresh.set_state(state)
    assert list(fresh) == [4, 6, 0, 2, 4, 6]
    assert fn.calls - calls == 4  # rebuilt the cache once, then served the last epoch from it


def test_limit_then_repeat() -> None:
    ds = RepeatIterDataset(
        CacheIterDataset(LimitIterDataset(MapDataset.range(100).to_iter_dataset(), 3)), 2
    )
    assert list(ds) == [0, 1, 2, 0, 1, 2]
    check_iterator_conformance(ds, positions=range(7))


def test_checkpoint_past_end_is_rejected() -> None:
    it = iter(CacheIterDataset(MapDataset.range(2).to_iter_dataset()))
    with pytest.raises(ValueError, match="past the end"):
        it.set_state({"parent": {"next_index": 2}, "position": 5, "cache_filled": False})


def test_under_mp_prefetch_each_worker_caches_its_slice() -> None:
    ds = RepeatIterDataset(
        CacheIterDataset(MapDataset.range(6).to_iter_dataset()).mp_prefetch(
            MultiprocessingOptions(num_workers=2)
        ),
        2,
    )
    assert list(ds) == list(range(6)) * 2


def test_parent_keyword_as_in_grain() -> None:
    ds = CacheIterDataset(parent=MapDataset.range(3).to_iter_dataset())
    assert ds.parents[0] is ds._parent
    assert list(RepeatIterDataset(ds, 2)) == [0, 1, 2, 0, 1, 2]

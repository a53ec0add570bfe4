"""Tests of grain_core.dataset.with_options."""

from __future__ import annotations

import pytest

from grain_core import MapDataset
from grain_core.experimental import (
    DatasetOptions,
    ExecutionTrackingMode,
    InterleaveIterDataset,
    WithOptionsIterDataset,
    ZipIterDataset,
)


def _source(n: int = 3000):  # noqa: ANN202 - small helper
    return MapDataset.range(n).to_iter_dataset()


def test_options_reach_upstream_and_downstream_nodes() -> None:
    ds = WithOptionsIterDataset(_source(), DatasetOptions(filter_warn_threshold_ratio=0.2))
    ds = ds.map(lambda x: x)
    it = iter(ds)
    assert it._ctx.dataset_options.filter_warn_threshold_ratio == 0.2
    assert it._parents[0]._ctx is it._ctx


def test_downstream_explicit_value_wins_unset_fields_kept() -> None:
    ds = WithOptionsIterDataset(
        _source(), DatasetOptions(filter_warn_threshold_ratio=0.2, min_shm_size=10)
    )
    ds = WithOptionsIterDataset(
        ds.map(lambda x: x), DatasetOptions(filter_warn_threshold_ratio=0.5)
    )
    opts = iter(ds)._ctx.dataset_options
    assert opts.filter_warn_threshold_ratio == 0.5
    assert opts.min_shm_size == 10
    assert opts.execution_tracking_mode is ExecutionTrackingMode.DISABLED


def test_branches_merge() -> None:
    left = WithOptionsIterDataset(_source(), DatasetOptions(min_shm_size=7))
    right = WithOptionsIterDataset(_source(), DatasetOptions(filter_raise_threshold_ratio=0.3))
    opts = iter(ZipIterDataset([left, right]))._ctx.dataset_options
    assert (opts.min_shm_size, opts.filter_raise_threshold_ratio) == (7, 0.3)


def test_zero_raise_threshold_is_real() -> None:
    """0.0 is a threshold, not 'disabled' (Grain's falsy test): it raises on any drop."""
    ds = _source().filter(lambda x: x != 3)
    ds = WithOptionsIterDataset(ds, DatasetOptions(filter_raise_threshold_ratio=0.0))
    with pytest.raises(ValueError, match="skipped"):
        list(ds)
    assert len(list(_source().filter(lambda x: x != 3))) == 2999


def test_raise_threshold_applies_upstream_of_the_options_node() -> None:
    ds = _source().filter(lambda x: x % 10 == 0)
    with pytest.raises(ValueError, match="filter_raise_threshold_ratio"):
        list(
            WithOptionsIterDataset(
                ds.map(lambda x: x), DatasetOptions(filter_raise_threshold_ratio=0.5)
            )
        )


def test_options_after_interleave_reach_inputs() -> None:
    inputs = [_source().filter(lambda x: x % 10 == 0), _source(5)]
    ds = WithOptionsIterDataset(
        InterleaveIterDataset(inputs, cycle_length=2),
        DatasetOptions(filter_raise_threshold_ratio=0.5),
    )
    with pytest.raises(ValueError, match="skipped"):
        list(ds)


def test_rejects_non_options() -> None:
    with pytest.raises(TypeError, match="DatasetOptions"):
        WithOptionsIterDataset(_source(), {"min_shm_size": 1})  # type: ignore[arg-type]

from __future__ import annotations

import pytest

from grain_core import MultiprocessingOptions, ReadOptions
from grain_core.dataset.options import DatasetOptions, ExecutionTrackingMode, FilterRatioChecker


def test_read_options_defaults_and_validation(caplog: pytest.LogCaptureFixture) -> None:
    assert ReadOptions() == ReadOptions(num_threads=16, prefetch_buffer_size=500)
    with pytest.raises(ValueError, match="num_threads must be non-negative"):
        ReadOptions(num_threads=-1)
    with pytest.raises(ValueError, match="prefetch_buffer_size must be non-negative"):
        ReadOptions(prefetch_buffer_size=-1)
    with caplog.at_level("WARNING"):
        ReadOptions(num_threads=8, prefetch_buffer_size=0)
        assert caplog.records == []
        ReadOptions(num_threads=8, prefetch_buffer_size=2)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "prefetch_buffer_size=2 is smaller than num_threads=8" in caplog.text


def test_multiprocessing_options_validation():
    assert MultiprocessingOptions().num_workers == 0
    with pytest.raises(ValueError, match="num_workers"):
        MultiprocessingOptions(num_workers=-1)
    with pytest.raises(ValueError, match="per_worker_buffer_size"):
        MultiprocessingOptions(per_worker_buffer_size=-2)


def test_stall_thresholds_are_positive_seconds_or_none():
    options = MultiprocessingOptions()
    assert (options.stall_warning_s, options.stall_timeout_s) == (30.0, None)  # warn, no kill
    MultiprocessingOptions(stall_warning_s=None, stall_timeout_s=0.5)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "60"):
        with pytest.raises(ValueError, match="stall_timeout_s must be a positive number"):
            MultiprocessingOptions(stall_timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stall_warning_s"):
        MultiprocessingOptions(stall_warning_s=0)


def test_in_process_is_a_mode_or_none():
    assert MultiprocessingOptions().in_process is None  # the config's: "never" by default
    for mode in ("never", "auto", "always"):
        assert MultiprocessingOptions(in_process=mode).in_process == mode
    with pytest.raises(ValueError, match="in_process must be one of"):
        MultiprocessingOptions(in_process="sometimes")


def test_dataset_options_merge_prefers_explicit_fields_of_self():
    a = DatasetOptions(filter_warn_threshold_ratio=0.5)
    b = DatasetOptions(filter_warn_threshold_ratio=0.1, min_shm_size=10)
    merged = a.merge(b)
    assert merged.filter_warn_threshold_ratio == 0.5
    assert merged.min_shm_size == 10
    assert merged.execution_tracking_mode is ExecutionTrackingMode.DISABLED
    assert a.merge(None) is a
    assert DatasetOptions().merge(b).filter_warn_threshold_ratio == 0.1


def test_dataset_options_validation():
    with pytest.raises(ValueError, match="filter_raise_threshold_ratio"):
        DatasetOptions(filter_raise_threshold_ratio=1.5)
    with pytest.raises(ValueError, match="min_shm_size"):
        DatasetOptions(min_shm_size=-1)


def test_zero_threshold_is_a_real_threshold():
    checker = FilterRatioChecker("f", window=10)
    options = DatasetOptions(filter_raise_threshold_ratio=0.0)
    checker.record(10, 0, options)  # nothing dropped: no error
    with pytest.raises(ValueError, match="skipped 10.00 % of the last seen 10 elements"):
        checker.record(10, 1, options)


def test_raise_threshold_checked_per_window():
    checker = FilterRatioChecker("f", window=100)
    options = DatasetOptions(filter_raise_threshold_ratio=0.5)
    checker.record(60, 60, options)
    with pytest.raises(ValueError, match="filter_raise_threshold_ratio=0.5"):
        checker.record(40, 0, options)

"""Tests for grain_core.observe.summary: the execution summary of a tracked pipeline."""

from __future__ import annotations

import json
import re

import pytest
from conftest import StageClock, stage_pipeline

import grain_core as grain
from grain_core.experimental import (
    DatasetOptions,
    ExecutionTrackingMode,
    InterleaveIterDataset,
    WithOptionsIterDataset,
    get_execution_summary,
)

TIMING = DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING)
SYNC = grain.ReadOptions(num_threads=0)


def test_summary_without_tracking_raises() -> None:
    it = iter(stage_pipeline())
    # Grain's text (users match on it), then how to turn tracking on in grain_core.
    grains = (
        "Set `grain_py_debug_mode` or set `execution_tracking_mode` in grain options to "
        "`STAGE_TIMING` to enable execution statistics collection"
    )
    with pytest.raises(ValueError, match=re.escape(grains)):
        get_execution_summary(it)


def test_summary_prints_a_table(stage_clock: StageClock) -> None:
    it = iter(WithOptionsIterDataset(stage_pipeline(stage_clock), TIMING))
    list(it)
    text = str(get_execution_summary(it))
    lines = text.splitlines()
    assert "execution summary" in lines[0]
    assert lines[1].split("|")[1].strip() == "stage"
    assert "MapMapDataset(transform=costly" in text
    assert "94.3%" in text  # 100_000 of 106_000 ns
    assert "1.00 us" in text  # costly: 1000 ns per element
    assert len(lines) == 3 + 6


def test_summary_is_json_serialisable(stage_clock: StageClock) -> None:
    it = iter(WithOptionsIterDataset(stage_pipeline(stage_clock), TIMING))
    next(it)
    data = json.loads(json.dumps(get_execution_summary(it).to_dict()))
    assert data["stages"][0]["num_produced_elements"] == 1


@pytest.mark.parametrize("iter_buffer_size", [0, 2])
def test_interleave_inputs_merge_into_one_row_per_stage(iter_buffer_size: int) -> None:
    inputs = [
        grain.MapDataset.range(i * 10, i * 10 + 5).to_iter_dataset(SYNC).map(abs) for i in range(4)
    ]
    ds = InterleaveIterDataset(inputs, cycle_length=2, iter_buffer_size=iter_buffer_size)
    it = iter(WithOptionsIterDataset(ds, TIMING))
    assert len(list(it)) == 20
    summary = get_execution_summary(it)
    assert summary.stages[0].name == "Interleave"
    assert summary.stages[0].num_produced_elements == 20
    merged = [s for s in summary.stages if s.name.startswith("Map(")]
    assert len(merged) == 1
    # Inputs the interleave finished and dropped still count.
    assert merged[0].instances == 4
    assert merged[0].num_produced_elements == 20


def test_a_summary_fits_a_width() -> None:
    def a_transform_with_a_long_descriptive_name(x: int) -> int:
        return x + 1

    ds = grain.MapDataset.range(64).map(a_transform_with_a_long_descriptive_name).batch(4)
    it = iter(WithOptionsIterDataset(ds.to_iter_dataset(), TIMING))
    list(it)
    summary = get_execution_summary(it)
    assert max(len(line) for line in str(summary).splitlines()) > 80
    narrow = summary.to_text(width=80)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert "self time" in narrow and "| min" not in narrow
    assert narrow.splitlines()[0] == str(summary).splitlines()[0][: len(narrow.splitlines()[0])]

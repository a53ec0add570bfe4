"""Tests for grain_core.observe: the observer the dataset layer and the engines ask."""

from __future__ import annotations

import subprocess
import sys

import grain_core as grain
from grain_core.dataset.iterator import pipeline_observer
from grain_core.experimental import DatasetOptions, ExecutionTrackingMode, WithOptionsIterDataset
from grain_core.observe import Observer, stages


def _iterator(mode: ExecutionTrackingMode) -> grain.DatasetIterator[int]:
    ds = grain.MapDataset.range(4).to_iter_dataset(grain.ReadOptions(num_threads=0))
    return iter(WithOptionsIterDataset(ds, DatasetOptions(execution_tracking_mode=mode)))


def test_building_a_pipeline_registers_the_observer_first() -> None:
    # A process that imports only the dataset gets timed pipelines: grain_core.dataset
    # imports observe, which registers itself.
    code = (
        "from grain_core.dataset.base import MapDataset\n"
        "from grain_core.dataset.iterator import pipeline_observer\n"
        "it = iter(MapDataset.range(3).to_iter_dataset().map(abs))\n"
        "print(type(pipeline_observer()).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "Observer"
    assert isinstance(pipeline_observer(), Observer)


def test_an_untracked_pipeline_gives_workers_nothing_to_send_or_wrap() -> None:
    it = _iterator(ExecutionTrackingMode.DISABLED)
    observer = pipeline_observer()
    assert not observer.tracks(it)
    assert observer.worker_snapshot(it) is None
    assert observer.span_wrapper(it) is None
    assert list(it) == [0, 1, 2, 3]


def test_a_tracked_pipeline_sends_its_stages_and_a_traced_one_wraps_in_spans() -> None:
    timed = _iterator(ExecutionTrackingMode.STAGE_TIMING)
    observer = pipeline_observer()
    assert list(timed) == [0, 1, 2, 3]
    assert observer.tracks(timed) and observer.span_wrapper(timed) is None
    rows = observer.worker_snapshot(timed)[0]
    assert rows[0][3] == 4  # the output stage's count
    receiver = _iterator(ExecutionTrackingMode.STAGE_TIMING)
    observer.receive_worker_snapshot(receiver, observer.worker_snapshot(timed))
    assert any(s.in_workers for s in stages.stages_of(receiver).inputs)  # type: ignore[union-attr]
    traced = _iterator(ExecutionTrackingMode.STAGE_TRACING)
    wrap = observer.span_wrapper(traced)
    assert wrap is not None and wrap(lambda x: x + 1, "send", "transport")(1) == 2

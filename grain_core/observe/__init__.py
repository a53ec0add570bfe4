"""Observability: what a running pipeline reports about itself, in one package.

* ``spans``: the clock of every span and the timeline trace (``experimental.Trace``).
* ``stages``: per-stage counts and self times, installed on a pipeline whose options ask for
  them (zero cost otherwise: ``stages.time_stages`` is the one entry point), and a worker
  process's statistics as it sends them and the parent receives them.
* ``summary``: the execution summary (``experimental.get_execution_summary``).
* ``graph``: Grain's debug mode and the dataset graph (``experimental.dataset_graph``).
* ``profile`` and ``report_html``: ``grain-core profile``, a pipeline run under a trace and
  written as an HTML report (imported only by that verb and ``grain_core.profiling``).

The dataset layer and the engines sit below this package and never import it: importing it
registers ``Observer`` with ``grain_core.dataset.iterator.set_pipeline_observer``, and
``grain_core.dataset`` imports it, so a pipeline is observed whenever it can be built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from grain_core.dataset.iterator import DatasetIterator, PipelineObserver, set_pipeline_observer
from grain_core.observe import stages

__all__ = ["Observer"]


class Observer(PipelineObserver):
    """grain_core's observer of pipelines: stage timing, debug-mode reports, worker
    statistics (from the stages registered as receiving them) and trace spans."""

    def time_stages(self, iterator: DatasetIterator[Any]) -> None:
        stages.time_stages(iterator)

    def watch_output(self, iterator: DatasetIterator[Any]) -> None:
        from grain_core.observe import graph  # import cost: only tracked pipelines report

        graph.watch_output(iterator)

    def tracks(self, iterator: DatasetIterator[Any]) -> bool:
        return stages.is_tracking(iterator)

    def worker_snapshot(self, iterator: DatasetIterator[Any]) -> Any:
        return stages.worker_stage_snapshot(iterator) if stages.is_tracking(iterator) else None

    def receive_worker_snapshot(self, iterator: DatasetIterator[Any], snapshot: Any) -> None:
        stages.attach_worker_stages(iterator, snapshot)

    def span_wrapper(
        self, iterator: DatasetIterator[Any]
    ) -> Callable[[Callable[..., Any], str, str], Callable[..., Any]] | None:
        return stages.span_wrapper(iterator)

    def receives_worker_stages(
        self,
        iterator: DatasetIterator[Any],
        request: Callable[[], None],
        receive: Callable[[], None],
    ) -> None:
        stages.register_worker_receiver(iterator, request, receive)

    def reads_inputs_on_own_thread(
        self,
        iterator: DatasetIterator[Any],
        inputs_paused: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        stages.register_reader_thread(iterator, inputs_paused)


set_pipeline_observer(Observer())

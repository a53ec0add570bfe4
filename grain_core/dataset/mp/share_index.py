"""``get_next_index`` / ``set_next_index`` for one input of an ``mp_prefetch``'s parent-side
interleave (a worker of the rotation engine, a class of positions of the dispatch engine).

Both report the state of worker ``index`` of ``count``'s share of the pipeline under strict
rotation, so the share's own iterator, built here in the parent at that state, counts or
jumps for them: no process is involved and no element is read. With one worker the share is
the whole pipeline; with several the interleave refuses first, as an interleave of several
inputs cannot count.
"""

from __future__ import annotations

from typing import Any

from grain_core.dataset.iterator import DatasetIterator
from grain_core.dataset.mp.pickling import EngineInput

__all__ = ["share_next_index", "share_state_at"]


def _share_iterator(engine: EngineInput, index: int, count: int) -> DatasetIterator[Any]:
    return iter(
        engine.nodes.worker_share(engine.pipeline, index, count, engine.sequential_slice, False)
    )


def share_next_index(engine: EngineInput, index: int, count: int, state: dict[str, Any]) -> int:
    """How many elements share ``index`` of ``count`` has produced at ``state``.

    Raises:
      NotImplementedError: If a step of the pipeline cannot count (filter, packing...).
    """
    it = _share_iterator(engine, index, count)
    try:
        it.set_state(state)
        return it._get_next_index()
    finally:
        it.close()


def share_state_at(engine: EngineInput, index: int, count: int, next_index: int) -> dict[str, Any]:
    """The state of share ``index`` of ``count`` whose next element is element ``next_index``.

    Raises:
      NotImplementedError: If a step of the pipeline cannot jump without reading (filter...).
    """
    it = _share_iterator(engine, index, count)
    try:
        it._set_next_index(next_index)
        return it.get_state()
    finally:
        it.close()

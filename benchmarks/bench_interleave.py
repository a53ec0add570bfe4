"""Interleave of 16 in-memory IterDatasets with cycle_length 4 (issue 6).

Two input kinds, each against Google Grain doing the same work in the same run:

* ``interleave_16x4``: inputs are ``MapDataset.source(list).to_iter_dataset()`` readers. They
  read ahead on their own, so grain_core reads them on the consumer thread; Grain adds a
  thread and a queue per input.
* ``interleave_16x4_sync_inputs``: the same with ``ReadOptions(num_threads=0)`` readers, so
  the figure is the interleave's own cost (no read thread pools on either side).
* ``interleave_16x4_mapped``: inputs are ``to_iter_dataset().map(f)`` pipelines, which
  grain_core reads ahead on one thread per input (``iter_buffer_size=1``), like Grain.

A plain-Python round-robin over 16 list iterators is the floor any interleave pays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _harness import import_google_grain, workload

NUM_INPUTS = 16
PER_INPUT = 500
CYCLE = 4
ELEMENTS = NUM_INPUTS * PER_INPUT


def _inputs() -> list[list[int]]:
    return [list(range(k * PER_INPUT, (k + 1) * PER_INPUT)) for k in range(NUM_INPUTS)]


def _add_one(x: int) -> int:
    return x + 1


def _check(out: list[Any]) -> None:
    if len(out) != ELEMENTS:
        raise AssertionError(f"interleave produced {len(out)} elements, expected {ELEMENTS}")


def _readers(grain: Any, read_options: Any = None) -> list[Any]:
    return [grain.MapDataset.source(v).to_iter_dataset(read_options) for v in _inputs()]


def _pass(ds: Any) -> Callable[[], None]:
    def run() -> None:
        _check(list(ds))

    return run


@workload(
    "interleave_16x4",
    elements=ELEMENTS,
    description="interleave 16 in-memory to_iter_dataset inputs, cycle_length 4",
)
def interleave_16x4() -> Callable[[], None]:
    import grain_core as grain
    from grain_core.experimental import InterleaveIterDataset

    return _pass(InterleaveIterDataset(_readers(grain), cycle_length=CYCLE))


@interleave_16x4.baseline("plain Python round-robin")
def _() -> Callable[[], None]:
    inputs = _inputs()

    def run() -> None:
        out: list[int] = []
        pending = iter(inputs)
        slots = [iter(next(pending)) for _ in range(CYCLE)]
        while slots:
            for it in list(slots):
                try:
                    out.append(next(it))
                except StopIteration:
                    nxt = next(pending, None)
                    if nxt is None:
                        slots.remove(it)
                    else:
                        slots[slots.index(it)] = iter(nxt)
        _check(out)

    return run


@interleave_16x4.baseline("grain", requires="grain")
def _() -> Callable[[], None]:
    grain: Any = import_google_grain()
    return _pass(grain.experimental.InterleaveIterDataset(_readers(grain), cycle_length=CYCLE))


@workload(
    "interleave_16x4_sync_inputs",
    elements=ELEMENTS,
    description="interleave 16 in-memory to_iter_dataset(num_threads=0) inputs, cycle_length 4",
)
def interleave_16x4_sync_inputs() -> Callable[[], None]:
    import grain_core as grain
    from grain_core.experimental import InterleaveIterDataset

    sync = grain.ReadOptions(num_threads=0)
    return _pass(InterleaveIterDataset(_readers(grain, sync), cycle_length=CYCLE))


@interleave_16x4_sync_inputs.baseline("grain", requires="grain")
def _() -> Callable[[], None]:
    grain: Any = import_google_grain()
    sync = grain.ReadOptions(num_threads=0)
    return _pass(
        grain.experimental.InterleaveIterDataset(_readers(grain, sync), cycle_length=CYCLE)
    )


@workload(
    "interleave_16x4_mapped",
    elements=ELEMENTS,
    description="interleave 16 to_iter_dataset().map(f) inputs (threaded reads), cycle_length 4",
)
def interleave_16x4_mapped() -> Callable[[], None]:
    import grain_core as grain
    from grain_core.experimental import InterleaveIterDataset

    return _pass(
        InterleaveIterDataset(
            [grain.MapDataset.source(v).to_iter_dataset().map(_add_one) for v in _inputs()],
            cycle_length=CYCLE,
        )
    )


@interleave_16x4_mapped.baseline("grain", requires="grain")
def _() -> Callable[[], None]:
    grain: Any = import_google_grain()
    return _pass(
        grain.experimental.InterleaveIterDataset(
            [grain.MapDataset.source(v).to_iter_dataset().map(_add_one) for v in _inputs()],
            cycle_length=CYCLE,
        )
    )

"""Dispatched mp_prefetch pipelines computed in the parent process
(grain_core.dataset.mp.in_process): the same elements and checkpoints as the workers'."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import grain_core as grain
from grain_core.dataset.mp import in_process
from grain_core.dataset.mp.in_process import START_S, WorkerPayoff


@pytest.fixture
def mode() -> Iterator[Any]:
    def set_mode(value: str) -> None:
        grain.config.update("py_mp_prefetch_in_process", value)

    yield set_mode
    grain.config.update("py_mp_prefetch_in_process", "never")


def _square(x: int) -> dict[str, Any]:
    return {"x": np.full(3, x * x), "i": x}


def _fails_at_7(x: int) -> int:
    if x == 7:
        raise ValueError("element 7")
    return x


def _pipelines() -> list[grain.IterDataset[Any]]:
    return [
        grain.MapDataset.range(23).seed(1).shuffle().map(_square).batch(4).to_iter_dataset(),
        grain.MapDataset.range(23).to_iter_dataset().map(_square).batch(3),
    ]


def _run(ds: grain.IterDataset[Any]) -> tuple[list[Any], list[Any]]:
    it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    elements, states = [], [it.get_state()]
    for element in it:
        elements.append(element)
        states.append(it.get_state())
    it.close()
    return elements, states


def _same(a: Any, b: Any) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_equal(x, y)


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("value", ["always", "auto"])
def test_output_and_states_equal_the_workers(mode: Any, index: int, value: str) -> None:
    expected, expected_states = _run(_pipelines()[index])
    mode(value)
    elements, states = _run(_pipelines()[index])
    _same(elements, expected)
    assert states == expected_states


@pytest.mark.parametrize("restore_in", ["never", "always"])
def test_checkpoints_are_interchangeable(mode: Any, restore_in: str) -> None:
    mode("always" if restore_in == "never" else "never")
    options = grain.MultiprocessingOptions(num_workers=2)
    ds = _pipelines()[0].mp_prefetch(options)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = it.get_state()
    rest = list(it)
    it.close()
    mode(restore_in)
    it = iter(_pipelines()[0].mp_prefetch(options))
    it.set_state(state)
    _same(list(it), rest)
    it.close()


def test_an_error_is_raised_at_its_position_again(mode: Any) -> None:
    mode("always")
    ds = grain.MapDataset.range(10).map(_fails_at_7).to_iter_dataset()
    it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    assert [next(it) for _ in range(7)] == list(range(7))
    for _ in range(2):
        with pytest.raises(ValueError, match="element 7"):
            next(it)
    it.close()


def test_payoff_keeps_cheap_results_here_and_sends_costly_ones_to_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(in_process, "usable_cores", lambda: 2)
    # 1 us per result: less than the parent alone spends receiving one from a worker.
    cheap = WorkerPayoff(workers=2, results=100_000)
    count = int(START_S / 1e-6) + 1
    decisions = [cheap.record(1e-6, 0) for _ in range(count)]
    assert set(decisions[:-2]) == {None} and decisions[-1] is False
    costly = WorkerPayoff(workers=2, results=10_000)
    assert costly.record(START_S, 0) is True
    # Workers that deliver more slowly than this process computed: it takes over again.
    assert costly.delivered(1.0) is True  # the first result waited for them to start
    assert costly.delivered(2 * START_S) is False

"""tests for grain_core/dataset/transfer_cost.py: the cost of moving results between
processes that the engines' in-process decision and the profiler share."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from grain_core._ipc import shm
from grain_core.dataset import transfer_cost
from grain_core.dataset.transfer_cost import (
    MESSAGE_S,
    OVERDRAFT_BYTES,
    RESULT_S,
    SMALL_AHEAD,
    overdraft_room,
    seconds_per_result_with_workers,
)


@given(st.integers(min_value=0, max_value=4 * OVERDRAFT_BYTES))
def test_overdraft_room_is_bounded_by_count_and_bytes(element_bytes: int) -> None:
    room = overdraft_room(element_bytes)
    assert 0 <= room <= SMALL_AHEAD
    assert room * max(1, element_bytes) <= OVERDRAFT_BYTES


def test_a_result_with_workers_costs_its_slowest_part() -> None:
    # The consumer's own time and receiving, each worker's share, or the cores' share.
    assert seconds_per_result_with_workers(4.0, 1.0, 4.0, 0.0, 0.5, 2, 3.0) == 2.0
    assert seconds_per_result_with_workers(4.0, 3.0, 4.0, 0.0, 0.5, 2, 3.0) == 3.5
    assert seconds_per_result_with_workers(4.0, 0.0, 4.0, 0.0, 0.0, 8, 1.0) == 4.0


def test_a_result_in_shared_memory_pays_a_whole_message_and_no_unpickling() -> None:
    large = np.zeros(shm.DEFAULT_MIN_SHM_SIZE, np.uint8)
    send, receive = transfer_cost.transport_seconds(large)
    assert send >= MESSAGE_S
    assert receive == RESULT_S + MESSAGE_S


def test_an_unpicklable_result_is_priced_as_one_message() -> None:
    assert transfer_cost.transport_seconds(lambda: None) == (MESSAGE_S, MESSAGE_S + RESULT_S)


def test_usable_cores_are_at_most_those_the_process_may_run_on() -> None:
    assert 0.1 <= transfer_cost.usable_cores() <= transfer_cost.cores_to_run_on()

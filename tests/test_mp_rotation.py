"""Strict rotation (grain_core.dataset.mp.rotation) with real worker processes: a worker's
credits and overdraft, small elements several to a message, exact checkpoints within a
message, and the final batch written into shared memory by the worker's pipeline. What both
engines do alike is in test_mp.py."""

from __future__ import annotations

import pickle
import sys
import time
from typing import Any

import cloudpickle
import numpy as np
import pytest
from conftest import LogProduced, big_element, fails_after, mp_options

import grain_core as grain
from grain_core._ipc import pool as ipc_pool
from grain_core._ipc import shm as _shm
from grain_core.dataset import transfer_cost
from grain_core.dataset.mp import positions, protocol, rotation
from grain_core.testing import assert_trees_equal, check_iterator_conformance

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX shm + /dev/shm")

# Workers receive this module's functions by value, so they never import pytest.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _times_ten(x: int) -> int:
    return x * 10


def test_map_dataset_batch_stacks_into_shared_memory_in_a_worker(
    no_shm_leak: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `.batch(n).to_iter_dataset()` is the usual end of a pipeline: inside a worker the batch
    # is written once, into a block that travels by name (no second copy into shared memory).
    monkeypatch.setattr(_shm, "_pool", _shm._BlockPool(4))  # as in a worker
    ds = grain.MapDataset.range(10).map(big_element).batch(3).to_iter_dataset()
    share = positions.worker_share(ds, 1, 2, False, True)
    it = rotation.build_worker_iterator(share, 1, 2, None)
    try:
        batch = next(it)
        assert_trees_equal(batch, list(ds)[1])
        assert isinstance(batch["z"], _shm.SharedMemoryArray)
        _, names = _shm.copy_to_shm(batch, _shm.DEFAULT_MIN_SHM_SIZE)
        assert names == [batch["z"].metadata.name]
    finally:
        it.close()
        _shm.unlink_pool()
    ds_strings = grain.MapDataset.range(4).map(big_element).batch(2).to_iter_dataset()
    out = list(ds_strings.mp_prefetch(mp_options(2)))
    assert_trees_equal(out, list(ds_strings))
    assert out[0]["s"].dtype == np.dtype("<U2")  # strings are not truncated


def _produced_once_idle(path: Any, at_least: int) -> int:
    """Elements logged once there are ``at_least`` and no more come for 0.3 s (the worker
    has used its credit)."""
    deadline = time.monotonic() + 10
    last = -1
    while time.monotonic() < deadline:
        count = len(path.read_text().split()) if path.exists() else 0
        if count >= at_least and count == last:
            return count
        last = count
        time.sleep(0.3)
    raise AssertionError(f"{last} elements produced, expected at least {at_least} and then none")


def _large_bytes(x: int) -> bytes:
    return x.to_bytes(4, "little") * 8192  # 32 KiB, pickled (not an array)


def _first_of(element: Any) -> int:
    if isinstance(element, dict):
        return int(element["a"])
    return int.from_bytes(element[:4], "little") if isinstance(element, bytes) else element


@pytest.mark.parametrize("size", ["small", "shared_memory", "pickled_large"])
@pytest.mark.parametrize("buffer", [1, 2, 5])
def test_worker_stays_within_its_buffer_ahead(
    buffer: int, size: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, no_shm_leak: None
) -> None:
    # Strict rotation: the steps after the slice point run on credit. Elements in shared
    # memory stay within the buffer, plus the one the worker made and holds back; pickled ones
    # also go on the overdraft (SMALL_AHEAD of them, OVERDRAFT_BYTES at most: 31 of 32 KiB)
    # instead of waiting for the parent after each. (Dispatching workers: test_mp_dispatch.)
    # Closing while the worker holds an element back leaves no shared memory behind.
    monkeypatch.setattr(positions, "dispatchable", lambda *_: False)
    log = tmp_path / "produced.txt"
    ds = grain.MapDataset.range(200).to_iter_dataset().map(LogProduced(str(log)))
    if size != "small":
        ds = ds.map(big_element if size == "shared_memory" else _large_bytes)
    if size == "shared_memory":
        limit = buffer + 1
    else:
        element = 0 if size == "small" else _large_bytes(0)
        overdraft = transfer_cost.overdraft_room(len(pickle.dumps((element, {"state": 0}))))
        limit = buffer + overdraft + 1
    with fails_after(60), iter(ds.mp_prefetch(mp_options(1, buffer))) as it:
        consumed = 0
        for target in (1, 9, 80):
            while consumed < target:
                assert _first_of(next(it)) == consumed
                consumed += 1
            # The pipe itself holds only two 32 KiB messages.
            least = 1 if size == "pickled_large" else buffer // 2 + 1
            ahead = _produced_once_idle(log, consumed + least) - consumed
            assert ahead <= limit
            if size == "small":
                assert ahead > buffer + 1


@pytest.mark.parametrize("size", ["small", "shared_memory"])
def test_a_buffer_of_zero_produces_on_request_only(
    size: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(positions, "dispatchable", lambda *_: False)
    log = tmp_path / "produced.txt"
    ds = grain.MapDataset.range(20).to_iter_dataset().map(LogProduced(str(log)))
    if size != "small":
        ds = ds.map(big_element)
    with fails_after(60), iter(ds.mp_prefetch(mp_options(1, 0))) as it:
        for consumed in range(1, 4):
            assert _first_of(next(it)) == consumed - 1
            assert _produced_once_idle(log, consumed) == consumed


def _varied_size(x: int) -> Any:
    """Mostly ints; every 7th element 3 KiB of bytes, every 50th 20 KiB (large pickled)."""
    if x % 50 == 0:
        return x.to_bytes(4, "little") * 5120
    if x % 7 == 0:
        return x.to_bytes(4, "little") * 768
    return x


def test_rotation_sends_small_elements_several_to_a_message(
    strict_rotation: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages: list[list[int]] = []  # per element message: the pickled size of each element
    recv = ipc_pool.WorkerPool.recv

    def recording_recv(pool: Any, index: int, ready: bool = False, **kw: Any) -> tuple[Any, ...]:
        message = recv(pool, index, ready, **kw)
        if message[1] == protocol.PICKLED_ELEMENTS:
            messages.append([len(blob) for blob in message[2]])
        return message

    monkeypatch.setattr(ipc_pool.WorkerPool, "recv", recording_recv)
    ds = grain.MapDataset.range(3000).to_iter_dataset().map(_varied_size)
    assert list(ds.mp_prefetch(mp_options(2, buffer=2))) == list(ds)
    assert sum(map(len, messages)) == 3000
    assert len(messages) < 3000 / 4


def test_rotation_credits_go_back_in_batches_while_elements_overdraw(
    strict_rotation: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Buffer 1, small elements: the overdraft carries the worker between credits, which go
    # half of it at a time, not one control message per element handed out.
    credits: list[int] = []
    send = ipc_pool.WorkerPool.send

    def recording_send(pool: Any, index: int, message: tuple[Any, ...]) -> None:
        if message[0] == protocol.CREDIT:
            credits.append(message[1])
        send(pool, index, message)

    monkeypatch.setattr(ipc_pool.WorkerPool, "send", recording_send)
    ds = grain.MapDataset.range(3000).to_iter_dataset().map(_times_ten)
    assert list(ds.mp_prefetch(mp_options(2, buffer=1))) == [x * 10 for x in range(3000)]
    assert sum(credits) >= 3000 - 2 * (1 + transfer_cost.SMALL_AHEAD)
    assert len(credits) < 3000 / 8


def _filter_sevens(x: int) -> bool:
    return x % 7 != 3


def test_rotation_checkpoints_are_exact_within_a_message(strict_rotation: None) -> None:
    ds = grain.MapDataset.range(400).to_iter_dataset().map(_times_ten).filter(_filter_sevens)
    check_iterator_conformance(
        lambda: ds.mp_prefetch(mp_options(2, buffer=2)),
        positions=[0, 1, 2, 5, 33, 64, 65, 200, 341],
    )

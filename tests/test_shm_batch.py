"""Tests of grain_core.dataset.ops.shm_batch: batches stacked straight into shared memory, and
a pipeline's final batch switched to them."""

from __future__ import annotations

import numpy as np
import pytest

import grain_core as grain
from grain_core._ipc import shm as _shm
from grain_core.dataset.ops import shm_batch
from grain_core.dataset.ops.batch import make_batch
from grain_core.dataset.source import StackedBlock
from grain_core.testing import assert_trees_equal


def test_batches_stacked_into_shared_memory_equal_make_batch(
    no_shm_leak: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_shm, "_pool", _shm._BlockPool(4))  # as in a worker
    rng = np.random.default_rng(0)
    try:
        for values in (
            [rng.random((64, 4, 8)) for _ in range(5)],  # leaves end to end: one copy
            [np.array(float(i)) for i in range(9000)],  # 0-d leaves
        ):
            batch = shm_batch.make_batch_in_shared_memory(values)
            assert isinstance(batch, _shm.SharedMemoryArray)
            assert_trees_equal(batch, make_batch(values))
            del batch
        # Leaves that differ in dtype are promoted as make_batch does, not cast.
        mixed = [np.ones((128, 64), np.float32), np.full((128, 64), 0.1, np.float64)]
        assert_trees_equal(
            shm_batch.make_batch_in_shared_memory(mixed),
            make_batch(mixed),
        )
        # Rows that add up to the same length but differ in shape are an error, as in make_batch.
        with pytest.raises(ValueError, match="same structure but got: .*leaf shapes must match"):
            shm_batch.make_batch_in_shared_memory([np.ones((1, 8192)), np.ones((3, 8192))])
        # Arrays gathered a batch at a time are the batch already: no element is taken apart
        # and stacked again (the transport moves the large leaves).
        gathered = {"image": rng.random((128, 28, 28)), "label": np.arange(128)}
        block = StackedBlock(gathered, 128)
        assert shm_batch.make_batch_in_shared_memory(block) is gathered
    finally:
        _shm.unlink_pool()


def test_a_final_batch_is_switched_to_shared_memory_and_others_are_left() -> None:
    iter_batch = grain.MapDataset.range(8).to_iter_dataset().batch(4)
    switched = shm_batch.with_shared_memory_output(iter_batch)
    assert switched is not iter_batch and switched.batch_fn is shm_batch.make_batch_in_shared_memory
    map_batch = grain.MapDataset.range(8).batch(4).to_iter_dataset()
    switched_map = shm_batch.with_shared_memory_output(map_batch)
    assert switched_map.map_parent.batch_fn is shm_batch.make_batch_in_shared_memory
    custom = grain.MapDataset.range(8).to_iter_dataset().batch(4, batch_fn=list)
    assert shm_batch.with_shared_memory_output(custom) is custom  # cannot: left as it is
    unbatched = grain.MapDataset.range(8).to_iter_dataset()
    assert shm_batch.with_shared_memory_output(unbatched) is unbatched

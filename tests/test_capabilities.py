"""grain_core.capabilities: each optional capability is a named Protocol that an object meets
by defining the method or attribute, and grain_core uses it where it is met."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import grain_core as grain
from grain_core import capabilities


class _Plain:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, key: int) -> int:
        return key


class _Getitems(_Plain):
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __getitems__(self, keys: list[int]) -> list[int]:
        self.calls.append(list(keys))
        return [k * 10 for k in keys]


class _GrainGetitems(_Plain):
    def _getitems(self, keys: list[int]) -> list[int]:
        return [k * 100 for k in keys]


class _Flags:
    batched = True
    max_fan_out = 3
    uses_record_rng = False
    creates_holes = True
    display_name = "flags"
    maps_batches = True
    reads_columns = True
    checkpoints_shard_states = True
    state_same_on_every_process = True
    state_is_bytes = True
    stacks_column_blocks = True

    def __call__(self, values: Any) -> Any:
        return values

    def output_spec(self, *args: Any) -> Any:
        return args

    def save_shard_checkpoint(self, directory: Any) -> None:
        return None

    def restore_shard_checkpoint(self, directory: Any) -> None:
        return None


@pytest.mark.parametrize(
    "protocol",
    [
        capabilities.BatchedTransform,
        capabilities.FanOutBounded,
        capabilities.RecordRngDeclaring,
        capabilities.HoleMaking,
        capabilities.BatchMapping,
        capabilities.ColumnBlockReading,
        capabilities.ShardStateCheckpointing,
        capabilities.SameStateEverywhere,
        capabilities.BytesState,
        capabilities.ColumnBlockStacking,
        capabilities.TransformOutputSpec,
        capabilities.BatchFunctionOutputSpec,
    ],
)
def test_an_object_meets_a_capability_by_having_it(protocol: type) -> None:
    assert isinstance(_Flags(), protocol)
    assert not isinstance(_Plain(), protocol)


def test_sources_are_read_with_their_batched_read_chosen_when_built() -> None:
    assert isinstance(_Getitems(), capabilities.BatchedReadSource)
    assert isinstance(_GrainGetitems(), capabilities.GrainBatchedReadSource)
    source = _Getitems()
    ds = grain.MapDataset.source(source)
    assert ds._getitems([1, 2]) == [10, 20] and source.calls == [[1, 2]]
    assert grain.MapDataset.source(_GrainGetitems())._getitems([1]) == [100]
    assert grain.MapDataset.source(_Plain())._getitems([3]) == [3]
    # Found when the dataset was built: a capability added to the object later is not used.
    plain = _Plain()
    late = grain.MapDataset.source(plain)
    plain.__getitems__ = lambda keys: pytest.fail("looked up per read")  # type: ignore[attr-defined]
    assert late._getitems([0, 1]) == [0, 1]


def test_the_built_in_batch_functions_stack_column_blocks() -> None:
    from grain_core.dataset.ops.batch import make_batch
    from grain_core.dataset.ops.shm_batch import make_batch_in_shared_memory

    for batch_fn in (make_batch, make_batch_in_shared_memory):
        assert isinstance(batch_fn, capabilities.ColumnBlockStacking)
        assert batch_fn.stacks_column_blocks
    assert make_batch([np.ones(2), np.zeros(2)]).shape == (2, 2)


def test_the_element_spec_reads_what_nodes_expose_as_capabilities() -> None:
    ds = grain.MapDataset.range(4)
    for mapped in (ds.map(str), ds.to_iter_dataset().map(str)):
        assert isinstance(mapped, capabilities.TransformApplying) and mapped.transform is str
    batches = (ds.batch(2, drop_remainder=True), ds.to_iter_dataset().batch(2, drop_remainder=True))
    for batch in batches:
        assert isinstance(batch, capabilities.FunctionBatching)
        assert (batch.batch_size, batch.drop_remainder, batch.custom_batch_fn) == (2, True, None)
    assert ds.batch(2, batch_fn=list).custom_batch_fn is list
    rebatched = grain.experimental.RebatchIterDataset(batches[1], 3)
    assert isinstance(rebatched, capabilities.Batching)
    assert not isinstance(rebatched, capabilities.FunctionBatching)
    assert not isinstance(_Plain(), capabilities.Batching)
    assert not isinstance(_Plain(), capabilities.TransformApplying)

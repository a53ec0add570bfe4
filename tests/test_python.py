"""The legacy alias package ``grain_core.python`` (``import grain.python as grain``)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import cloudpickle
import numpy as np
import pytest

import grain_core
import grain_core.python as grain
from grain_core import checkpoint, constants, data_loader, samplers, sharding, sources, transforms
from grain_core.dataset.ops.batch import make_batch
from grain_core.testing import assert_trees_equal

cloudpickle.register_pickle_by_value(sys.modules[__name__])

EAGER_NAMES = [
    "Batch",
    "BatchOperation",
    "DATASET_INDEX",
    "DataLoader",
    "DatasetIterator",
    "DatasetSelectionMap",
    "EPOCH",
    "FilterOperation",
    "FilterTransform",
    "INDEX",
    "InMemoryDataSource",
    "IndexSampler",
    "IterDataset",
    "META_FEATURES",
    "MapDataset",
    "MapOperation",
    "MapTransform",
    "MapWithIndexTransform",
    "MultiprocessingOptions",
    "NoSharding",
    "Operation",
    "PyGrainCheckpointHandler",
    "PyGrainDatasetIterator",
    "RECORD",
    "RECORD_KEY",
    "RandomAccessDataSource",
    "RandomMapOperation",
    "RandomMapTransform",
    "RangeDataSource",
    "ReadOptions",
    "Record",
    "RecordMetadata",
    "SEED",
    "Sampler",
    "SequentialSampler",
    "ShardByJaxProcess",
    "ShardOptions",
    "SharedMemoryArray",
    "Transformation",
    "Transformations",
    "config",
    "experimental",
    "load",
]


def test_every_legacy_name_resolves_and_all_is_exact() -> None:
    for name in EAGER_NAMES:
        assert getattr(grain, name) is not None, name
    assert sorted(grain.__all__) == sorted(EAGER_NAMES)
    assert {"ArrayRecordDataSource", "PyGrainCheckpointSave"} <= set(dir(grain))
    with pytest.raises(AttributeError, match="NoSuchName"):
        grain.NoSuchName  # noqa: B018


def test_array_record_source_resolves_through_the_plugin() -> None:
    plugin = pytest.importorskip("grain_arrayrecord")
    assert grain.ArrayRecordDataSource is plugin.ArrayRecordDataSource
    assert grain.ArrayRecordDataSource is sources.ArrayRecordDataSource


def test_orbax_checkpoint_args_are_lazy_aliases() -> None:
    pytest.importorskip("orbax.checkpoint")
    assert grain.PyGrainCheckpointSave is checkpoint.CheckpointSave
    assert grain.PyGrainCheckpointRestore is checkpoint.CheckpointRestore


@pytest.mark.parametrize(
    ("legacy", "modern"),
    [
        ("PyGrainDatasetIterator", data_loader.DataLoaderIterator),
        ("InMemoryDataSource", sources.SharedMemoryDataSource),
        ("PyGrainCheckpointHandler", checkpoint.CheckpointHandler),
        ("MapTransform", transforms.Map),
        ("RandomMapTransform", transforms.RandomMap),
        ("FilterTransform", transforms.Filter),
        ("MapWithIndexTransform", transforms.MapWithIndex),
        ("Batch", transforms.Batch),
        ("DataLoader", grain_core.DataLoader),
        ("load", grain_core.load),
        ("config", grain_core.config),
        ("experimental", grain_core.experimental),
        ("IndexSampler", samplers.IndexSampler),
        ("SequentialSampler", samplers.SequentialSampler),
        ("NoSharding", sharding.NoSharding),
        ("ShardByJaxProcess", sharding.ShardByJaxProcess),
        ("RangeDataSource", sources.RangeDataSource),
        ("SharedMemoryArray", grain_core.multiprocessing.SharedMemoryArray),
        ("Record", grain_core.Record),
        ("MapDataset", grain_core.MapDataset),
        ("META_FEATURES", constants.META_FEATURES),
        ("Transformations", transforms.Transformations),
    ],
    ids=str,
)
def test_aliases_are_the_modern_objects(legacy: str, modern: Any) -> None:
    assert getattr(grain, legacy) is modern


def test_experimental_submodule_is_the_modern_module() -> None:
    import grain_core.python.experimental as legacy_experimental
    from grain_core.python.experimental import FlatMapTransform

    assert legacy_experimental is grain_core.experimental
    assert FlatMapTransform is transforms.FlatMap


def test_importing_grain_core_does_not_import_the_alias_package() -> None:
    code = "import sys, grain_core; assert 'grain_core.python' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------ legacy program
class Square(grain.MapTransform):
    def map(self, x: Any) -> Any:
        return x * x


class ModernPlusOne(transforms.Map):
    def map(self, x: Any) -> Any:
        return x + 1


class ModernNotDivisibleByThree(transforms.Filter):
    def filter(self, x: Any) -> bool:
        return x % 3 != 0


class ModernNoise(transforms.RandomMap):
    def random_map(self, x: Any, rng: np.random.Generator) -> Any:
        return {"x": x, "noise": rng.integers(1000)}


NUM_RECORDS = 20
BATCH = 4


def _legacy_operations() -> list[Any]:
    return [
        Square(),
        grain.MapOperation(lambda x: x + 1),
        grain.FilterOperation(lambda x: x % 3 != 0),
        grain.RandomMapOperation(lambda x, rng: {"x": x, "noise": rng.integers(1000)}),
        grain.BatchOperation(BATCH),
    ]


def _modern_operations() -> list[Any]:
    return [
        Square(),
        ModernPlusOne(),
        ModernNotDivisibleByThree(),
        ModernNoise(),
        transforms.Batch(BATCH),
    ]


def _loader(operations: list[Any], workers: int) -> Any:
    sampler = grain.IndexSampler(
        num_records=NUM_RECORDS,
        shard_options=grain.NoSharding(),
        shuffle=False,
        num_epochs=1,
        seed=7,
    )
    return grain.DataLoader(
        data_source=grain.RangeDataSource(0, NUM_RECORDS, 1),
        sampler=sampler,
        operations=operations,
        worker_count=workers,
    )


def _expected_x_batches(workers: int) -> list[list[int]]:
    """Records are strided across workers, filtered and batched there, and the batches are
    interleaved round-robin, as Grain's DataLoader does."""
    per_worker = []
    for w in range(max(workers, 1)):
        kept = [x * x + 1 for x in range(w, NUM_RECORDS, max(workers, 1)) if (x * x + 1) % 3]
        per_worker.append([kept[i : i + BATCH] for i in range(0, len(kept), BATCH)])
    out = []
    for position in range(max(len(b) for b in per_worker)):
        out.extend(b[position] for b in per_worker if position < len(b))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_legacy_program_output_matches_modern_transforms(workers: int) -> None:
    with iter(_loader(_legacy_operations(), workers)) as it:
        legacy = list(it)
    with iter(_loader(_modern_operations(), workers)) as it:
        modern = list(it)
    assert [b["x"].tolist() for b in legacy] == _expected_x_batches(workers)
    assert_trees_equal(legacy, modern)
    noise = np.concatenate([b["noise"] for b in legacy])
    assert noise.min() >= 0 and noise.max() < 1000 and len(set(noise.tolist())) > 1


@pytest.mark.parametrize(("workers", "positions"), [(0, [0, 1, 2, 3]), (2, [3])])
def test_legacy_program_checkpoints_and_restores(workers: int, positions: list[int]) -> None:
    loader = _loader(_legacy_operations(), workers)
    with iter(loader) as it:
        everything = list(it)
    for k in positions:
        with iter(loader) as it:
            assert isinstance(it, grain.PyGrainDatasetIterator)
            for _ in range(k):
                next(it)
            state = it.get_state()
        assert json.loads(state)["version"] == 2
        with iter(loader) as restored:
            restored.set_state(state)
            assert_trees_equal(list(restored), everything[k:])


# ------------------------------------------------------------- operations on their own
def _records(values: list[Any], *, seed: int | None = None) -> list[Any]:
    return [
        grain.Record(
            grain.RecordMetadata(
                index=i,
                record_key=i,
                rng=None if seed is None else np.random.Generator(np.random.Philox(seed + i)),
            ),
            v,
        )
        for i, v in enumerate(values)
    ]


def test_map_and_filter_operations_keep_metadata_but_the_record_key() -> None:
    records = _records([1, 2, 3, 4], seed=3)
    mapped = list(grain.MapOperation(lambda x: 10 * x)(iter(records)))
    assert [r.data for r in mapped] == [10, 20, 30, 40]
    assert [r.metadata for r in mapped] == [r.metadata.remove_record_key() for r in records]
    assert all(m.metadata.rng is r.metadata.rng for m, r in zip(mapped, records, strict=True))
    kept = list(grain.FilterOperation(lambda x: x % 2 == 0)(iter(records)))
    assert [(r.metadata.index, r.metadata.record_key, r.data) for r in kept] == [
        (1, None, 2),
        (3, None, 4),
    ]
    randomized = list(grain.RandomMapOperation(lambda x, rng: x)(iter(records)))
    assert [r.metadata.record_key for r in randomized] == [None] * 4


@pytest.mark.parametrize(
    ("first", "second"), [([1, 2], [3, 4, 5]), ({"a": 1}, {"b": 2}), ((1, 2), [1, 2])]
)
def test_batch_operation_names_records_of_another_structure(first: Any, second: Any) -> None:
    records = _records([first, second, first])
    with pytest.raises(
        TypeError, match=r"Record structures do not match\. Record at position 0"
    ) as e:
        list(grain.BatchOperation(3)(iter(records)))
    assert str(e.value).endswith(f"positions [1] have structures [{second!r}].")


def test_random_map_operation_uses_the_record_generator() -> None:
    op = grain.RandomMapOperation(lambda x, rng: x + rng.integers(100))
    out = list(op(iter(_records([0, 0, 0], seed=5))))
    expected = [int(r.metadata.rng.integers(100)) for r in _records([0, 0, 0], seed=5)]
    assert [int(r.data) for r in out] == expected


def test_random_map_operation_without_a_generator_says_to_seed_the_sampler() -> None:
    op = grain.RandomMapOperation(lambda x, rng: x)
    with pytest.raises(ValueError, match="record 0 has none.*seed"):
        list(op(iter(_records([1]))))
    unseeded = grain.IndexSampler(num_records=4, shard_options=grain.NoSharding(), num_epochs=1)
    with pytest.raises(ValueError, match="has no seed"):
        grain.DataLoader(data_source=[1, 2, 3, 4], sampler=unseeded, operations=[op])


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_batch_operation_equals_the_batch_transform(drop_remainder: bool) -> None:
    values = [{"a": np.full((2,), i), "b": i} for i in range(7)]
    records = _records(values)
    batches = list(grain.BatchOperation(3, drop_remainder=drop_remainder)(iter(records)))
    assert len(batches) == (2 if drop_remainder else 3)
    for n, batch in enumerate(batches):
        assert_trees_equal(batch.data, make_batch(values[3 * n : 3 * n + 3]))
        last = min(3 * n + 2, 6)
        assert batch.metadata == grain.RecordMetadata(index=last, record_key=None)

    def load(operation: Any) -> list[Any]:
        sampler = grain.SequentialSampler(num_records=7, shard_options=grain.NoSharding())
        loader = grain.DataLoader(data_source=values, sampler=sampler, operations=[operation])
        return list(loader)

    legacy = load(grain.BatchOperation(3, drop_remainder=drop_remainder))
    assert_trees_equal(legacy, load(grain.Batch(3, drop_remainder=drop_remainder)))
    assert_trees_equal(legacy, [b.data for b in batches])


@pytest.mark.parametrize("batch_size", [0, -2])
def test_batch_operation_rejects_non_positive_sizes(batch_size: int) -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        grain.BatchOperation(batch_size)


@pytest.mark.parametrize(
    "make", [grain.MapOperation, grain.RandomMapOperation, grain.FilterOperation]
)
def test_function_operations_reject_non_callables(make: Any) -> None:
    with pytest.raises(TypeError, match="must be callable"):
        make(3)


def test_operations_follow_the_protocol_and_survive_cloudpickle() -> None:
    ops = _legacy_operations()[1:]
    for op in [*ops, grain.experimental.PackAndBatchOperation(np.int64(4), batch_size=2)]:
        assert isinstance(op, grain.Operation)
    for op in ops:
        copy = cloudpickle.loads(cloudpickle.dumps(op))
        assert_trees_equal(
            [r.data for r in copy(iter(_records(list(range(8)), seed=1)))],
            [r.data for r in op(iter(_records(list(range(8)), seed=1)))],
        )

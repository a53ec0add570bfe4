"""DataLoader and DataLoaderIterator with real worker processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import grain_core as grain
from grain_core import transforms
from grain_core.data_loader import checkpoint_names, fingerprint
from grain_core.samplers import IndexSampler, SequentialSampler
from grain_core.sharding import NoSharding, ShardOptions
from grain_core.sources import RangeDataSource, SharedMemoryDataSource
from grain_core.testing import assert_trees_equal

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class PlusOne(transforms.Map):
    def map(self, x: Any) -> Any:
        return {"x": np.full((4,), x, np.int64) + 1}


class AddNoise(transforms.RandomMap):
    def random_map(self, x: Any, rng: np.random.Generator) -> Any:
        return {"x": x["x"], "noise": rng.integers(1000)}


class WithIndex(transforms.MapWithIndex):
    def map_with_index(self, index: int, x: Any) -> Any:
        return {**x, "index": index}


class NotThree(transforms.Filter):
    def filter(self, x: Any) -> bool:
        return int(x["x"][0]) % 3 != 0


class Twice(transforms.FlatMap):
    max_fan_out = 2

    def flat_map(self, x: Any) -> list[Any]:
        return [x, x]


SOURCE = list(range(30))


def _loader(workers: int, ops: list[Any], *, epochs: int = 1, **kw: Any) -> grain.DataLoader:
    sampler = IndexSampler(len(SOURCE), num_epochs=epochs, shuffle=True, seed=4)
    return grain.DataLoader(
        data_source=SOURCE, sampler=sampler, operations=ops, worker_count=workers, **kw
    )


ONE_TO_ONE = [PlusOne(), AddNoise(), WithIndex(), transforms.Batch(4)]


def _assert_streams_equal(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert_trees_equal(x, y)


def test_fresh_state_golden_and_str() -> None:
    loader = grain.DataLoader(
        data_source=RangeDataSource(0, 8, 1), sampler=SequentialSampler(8), worker_count=3
    )
    it = iter(loader)
    assert json.loads(it.get_state()) == {
        "version": 2,
        "last_seen_indices": {"0": -3, "1": -2, "2": -1},
        "last_worker_index": -1,
        "worker_count": 3,
        "sampler": "SequentialSampler(num_records=8, shard_options=NoSharding(shard_index=0, "
        "shard_count=1, drop_remainder=False))",
        "data_source": "RangeDataSource(start=0, stop=8, step=1)",
    }
    assert str(it) == f"PyGrainDatasetIterator(state={it.get_state().decode()})"
    assert list(it) == list(range(8))
    it.close()


def test_worker_stall_thresholds_reach_the_workers_options() -> None:
    loader = _loader(2, [], worker_stall_warning_s=None, worker_stall_timeout_s=7.5)
    options = loader.multiprocessing_options
    assert (options.num_workers, options.stall_warning_s, options.stall_timeout_s) == (
        2,
        None,
        7.5,
    )
    assert _loader(2, []).multiprocessing_options.stall_warning_s == 30.0
    with pytest.raises(ValueError, match="stall_timeout_s"):
        _loader(2, [], worker_stall_timeout_s=0)


def test_output_is_the_same_for_any_worker_count() -> None:
    expected = list(_loader(0, ONE_TO_ONE, epochs=2))
    assert len(expected) == 15
    for workers in (1, 2, 3):
        with iter(_loader(workers, ONE_TO_ONE, epochs=2)) as it:
            _assert_streams_equal(list(it), expected)


@pytest.mark.parametrize(
    ("saved_with", "restored_with", "position"),
    [(2, 0, 5), (0, 3, 4), (3, 1, 7), (1, 2, 0), (2, 2, 8)],
)
def test_checkpoint_restores_with_another_worker_count(
    saved_with: int, restored_with: int, position: int
) -> None:
    expected = list(_loader(0, ONE_TO_ONE))
    with iter(_loader(saved_with, ONE_TO_ONE)) as it:
        for _ in range(position):
            next(it)
        state = it.get_state()
    with iter(_loader(restored_with, ONE_TO_ONE)) as restored:
        restored.set_state(state)
        _assert_streams_equal(list(restored), expected[position:])


@pytest.mark.parametrize("workers", [0, 2])
def test_filter_pipeline_restores_with_the_same_worker_count(workers: int) -> None:
    ops = [PlusOne(), NotThree(), transforms.Batch(3)]
    expected = list(_loader(workers, ops))
    assert len(expected) == 7
    for position in (0, 3, len(expected)):
        with iter(_loader(workers, ops)) as it:
            for _ in range(position):
                next(it)
            state = it.get_state()
            it.set_state(state)  # repeated get/set does not drift
            assert it.get_state() == state
        with iter(_loader(workers, ops)) as restored:
            restored.set_state(state)
            _assert_streams_equal(list(restored), expected[position:])
    other = iter(_loader(workers + 1, ops))
    with pytest.raises(ValueError, match="worker_count"):
        other.set_state(state)
    other.close()


def test_flat_map_pipeline_checkpoints() -> None:
    ops = [PlusOne(), Twice(), transforms.Batch(4)]
    expected = list(_loader(2, ops))
    assert sum(len(b["x"]) for b in expected) == 60
    with iter(_loader(2, ops)) as it:
        next(it)
        next(it)
        state = it.get_state()
    with iter(_loader(2, ops)) as restored:
        restored.set_state(state)
        _assert_streams_equal(list(restored), expected[2:])


def test_state_is_small_for_a_large_list_source() -> None:
    source = list(range(10_000))
    loader = grain.DataLoader(
        data_source=source, sampler=SequentialSampler(len(source)), worker_count=0
    )
    it = iter(loader)
    for _ in range(10_000):
        next(it)
    assert len(it.get_state()) < 1000
    assert json.loads(it.get_state())["data_source"] == "list(len=10000)"


def test_shared_memory_source_fingerprint_is_stable() -> None:
    a = SharedMemoryDataSource(list(range(20)))
    b = SharedMemoryDataSource(list(range(20)))
    try:
        make = lambda src: grain.DataLoader(  # noqa: E731
            data_source=src, sampler=SequentialSampler(20), worker_count=0
        )
        it = iter(make(a))
        next(it)
        state = it.get_state()
        assert b"0, 1, 2" not in state and a.shm.name.encode() not in state
        restored = iter(make(b))
        restored.set_state(state)
        assert next(restored) == 1
    finally:
        for src in (a, b):
            src.close()
            src.unlink()


def test_restore_validates_source_and_sampler() -> None:
    it = iter(_loader(0, ONE_TO_ONE))
    next(it)
    state = it.get_state()
    other_source = grain.DataLoader(
        data_source=list(range(31)),
        sampler=IndexSampler(30, num_epochs=1, shuffle=True, seed=4),
        operations=ONE_TO_ONE,
    )
    with pytest.raises(ValueError, match="data_source"):
        iter(other_source).set_state(state)
    other_sampler = grain.DataLoader(
        data_source=SOURCE,
        sampler=IndexSampler(30, num_epochs=1, shuffle=True, seed=5),
        operations=ONE_TO_ONE,
    )
    with pytest.raises(ValueError, match="sampler"):
        iter(other_sampler).set_state(state)
    with pytest.raises(ValueError, match="not valid JSON"):
        it.set_state(b'{"version": 2, "last_')
    with pytest.raises(ValueError, match="version"):
        it.set_state(b'{"version": 1}')
    fields = json.loads(state)
    for broken in ({"last_seen_indices": {"0": "x"}}, {"last_seen_indices": None}):
        with pytest.raises(ValueError, match="DataLoader state is malformed"):
            it.set_state(json.dumps({**fields, **broken}).encode())
    del fields["last_seen_indices"]
    with pytest.raises(ValueError, match="malformed \\(KeyError"):
        it.set_state(json.dumps(fields).encode())


class _UserSource:
    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> int:
        return i


def test_default_repr_sources_get_a_stable_fingerprint() -> None:
    assert fingerprint(_UserSource()) == f"{__name__}._UserSource(len=5)"
    assert "repr_sha1" in fingerprint(_LongRepr())


class _LongRepr:
    def __len__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "X" * 1000


def test_random_map_without_seed_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="has no seed"):
        grain.DataLoader(
            data_source=SOURCE, sampler=IndexSampler(30, num_epochs=1), operations=[AddNoise()]
        )


def test_invalid_arguments() -> None:
    sampler = IndexSampler(30, num_epochs=1)
    with pytest.raises(ValueError, match="worker_count"):
        grain.DataLoader(data_source=SOURCE, sampler=sampler, worker_count=-1)
    with pytest.raises(ValueError, match="worker_buffer_size"):
        grain.DataLoader(data_source=SOURCE, sampler=sampler, worker_buffer_size=-1)

    class NoShards:
        def __getitem__(self, i: int) -> Any:
            return grain.RecordMetadata(i, i)

    with pytest.raises(ValueError, match="No shard options"):
        grain.DataLoader(data_source=SOURCE, sampler=NoShards())
    with pytest.raises(TypeError, match="Unsupported DataLoader operation"):
        grain.DataLoader(data_source=SOURCE, sampler=sampler, operations=["batch"])
    for not_an_operation, match in (
        (lambda records: 3, "returned int, not an iterator"),
        (len, "has no len"),
    ):
        loader = grain.DataLoader(
            data_source=SOURCE, sampler=sampler, operations=[not_an_operation]
        )
        with pytest.raises(TypeError, match=match) as raised:
            next(iter(loader))
        assert "use transforms.Map for a function of one element" in str(raised.value) + "".join(
            getattr(raised.value, "__notes__", [])
        )


def tag_pairs(records: Any) -> Any:
    """A legacy operation: an iterator of Records to an iterator of Records (2 -> 1)."""
    for first in records:
        second = next(records, None)
        pair = np.int64(-1 if second is None else second.data["x"][0])
        data = {"x": first.data["x"], "pair": pair}
        yield grain.Record(first.metadata, data)


def test_legacy_operation_runs_with_any_worker_count_and_checkpoints() -> None:
    ops = [PlusOne(), tag_pairs, transforms.Batch(3)]
    expected = list(_loader(0, ops))
    assert len(expected) == 5
    assert [int(p) for b in expected for p in b["pair"]] == [
        int(x[0]) for b in list(_loader(0, [PlusOne(), transforms.Batch(2)])) for x in b["x"][1:]
    ]
    # Each worker runs the operation over its own records (15 each: 8 outputs).
    for workers, outputs in ((0, 15), (2, 16)):
        with iter(_loader(workers, ops)) as it:
            assert sum(len(b["pair"]) for b in it) == outputs
    # The legacy operation has no state of its own; it consumes exactly two records per
    # output, so a checkpoint between batches is exact.
    for position in (0, 2, 5):
        with iter(_loader(0, ops)) as it:
            for _ in range(position):
                next(it)
            state = it.get_state()
        with iter(_loader(0, ops)) as restored:
            restored.set_state(state)
            _assert_streams_equal(list(restored), expected[position:])


def test_pack_and_batch_operation_in_a_dataloader() -> None:
    source = [np.arange(n, dtype=np.int32) + 1 for n in (3, 2, 4, 1, 5, 2, 3)]
    loader = grain.DataLoader(
        data_source=source,
        sampler=SequentialSampler(len(source)),
        operations=[grain.experimental.PackAndBatchOperation(np.int64(6), batch_size=2)],
        worker_count=2,
    )
    with iter(loader) as it:
        batches = list(it)
    tokens = sum(int((values > 0).sum()) for values, _, _ in batches)
    assert tokens == sum(len(s) for s in source)  # every token packed, none dropped
    for values, segments, positions in batches:
        assert values.shape == segments.shape == positions.shape == (2, 6)


def test_sharded_loaders_and_sampler_without_len() -> None:
    class Unsized:
        _shard_options = NoSharding()

        def __getitem__(self, i: int) -> Any:
            if i >= 10:
                raise IndexError(i)
            return grain.RecordMetadata(i, 9 - i)

    assert list(grain.DataLoader(data_source=SOURCE, sampler=Unsized())) == list(range(9, -1, -1))

    class Endless:  # no __len__, never an IndexError: infinite, as an unbounded IndexSampler
        _shard_options = NoSharding()

        def __getitem__(self, i: int) -> Any:
            return grain.RecordMetadata(i, i % 3)

    with iter(grain.DataLoader(data_source=SOURCE, sampler=Endless())) as it:
        assert [next(it) for _ in range(5)] == [0, 1, 2, 0, 1]
    sampler = SequentialSampler(10, ShardOptions(1, 3, drop_remainder=False))
    assert list(grain.DataLoader(data_source=SOURCE, sampler=sampler)) == [1, 4, 7]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_without_records_yields_nothing(workers: int) -> None:
    # One record over two shards: shard 1 is empty, with or without worker processes.
    sampler = IndexSampler(1, ShardOptions(1, 2), shuffle=True, num_epochs=1, seed=0)
    loader = grain.DataLoader(
        data_source=SOURCE,
        sampler=sampler,
        operations=[transforms.Batch(2)],
        shard_options=ShardOptions(1, 2),
        worker_count=workers,
    )
    it = iter(loader)
    assert list(it) == []
    restored = iter(loader)
    restored.set_state(it.get_state())
    assert list(restored) == []


def test_load() -> None:
    loader = grain.load(
        SOURCE,
        num_epochs=1,
        shuffle=True,
        seed=1,
        batch_size=8,
        transformations=[PlusOne()],
        drop_remainder=True,
        worker_count=2,
    )
    batches = list(loader)
    assert [b["x"].shape for b in batches] == [(8, 4)] * 3
    with iter(loader) as it:
        it.start_prefetch()
        assert_trees_equal(next(it), batches[0])


def test_orbax_v1_save_and_load_of_a_dataloader_iterator(tmp_path):
    import asyncio

    async def run(coroutine_factory):
        await (await coroutine_factory)

    loader = grain.DataLoader(
        data_source=RangeDataSource(0, 20, 1),
        sampler=SequentialSampler(20, NoSharding()),
        worker_count=0,
    )
    it = iter(loader)
    for _ in range(7):
        next(it)
    asyncio.run(run(it.save(tmp_path)))
    assert (tmp_path / "process_0-of-1.json").read_text() == it.get_state().decode()
    fresh = iter(loader)
    asyncio.run(run(fresh.load(tmp_path)))
    assert list(fresh) == list(range(7, 20))


# Checkpoints written by Google Grain's DataLoader (tests/data/make_grain_states.py ran it), and
# the stream Grain produced after each.
GRAIN_STATES = json.loads((Path(__file__).parent / "data" / "grain_states.json").read_text())


class TimesTen(transforms.Map):
    def map(self, x: Any) -> Any:
        return x * 10


class NotThirds(transforms.Filter):
    def filter(self, x: Any) -> bool:
        return bool(x % 3 != 0)


class WithHundred(transforms.FlatMap):
    max_fan_out = 2

    def flat_map(self, x: Any) -> list[Any]:
        return [x, x + 100]


_GRAIN_OPERATIONS: dict[str, Any] = {
    "none": lambda: [],
    "batch4": lambda: [transforms.Batch(4)],
    "batch3_drop": lambda: [transforms.Batch(3, drop_remainder=True)],
    "map_batch4": lambda: [TimesTen(), transforms.Batch(4)],
    "filter_batch4": lambda: [NotThirds(), transforms.Batch(4)],
    "flat_map_batch3": lambda: [WithHundred(), transforms.Batch(3)],
}


def _grain_case_loader(case: dict[str, Any], workers: int | None = None) -> grain.DataLoader:
    source = list(range(40)) if case["source"] == "list" else RangeDataSource(0, 40, 1)
    return grain.DataLoader(
        data_source=source,
        sampler=IndexSampler(
            40,
            ShardOptions(*case["shard"]) if case["shard"] else NoSharding(),
            shuffle=True,
            num_epochs=1,
            seed=3,
        ),
        operations=_GRAIN_OPERATIONS[case["ops"]](),
        worker_count=case["workers"] if workers is None else workers,
    )


def _grain_case(**key: Any) -> dict[str, Any]:
    (case,) = (c for c in GRAIN_STATES["cases"] if key.items() <= c.items())
    return case  # type: ignore[no-any-return]


def _grain_state_bytes(case: dict[str, Any]) -> bytes:
    return json.dumps(case["state"], indent=4).encode()


@pytest.mark.parametrize(
    "first",
    [c for c in GRAIN_STATES["cases"] if c["steps"] == 1],
    ids=lambda c: f"{c['workers']}w-{c['ops']}-{c['source']}-shard{c['shard']}",
)
def test_checkpoints_written_by_grain_continue_as_grain_does(first: dict[str, Any]) -> None:
    # Where several Grain workers batch their own records the positions are no index-layout
    # state: the iterator goes on as Grain's would (and would skip or repeat records if it
    # read them as one). Its own checkpoints then hold the positions Grain's would (with a
    # FlatMap Grain writes the pipeline's state bare; grain_core validates its own).
    later = _grain_case(**{k: first[k] for k in ("workers", "ops", "source", "shard")}, steps=3)
    with iter(_grain_case_loader(first)) as it:
        it.set_state(_grain_state_bytes(first))
        got = [np.asarray(next(it)).tolist() for _ in range(2)]
        state = it.get_state()
        if first["ops"] != "flat_map_batch3":
            # The same positions as Grain's; the source under grain_core's own name for it.
            assert json.loads(state) == {
                **later["state"],
                "data_source": fingerprint(it._loader._data_source),
            }
        got += [np.asarray(x).tolist() for x in it]
    assert got == first["rest"]
    with iter(_grain_case_loader(first)) as it:
        it.set_state(state)
        assert [np.asarray(x).tolist() for x in it] == first["rest"][2:]
    with iter(_grain_case_loader(later)) as it:
        it.set_state(_grain_state_bytes(later))
        assert [np.asarray(x).tolist() for x in it] == later["rest"]


def test_a_grain_checkpoint_of_workers_batching_needs_their_worker_count() -> None:
    case = _grain_case(workers=2, ops="batch4", source="range", shard=None, steps=3)
    with iter(_grain_case_loader(case, workers=3)) as it:
        with pytest.raises(ValueError, match="Grain's workers batched their own records"):
            it.set_state(_grain_state_bytes(case))


def test_index_layout_checkpoints_after_a_grain_one() -> None:
    # Restoring one of its own states takes an iterator restored from Grain's back to the
    # index layout, where any worker count restores.
    grain_case = _grain_case(workers=2, ops="batch4", source="list", shard=None, steps=1)
    own = iter(_grain_case_loader(grain_case, workers=3))
    for _ in range(3):
        next(own)
    state = own.get_state()
    expected = [np.asarray(x).tolist() for x in own]
    with iter(_grain_case_loader(grain_case)) as it:
        it.set_state(_grain_state_bytes(grain_case))
        next(it)
        it.set_state(state)
        assert [np.asarray(x).tolist() for x in it] == expected


class _RenamedSource(_UserSource):
    def __repr__(self) -> str:
        return "_RenamedSource(v2)"

    def checkpoint_reprs(self) -> list[str]:
        return ["_RenamedSource(v1)"]


def test_sources_name_other_checkpoint_names() -> None:
    assert checkpoint_names(list(range(3))) == {"list(len=3)", "<class 'list'>"}
    assert checkpoint_names(_RenamedSource()) == {"_RenamedSource(v2)", "_RenamedSource(v1)"}
    loader = grain.DataLoader(data_source=_RenamedSource(), sampler=SequentialSampler(5))
    it = iter(loader)
    next(it)
    state = json.loads(it.get_state())
    for name, first in (("_RenamedSource(v1)", 1), ("_RenamedSource(v0)", None)):
        restored = iter(loader)
        text = json.dumps({**state, "data_source": name}).encode()
        if first is None:
            with pytest.raises(ValueError, match="_RenamedSource\\(v0\\)"):
                restored.set_state(text)
        else:
            restored.set_state(text)
            assert next(restored) == first


def _rng_draw(records: Any) -> Any:
    """A legacy operation that reads each record's rng."""
    for r in records:
        rng = r.metadata.rng
        yield grain.Record(r.metadata, (r.data, None if rng is None else int(rng.integers(1000))))


class _NoRngDraw:
    uses_record_rng = False  # as PackAndBatchOperation says: no generators are built

    def __call__(self, records: Any) -> Any:
        return _rng_draw(records)


def test_a_legacy_operation_gets_each_records_rng_from_a_seeded_sampler() -> None:
    # Golden values from Google Grain 0.2.18: rng = Philox(seed + index) per record.
    sampler = IndexSampler(5, shuffle=True, seed=7, num_epochs=1)
    loader = grain.DataLoader(data_source=list(range(5)), sampler=sampler, operations=[_rng_draw])
    assert list(loader) == [(4, 163), (0, 312), (3, 809), (1, 500), (2, 854)]
    loader = grain.DataLoader(
        data_source=list(range(5)), sampler=sampler, operations=[_NoRngDraw()]
    )
    assert list(loader) == [(4, None), (0, None), (3, None), (1, None), (2, None)]
    assert grain.experimental.PackAndBatchOperation.uses_record_rng is False


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("records, batch", [(9, 2), (7, 3)])
def test_the_state_after_a_partial_last_batch_names_its_last_record(
    workers: int, records: int, batch: int
) -> None:
    # As Google Grain writes it (golden: 9 records in batches of 2 end at record 8), and
    # restoring it, or the form earlier versions wrote (one past), yields nothing more.
    def loader() -> grain.DataLoader:
        sampler = IndexSampler(records, num_epochs=1)
        return grain.DataLoader(
            data_source=SOURCE[:records],
            sampler=sampler,
            operations=[transforms.Batch(batch)],
            worker_count=workers,
        )

    with iter(loader()) as it:
        assert list(it)[-1].tolist() == list(range(records - records % batch, records))
        end = json.loads(it.get_state())
    last_batch_worker = str((-(-records // batch) - 1) % max(workers, 1))
    assert end["last_seen_indices"][last_batch_worker] == records - 1
    earlier = json.loads(json.dumps(end))
    earlier["last_seen_indices"][last_batch_worker] = -(-records // batch) * batch - 1
    for state in (end, earlier):
        with iter(loader()) as restored:
            restored.set_state(json.dumps(state).encode())
            assert list(restored) == []


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("last_seen_indices", {"0": 2.7}, r"`last_seen_indices\[0\]` must be an integer"),
        ("last_seen_indices", {"0": "5"}, r"`last_seen_indices\[0\]` must be an integer"),
        ("last_worker_index", True, "`last_worker_index` must be an integer, got a bool"),
        ("worker_count", 0.0, "`worker_count` must be an integer"),
    ],
)
def test_state_positions_that_are_not_integers_are_refused(
    key: str, value: Any, message: str
) -> None:
    loader = grain.DataLoader(
        data_source=list(range(10)),
        sampler=IndexSampler(10, shard_options=NoSharding(), num_epochs=1),
    )
    it = iter(loader)
    next(it)
    state = json.loads(it.get_state())
    state[key] = value
    with pytest.raises(ValueError, match=f"DataLoader state is malformed.*{message}"):
        iter(loader).set_state(json.dumps(state).encode())


class WithPid(transforms.Map):
    def map(self, element: int) -> tuple[int, int]:
        return element, os.getpid()


def test_persistent_workers_serve_every_epoch_until_close() -> None:
    loader = grain.DataLoader(
        data_source=RangeDataSource(0, 24, 1),
        sampler=IndexSampler(24, NoSharding(), num_epochs=1, seed=1),
        operations=[WithPid()],
        worker_count=2,
        persistent_workers=True,
    )
    first, second = list(loader), list(loader)
    workers = {pid for _, pid in first}
    assert len(workers) == 2 and os.getpid() not in workers
    assert {pid for _, pid in second} == workers
    assert [x for x, _ in first] == [x for x, _ in second]
    loader.close()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)  # stopped and reaped

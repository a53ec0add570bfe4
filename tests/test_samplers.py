"""Samplers: goldens, sharding, epochs, rng and validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grain_core.samplers import IndexSampler, Sampler, SequentialSampler
from grain_core.sharding import NoSharding, ShardOptions


def _keys(sampler: object, indices: range) -> list[int]:
    return [sampler[i].record_key for i in indices]  # type: ignore[index]


def test_index_sampler_shuffle_golden() -> None:
    sampler = IndexSampler(5, shuffle=True, num_epochs=2, seed=32)
    assert len(sampler) == 10
    assert _keys(sampler, range(10)) == [2, 4, 3, 0, 1, 0, 2, 4, 1, 3]
    assert [m.record_key for m in sampler.metadata_block(range(10))] == _keys(sampler, range(10))


def test_every_shard_runs_the_same_number_of_epochs() -> None:
    # Grain gives shard 1 only [3, 4, 5, 3, 4] (global index budget).
    shards = [IndexSampler(8, ShardOptions(s, 3), num_epochs=2) for s in range(3)]
    assert _keys(shards[0], range(0, len(shards[0]), 3)) == [0, 1, 2, 0, 1, 2]
    assert _keys(shards[1], range(1, len(shards[1]), 3)) == [3, 4, 5, 3, 4, 5]
    assert _keys(shards[2], range(2, len(shards[2]), 3)) == [6, 7, 6, 7]
    dropped = [
        IndexSampler(8, ShardOptions(s, 3, drop_remainder=True), num_epochs=2) for s in range(3)
    ]
    assert [_keys(d, range(s, len(d), 3)) for s, d in enumerate(dropped)] == [
        [0, 1, 0, 1],
        [2, 3, 2, 3],
        [4, 5, 4, 5],
    ]


def test_shuffle_stays_within_the_shard_block() -> None:
    sampler = IndexSampler(10, ShardOptions(1, 2), shuffle=True, num_epochs=3, seed=5)
    epochs = [_keys(sampler, range(1 + 10 * e, 10 * (e + 1), 2)) for e in range(3)]
    assert all(sorted(e) == [5, 6, 7, 8, 9] for e in epochs)
    assert epochs[0] != epochs[1]


@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 3), st.booleans())
def test_shards_cover_every_record_each_epoch(n: int, count: int, epochs: int, drop: bool) -> None:
    keys = []
    for s in range(count):
        sampler = IndexSampler(n, ShardOptions(s, count, drop), num_epochs=epochs)
        keys.append(_keys(sampler, range(s, len(sampler), count)))
    sizes = {len(k) for k in keys}
    if drop:
        assert sizes == {(n // count) * epochs}
    expected = sorted(range(n if not drop else (n // count) * count))
    assert sorted(k for shard in keys for k in shard) == sorted(expected * epochs)


def test_rng_depends_on_global_index_only() -> None:
    a = IndexSampler(10, num_epochs=1, seed=3)
    b = IndexSampler(10, ShardOptions(1, 2), num_epochs=1, seed=3)
    assert a[5].rng.integers(1 << 30) == b[5].rng.integers(1 << 30)
    assert a[4].rng.integers(1 << 30) != a[5].rng.integers(1 << 30)
    expected = np.random.Generator(np.random.Philox(key=3 + 7)).random()
    assert a[7].rng.random() == expected
    assert IndexSampler(10)[0].rng is None


def test_infinite_epochs() -> None:
    sampler = IndexSampler(3)
    assert len(sampler) > 10**15
    assert _keys(sampler, range(7)) == [0, 1, 2, 0, 1, 2, 0]


def test_index_sampler_validation() -> None:
    with pytest.raises(ValueError, match="Invalid number of records"):
        IndexSampler(0)
    with pytest.raises(ValueError, match="num_epochs"):
        IndexSampler(3, num_epochs=0)
    with pytest.raises(ValueError, match="Shuffling requires specifying a seed"):
        IndexSampler(3, shuffle=True)
    with pytest.raises(TypeError, match="integer"):
        IndexSampler(3, shuffle=True, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive 32-bit"):
        IndexSampler(3, shuffle=True, seed=-1)
    with pytest.raises(ValueError, match="positive 32-bit"):
        IndexSampler(3, seed=2**32)
    with pytest.raises(IndexError):
        IndexSampler(3, num_epochs=1)[3]
    with pytest.raises(IndexError):
        IndexSampler(3, num_epochs=1).metadata_block([0, 3])


def test_sequential_sampler() -> None:
    sampler = SequentialSampler(10, ShardOptions(0, 3))
    assert len(sampler) == 10
    assert [sampler[i].record_key for i in range(0, 10, 3)] == [0, 3, 6, 9]
    dropped = SequentialSampler(10, ShardOptions(0, 3, drop_remainder=True))
    assert [dropped[i].record_key for i in range(0, len(dropped), 3)] == [0, 3, 6]
    assert [dropped[i].record_key for i in range(1, len(dropped), 3)] == [1, 4, 7]
    with pytest.raises(IndexError):
        sampler[10]
    with pytest.raises(ValueError, match="Invalid number of records"):
        SequentialSampler(-1)
    seeded = SequentialSampler(4, seed=9)
    assert seeded[2].rng.random() == np.random.Generator(np.random.Philox(key=11)).random()
    assert repr(SequentialSampler(8)) == (
        "SequentialSampler(num_records=8, shard_options=NoSharding(shard_index=0, "
        "shard_count=1, drop_remainder=False))"
    )
    assert isinstance(sampler, Sampler) and isinstance(IndexSampler(2), Sampler)
    assert repr(IndexSampler(5, NoSharding(), True, 2, 32)) == (
        "IndexSampler(num_records=5, shard_options=NoSharding(shard_index=0, shard_count=1, "
        "drop_remainder=False), shuffle=True, num_epochs=2, seed=32)"
    )


def test_metadata_block_builds_generators_only_when_asked():
    from grain_core.samplers import IndexSampler, SequentialSampler

    for sampler in (IndexSampler(10, shuffle=True, seed=3), SequentialSampler(10, seed=3)):
        with_rng = sampler.metadata_block([0, 4])
        without = sampler.metadata_block([0, 4], with_rng=False)
        assert [m.record_key for m in with_rng] == [m.record_key for m in without]
        assert all(m.rng is not None for m in with_rng)
        assert all(m.rng is None for m in without)


@given(st.integers(1, 50), st.integers(1, 4), st.booleans(), st.data())
def test_record_keys_match_the_metadata(n: int, count: int, shuffle: bool, data) -> None:
    shard = ShardOptions(data.draw(st.integers(0, count - 1)), count)
    for sampler in (
        IndexSampler(n, shard, shuffle=shuffle, num_epochs=2, seed=3),
        SequentialSampler(n, shard),
    ):
        length = len(sampler)
        # A shard can be empty (1 record over 2 shards): then no index is valid.
        indices = data.draw(st.lists(st.integers(0, length - 1), max_size=20)) if length else []
        keys = sampler.record_keys(indices)
        assert keys.dtype == np.int64
        assert keys.tolist() == [sampler[i].record_key for i in indices]
        with pytest.raises(IndexError, match=f"Index {length} out of range"):
            sampler.record_keys([*indices[:1], length])

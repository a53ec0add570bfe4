"""Tests of grain_core.dataset.elastic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from grain_core import IterDataset, MapDataset, MultiprocessingOptions, ReadOptions
from grain_core.checkpoint import CheckpointHandler
from grain_core.dataset.interleave import InterleaveDatasetIterator
from grain_core.experimental import ElasticIterator, InterleaveIterDataset, ZipIterDataset
from grain_core.sharding import ShardOptions
from grain_core.testing import check_iterator_conformance


def _shard(index: int, count: int) -> ShardOptions:
    return ShardOptions(shard_index=index, shard_count=count)


def _take(it: ElasticIterator, steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        out.extend(np.asarray(next(it)).ravel().tolist())
    return out


def _drain(it: ElasticIterator) -> list[int]:
    return [x for batch in it for x in np.asarray(batch).ravel().tolist()]


# ----------------------------------------------------------------------- MapDataset mode
def test_shards_cover_every_element_once() -> None:
    ds = MapDataset.range(24)
    its = [ElasticIterator(ds, 6, _shard(i, 3)) for i in range(3)]
    assert [next(it).tolist() for it in its] == [[0, 3], [1, 4], [2, 5]]
    rest = [x for it in its for x in _drain(it)]
    assert sorted([0, 3, 1, 4, 2, 5, *rest]) == list(range(24))


def test_state_is_global_and_identical_on_every_shard() -> None:
    ds = MapDataset.range(40)
    its = [ElasticIterator(ds, 8, _shard(i, 2)) for i in range(2)]
    for it in its:
        _take(it, 3)
    assert [it.get_state() for it in its] == [{"global_next_index": 24}] * 2


@pytest.mark.parametrize(("old", "new"), [(2, 4), (4, 2), (2, 1), (1, 3)])
def test_restore_under_a_different_shard_count(old: int, new: int) -> None:
    ds = MapDataset.range(48).map(lambda x: x * 10)
    gbs = 12
    before = []
    olds = [ElasticIterator(ds, gbs, _shard(i, old)) for i in range(old)]
    for it in olds:
        before += _take(it, 2)
    state = json.loads(json.dumps(olds[-1].get_state()))
    news = [ElasticIterator(ds, gbs, _shard(i, new)) for i in range(new)]
    after = []
    for it in news:
        it.set_state(state)
        after += _drain(it)
    assert sorted(before + after) == [x * 10 for x in range(48)]


def test_restore_with_worker_processes() -> None:
    ds = MapDataset.range(32)
    mp = MultiprocessingOptions(num_workers=2)
    first = ElasticIterator(ds, 8, _shard(0, 2), multiprocessing_options=mp)
    second = ElasticIterator(ds, 8, _shard(1, 2), multiprocessing_options=mp)
    before = _take(first, 1) + _take(second, 1)
    state = first.get_state()
    first.close()
    second.close()
    resized = [ElasticIterator(ds, 8, _shard(i, 4), multiprocessing_options=mp) for i in range(4)]
    after = []
    for it in resized:
        it.set_state(state)
        after += _drain(it)
        it.close()
    assert sorted(before + after) == list(range(32))


def test_conformance_map_mode() -> None:
    out = check_iterator_conformance(
        lambda: ElasticIterator(MapDataset.range(30), 4, _shard(1, 2)), positions=[0, 3, 7]
    )
    assert [b.tolist() for b in out[:2]] == [[1, 3], [5, 7]]
    assert len(out) == 7


def test_rejects_filter_and_bad_batch_sizes() -> None:
    with pytest.raises(ValueError, match="does not support `filter` transformation"):
        ElasticIterator(MapDataset.range(9).filter(lambda x: x).map(str), 2, _shard(0, 1))
    with pytest.raises(ValueError, match="positive multiple of the shard count"):
        ElasticIterator(MapDataset.range(9), 5, _shard(0, 2))


def test_close_really_closes_the_base_iterator() -> None:
    it = ElasticIterator(MapDataset.range(9), 2, _shard(0, 1), read_options=ReadOptions(2, 4))
    next(it)
    base = it.base_iterator
    it.close()
    it.close()
    assert base._closed
    with pytest.raises(ValueError, match="closed iterator"):
        next(it)


# ----------------------------------------------------------------------- IterDataset mode
FILES = [list(range(100 * k, 100 * k + 3 + k)) for k in range(6)]


def _files_ds(cycle_length: int = 2) -> InterleaveIterDataset:
    return InterleaveIterDataset([MapDataset.source(f) for f in FILES], cycle_length=cycle_length)


def test_iter_mode_slices_the_interleave() -> None:
    it = ElasticIterator(_files_ds(), 2, _shard(1, 2))
    out = _drain(it)
    assert sorted(out) == sorted(x for f in FILES[1::2] for x in f)


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (1, 2)])
def test_iter_mode_shard_states_move_between_topologies(old: int, new: int, tmp_path: Path) -> None:
    before = []
    handler = CheckpointHandler()
    for i in range(old):
        it = ElasticIterator(_files_ds(), old, _shard(i, old))
        before += _take(it, 3)
        handler.save(tmp_path, it)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"shard_state_{k}.json" for k in range(len(FILES)))
    after = []
    for i in range(new):
        it = ElasticIterator(_files_ds(3), new, _shard(i, new))
        handler.restore(tmp_path, it)
        after += _drain(it)
    assert sorted(before + after) == sorted(x for f in FILES for x in f)


def test_iter_mode_shard_state_keys_and_string_keys() -> None:
    it = ElasticIterator(_files_ds(), 2, _shard(1, 2))
    before = _take(it, 2)
    states = it.get_shard_states()
    assert sorted(states) == [1, 3, 5]
    restored = ElasticIterator(_files_ds(), 2, _shard(1, 2))
    restored.set_shard_states(json.loads(json.dumps(states)))
    assert sorted(before + _drain(restored)) == sorted(x for f in FILES[1::2] for x in f)


def test_iter_mode_get_state_passes_through() -> None:
    check_iterator_conformance(
        lambda: ElasticIterator(_files_ds(), 2, _shard(0, 2)), positions=[0, 2, 5]
    )


def test_iter_mode_restrictions() -> None:
    with pytest.raises(NotImplementedError, match="worker processes"):
        ElasticIterator(
            _files_ds(), 2, _shard(0, 1), multiprocessing_options=MultiprocessingOptions(2)
        )
    zipped: Any = ZipIterDataset([_files_ds(), _files_ds()])
    with pytest.raises(ValueError, match="does not support zip, mix or prefetch"):
        ElasticIterator(zipped, 2, _shard(0, 1))
    with pytest.raises(ValueError, match="does not support zip, mix or prefetch"):
        ElasticIterator(MapDataset.range(5).to_iter_dataset(), 2, _shard(0, 1))
    map_mode = ElasticIterator(MapDataset.range(5), 1, _shard(0, 1))
    with pytest.raises(ValueError, match="IterDataset mode only"):
        map_mode.get_shard_states()


# --------------------------------------------------------- IterDataset mode, split by threads
class _FileReader(IterDataset):
    """Reads its files one after another on the consumer thread, as the file readers do."""

    def __init__(self, files: list[list[int]]) -> None:
        super().__init__()
        self.files = files

    def with_slice(self, sl: slice) -> _FileReader:
        return _FileReader(self.files[sl])

    def __iter__(self) -> Any:
        inputs = [MapDataset.source(f).to_iter_dataset(SYNC) for f in self.files]
        return iter(InterleaveIterDataset(inputs, cycle_length=2, iter_buffer_size=0))

    def __repr__(self) -> str:
        return f"_FileReader({len(self.files)} files)"


SYNC = ReadOptions(num_threads=0)


def _reader_it(index: int, count: int, threads: int, gbs: int = 2) -> ElasticIterator:
    return ElasticIterator(
        _FileReader(FILES).map(lambda x: x * 10),
        gbs,
        _shard(index, count),
        read_options=ReadOptions(num_threads=threads, prefetch_buffer_size=max(threads, 1)),
    )


def test_file_reader_shard_is_split_by_threads() -> None:
    it = _reader_it(1, 2, threads=2)
    merge = it.base_iterator._parents[0]
    assert isinstance(merge, InterleaveDatasetIterator)
    first = next(it).tolist()
    assert [type(s).__name__ for s in merge._iters] == ["ThreadPrefetchDatasetIterator"] * 2
    out = first + _drain(it)
    # Shard 1 of 2 reads files 1, 3, 5: thread 0 files 1 and 5 (two at a time), thread 1
    # file 3, merged in rotation.
    assert sorted(out) == sorted(10 * x for f in FILES[1::2] for x in f)
    assert out[:4] == [1000, 3000, 5000, 3010]
    unsplit = _drain(_reader_it(1, 2, threads=1))
    assert sorted(unsplit) == sorted(out) and unsplit != out


def test_interleave_pipelines_are_not_split() -> None:
    it = ElasticIterator(_files_ds(), 2, _shard(0, 2), read_options=ReadOptions(4, 8))
    interleave = it.base_iterator._parents[0]
    assert all(isinstance(d, MapDataset) for d in interleave._datasets)  # the files themselves


def test_split_by_threads_conformance() -> None:
    check_iterator_conformance(lambda: _reader_it(0, 2, threads=2), positions=[0, 2, 5])


@pytest.mark.parametrize(
    ("old", "old_threads", "new", "new_threads"),
    [(2, 2, 3, 3), (1, 3, 2, 1), (2, 1, 1, 2)],
)
def test_split_by_threads_shard_states_move_between_topologies(
    old: int, old_threads: int, new: int, new_threads: int, tmp_path: Path
) -> None:
    handler = CheckpointHandler()
    before = []
    for i in range(old):
        it = _reader_it(i, old, old_threads, gbs=old)
        before += _take(it, 3)
        handler.save(tmp_path, it)
        it.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"shard_state_{k}.json" for k in range(len(FILES))
    )
    after = []
    for i in range(new):
        it = _reader_it(i, new, new_threads, gbs=new)
        handler.restore(tmp_path, it)
        after += _drain(it)
        it.close()
    assert sorted(before + after) == sorted(10 * x for f in FILES for x in f)


def test_split_by_threads_shard_states_keys() -> None:
    it = _reader_it(1, 2, threads=2)
    before = _take(it, 2)
    states = it.get_shard_states()
    assert sorted(states) == [1, 3, 5]
    restored = _reader_it(1, 2, threads=2)
    restored.set_shard_states(json.loads(json.dumps(states)))
    assert sorted(before + _drain(restored)) == sorted(10 * x for f in FILES[1::2] for x in f)

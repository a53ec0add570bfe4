from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_core as grain
from grain_core import transforms
from grain_core.dataset.ops.map import RandomMapIterDataset, RandomMapMapDataset
from grain_core.testing import assert_equal_output_after_checkpoint, check_iterator_conformance

MD = grain.MapDataset


class AddOne(transforms.Map):
    def map(self, x):
        return x + 1


class AddIndex(transforms.MapWithIndex):
    def map_with_index(self, i, x):
        return (i, x)


class AddNoise(transforms.RandomMap):
    def random_map(self, x, rng):
        return x + int(rng.integers(0, 100))


class Even(transforms.Filter):
    def filter(self, x):
        return x % 2 == 0


def test_random_map_golden_cross_version():
    ds = MD.range(10).seed(41).random_map(lambda x, r: x + r.integers(0, 10))
    assert [int(v) for v in ds] == [0, 6, 9, 5, 10, 14, 14, 13, 15, 13]
    assert [int(v) for v in ds._getitems(range(10))] == [0, 6, 9, 5, 10, 14, 14, 13, 15, 13]


def test_random_map_differs_per_epoch_and_seed():
    ds = MD.range(20).seed(1).random_map(AddNoise()).repeat(2)
    values = [ds[i] - (i % 20) for i in range(40)]
    assert values[:20] != values[20:]
    other = MD.range(20).seed(2).random_map(AddNoise())
    assert [other[i] for i in range(20)] != [ds[i] for i in range(20)]
    explicit = MD.range(20).random_map(AddNoise(), seed=5)
    assert list(explicit) == list(MD.range(20).random_map(AddNoise(), seed=5))


def test_random_map_without_reseeding_repeats_exactly():
    ds = MD.range(10).seed(1).random_map(AddNoise()).repeat(3, reseed_each_epoch=False)
    values = list(ds)
    assert values[:10] == values[10:20] == values[20:]


def test_map_and_class_transforms():
    assert list(MD.range(3).map(AddOne())) == [1, 2, 3]
    assert list(MD.range(3).map(lambda x: x * 3)) == [0, 3, 6]
    ds = MD.range(3).map_with_index(AddIndex())
    assert [ds[i] for i in range(5)] == [(0, 0), (1, 1), (2, 2), (3, 0), (4, 1)]
    assert ds._getitems([4, 0]) == [(4, 1), (0, 0)]


def test_filter_makes_holes_and_iteration_skips_them():
    ds = MD.range(10).filter(Even())
    assert len(ds) == 10
    assert ds[1] is None and ds[2] == 2
    assert list(ds) == [0, 2, 4, 6, 8]
    assert list(ds.map(lambda x: x + 1)) == [1, 3, 5, 7, 9]
    assert list(ds.to_iter_dataset(allow_nones=True))[:3] == [0, None, 2]


def test_holes_pass_through_map_without_calling_the_function():
    calls = []
    ds = MD.range(4).filter(lambda x: x > 1).map(lambda x: calls.append(x) or x)
    assert ds._getitems(range(4)) == [None, None, 2, 3]
    assert calls == [2, 3]


def test_iter_map_filter_random_map_and_states():
    ds = (
        MD.range(30)
        .seed(4)
        .to_iter_dataset()
        .map(AddOne())
        .filter(lambda x: x % 3 != 0)
        .random_map(AddNoise())
        .map_with_index(lambda i, x: (i, x))
    )
    out = check_iterator_conformance(ds)
    assert [i for i, _ in out] == list(range(len(out)))
    it = iter(ds)
    next(it)
    state = it.get_state()
    assert state == {"parent": {"parent": {"next_index": 1}, "index_for_rng": 1}, "counter": 1}
    assert_equal_output_after_checkpoint(ds)


def test_iter_random_map_index_is_global_under_worker_context():
    ds = MD.range(4).to_iter_dataset().random_map(lambda x, r: int(r.integers(0, 1 << 30)), seed=9)
    single = list(ds)
    it = iter(ds)
    it._ctx.mp_context.process_index, it._ctx.mp_context.process_count = 1, 2
    # Worker 1 of 2 numbers its elements 1, 3, 5, ...: its first element uses rng index 1.
    assert next(it) == single[1]


def test_map_errors_propagate_with_original_type():
    def boom(x):
        if x == 3:
            raise KeyError("bad element")
        return x

    it = iter(MD.range(6).map(boom).to_iter_dataset(grain.ReadOptions(num_threads=2)))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="bad element"):
        next(it)


def _stops_at_three(*args):
    if args[-1] == 3 or (len(args) == 2 and args[0] == 3):
        raise StopIteration  # a next() on an exhausted iterator inside a map, say
    return args[-1]


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: ds.map(_stops_at_three).to_iter_dataset(),
        lambda ds: ds.filter(_stops_at_three).to_iter_dataset(),
        lambda ds: ds.to_iter_dataset().map(_stops_at_three),
        lambda ds: ds.to_iter_dataset().filter(_stops_at_three),
        lambda ds: ds.to_iter_dataset().map_with_index(_stops_at_three),
        lambda ds: ds.to_iter_dataset().random_map(_stops_at_three, seed=1),
    ],
    ids=["map", "filter", "iter_map", "iter_filter", "iter_map_with_index", "iter_random_map"],
)
def test_stop_iteration_in_a_function_is_an_error_not_the_end(make):
    # As in a generator (PEP 479): passed on, it would end the stream silently at element 3.
    it = iter(make(MD.range(6)))
    out = []
    with pytest.raises(RuntimeError, match="raised StopIteration"):
        for x in it:
            out.append(x)
    assert len(out) < 6


def test_non_callable_transform_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        MD.range(3).map(42)


def test_batched_reads_match_single_reads():
    ds = MD.range(50).seed(3).shuffle().random_map(AddNoise()).map_with_index(lambda i, x: i * x)
    idx = np.array([49, 0, 7, 7, 120])
    assert ds._getitems(idx) == [ds[int(i)] for i in idx]


# ------------------------------------------------------------------------ batched map
def _normalise(element):
    return {"image": element["image"].astype(np.float32) / 255, "label": element["label"] + 1}


class _Normalise(transforms.Map):
    batched = True

    def map(self, batch):
        return _normalise(batch)


@given(
    n=st.integers(1, 30),
    batch_size=st.integers(1, 8),
    drop_remainder=st.booleans(),
    seed=st.integers(0, 3),
    as_class=st.booleans(),
    restore_at=st.integers(0, 40),
)
@settings(max_examples=50, deadline=None)
def test_batched_map_gives_the_elements_of_the_element_map(
    n, batch_size, drop_remainder, seed, as_class, restore_at
):
    image = np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2)
    base = grain.MapDataset.source({"image": image, "label": np.arange(n)}).seed(seed).shuffle()
    batched = base.map(_Normalise()) if as_class else base.map(_normalise, batched=True)
    element_wise = base.map(_normalise)
    for i in (0, n - 1, n + 2):
        _assert_same_tree(batched[i], element_wise[i])
    _assert_same_tree(list(batched._getitems([2, 0, n])), element_wise._getitems([2, 0, n]))
    _assert_same_tree(list(batched.to_iter_dataset()), list(element_wise.to_iter_dataset()))
    batches = batched.batch(batch_size, drop_remainder=drop_remainder)
    expected = element_wise.batch(batch_size, drop_remainder=drop_remainder)
    _assert_same_tree(list(batches), list(expected))
    # Checkpoints are interchangeable.
    it = iter(batches.to_iter_dataset())
    for _ in range(min(restore_at, len(batches))):
        next(it)
    other = iter(expected.to_iter_dataset())
    other.set_state(it.get_state())
    _assert_same_tree(list(other), list(it))


@pytest.mark.parametrize("options", [grain.ReadOptions(num_threads=0), grain.ReadOptions()])
def test_batched_and_element_maps_have_the_same_state_at_every_position(options):
    rng = np.random.default_rng(0)
    source = {"image": rng.integers(0, 256, (300, 3, 3), dtype=np.uint8), "label": np.arange(300)}
    base = grain.MapDataset.source(source).seed(5).shuffle().repeat(2)
    paths = [base.map(_normalise, batched=True), base.map(_normalise)]
    batched, element_wise = (iter(p.batch(16).to_iter_dataset(options)) for p in paths)
    states = []
    for _ in range(len(paths[0].batch(16))):
        _assert_same_tree(next(batched), next(element_wise))
        states.append(batched.get_state())
        assert states[-1] == element_wise.get_state()
    for position in (0, 1, 17, len(states) - 2):
        for restored, reference in (paths, paths[::-1]):
            it = iter(restored.batch(16).to_iter_dataset(options))
            it.set_state(states[position])
            expected = iter(reference.batch(16).to_iter_dataset(options))
            expected.set_state(states[position])
            _assert_same_tree(list(it), list(expected))


def _assert_same_tree(a, b):
    from grain_core._tree import flatten

    leaves_a, leaves_b = flatten(a), flatten(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)


def test_batched_map_runs_once_per_batch():
    calls = []

    def double(batch):
        calls.append(len(batch))
        return batch * 2

    ds = grain.MapDataset.source(np.arange(10)).map(double, batched=True).batch(4)
    assert [b.tolist() for b in ds] == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18]]
    assert sum(calls) == 10 and len(calls) <= 3  # once per block read: one or more batches
    calls.clear()
    assert ds[1].tolist() == [8, 10, 12, 14] and calls == [4]


def test_batched_map_refuses_holes_and_results_of_another_length():
    with pytest.raises(ValueError, match="cannot follow `FilterMapDataset`"):
        grain.MapDataset.range(5).filter(lambda x: x > 1).map(lambda b: b, batched=True)
    ds = grain.MapDataset.source(np.arange(10)).map(lambda b: b[:1], batched=True)
    with pytest.raises(ValueError, match=r"lengths \[1\] for a batch of 3 elements"):
        ds.batch(3)[0]


class _DropAll(transforms.Filter):
    def filter(self, element: int) -> bool:
        return False


def test_a_filter_dropping_everything_is_reported_in_grains_text(caplog) -> None:
    # Grain's text, which users' log monitoring matches: the filter named by its class.
    text = (
        r"Transformation FilterDatasetIterator\(transform=_DropAll\) skipped 100.00 % of the "
        r"last seen 1000 elements"
    )
    ds = grain.MapDataset.range(1000).to_iter_dataset().filter(_DropAll())
    with caplog.at_level("WARNING"):
        assert list(ds) == []
    assert caplog.records and re.search(text, caplog.records[0].getMessage())
    raising = grain.experimental.WithOptionsIterDataset(
        ds, grain.experimental.DatasetOptions(filter_raise_threshold_ratio=0.9)
    )
    with pytest.raises(ValueError, match=text):
        list(raising)


def test_random_map_datasets_default_to_the_pipeline_seed() -> None:
    # Built directly without `seed`, as Grain's classes allow: the seed comes from `.seed()`.
    def draw(x: int, rng: np.random.Generator) -> int:
        return x + int(rng.integers(0, 1000))

    seeded = grain.MapDataset.range(6).seed(7)
    assert list(RandomMapMapDataset(seeded, draw)) == list(seeded.random_map(draw))
    iter_seeded = seeded.to_iter_dataset()
    assert list(RandomMapIterDataset(iter_seeded, draw)) == list(iter_seeded.random_map(draw))

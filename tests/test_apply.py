from __future__ import annotations

import pytest

import grain_core as grain
from grain_core import transforms
from grain_core.experimental import apply_transformations

MD = grain.MapDataset


class Double(transforms.Map):
    def map(self, x):
        return x * 2


class Jitter(transforms.RandomMap):
    def random_map(self, x, rng):
        return x + int(rng.integers(0, 3))


class Odd(transforms.Filter):
    def filter(self, x):
        return x % 2 == 1


class Tag(transforms.MapWithIndex):
    def map_with_index(self, i, x):
        return (i, x)


def test_apply_dispatches_in_order():
    ds = MD.range(6).seed(2).apply([Double(), Jitter(), transforms.Batch(2, drop_remainder=True)])
    expected = (
        MD.range(6).seed(2).map(lambda x: x * 2).random_map(Jitter()).batch(2, drop_remainder=True)
    )
    assert [b.tolist() for b in ds] == [b.tolist() for b in expected]
    it_ds = MD.range(6).to_iter_dataset().apply([Odd(), Tag()])
    assert list(it_ds) == [(0, 1), (1, 3), (2, 5)]
    assert list(apply_transformations(MD.range(3), Double())) == [0, 2, 4]


def test_apply_rejects_unsupported_transformations():
    class Legacy(transforms.TfRandomMap):
        def np_random_map(self, x, rng):
            return x

    with pytest.raises(NotImplementedError, match="Legacy"):
        MD.range(3).apply(Legacy())
    with pytest.raises(NotImplementedError):
        MD.range(3).apply(object())


def test_batch_descriptor_validates():
    with pytest.raises(ValueError, match="batch_size"):
        transforms.Batch(0)

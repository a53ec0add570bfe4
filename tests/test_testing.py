"""The conformance helpers must catch broken iterators, or they prove nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import grain_core as grain
from grain_core.dataset.base import IterDataset
from grain_core.dataset.iterator import DatasetIterator
from grain_core.testing import (
    assert_equal_output_after_checkpoint,
    assert_trees_equal,
    check_iterator_conformance,
    check_random_access_source,
)


class _Broken(IterDataset[int]):
    def __init__(self, bug: str) -> None:
        super().__init__()
        self.bug = bug

    def __iter__(self) -> DatasetIterator[int]:
        return _BrokenIterator(self.bug)


class _BrokenIterator(DatasetIterator[int]):
    def __init__(self, bug: str) -> None:
        super().__init__()
        self.bug = bug
        self.i = 0

    def __next__(self) -> int:
        if self.i >= 10:
            raise StopIteration
        self.i += 1
        return self.i

    def get_state(self) -> dict[str, Any]:
        if self.bug == "stale":
            return {"i": 0}
        if self.bug == "shape" and self.i > 3:
            return {"i": [self.i]}
        return {"i": self.i}

    def set_state(self, state: dict[str, Any]) -> None:
        self.i = state["i"] + (1 if self.bug == "off_by_one" else 0)


@pytest.mark.parametrize("bug", ["stale", "off_by_one"])
def test_conformance_catches_bad_restores(bug):
    with pytest.raises(AssertionError):
        check_iterator_conformance(_Broken(bug))
    with pytest.raises(AssertionError):
        assert_equal_output_after_checkpoint(_Broken(bug))


def test_state_shape_change_is_caught():
    with pytest.raises(AssertionError, match="structure changed"):
        assert_equal_output_after_checkpoint(_Broken("shape"))


def test_correct_iterator_passes():
    assert check_iterator_conformance(_Broken("none")) == list(range(1, 11))
    assert_equal_output_after_checkpoint(_Broken("none"))


def test_nondeterminism_is_caught():
    rng = np.random.default_rng()
    with pytest.raises(AssertionError):
        check_iterator_conformance(
            lambda: grain.MapDataset.range(10).map(lambda x: int(rng.integers(1 << 30)))
        )


def test_trees_equal_compares_dtype_and_path():
    assert_trees_equal({"a": np.zeros(2)}, {"a": np.zeros(2)})
    with pytest.raises(AssertionError, match=r"element\['a'\]"):
        assert_trees_equal({"a": np.zeros(2, np.float32)}, {"a": np.zeros(2)})
    with pytest.raises(AssertionError):
        assert_trees_equal((1, 2), [1, 2])


def test_source_checker_catches_missing_index_error():
    class NoBounds:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return i % 3

    with pytest.raises(AssertionError, match="IndexError"):
        check_random_access_source(NoBounds())

    class WrongBatch(list):
        def __getitems__(self, keys):
            return sorted(self[k] for k in keys)

    with pytest.raises(AssertionError, match="__getitems__"):
        check_random_access_source(WrongBatch(range(100)))


def test_an_iterator_given_is_restored_in_place_and_left_open() -> None:
    ds = grain.MapDataset.range(12).shuffle(3)
    it = grain.experimental.ElasticIterator(ds, 4, grain.sharding.NoSharding())
    assert_equal_output_after_checkpoint(it)
    it.set_state({"global_next_index": 0})
    assert [b.tolist() for b in it] == [b.tolist() for b in ds.batch(4)]

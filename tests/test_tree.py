from __future__ import annotations

import collections

import numpy as np
import pytest

from grain_core import _tree

Point = collections.namedtuple("Point", ["x", "y"])


def test_flatten_sorts_dict_keys_and_skips_none():
    tree = {"b": 2, "a": [1, None, (3, 4)], "c": None}
    assert _tree.flatten(tree) == [1, 3, 4, 2]


def test_map_structure_rebuilds_types_and_keeps_none():
    tree = {"b": Point(1, 2), "a": [1.0, None]}
    out = _tree.map_structure(lambda x: x * 10, tree)
    assert out == {"a": [10.0, None], "b": Point(10, 20)}
    assert list(out) == ["a", "b"]
    assert isinstance(out["b"], Point)


def test_map_structure_over_several_trees():
    out = _tree.map_structure(lambda a, b: a + b, {"x": (1, 2)}, {"x": (10, 20)})
    assert out == {"x": (11, 22)}


@pytest.mark.parametrize(
    "a, b",
    [
        ({"x": 1}, {"y": 1}),
        ([1, 2], [1]),
        ((1, 2), [1, 2]),
        ({"x": 1}, {"x": [1]}),
        (None, 1),
        (1, None),
    ],
)
def test_map_structure_mismatch_names_both_structures(a, b):
    with pytest.raises(ValueError, match="same structure"):
        _tree.map_structure(lambda *x: x, a, b)


def test_unflatten_round_trip():
    tree = {"a": np.zeros(2), "b": [1, Point(2, 3)]}
    leaves = _tree.flatten(tree)
    assert _tree.unflatten(tree, leaves)["b"][1] == Point(2, 3)
    with pytest.raises(ValueError):
        _tree.unflatten(tree, leaves + [1])


def test_uncomparable_keys_are_a_clear_error():
    with pytest.raises(TypeError, match="comparable"):
        _tree.flatten({1: 1, "a": 2})


def test_spec_str_describes_arrays():
    assert _tree.spec_str({"a": np.zeros((2, 3), np.float32)}) == "{'a': ndarray[float32[2, 3]]}"

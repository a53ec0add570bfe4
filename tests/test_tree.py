from __future__ import annotations

import collections
import collections.abc

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

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


def test_leaf_paths_follow_flatten_order():
    tree = {"b": 2, "a": [1, None, Point(3, 4)], "c": None}
    assert _tree.leaf_paths(tree) == [
        (("a", 0), 1),
        (("a", 2, 0), 3),
        (("a", 2, 1), 4),
        (("b",), 2),
    ]
    assert [leaf for _, leaf in _tree.leaf_paths(tree)] == _tree.flatten(tree)
    assert _tree.leaf_paths(5) == [((), 5)]


def test_map_structure_with_path_passes_each_leafs_path():
    a = {"y": [1, 2], "x": None, "z": Point(3, 4)}
    b = {"y": [10, 20], "x": None, "z": Point(30, 40)}
    out = _tree.map_structure_with_path(lambda path, u, v: (path, u + v), a, b)
    assert out == {
        "x": None,
        "y": [(("y", 0), 11), (("y", 1), 22)],
        "z": Point((("z", 0), 33), (("z", 1), 44)),
    }
    with pytest.raises(ValueError, match="same structure"):
        _tree.map_structure_with_path(lambda path, u, v: u, {"y": [1]}, {"y": [1, 2]})


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


def _reference_map(fn, *trees):
    """What map_structure must compute, written plainly: the model the fast walk is checked
    against."""
    first = trees[0]
    if isinstance(first, collections.abc.Mapping):
        if not all(
            isinstance(t, collections.abc.Mapping) and t.keys() == first.keys() for t in trees
        ):
            raise ValueError("same structure")
        return {k: _reference_map(fn, *[t[k] for t in trees]) for k in sorted(first)}
    if isinstance(first, (list, tuple)):
        if not all(type(t) is type(first) and len(t) == len(first) for t in trees):
            raise ValueError("same structure")
        children = [_reference_map(fn, *[t[i] for t in trees]) for i in range(len(first))]
        return type(first)(*children) if hasattr(first, "_fields") else type(first)(children)
    if first is None:
        if any(t is not None for t in trees):
            raise ValueError("same structure")
        return None
    if any(t is None or isinstance(t, (collections.abc.Mapping, list, tuple)) for t in trees):
        raise ValueError("same structure")
    return fn(*trees)


class _Fields:
    """Looks like a mapping without being one (no ``Mapping`` base, not registered)."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def keys(self):
        return self._data.keys()


class _FrozenMapping(_Fields, collections.abc.Mapping):
    pass


_leaves = st.one_of(
    st.integers(-5, 5),
    st.integers(-5, 5).map(np.int64),
    st.floats(-1, 1).map(np.float32),
    st.text(max_size=3),
    st.integers(0, 3).map(lambda n: np.arange(n, dtype=np.float32)),
)
_trees = st.recursive(
    st.one_of(_leaves, st.none()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda xy: Point(*xy)),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=3).map(_FrozenMapping),
    ),
    max_leaves=8,
)


def _mutations(tree):
    """Trees differing from ``tree`` in structure somewhere (none when it has no node)."""
    yield [tree]
    if isinstance(tree, collections.abc.Mapping):
        for k in tree:
            rest = {key: tree[key] for key in tree if key != k}
            yield rest
            for changed in _mutations(tree[k]):
                yield {**rest, k: changed}
    elif isinstance(tree, (list, tuple)):
        yield list(tree) if isinstance(tree, tuple) else tuple(tree)
        yield [*tree, 1] if isinstance(tree, list) else None
    elif tree is None:
        yield 1
    else:
        yield None


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(_trees, st.integers(1, 4), st.data())
def test_map_structure_agrees_with_the_plain_walk(tree, copies, data):
    # Every leaf becomes its own marker: the same tree several times, leaf by leaf.
    trees = [tree] * copies
    expected = _reference_map(lambda *xs: len(xs), *trees)
    assert _tree.map_structure(lambda *xs: len(xs), *trees) == expected
    other = data.draw(st.sampled_from(list(_mutations(tree))))
    position = data.draw(st.integers(0, copies))
    mixed = [*trees[:position], other, *trees[position:]]
    try:
        expected = _reference_map(lambda *xs: None, *mixed)
    except ValueError:
        with pytest.raises(ValueError, match="same structure"):
            _tree.map_structure(lambda *xs: None, *mixed)
    else:
        assert _tree.map_structure(lambda *xs: None, *mixed) == expected


def test_a_class_registered_as_a_mapping_later_is_walked_as_one():
    class Record(_Fields):  # a class of its own: the registration stays with this test
        pass

    records = [Record({"a": 1, "b": 2}), Record({"a": 10, "b": 20})]
    assert _tree.map_structure(lambda *xs: len(xs), *records) == 2  # a leaf
    collections.abc.Mapping.register(Record)
    assert _tree.map_structure(lambda *xs: sum(xs), *records) == {"a": 11, "b": 22}


def test_list_subclasses_are_containers_as_in_flatten():
    class Row(list):
        pass

    out = _tree.map_structure(lambda a, b: a + b, Row([1, 2]), Row([10, 20]))
    assert type(out) is Row and out == [11, 22]
    assert _tree.flatten(Row([1, 2])) == [1, 2]


def test_a_mapping_answering_missing_keys_is_still_a_mismatch():
    other = collections.defaultdict(int, {"b": 1})
    with pytest.raises(ValueError, match="same structure"):
        _tree.map_structure(lambda *xs: xs, {"a": 1}, other)
    assert dict(other) == {"b": 1}  # not filled in by the walk


def test_the_cache_of_class_kinds_stays_bounded():
    # Classes made on the fly (one per call here) must not pile up in the cache.
    for i in range(_tree._KINDS_MAX + 10):
        leaf = type(f"Leaf{i}", (), {})()
        assert _tree.map_structure(lambda x: x, leaf) is leaf
    assert len(_tree._kinds) <= _tree._KINDS_MAX + 1

"""Tests for ConcatThenSplitIterDataset and BOSHandling (grain_core.dataset.ops.packing_concat_split)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_core as grain
from grain_core import experimental
from grain_core.dataset.ops.packing_concat_split import BOSHandling, ConcatThenSplitIterDataset
from grain_core.testing import (
    assert_equal_output_after_checkpoint,
    assert_trees_equal,
    check_iterator_conformance,
)


def observations(n: int) -> grain.IterDataset:
    """``{"observation": [v] * v, "index": k + 1}`` for v cycling 1..7: lengths 1..7 repeat."""
    return (
        grain.MapDataset.range(1, 8)
        .repeat()
        .map_with_index(lambda k, v: {"observation": np.repeat(v, v), "index": k + 1})[:n]
        .to_iter_dataset()
    )


def _out(obs: list[int], segments: list[int], positions: list[int], index: list[int]) -> dict:
    return {
        "observation": np.asarray(obs),
        "observation_segment_ids": np.asarray(segments, dtype=np.int32),
        "observation_positions": np.asarray(positions, dtype=np.int32),
        "index": np.asarray(index),
    }


def _single(values: list[int], segments: list[int], positions: list[int]) -> dict:
    return {
        "observation": np.asarray(values),
        "observation_segment_ids": np.asarray(segments, dtype=np.int32),
        "observation_positions": np.asarray(positions, dtype=np.int32),
    }


def _assert_outputs(actual: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(actual) == len(expected), [a["observation"].tolist() for a in actual]
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_trees_equal(a, e, f"output {i}")


def _cts(elements: list[dict[str, Any]], **kwargs: Any) -> list[dict[str, Any]]:
    ds = grain.MapDataset.source(elements).to_iter_dataset()
    return list(ConcatThenSplitIterDataset(ds, **kwargs))


def test_docstring_example():
    data = [
        {"inputs": np.array([1, 2, 3], np.int32), "targets": np.array([10, 20], np.int32)},
        {"inputs": np.array([4, 5, 6], np.int32), "targets": np.array([30, 40], np.int32)},
    ]
    first = _cts(data, length_struct={"inputs": 4, "targets": 3})[0]
    np.testing.assert_array_equal(first["inputs"], [1, 2, 3, 4])
    np.testing.assert_array_equal(first["inputs_segment_ids"], [1, 1, 1, 2])
    np.testing.assert_array_equal(first["inputs_positions"], [0, 1, 2, 0])
    assert first["inputs"].dtype == np.int32


def test_meta_features_not_restricting_split_full_length():
    ds = ConcatThenSplitIterDataset(
        observations(9), length_struct={"observation": 6, "index": 6}, meta_features={"index"}
    )
    _assert_outputs(
        list(ds),
        [
            _out([1, 2, 2, 3, 3, 3], [1, 2, 2, 3, 3, 3], [0, 0, 1, 0, 1, 2], [1, 2, 3, 0, 0, 0]),
            # The 5 is split across two outputs; its meta feature appears in both.
            _out([4, 4, 4, 4, 5, 5], [1, 1, 1, 1, 2, 2], [0, 1, 2, 3, 0, 1], [4, 5, 0, 0, 0, 0]),
            _out([5, 5, 5, 6, 6, 6], [1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2], [5, 6, 0, 0, 0, 0]),
            _out([6, 6, 6, 7, 7, 7], [1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2], [6, 7, 0, 0, 0, 0]),
            _out([7, 7, 7, 7, 1, 2], [1, 1, 1, 1, 2, 3], [0, 1, 2, 3, 0, 0], [7, 8, 9, 0, 0, 0]),
            _out([2, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0]),
        ],
    )


NOT_SPLITTING_FULL_LENGTH = [
    _out([1, 2, 2, 3, 3, 3], [1, 2, 2, 3, 3, 3], [0, 0, 1, 0, 1, 2], [1, 2, 3, 0, 0, 0]),
    _out([4, 4, 4, 4, 5, 5], [1, 1, 1, 1, 2, 2], [0, 1, 2, 3, 0, 1], [4, 5, 0, 0, 0, 0]),
    _out([5, 5, 5, 7, 7, 7], [1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2], [5, 7, 0, 0, 0, 0]),
    # The full-length 6 is emitted whole, behind the buffer that was filling when it arrived.
    _out([6, 6, 6, 6, 6, 6], [1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5], [6, 0, 0, 0, 0, 0]),
    _out([7, 7, 7, 7, 1, 2], [1, 1, 1, 1, 2, 3], [0, 1, 2, 3, 0, 0], [7, 8, 9, 0, 0, 0]),
    _out([2, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0]),
]


def test_meta_features_not_restricting_full_length_passthrough():
    ds = ConcatThenSplitIterDataset(
        observations(9),
        length_struct={"observation": 6, "index": 6},
        meta_features={"index"},
        split_full_length_features=False,
    )
    _assert_outputs(list(ds), NOT_SPLITTING_FULL_LENGTH)


def test_meta_features_restricting(caplog):
    ds = ConcatThenSplitIterDataset(
        observations(9),
        length_struct={"observation": 6, "index": 2},
        meta_features={"index"},
        split_full_length_features=False,
    )
    _assert_outputs(
        list(ds),
        [
            _out([1, 2, 2, 0, 0, 0], [1, 2, 2, 0, 0, 0], [0, 0, 1, 0, 0, 0], [1, 2]),
            _out([3, 3, 3, 4, 4, 4], [1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2], [3, 4]),
            _out([4, 5, 5, 5, 5, 5], [1, 2, 2, 2, 2, 2], [0, 0, 1, 2, 3, 4], [4, 5]),
            _out([6, 6, 6, 6, 6, 6], [1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5], [6, 0]),
            _out([7, 7, 7, 7, 7, 7], [1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5], [7, 0]),
            _out([7, 1, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [7, 8]),
            _out([2, 2, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [9, 0]),
        ],
    )
    assert "Meta feature 'index' limited packing" in caplog.text


def test_replace_first_token_with_bos():
    ds = ConcatThenSplitIterDataset(
        observations(9),
        length_struct={"observation": 6, "index": 6},
        meta_features={"index"},
        split_full_length_features=False,
        bos_handling=BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS,
        bos_token_id=1000,
        bos_features={"observation"},
    )
    expected = []
    for e in NOT_SPLITTING_FULL_LENGTH:
        e = dict(e)
        starts = np.flatnonzero(
            (e["observation_positions"] == 0) & (e["observation_segment_ids"] > 0)
        )
        e["observation"] = e["observation"].copy()
        e["observation"][starts] = 1000
        expected.append(e)
    assert expected[2]["observation"].tolist() == [1000, 5, 5, 1000, 7, 7]
    _assert_outputs(list(ds), expected)


def test_element_split_multiple_times():
    out = _cts(
        [{"observation": np.arange(7)}, {"observation": np.arange(25)}],
        length_struct={"observation": 10},
    )
    _assert_outputs(
        out,
        [
            _single([0, 1, 2, 3, 4, 5, 6, 0, 1, 2], [1] * 7 + [2] * 3, list(range(7)) + [0, 1, 2]),
            _single(list(range(3, 13)), [1] * 10, list(range(10))),
            _single(list(range(13, 23)), [1] * 10, list(range(10))),
            _single([23, 24] + [0] * 8, [1, 1] + [0] * 8, [0, 1] + [0] * 8),
        ],
    )


def test_large_element_with_exact_fit_then_small_elements():
    out = _cts(
        [
            {"observation": np.arange(40)},
            {"observation": np.arange(5)},
            {"observation": np.arange(5)},
        ],
        length_struct={"observation": 10},
    )
    full = [_single(list(range(k, k + 10)), [1] * 10, list(range(10))) for k in (0, 10, 20, 30)]
    _assert_outputs(
        out, [*full, _single([0, 1, 2, 3, 4] * 2, [1] * 5 + [2] * 5, [0, 1, 2, 3, 4] * 2)]
    )


TWO_FIVES = _single([0, 1, 2, 3, 4] * 2, [1] * 5 + [2] * 5, [0, 1, 2, 3, 4] * 2)
FULL = _single(list(range(10)), [1] * 10, list(range(10)))


@pytest.mark.parametrize(
    "lengths, expected",
    [
        # A full-length input waits for the partially filled buffer to complete.
        (
            [1, 10, 5, 5],
            [
                _single(
                    [0, 0, 1, 2, 3, 4, 0, 1, 2, 3],
                    [1, 2, 2, 2, 2, 2, 3, 3, 3, 3],
                    [0, 0, 1, 2, 3, 4, 0, 1, 2, 3],
                ),
                FULL,
                _single([4] + [0] * 9, [1] + [0] * 9, [0] * 10),
            ],
        ),
        # A full buffer is emitted when the next input arrives: the full-length input follows it.
        ([5, 5, 10, 5, 5], [TWO_FIVES, FULL, TWO_FIVES]),
        # At the very start the (empty) buffer must fill first: Grain's "historical" order.
        ([10, 5, 5], [TWO_FIVES, FULL]),
    ],
)
def test_full_length_passthrough_order(lengths, expected):
    out = _cts(
        [{"observation": np.arange(n)} for n in lengths],
        length_struct={"observation": 10},
        split_full_length_features=False,
    )
    _assert_outputs(out, expected)


@pytest.mark.parametrize(
    "element, length_struct",
    [
        ({"observation": [2, 2], "index": 1}, {"observation": 1, "index": 1}),
        ({"index": 1, "observation": [2, 2]}, {"index": 1, "observation": 1}),
    ],
)
def test_oversized_feature_prevents_full_length_passthrough(element, length_struct):
    out = _cts(
        [element],
        length_struct=length_struct,
        split_full_length_features=False,
        meta_features={"index"},
    )
    one = {
        "observation": np.asarray([2]),
        "observation_segment_ids": np.asarray([1], np.int32),
        "observation_positions": np.asarray([0], np.int32),
        "index": np.asarray([1]),
    }
    _assert_outputs(out, [one, one])


def test_multi_feature_remainders_keep_every_token():
    # Grain's remainder split puts the cut of a fitting feature at its length instead of its
    # stop, losing or duplicating tokens; every token here appears exactly once.
    out = _cts([{"a": np.arange(1, 11), "b": np.arange(1, 6)}], length_struct={"a": 4, "b": 4})
    expected = [
        ([1, 2, 3, 4], [1, 1, 1, 1], [1, 2, 3, 4], [1, 1, 1, 1]),
        ([5, 6, 7, 8], [1, 1, 1, 1], [5, 0, 0, 0], [1, 0, 0, 0]),
        ([9, 10, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]),
    ]
    assert len(out) == 3
    for row, (a, a_seg, b, b_seg) in zip(out, expected, strict=True):
        np.testing.assert_array_equal(row["a"], a)
        np.testing.assert_array_equal(row["a_segment_ids"], a_seg)
        np.testing.assert_array_equal(row["b"], b)
        np.testing.assert_array_equal(row["b_segment_ids"], b_seg)


def test_scalar_features_count_as_length_one():
    out = _cts([{"x": 5}, {"x": np.int64(6)}, {"x": 7}], length_struct={"x": 2})
    assert [o["x"].tolist() for o in out] == [[5, 6], [7, 0]]


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "length_struct",
    [
        {"observation": 6, "index": 6, "does_not_exist": 6},  # extra target length
        {"index": 6},  # missing target length
    ],
)
def test_wrong_keys_are_rejected(length_struct):
    ds = ConcatThenSplitIterDataset(
        observations(7), length_struct=length_struct, meta_features={"index"}
    )
    with pytest.raises(ValueError, match="Parent element has structure"):
        list(ds)


def test_nested_or_object_features_are_rejected():
    with pytest.raises(ValueError, match="not an array of numbers"):
        _cts([{"x": {"y": np.arange(2)}}], length_struct={"x": 4})


def test_meta_feature_longer_than_target_is_rejected():
    with pytest.raises(
        ValueError, match="Meta feature 'm' has length 3 but its target length is 2"
    ):
        _cts(
            [{"x": np.arange(2), "m": np.arange(3)}],
            length_struct={"x": 4, "m": 2},
            meta_features={"m"},
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bos_token_id=1), "means no BOS handling"),
        (dict(bos_features={"x"}), "means no BOS handling"),
        (dict(bos_handling=BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS), "bos_token_id"),
        (
            dict(
                bos_handling=BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS,
                bos_token_id=1,
                bos_features={"m"},
                meta_features={"m"},
            ),
            "must not overlap",
        ),
        (
            dict(
                bos_handling=BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS,
                bos_token_id=1,
                bos_features={"z"},
            ),
            "bos_features.*not features",
        ),
        (dict(meta_features={"z"}), "meta_features.*not features"),
        (dict(meta_features="m"), "collection of names"),
        (dict(length_struct={"x": 0, "m": 1}), "Target length of feature 'x'"),
        (dict(length_struct={}), "non-empty"),
    ],
)
def test_configuration_errors(kwargs, match):
    args: dict[str, Any] = dict(length_struct={"x": 4, "m": 1})
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ConcatThenSplitIterDataset(observations(1), **args)


# ------------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("n", [1, 4, 7, 11])
@pytest.mark.parametrize("split_full_length", [True, False])
def test_checkpoint_at_every_step(n, split_full_length):
    assert_equal_output_after_checkpoint(
        ConcatThenSplitIterDataset(
            observations(n),
            length_struct={"observation": 8, "index": 6},
            meta_features={"index"},
            split_full_length_features=split_full_length,
        )
    )


@pytest.mark.parametrize("split_full_length", [True, False])
def test_conformance_multi_feature_with_bos(split_full_length):
    rng = np.random.default_rng(3)
    elements = [
        {
            "a": rng.integers(1, 9, size=int(rng.integers(1, 14))),
            "b": rng.integers(1, 9, size=int(rng.integers(1, 7))),
        }
        for _ in range(30)
    ]

    def make() -> grain.IterDataset:
        return ConcatThenSplitIterDataset(
            grain.MapDataset.source(elements).to_iter_dataset(),
            length_struct={"a": 6, "b": 5},
            split_full_length_features=split_full_length,
            bos_handling=BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS,
            bos_token_id=99,
            bos_features={"a"},
        )

    out = check_iterator_conformance(make, positions=[0, 1, 5, 10, 20, 30])
    assert len(out) >= 30
    assert_equal_output_after_checkpoint(make())


def test_state_shape_and_restore_after_stop_iteration():
    ds = ConcatThenSplitIterDataset(
        observations(9), length_struct={"observation": 8, "index": 6}, meta_features={"index"}
    )
    it = iter(ds)
    next(it)
    next(it)  # the second output starts with the rest of the 4, cut after 2 of its tokens
    state = it.get_state()
    assert set(state) == {
        "parent_state",
        "remainder_slices",
        "elements_from_buffer_after_checkpoint",
    }
    assert state["remainder_slices"] == {"observation": [2, 4]}
    assert state["elements_from_buffer_after_checkpoint"] == 1
    list(it)
    final = it.get_state()
    for target in (iter(ds), it):
        target.set_state(final)
        with pytest.raises(StopIteration):
            next(target)
        assert target.get_state() == final


def test_restore_with_exhausted_parent_is_reported():
    ds = ConcatThenSplitIterDataset(
        observations(3), length_struct={"observation": 2, "index": 3}, meta_features={"index"}
    )
    it = iter(ds)
    with pytest.raises(ValueError, match="parent is exhausted"):
        it.set_state(
            {
                "parent_state": {"next_index": 3},
                "remainder_slices": {"observation": [1, 3]},
                "elements_from_buffer_after_checkpoint": 0,
            }
        )
    with pytest.raises(ValueError, match="remainder slices for"):
        it.set_state(
            {
                "parent_state": {"next_index": 0},
                "remainder_slices": {},
                "elements_from_buffer_after_checkpoint": 0,
            }
        )


# ---------------------------------------------------------------------------- properties
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 7)), max_size=25),
    targets=st.tuples(st.integers(1, 8), st.integers(1, 6)),
)
def test_tokens_come_out_in_order_exactly_once(lengths, targets):
    counter = iter(range(1, 10_000))
    elements = [
        {
            "a": np.asarray([next(counter) for _ in range(la)]),
            "b": np.asarray([next(counter) for _ in range(lb)]),
        }
        for la, lb in lengths
    ]
    out = _cts(elements, length_struct={"a": targets[0], "b": targets[1]})
    for key, target in zip("ab", targets, strict=True):
        packed = [o[key][o[f"{key}_segment_ids"] > 0] for o in out]
        flat = np.concatenate(packed) if packed else np.zeros(0)
        want = np.concatenate([e[key] for e in elements]) if elements else np.zeros(0)
        np.testing.assert_array_equal(flat, want)
        for o in out:
            assert len(o[key]) == target


def test_exported_from_experimental():
    assert experimental.ConcatThenSplitIterDataset is ConcatThenSplitIterDataset
    assert experimental.BOSHandling is BOSHandling

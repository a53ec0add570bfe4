"""Tests for first-fit / best-fit packing and PackAndBatchOperation (grain_core.dataset.ops.packing)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_core as grain
from grain_core import experimental
from grain_core.dataset.ops.packing import (
    BestFitPackIterDataset,
    FirstFitPackIterDataset,
    PackAndBatchOperation,
    non_sequence_meta_features,
)
from grain_core.testing import (
    assert_equal_output_after_checkpoint,
    assert_trees_equal,
    check_iterator_conformance,
)

PACKERS = [FirstFitPackIterDataset, BestFitPackIterDataset]


def _source(elements: list[dict[str, Any]], *, as_arrays: bool = True) -> grain.IterDataset:
    if as_arrays:
        elements = [{k: np.asarray(v) for k, v in e.items()} for e in elements]
    return grain.MapDataset.source(elements).to_iter_dataset()


def _pack(packer: type, elements: list[dict[str, Any]], *, as_arrays: bool = True, **kwargs: Any):
    kwargs.setdefault("shuffle_bins", False)
    return list(packer(_source(elements, as_arrays=as_arrays), **kwargs))


def _row(feature: str, *segments: list[int], length: int) -> dict[str, np.ndarray]:
    """Expected packed row: ``segments`` laid out back to back, then zero padding."""
    values, segment_ids, positions = [], [], []
    for sid, seg in enumerate(segments, 1):
        values += seg
        segment_ids += [sid] * len(seg)
        positions += list(range(len(seg)))
    pad = length - len(values)
    return {
        feature: np.asarray(values + [0] * pad),
        f"{feature}_segment_ids": np.asarray(segment_ids + [0] * pad, dtype=np.int32),
        f"{feature}_positions": np.asarray(positions + [0] * pad, dtype=np.int32),
    }


def _assert_rows(actual: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(actual) == len(expected), (len(actual), len(expected))
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        e = {k: np.asarray(v, dtype=a[k].dtype) if k in a else v for k, v in e.items()}
        assert_trees_equal(a, e, f"row {i}")


# -------------------------------------------------------------------- placement scenarios
# (item sizes, capacity, bins) -> expected bins as lists of item sizes, for each strategy.
# Items are filled with their 1-based input index so each bin's content shows its items.
SCENARIOS = [
    # Spec 14: capacity 10, items 4, 8, 2: first-fit puts the 2 into bin 0, best-fit into bin 1.
    ([4, 8, 2], 10, 2, [[1, 3], [2]], [[1], [2, 3]]),
    # The 4 fits both bins: first-fit takes bin 0, best-fit the tighter bin 1.
    ([10, 15, 4], 20, 2, [[1, 3], [2]], [[1], [2, 3]]),
    # First-fit needs a third bin for the 40; best-fit's choices leave room for it.
    ([50, 70, 25, 40], 100, 3, [[1, 3], [2], [4]], [[1, 4], [2, 3]]),
    ([10, 15, 4, 10], 20, 3, [[1, 3], [2], [4]], [[1, 4], [2, 3]]),
]


@pytest.mark.parametrize("sizes, capacity, bins, first_fit, best_fit", SCENARIOS)
@pytest.mark.parametrize("packer", PACKERS)
def test_placement_scenarios(packer, sizes, capacity, bins, first_fit, best_fit):
    elements = [{"features": [i] * n} for i, n in enumerate(sizes, 1)]
    layout = first_fit if packer is FirstFitPackIterDataset else best_fit
    expected = [
        _row("features", *[[item] * sizes[item - 1] for item in items], length=capacity)
        for items in layout
    ]
    actual = _pack(packer, elements, length_struct={"features": capacity}, num_packing_bins=bins)
    _assert_rows(actual, expected)


THREE = [
    {"inputs": [1, 2, 3], "targets": [10]},
    {"inputs": [4, 5], "targets": [20, 30, 40]},
    {"inputs": [6], "targets": [50, 60]},
]


def _two(inputs: tuple[list[int], ...], targets: tuple[list[int], ...], li: int, lt: int):
    return {**_row("inputs", *inputs, length=li), **_row("targets", *targets, length=lt)}


@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize(
    "length, bins, expected",
    [
        (3, 1, [(([1, 2, 3],), ([10],)), (([4, 5],), ([20, 30, 40],)), (([6],), ([50, 60],))]),
        (3, 3, [(([1, 2, 3],), ([10],)), (([4, 5],), ([20, 30, 40],)), (([6],), ([50, 60],))]),
        (4, 2, [(([1, 2, 3], [6]), ([10], [50, 60])), (([4, 5],), ([20, 30, 40],))]),
        (5, 2, [(([1, 2, 3], [4, 5]), ([10], [20, 30, 40])), (([6],), ([50, 60],))]),
        (6, 2, [(([1, 2, 3], [4, 5], [6]), ([10], [20, 30, 40], [50, 60]))]),
        (7, 1, [(([1, 2, 3], [4, 5], [6]), ([10], [20, 30, 40], [50, 60]))]),
    ],
)
def test_two_features_must_both_fit(packer, length, bins, expected):
    actual = _pack(
        packer, THREE, length_struct={"inputs": length, "targets": length}, num_packing_bins=bins
    )
    _assert_rows(actual, [_two(i, t, length, length) for i, t in expected])


@pytest.mark.parametrize("packer", PACKERS)
def test_different_target_lengths_per_feature(packer):
    actual = _pack(packer, THREE, length_struct={"inputs": 3, "targets": 4}, num_packing_bins=3)
    _assert_rows(
        actual,
        [
            _two(([1, 2, 3],), ([10],), 3, 4),
            _two(([4, 5],), ([20, 30, 40],), 3, 4),
            _two(([6],), ([50, 60],), 3, 4),
        ],
    )


@pytest.mark.parametrize("packer", PACKERS)
def test_two_dimensional_features(packer):
    elements = [
        {"tokens": [1, 2, 3], "vectors": [[0, 1, 2], [1, 2, 3], [2, 3, 4]]},
        {"tokens": [4, 5], "vectors": [[3, 4, 5], [4, 5, 6]]},
        {"tokens": [6], "vectors": [[5, 6, 7]]},
    ]
    actual = _pack(packer, elements, length_struct={"tokens": 5, "vectors": 3}, num_packing_bins=2)
    assert len(actual) == 2
    np.testing.assert_array_equal(actual[0]["vectors"], [[0, 1, 2], [1, 2, 3], [2, 3, 4]])
    np.testing.assert_array_equal(actual[1]["vectors"], [[3, 4, 5], [4, 5, 6], [5, 6, 7]])
    np.testing.assert_array_equal(actual[1]["vectors_segment_ids"], [1, 1, 2])
    np.testing.assert_array_equal(actual[1]["tokens"], [4, 5, 6, 0, 0])
    np.testing.assert_array_equal(actual[1]["tokens_positions"], [0, 1, 0, 0, 0])


@pytest.mark.parametrize("packer", PACKERS)
def test_bfloat16(packer):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = np.asarray([[0.5], [1.5], [2.5]], dtype=ml_dtypes.bfloat16)
    (row,) = _pack(packer, [{"x": values}], length_struct={"x": 4}, num_packing_bins=1)
    assert row["x"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(row["x"].astype(np.float32), [[0.5], [1.5], [2.5], [0.0]])


@pytest.mark.parametrize("packer", PACKERS)
def test_zero_valued_tokens_are_not_padding(packer):
    elements = [{"x": [0, 0]}, {"x": [0]}]
    (row,) = _pack(packer, elements, length_struct={"x": 4}, num_packing_bins=1)
    np.testing.assert_array_equal(row["x_segment_ids"], [1, 1, 2, 0])
    np.testing.assert_array_equal(row["x_positions"], [0, 1, 0, 0])


@pytest.mark.parametrize("packer", PACKERS)
def test_features_outside_length_struct_are_dropped(packer):
    (row,) = _pack(
        packer, [{"a": [1, 2, 3], "b": [1, 2, 3]}], length_struct={"a": 3}, num_packing_bins=1
    )
    assert sorted(row) == ["a", "a_positions", "a_segment_ids"]


# ------------------------------------------------------------------------- bin shuffling
@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("seed, order", [(0, [2, 0, 1]), (42, [2, 1, 0]), (123, [0, 2, 1])])
def test_shuffle_seed_golden(packer, seed, order):
    # Group rows (bins) 0, 1, 2 hold inputs 0, 1, 2; the order is
    # default_rng(seed + rows emitted before the group).permuted(range(3)).
    actual = _pack(
        packer,
        THREE,
        length_struct={"inputs": 3, "targets": 3},
        num_packing_bins=5,
        seed=seed,
        shuffle_bins=True,
    )
    assert [int(row["inputs"][0]) for row in actual] == [[1, 4, 6][i] for i in order]


@pytest.mark.parametrize("packer", PACKERS)
def test_shuffle_seed_advances_with_rows_emitted(packer):
    elements = [{"x": [i] * 3} for i in range(1, 7)]
    actual = _pack(
        packer, elements, length_struct={"x": 3}, num_packing_bins=3, seed=5, shuffle_bins=True
    )
    first = np.random.default_rng(5).permuted(np.arange(3))
    second = np.random.default_rng(5 + 3).permuted(np.arange(3))
    assert [int(r["x"][0]) for r in actual] == [1 + i for i in first] + [4 + i for i in second]


EPOCHS = [
    {"inputs": [1, 2, 3], "epoch": [2]},
    {"inputs": [4, 5], "epoch": [3]},
    {"inputs": [6], "epoch": [3]},
    {"inputs": [7], "epoch": [2]},
    {"inputs": [8, 9, 10], "epoch": [2]},
]


@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("bins", [4, 5])
def test_shuffle_grouped_by_feature(packer, bins):
    actual = _pack(
        packer,
        EPOCHS,
        length_struct={"inputs": 3, "epoch": 3},
        num_packing_bins=bins,
        shuffle_bins=True,
        shuffle_bins_group_by_feature="epoch",
        meta_features=["epoch"],
    )
    # Epoch-2 bins come first (in the shuffled order), then the epoch-3 bin.
    expected = [
        ([7, 0, 0], [2, 0, 0], [1, 0, 0]),
        ([1, 2, 3], [2, 0, 0], [1, 1, 1]),
        ([8, 9, 10], [2, 0, 0], [1, 1, 1]),
        ([4, 5, 6], [3, 3, 0], [1, 1, 2]),
    ]
    assert len(actual) == 4
    for row, (inputs, epoch, segments) in zip(actual, expected, strict=True):
        assert sorted(row) == ["epoch", "inputs", "inputs_positions", "inputs_segment_ids"]
        np.testing.assert_array_equal(row["inputs"], inputs)
        np.testing.assert_array_equal(row["epoch"], epoch)
        np.testing.assert_array_equal(row["inputs_segment_ids"], segments)


@pytest.mark.parametrize("packer", PACKERS)
def test_shuffle_grouped_by_feature_all_zero_keeps_inverse_shuffle_order(packer):
    elements = [dict(e, epoch=[0]) for e in EPOCHS[:4]]
    actual = _pack(
        packer,
        elements,
        length_struct={"inputs": 3, "epoch": 3},
        num_packing_bins=5,
        shuffle_bins=True,
        shuffle_bins_group_by_feature="epoch",
        meta_features=["epoch"],
    )
    assert [row["inputs"].tolist() for row in actual] == [[4, 5, 6], [7, 0, 0], [1, 2, 3]]


# ------------------------------------------------------------------------- meta features
@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("as_arrays", [True, False])
def test_sequence_meta_features_have_no_segment_ids(packer, as_arrays):
    elements = [
        {"inputs": np.asarray([1, 2, 3]), "meta": 3},
        {"inputs": np.asarray([4, 5]), "meta": 7},
        {"inputs": np.asarray([6]), "meta": 5},
    ]
    actual = _pack(
        packer,
        elements,
        as_arrays=as_arrays,
        length_struct={"inputs": 3, "meta": 3},
        num_packing_bins=5,
        meta_features=["meta"],
    )
    assert [sorted(r) for r in actual] == [
        ["inputs", "inputs_positions", "inputs_segment_ids", "meta"]
    ] * 2
    np.testing.assert_array_equal(actual[0]["meta"], [3, 0, 0])
    np.testing.assert_array_equal(actual[1]["meta"], [7, 5, 0])
    assert actual[1]["meta"].dtype == np.int64


@pytest.mark.parametrize("packer", PACKERS)
def test_non_sequence_meta_features_are_lists_per_bin(packer):
    elements = [
        {"x": [1, 2], "doc": "a", "id": np.float32(0.5)},
        {"x": [3], "doc": "b", "id": np.float32(1.5)},
        {"x": [4, 5], "doc": "c", "id": np.float32(2.5)},
    ]
    actual = _pack(
        packer,
        elements,
        as_arrays=False,
        length_struct={"x": 3},
        num_packing_bins=2,
        meta_features=["doc", "id"],
    )
    assert [r["doc"] for r in actual] == [["a", "b"], ["c"]]
    assert [r["id"] for r in actual] == [[0.5, 1.5], [2.5]]
    assert "doc_segment_ids" not in actual[0]


def test_non_sequence_meta_features_are_those_not_in_length_struct():
    length_struct = {"x": 3, "nested": {"inner": 3}}
    meta = ["id", "nested", "doc"]
    assert non_sequence_meta_features(length_struct, meta) == ["id", "doc"]
    assert non_sequence_meta_features(length_struct, []) == []


@pytest.mark.parametrize("packer", PACKERS)
def test_nested_meta_feature_is_packed(packer):
    elements = [{"row": np.arange(3), "nested": {"inner": np.int64(i)}} for i in range(1, 4)]
    actual = _pack(
        packer,
        elements,
        as_arrays=False,
        length_struct={"row": 6, "nested": {"inner": 4}},
        num_packing_bins=1,
        meta_features=["nested"],
    )
    np.testing.assert_array_equal(actual[0]["nested"]["inner"], [1, 2, 0, 0])
    np.testing.assert_array_equal(actual[1]["nested"]["inner"], [3, 0, 0, 0])


@pytest.mark.parametrize("packer", PACKERS)
def test_nested_feature_not_marked_meta_is_rejected(packer):
    with pytest.raises(
        ValueError, match="Failed to extract segment ids for 'nested'.*meta feature"
    ):
        packer(
            _source([{"row": [1]}]),
            length_struct={"row": 6, "nested": {"inner": 4}},
            num_packing_bins=1,
        )


# ----------------------------------------------------------------- alignment and padding
@pytest.mark.parametrize("packer", PACKERS)
def test_alignment_and_padding(packer):
    elements = [{"x": [1, 2, 3], "y": [7]}, {"x": [4, 5], "y": [8, 8]}, {"x": [6], "y": [9]}]
    actual = _pack(
        packer,
        elements,
        length_struct={"x": 8, "y": 4},
        num_packing_bins=1,
        pack_alignment_struct={"x": 4, "y": 1},
        padding_struct={"x": -1, "y": -2},
    )
    # x: [1,2,3] ends at 3, aligned to 4; [4,5] at 4..6 aligned to 8: the bin is full for x, so
    # [6] opens the next group. Segment ids/positions stay 0 in padding cells.
    _assert_rows(
        actual,
        [
            {
                "x": [1, 2, 3, -1, 4, 5, -1, -1],
                "x_segment_ids": [1, 1, 1, 0, 2, 2, 0, 0],
                "x_positions": [0, 1, 2, 0, 0, 1, 0, 0],
                "y": [7, 8, 8, -2],
                "y_segment_ids": [1, 2, 2, 0],
                "y_positions": [0, 0, 1, 0],
            },
            {
                "x": [6, -1, -1, -1, -1, -1, -1, -1],
                "x_segment_ids": [1, 0, 0, 0, 0, 0, 0, 0],
                "x_positions": [0, 0, 0, 0, 0, 0, 0, 0],
                "y": [9, -2, -2, -2],
                "y_segment_ids": [1, 0, 0, 0],
                "y_positions": [0, 0, 0, 0],
            },
        ],
    )


@pytest.mark.parametrize("packer", PACKERS)
def test_max_sequences_per_bin(packer):
    elements = [{"x": [i]} for i in range(1, 6)]
    actual = _pack(
        packer, elements, length_struct={"x": 10}, num_packing_bins=2, max_sequences_per_bin=2
    )
    assert [r["x"][:3].tolist() for r in actual] == [[1, 2, 0], [3, 4, 0], [5, 0, 0]]
    assert [int(r["x_segment_ids"].max()) for r in actual] == [2, 2, 1]


@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_invalid_max_sequences_per_bin(packer, bad, error):
    # Grain's text for a value that is not positive (users match on it).
    grains = rf"If specified, `max_sequences_per_bin` must be a positive integer, but got {bad}\."
    with pytest.raises(error, match=grains if error is ValueError else "max_sequences_per_bin"):
        packer(
            _source([{"x": [1]}]),
            length_struct={"x": 4},
            num_packing_bins=1,
            max_sequences_per_bin=bad,
        )


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("packer", PACKERS)
def test_element_longer_than_target_names_feature_and_lengths(packer):
    ds = packer(
        _source([{"tokens": np.arange(12)}]), length_struct={"tokens": 10}, num_packing_bins=2
    )
    with pytest.raises(
        ValueError, match=r"'tokens' has length 12 but its target length is 10.*truncated"
    ):
        next(iter(ds))


@pytest.mark.parametrize("packer", PACKERS)
def test_missing_feature_names_it(packer):
    ds = packer(
        _source([{"a": [1, 2, 3], "b": [1, 2, 3]}, {"a": [1, 2, 3]}]),
        length_struct={"a": 3, "b": 3},
        num_packing_bins=1,
    )
    with pytest.raises(ValueError, match="no feature 'b'"):
        list(ds)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_packing_bins=0), "num_packing_bins"),
        (dict(length_struct={"x": 0}), "Target length of feature 'x'"),
        (dict(length_struct=4), "length_struct"),
        (dict(seed=-1), "seed"),
        (dict(meta_features="x"), "did you mean"),
        (dict(pack_alignment_struct={"y": 2}), "pack_alignment_struct.*'x'"),
        (dict(shuffle_bins_group_by_feature="nope"), "shuffle_bins_group_by_feature"),
    ],
)
def test_invalid_configuration(kwargs, match):
    args: dict[str, Any] = dict(length_struct={"x": 4}, num_packing_bins=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        FirstFitPackIterDataset(_source([{"x": [1]}]), **args)


@pytest.mark.parametrize("packer", PACKERS)
def test_mismatched_trailing_shape_is_reported(packer):
    ds = packer(
        _source([{"v": np.zeros((2, 3))}, {"v": np.zeros((1, 4))}]),
        length_struct={"v": 4},
        num_packing_bins=1,
    )
    with pytest.raises(ValueError, match="'v' of shape \\(1, 4\\) cannot be packed"):
        list(ds)


@pytest.mark.parametrize("packer", PACKERS)
def test_rows_stay_valid_while_later_groups_are_packed(packer):
    elements = [{"x": np.full(3, i, np.int32)} for i in range(1, 9)]
    it = iter(
        packer(_source(elements), length_struct={"x": 4}, num_packing_bins=2, shuffle_bins=False)
    )
    first = next(it)
    snapshot = {k: v.copy() for k, v in first.items()}
    rest = list(it)
    assert len(rest) == 7
    assert_trees_equal(first, snapshot)
    assert [int(r["x"][0]) for r in [first, *rest]] == list(range(1, 9))


@pytest.mark.parametrize("packer", PACKERS)
def test_each_group_takes_shapes_from_its_first_element(packer):
    elements = [{"v": np.ones((3, 2), np.float32)}, {"v": np.ones((3, 3), np.int64)}]
    rows = _pack(packer, elements, length_struct={"v": 4}, num_packing_bins=1)
    assert [(r["v"].shape, r["v"].dtype) for r in rows] == [
        ((4, 2), np.dtype(np.float32)),
        ((4, 3), np.dtype(np.int64)),
    ]


# ------------------------------------------------------------------ packed buffer bytes
@pytest.mark.parametrize("packer", PACKERS)
def test_packed_batch_size_bytes(packer):
    ds = packer(
        _source(
            [
                {"x": np.zeros(5, np.int64)},
                {"x": np.ones(4, np.int64)},
                {"x": np.zeros(10, np.int64)},
            ]
        ),
        length_struct={"x": 10},
        num_packing_bins=2,
    )
    it = iter(ds)
    with pytest.raises(ValueError, match="call next"):
        it.get_packed_batch_size_bytes()
    next(it)
    # values 2*10*8 + segment ids 2*10*4 + positions 2*10*4 + free cells 2*8.
    assert it.get_packed_batch_size_bytes() == 336


# ------------------------------------------------------------------------- checkpointing
def _random_elements(n: int, seed: int, max_len: int = 30) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"row": rng.integers(0, 10, size=int(rng.integers(1, max_len))), "id": np.int64(i)}
        for i in range(n)
    ]


@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("shuffle_bins", [True, False])
def test_checkpoint_at_every_step(packer, shuffle_bins):
    elements = _random_elements(40, seed=1)
    ds = packer(
        grain.MapDataset.source(elements).to_iter_dataset(),
        length_struct={"row": 40},
        num_packing_bins=3,
        shuffle_bins=shuffle_bins,
        meta_features=["id"],
        seed=7,
    )
    assert_equal_output_after_checkpoint(ds)


@pytest.mark.parametrize("packer", PACKERS)
def test_conformance_with_repeat_and_restore_mid_group(packer):
    elements = _random_elements(25, seed=2)

    def make() -> grain.IterDataset:
        return packer(
            grain.MapDataset.source(elements).repeat(3).to_iter_dataset(),
            length_struct={"row": 50},
            num_packing_bins=4,
            shuffle_bins=True,
            seed=3,
        )

    out = check_iterator_conformance(make, positions=[0, 1, 2, 5, 9, 13, 21])
    assert len(out) > 21
    it = iter(make())
    for _ in range(6):
        next(it)
    state = it.get_state()
    assert set(state) == {"parent", "next_row", "counter"}
    assert state["counter"] == 6
    assert state["parent"] == {"next_index": state["parent"]["next_index"]}


@pytest.mark.parametrize("packer", PACKERS)
def test_state_after_exhaustion_restores_to_end(packer):
    ds = packer(_source(THREE), length_struct={"inputs": 3, "targets": 3}, num_packing_bins=2)
    it = iter(ds)
    assert len(list(it)) == 3
    state = it.get_state()
    fresh = iter(ds)
    fresh.set_state(state)
    with pytest.raises(StopIteration):
        next(fresh)
    assert fresh.get_state() == state


# ---------------------------------------------------------------------------- properties
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), max_size=30),
    bins=st.integers(1, 5),
    best_fit=st.booleans(),
    shuffle=st.booleans(),
    max_seqs=st.one_of(st.none(), st.integers(1, 4)),
    align=st.integers(1, 3),
)
def test_every_sequence_is_packed_once_and_intact(
    lengths, bins, best_fit, shuffle, max_seqs, align
):
    elements = [
        {"a": np.full(la, i + 1, np.int32), "b": np.full(lb, -(i + 1), np.int32)}
        for i, (la, lb) in enumerate(lengths)
    ]
    packer = BestFitPackIterDataset if best_fit else FirstFitPackIterDataset
    rows = list(
        packer(
            grain.MapDataset.source(elements).to_iter_dataset(),
            length_struct={"a": 9, "b": 5},
            num_packing_bins=bins,
            shuffle_bins=shuffle,
            max_sequences_per_bin=max_seqs,
            pack_alignment_struct={"a": align, "b": 1},
        )
    )
    seen: dict[int, tuple[int, int]] = {}
    for row in rows:
        segments = row["a_segment_ids"]
        if max_seqs is not None:
            assert segments.max(initial=0) <= max_seqs
        for sid in range(
            1, int(max(segments.max(initial=0), row["b_segment_ids"].max(initial=0))) + 1
        ):
            a_cells = row["a"][segments == sid]
            b_cells = row["b"][row["b_segment_ids"] == sid]
            owner = int(a_cells[0]) if len(a_cells) else -int(b_cells[0]) if len(b_cells) else None
            if owner is None:  # an element with two empty features leaves no trace
                continue
            assert owner not in seen
            assert (a_cells == owner).all() and (b_cells == -owner).all()
            np.testing.assert_array_equal(
                row["a_positions"][segments == sid], np.arange(len(a_cells))
            )
            seen[owner] = (len(a_cells), len(b_cells))
    assert seen == {i + 1: ln for i, ln in enumerate(lengths) if ln != (0, 0)}


# ------------------------------------------------------------------ PackAndBatchOperation
def test_pack_and_batch_operation_over_records(caplog):
    from grain_core.record import Record, RecordMetadata

    records = [
        Record(RecordMetadata(index=i, record_key=10 + i), {"a": np.asarray(v), "b": np.asarray(w)})
        for i, (v, w) in enumerate([([1, 2], [5]), ([3], [6, 6]), ([4, 4, 4], [7]), ([8], [9])])
    ]
    op = PackAndBatchOperation(length_struct={"a": 3, "b": 3}, batch_size=2)
    assert "deprecated" in caplog.text
    out = list(op(iter(records)))
    assert len(out) == 2
    values, segmentations, positions = out[0].data
    np.testing.assert_array_equal(values["a"], [[1, 2, 3], [4, 4, 4]])
    np.testing.assert_array_equal(values["b"], [[5, 6, 6], [7, 0, 0]])
    np.testing.assert_array_equal(segmentations["a"], [[1, 1, 2], [1, 1, 1]])
    np.testing.assert_array_equal(positions["b"], [[0, 0, 1], [0, 0, 0]])
    assert out[0].metadata.index == 2 and out[0].metadata.record_key is None
    # The final partial batch keeps all batch_size rows; unused rows are padding.
    values, segmentations, _ = out[1].data
    np.testing.assert_array_equal(values["a"], [[8, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(segmentations["b"], [[1, 0, 0], [0, 0, 0]])
    assert out[1].metadata.index == 3


def test_pack_and_batch_operation_limits_and_errors():
    from grain_core.record import Record, RecordMetadata

    records = [Record(RecordMetadata(index=i), np.asarray([i])) for i in range(5)]
    out = list(
        PackAndBatchOperation(length_struct=4, batch_size=1, max_sequences_per_bin=2)(records)
    )
    assert [b.data[0].tolist() for b in out] == [[[0, 1, 0, 0]], [[2, 3, 0, 0]], [[4, 0, 0, 0]]]
    assert list(PackAndBatchOperation(length_struct=4, batch_size=1)([])) == []
    with pytest.raises(ValueError, match="batch_size"):
        PackAndBatchOperation(length_struct=4, batch_size=0)
    with pytest.raises(ValueError, match="max_sequences_per_bin"):
        PackAndBatchOperation(length_struct=4, batch_size=1, max_sequences_per_bin=0)
    too_long = [Record(RecordMetadata(index=0), np.arange(5))]
    with pytest.raises(ValueError, match="length 5 but its target length is 4"):
        list(PackAndBatchOperation(length_struct=4, batch_size=1)(too_long))


def test_exported_from_experimental():
    assert experimental.FirstFitPackIterDataset is FirstFitPackIterDataset
    assert experimental.BestFitPackIterDataset is BestFitPackIterDataset
    assert experimental.PackAndBatchOperation is PackAndBatchOperation


def test_packing_in_worker_processes_restores_exactly():
    elements = [{"x": np.full(i % 7 + 1, i, np.int32)} for i in range(120)]
    ds = FirstFitPackIterDataset(
        grain.MapDataset.source(elements).to_iter_dataset(),
        length_struct={"x": 16},
        num_packing_bins=4,
    ).mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    with iter(ds) as it:
        rows = list(it)
    tokens = np.sort(np.concatenate([r["x"][r["x_segment_ids"] > 0] for r in rows]))
    np.testing.assert_array_equal(tokens, np.sort(np.concatenate([e["x"] for e in elements])))
    with iter(ds) as it:
        for _ in range(5):
            next(it)
        state = it.get_state()
        expected = [next(it) for _ in range(3)]
    with iter(ds) as restored:
        restored.set_state(state)
        for e in expected:
            assert_trees_equal(next(restored), e)

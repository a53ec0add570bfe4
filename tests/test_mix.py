from __future__ import annotations

import pytest
from block_reading import assert_blocks_read_as_elements, block_inputs, element_by_element
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_core as grain
from grain_core.dataset.ops.mix import select_by_proportions
from grain_core.testing import check_iterator_conformance
from grain_core.transforms import DatasetSelectionMap

MD = grain.MapDataset
ID = grain.IterDataset


def test_selection_goldens():
    assert [select_by_proportions(k, (300, 100)) for k in range(8)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (0, 3),
        (0, 4),
        (0, 5),
        (1, 1),
    ]
    assert [select_by_proportions(k, (100, 200, 100)) for k in range(8)] == [
        (0, 0),
        (1, 0),
        (1, 1),
        (2, 0),
        (0, 1),
        (1, 2),
        (1, 3),
        (2, 1),
    ]


def test_mix_goldens():
    evens, odds = MD.source([0, 2, 4, 6, 8]), MD.source([1, 3, 5, 7, 9])
    mixed = MD.mix([evens, odds], [0.75, 0.25])
    assert len(mixed) == 6 and list(mixed) == [0, 2, 4, 1, 6, 8]
    assert list(mixed.repeat(2))[6:11] == [0, 3, 2, 4, 6]
    assert list(MD.mix([MD.range(5), MD.range(7, 10)])) == [0, 7, 1, 8, 2, 9]
    lens = [MD.range(10), MD.range(20), MD.range(5)]
    assert len(MD.mix(lens)) == 15
    assert len(MD.mix(lens, [1, 2, 1])) == 20
    assert repr(mixed) == (
        "MixedMapDataset(parent_lengths=[5, 5], selection_map=SelectionWithProportionsMap("
        "proportions=(300, 100), length=6))"
    )


def test_mix_of_infinite_datasets_keeps_exact_proportions():
    mixed = MD.mix([MD.range(3).repeat(), MD.range(100, 103).repeat()], [0.4, 0.6])
    first = mixed._getitems(range(1000))
    assert sum(x < 100 for x in first) == 400


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"weights": [1, 0]}, "non-zero"),
        ({"weights": [1]}, "2 datasets"),
    ],
)
def test_mix_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MD.mix([MD.range(3), MD.range(3)], **kwargs)


def test_mix_rejects_empty_components():
    with pytest.raises(ValueError, match="positive length"):
        MD.mix([MD.range(3), MD.range(0)])


def test_select_from_datasets_with_explicit_map():
    class Interleave(DatasetSelectionMap):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return i % 2, i // 2

    ds = MD.select_from_datasets([MD.range(3), MD.range(10, 13)], Interleave())
    assert list(ds) == [0, 10, 1, 11, 2, 12]
    assert ds[6] == 0  # next epoch of component 0 is itself a range, so wraps


def test_select_rejects_both_weights_and_selection_map():
    from grain_core.dataset.ops.mix import MixedMapDataset, SelectionWithProportionsMap

    with pytest.raises(ValueError, match="not both"):
        MixedMapDataset(
            [MD.range(2)], proportions=[1], selection_map=SelectionWithProportionsMap((1,), 2)
        )


def test_concatenate_epochs_and_errors():
    ds = MD.concatenate([MD.range(3), MD.range(10, 12)])
    assert list(ds) == [0, 1, 2, 10, 11]
    assert ds[5] == 0 and ds._getitems([4, 5, 9]) == [11, 0, 11]
    shuffled = MD.concatenate([MD.range(3).seed(1).shuffle(), MD.range(2)])
    assert sorted(shuffled[i] for i in range(5, 8)) == [0, 1, 2]  # reshuffled second epoch
    assert list(ds[1:4]) == [1, 2, 10]
    with pytest.raises(ValueError, match="infinite"):
        MD.concatenate([MD.range(3).repeat(), MD.range(2)])


def test_iter_mix_stopping_rule():
    def parts():
        return [MD.range(n).to_iter_dataset() for n in (10, 20, 5)]

    assert len(list(ID.mix(parts()))) == 17
    assert len(list(ID.mix(parts(), [1, 2, 1]))) == 23


def test_iter_mix_checkpoints():
    ds = ID.mix([MD.range(10).to_iter_dataset(), MD.range(100, 120).to_iter_dataset()], [1, 2])
    out = check_iterator_conformance(ds)
    it = iter(ds)
    next(it)
    assert it.get_state() == {
        "parents": [{"next_index": 1}, {"next_index": 0}],
        "index": 1,
        "stop": False,
    }
    assert len(out) == 30  # lengths match the 1:2 weights, so both run out together


def test_iter_mix_mapping_allows_changing_components():
    def build(names):
        return ID.mix({n: MD.range(i * 100, i * 100 + 10).to_iter_dataset() for i, n in names})

    it = iter(build([(0, "a"), (1, "b")]))
    for _ in range(4):
        next(it)
    state = it.get_state()
    assert set(state["parents"]) == {"a", "b"}
    grown = iter(build([(0, "a"), (1, "b"), (2, "c")]))
    grown.set_state(state)
    rest = list(grown)
    assert 200 in rest and 0 not in rest and 2 in rest


def test_iter_mix_error_is_sticky_and_annotated():
    def boom(x):
        raise RuntimeError("broken component")

    ds = ID.mix([MD.range(3).to_iter_dataset(), MD.range(3).to_iter_dataset().map(boom)])
    it = iter(ds)
    next(it)
    with pytest.raises(RuntimeError, match="broken component") as info:
        next(it)
    assert any("mixed dataset 1" in n for n in info.value.__notes__)
    with pytest.raises(StopIteration):
        next(it)


def test_iter_mix_mapping_weight_keys_must_match():
    with pytest.raises(ValueError, match="do not match"):
        ID.mix({"a": MD.range(2).to_iter_dataset()}, {"b": 1.0})


# ------------------------------------------------------------------ block reading
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    weights=st.lists(st.integers(1, 4), min_size=4, max_size=4),
    bad=st.one_of(st.none(), st.integers(0, 100)),
    restore_at=st.integers(0, 100),
)
@settings(max_examples=40, deadline=None)
def test_block_components_give_the_elements_errors_and_states_of_next(
    sizes, weights, bad, restore_at
):
    weights = weights[: len(sizes)]
    blockwise = grain.IterDataset.mix(block_inputs(sizes, bad), weights)
    reference = grain.IterDataset.mix(
        [ds.map(element_by_element) for ds in block_inputs(sizes, bad)], weights
    )
    assert_blocks_read_as_elements(blockwise, reference, restore_at)


def test_mixing_an_empty_dataset_names_it_in_grains_text() -> None:
    empty = grain.MapDataset.range(0)
    with pytest.raises(
        ValueError,
        match=r"All datasets must have positive length for mixing, but dataset\(s\) at "
        r"index 0 \(RangeMapDataset\(start=0, stop=0, step=1\)\), index 2 \(RangeMapDataset"
        r"\(start=0, stop=0, step=1\)\) have length 0",
    ):
        grain.MapDataset.mix([empty, grain.MapDataset.range(3), empty], [1, 1, 1])

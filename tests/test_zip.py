"""Tests of grain_core.dataset.ops.zip."""

from __future__ import annotations

import pytest

from grain_core import MapDataset
from grain_core.experimental import ZipIterDataset, ZipMapDataset
from grain_core.testing import assert_equal_output_after_checkpoint, check_iterator_conformance


def _it(n: int, start: int = 0):  # noqa: ANN202 - small helper
    return MapDataset.range(start, start + n).to_iter_dataset()


def test_zip_map_dataset() -> None:
    ds = ZipMapDataset([MapDataset.range(3), MapDataset.range(10, 13)])
    assert list(ds) == [(0, 10), (1, 11), (2, 12)]
    with pytest.raises(ValueError, match="same length"):
        ZipMapDataset([MapDataset.range(3), MapDataset.range(4)])


def test_zip_map_keeps_a_parents_hole_as_none_in_the_tuple() -> None:
    # Spec 7.14, as in Grain 0.2.18: the zip of a filtered dataset has every index.
    ds = ZipMapDataset([MapDataset.range(4).filter(lambda x: x % 2), MapDataset.range(4)])
    expected = [(None, 0), (1, 1), (None, 2), (3, 3)]
    assert [ds[i] for i in range(4)] == ds._getitems(range(4)) == expected
    assert list(ds) == expected


def test_zip_iter_outputs_and_state() -> None:
    ds = ZipIterDataset([_it(3), _it(3, 10)])
    it = iter(ds)
    assert next(it) == (0, 10)
    assert it.get_state() == {"parents": [{"next_index": 1}, {"next_index": 1}]}
    assert list(it) == [(1, 11), (2, 12)]


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([3, 2], "argument 2 is shorter than argument 1"),
        ([3, 3, 1], "argument 3 is shorter than arguments 1-2"),
        ([2, 3], "argument 2 is longer than argument 1"),
        ([2, 2, 5], "argument 3 is longer than arguments 1-2"),
    ],
)
def test_strict_unequal_lengths(lengths: list[int], message: str) -> None:
    ds = ZipIterDataset([_it(n) for n in lengths])
    with pytest.raises(ValueError) as raised:
        list(ds)
    # The whole text is Grain's: its users (and its tests) compare it literally.
    assert str(raised.value) == f"ZipIterDataset {message}"


def test_non_strict_stops_at_shortest() -> None:
    ds = ZipIterDataset([_it(5), _it(2, 10), _it(4, 20)], strict=False)
    assert list(ds) == [(0, 10, 20), (1, 11, 21)]


def test_needs_a_parent() -> None:
    with pytest.raises(ValueError, match="at least one parent"):
        ZipIterDataset([])


def test_empty_inputs() -> None:
    assert list(ZipIterDataset([_it(0), _it(0)])) == []


@pytest.mark.parametrize("strict", [True, False])
def test_conformance(strict: bool) -> None:
    ds = ZipIterDataset([_it(6), _it(6, 100).map(lambda x: {"y": x})], strict=strict)
    out = check_iterator_conformance(ds, positions=range(7))
    assert out[2] == (2, {"y": 102})
    assert_equal_output_after_checkpoint(ds)


def test_wrong_checkpoint() -> None:
    it = iter(ZipIterDataset([_it(2), _it(2)]))
    with pytest.raises(ValueError, match="different pipeline"):
        it.set_state({"parents": [{"next_index": 0}]})

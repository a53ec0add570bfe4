"""Tests of grain_core.dataset.ops.seed: the node ``.seed()`` adds passes its parent through."""

from __future__ import annotations

import pytest

import grain_core as grain
from grain_core.dataset.ops.seed import _WithSeedIterDataset, _WithSeedMapDataset

MD = grain.MapDataset


def test_a_seeded_map_dataset_reads_its_parent() -> None:
    parent = MD.range(6).map(lambda x: x * 3)
    seeded = parent.seed(5)
    assert isinstance(seeded, _WithSeedMapDataset) and seeded.passes_values
    assert len(seeded) == 6
    assert list(seeded) == list(parent)
    assert list(seeded._getitems([4, 1])) == [12, 3]
    assert list(seeded[1:3]) == [3, 6]
    assert repr(seeded) == "SeedMapDataset(seed=5)"


def test_a_seeded_iter_dataset_iterates_its_parent() -> None:
    parent = MD.range(4).to_iter_dataset()
    seeded = parent.seed(2**40)
    assert isinstance(seeded, _WithSeedIterDataset)
    assert list(seeded) == [0, 1, 2, 3]
    assert repr(seeded) == f"SeedIterDataset(seed={2**40})"


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_the_seed_is_validated_on_both_sides(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        MD.range(3).seed(bad)  # type: ignore[arg-type]
    with pytest.raises((ValueError, TypeError)):
        MD.range(3).to_iter_dataset().seed(bad)  # type: ignore[arg-type]

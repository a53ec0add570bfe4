"""get_next_index / set_next_index through ``mp_prefetch`` (grain_core.dataset.mp.share_index),
with both engines and real worker processes."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
from conftest import mp_options

import grain_core as grain
from grain_core.experimental import get_next_index, set_next_index

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX shm + /dev/shm")

# Workers receive this module's functions by value, so they never import pytest.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _double(x: int) -> int:
    return 2 * x


def _even(x: int) -> bool:
    return x % 2 == 0


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> str:
    if request.param == "rotation":
        request.getfixturevalue("strict_rotation")
    return str(request.param)


@pytest.mark.parametrize("engine", ["dispatch", "rotation"], indirect=True)
def test_one_worker_counts_and_jumps_like_the_pipeline_in_process(engine: str) -> None:
    ds = grain.MapDataset.range(20).to_iter_dataset().map(_double)
    with iter(ds.mp_prefetch(mp_options(1))) as it:
        counts = []
        for _ in range(4):
            counts.append(get_next_index(it))
            next(it)
        assert counts == [0, 1, 2, 3]
        for i in (9, 2, 15):
            set_next_index(it, i)
            assert get_next_index(it) == i
            assert next(it) == 2 * i
        set_next_index(it, 1)
        state_at_one = it.get_state()
        assert [next(it), next(it)] == [2, 4]
        set_next_index(it, 1)
        assert it.get_state() == state_at_one
        set_next_index(it, 20)
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.parametrize("engine", ["dispatch", "rotation"], indirect=True)
def test_one_worker_counts_batches(engine: str) -> None:
    ds = grain.MapDataset.range(10).to_iter_dataset().batch(3)
    with iter(ds.mp_prefetch(mp_options(1))) as it:
        next(it)
        assert get_next_index(it) == 1
        set_next_index(it, 3)
        assert next(it).tolist() == [9]


def test_a_filter_or_several_workers_cannot_count() -> None:
    filtered = grain.MapDataset.range(10).to_iter_dataset().filter(_even)
    with iter(filtered.mp_prefetch(mp_options(1))) as it:
        next(it)
        with pytest.raises(NotImplementedError):
            get_next_index(it)
        with pytest.raises(NotImplementedError):
            set_next_index(it, 3)
    plain = grain.MapDataset.range(10).to_iter_dataset()
    with iter(plain.mp_prefetch(mp_options(2))) as it:
        with pytest.raises(NotImplementedError):
            get_next_index(it)

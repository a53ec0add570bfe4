"""Tests of grain_core.dataset.element_spec."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from grain_core import IterDataset, MapDataset, MultiprocessingOptions, transforms
from grain_core.dataset import element_spec
from grain_core.experimental import (
    CacheIterDataset,
    InterleaveIterDataset,
    LimitIterDataset,
    RebatchIterDataset,
    RepeatIterDataset,
    ShapeDtypeStruct,
    ShapeDtypeStructProtocol,
    ZipIterDataset,
    batch_and_pad,
    get_element_spec,
)

INT = ShapeDtypeStruct((), np.int64)


class _ToPair(transforms.Map):
    def map(self, element: int) -> dict[str, Any]:
        return {"x": np.full((3,), element, np.float32), "y": element}

    def output_spec(self, input_spec: Any) -> dict[str, Any]:
        return {"x": ShapeDtypeStruct((3,), np.float32), "y": input_spec}


def test_shape_dtype_struct() -> None:
    s = ShapeDtypeStruct([2, None], "float32")
    assert s.shape == (2, None)
    assert s.dtype == np.dtype(np.float32)
    assert isinstance(s, ShapeDtypeStructProtocol)
    assert not isinstance(3, ShapeDtypeStructProtocol)
    with pytest.raises(AttributeError):
        s.shape = (1,)  # type: ignore[misc]
    jax = pytest.importorskip("jax")
    assert isinstance(jax.ShapeDtypeStruct((1,), np.int32), ShapeDtypeStructProtocol)


def test_range_and_pass_through_nodes() -> None:
    ds = MapDataset.range(10).seed(1).shuffle().slice(slice(2, 8)).repeat(2).filter(lambda x: x)
    assert get_element_spec(ds) == INT
    it_ds = RepeatIterDataset(
        CacheIterDataset(LimitIterDataset(ds.to_iter_dataset(), 3)), 2
    ).mp_prefetch(MultiprocessingOptions(num_workers=2))
    assert get_element_spec(it_ds) == INT


def test_map_needs_output_spec() -> None:
    ds = MapDataset.range(4).map(_ToPair())
    spec = {"x": ShapeDtypeStruct((3,), np.float32), "y": INT}
    assert get_element_spec(ds) == spec
    assert get_element_spec(MapDataset.range(4).to_iter_dataset().map(_ToPair())) == spec
    element = ds[1]
    assert element["x"].shape == spec["x"].shape and element["x"].dtype == spec["x"].dtype
    with pytest.raises(ValueError, match="output_spec"):
        get_element_spec(MapDataset.range(4).map(lambda x: x))


def test_batch_rebatch_zip_mix_interleave() -> None:
    ds = MapDataset.range(10).map(_ToPair())
    assert get_element_spec(ds.batch(4, drop_remainder=True))["x"] == ShapeDtypeStruct(
        (4, 3), np.float32
    )
    assert get_element_spec(ds.to_iter_dataset().batch(4))["x"] == ShapeDtypeStruct(
        (None, 3), np.float32
    )
    rebatched = RebatchIterDataset(ds.to_iter_dataset().batch(4), 6)
    assert get_element_spec(rebatched)["y"] == ShapeDtypeStruct((6,), np.int64)
    zipped = ZipIterDataset([MapDataset.range(3).to_iter_dataset()] * 2)
    assert get_element_spec(zipped) == (INT, INT)
    assert get_element_spec(MapDataset.mix([MapDataset.range(3), MapDataset.range(4)])) == INT
    inter = InterleaveIterDataset([MapDataset.range(3), MapDataset.range(2)], cycle_length=2)
    assert get_element_spec(inter) == INT


def test_batch_spec_is_unchanged_by_shared_memory_output() -> None:
    # Batches written into shared memory have the spec of the batch function as given.
    map_batch = MapDataset.range(10).map(_ToPair()).batch(4, drop_remainder=True)
    iter_batch = MapDataset.range(10).map(_ToPair()).to_iter_dataset().batch(4)
    specs = [get_element_spec(map_batch), get_element_spec(iter_batch)]
    map_batch.enable_shared_memory_output()
    iter_batch.enable_shared_memory_output()
    assert [get_element_spec(map_batch), get_element_spec(iter_batch)] == specs
    assert specs[0]["x"] == ShapeDtypeStruct((4, 3), np.float32)


def test_custom_batch_fn_needs_output_spec() -> None:
    padded = MapDataset.range(5).batch(3, batch_fn=functools.partial(batch_and_pad, batch_size=3))
    with pytest.raises(NotImplementedError, match="batch_fn"):
        get_element_spec(padded)


def test_unknown_sources_raise() -> None:
    with pytest.raises(NotImplementedError, match="without reading data"):
        get_element_spec(MapDataset.source([1, 2]))
    with pytest.raises(NotImplementedError, match="without reading data"):
        get_element_spec([1, 2])  # type: ignore[arg-type]  # not a dataset at all


def test_node_hook() -> None:
    class Tokens(MapDataset[Any]):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, index: Any) -> Any:
            return np.zeros(8, np.int32)

        def _element_spec(self) -> ShapeDtypeStruct:
            return ShapeDtypeStruct((8,), np.int32)

    assert get_element_spec(Tokens().batch(2)) == ShapeDtypeStruct((None, 8), np.int32)


def _node_classes(cls: type) -> list[type]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _node_classes(sub))]


def test_every_node_class_names_a_rule_of_the_module_or_none() -> None:
    # Each node declares its rule in one line; the rules are the module's, not the nodes'.
    rules = {getattr(element_spec, name) for name in element_spec.__all__ if name.endswith("_spec")}
    rules.discard(element_spec.get_element_spec)
    declared = {
        c: c.element_spec_rule for c in _node_classes(MapDataset) + _node_classes(IterDataset)
    }
    assert {rule for rule in declared.values() if rule is not None} == rules
    assert declared[MapDataset] is None and declared[IterDataset] is None

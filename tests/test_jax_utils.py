"""device_put and make_global_batch on 4 host-platform CPU devices."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

# JAX reads XLA_FLAGS when its backend starts; test modules are imported (collected) before any
# test runs, so the 4 host devices are in place whichever test touches JAX first.
_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

jax = pytest.importorskip("jax")

import grain_core as grain  # noqa: E402
from grain_core.checkpoint import CheckpointHandler  # noqa: E402
from grain_core.experimental import device_put, make_global_batch  # noqa: E402
from grain_core.jax_utils import _local_parts_of_leading_dim  # noqa: E402

P = jax.sharding.PartitionSpec


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    devices = jax.devices()
    assert len(devices) >= 4, (
        f"expected 4 CPU devices from {_FLAG}, got {devices}: the JAX backend was started "
        "before this module set XLA_FLAGS."
    )
    return jax.make_mesh((4,), ("data",), devices=devices[:4])


def _batches(num_records: int = 64, batch_size: int = 8) -> grain.IterDataset:
    records = [
        {"x": np.full((3,), i, np.float32), "label": np.int32(i)} for i in range(num_records)
    ]
    return grain.MapDataset.source(records).batch(batch_size).to_iter_dataset()


def _host(tree: object) -> object:
    return jax.tree.map(np.asarray, tree)


def test_device_put_to_one_device_keeps_order_and_values() -> None:
    device = jax.devices()[1]
    out = list(device_put(_batches(), device))
    expected = list(_batches())
    assert len(out) == len(expected) == 8
    for got, want in zip(out, expected, strict=True):
        assert isinstance(got["x"], jax.Array)
        assert got["x"].devices() == {device}
        grain.testing.assert_trees_equal(_host(got), want)


def test_device_put_with_named_sharding_splits_rows_over_the_mesh(
    mesh: jax.sharding.Mesh,
) -> None:
    sharding = jax.sharding.NamedSharding(mesh, P("data"))
    first = next(iter(device_put(_batches(), sharding)))
    x = first["x"]
    assert x.shape == (8, 3) and x.dtype == np.float32
    assert x.sharding == sharding
    rows = {shard.device: np.asarray(shard.data)[:, 0].tolist() for shard in x.addressable_shards}
    assert sorted(rows.values()) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert first["label"].sharding.shard_shape((8,)) == (2,)
    np.testing.assert_array_equal(np.asarray(first["label"]), np.arange(8))


def test_make_global_batch_replicated_and_nested(mesh: jax.sharding.Mesh) -> None:
    replicated = jax.sharding.NamedSharding(mesh, P())
    batch = {"a": [np.arange(6).reshape(2, 3)], "b": (np.float32(2.5),)}
    out = make_global_batch(batch, replicated)
    assert out["a"][0].shape == (2, 3)
    assert all(s.data.shape == (2, 3) for s in out["a"][0].addressable_shards)
    np.testing.assert_array_equal(np.asarray(out["a"][0]), batch["a"][0])
    assert float(out["b"][0]) == 2.5


def test_leading_dim_not_divisible_over_mesh_is_a_clear_error(mesh: jax.sharding.Mesh) -> None:
    sharding = jax.sharding.NamedSharding(mesh, P("data"))
    with pytest.raises(ValueError, match=r"\['x'\] has shape \(6, 3\).*multiple of 4"):
        make_global_batch({"x": np.zeros((6, 3))}, sharding)
    # Through device_put: 18 records in batches of 8 end with a batch of 2 rows.
    it = iter(device_put(_batches(num_records=18), sharding))
    next(it), next(it)
    with pytest.raises(ValueError, match=r"leading dimension 2 does not divide over the 4"):
        next(it)


def test_leading_dim_split_over_two_mesh_axes(mesh: jax.sharding.Mesh) -> None:
    grid = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    assert _local_parts_of_leading_dim(jax.sharding.NamedSharding(grid, P("data")), 2) == 2
    both = jax.sharding.NamedSharding(grid, P(("data", "model")))
    assert _local_parts_of_leading_dim(both, 2) == 4
    out = make_global_batch(np.arange(4.0), both)
    assert out.sharding.shard_shape((4,)) == (1,)


def test_checkpoint_restores_exactly_despite_prefetched_elements(tmp_path: object) -> None:
    device = jax.devices()[0]
    ds = device_put(_batches(), device, cpu_buffer_size=3, device_buffer_size=2)
    it = iter(ds)
    for _ in range(3):
        next(it)
    CheckpointHandler().save(tmp_path, it)
    rest = [_host(b) for b in it]
    it.close()
    restored = CheckpointHandler().restore(tmp_path, iter(ds))
    resumed = [_host(b) for b in restored]
    assert len(resumed) == len(rest) == 5
    grain.testing.assert_trees_equal(resumed, rest)


def test_prefetches_ahead_of_the_consumer() -> None:
    produced = []
    enough = threading.Event()

    def count(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        produced.append(int(batch["label"][0]))
        if len(produced) >= 4:
            enough.set()
        return batch

    ds = device_put(
        _batches().map(count), jax.devices()[0], cpu_buffer_size=2, device_buffer_size=1
    )
    with iter(ds) as it:
        next(it)
        # One element consumed; the threads fill both buffers without further next() calls.
        assert enough.wait(timeout=30), f"only {len(produced)} elements were read ahead"


def test_data_loader_input_keeps_the_loader_checkpoint_format(tmp_path: object) -> None:
    source = np.arange(40, dtype=np.int32)  # JAX keeps int32 unless x64 is enabled
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(40, shuffle=True, seed=3, num_epochs=1),
        operations=[grain.transforms.Batch(4)],
    )
    expected = [np.asarray(b) for b in loader]
    it = iter(device_put(loader, jax.devices()[2]))
    got = [np.asarray(next(it)) for _ in range(4)]
    CheckpointHandler().save(tmp_path / "a", it)
    reference = iter(loader)
    for _ in range(4):
        next(reference)
    (saved,) = (tmp_path / "a").iterdir()
    assert saved.read_text() == reference.get_state().decode()
    it.close()
    restored = CheckpointHandler().restore(
        tmp_path / "a", iter(device_put(loader, jax.devices()[2]))
    )
    got += [np.asarray(b) for b in restored]
    grain.testing.assert_trees_equal(got, expected)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="jax.Device or a jax.sharding.Sharding"):
        device_put(_batches(), "cpu:0")
    with pytest.raises(TypeError, match=r"to_iter_dataset\(\) first"):
        device_put(grain.MapDataset.range(4), jax.devices()[0])
    with pytest.raises(ValueError, match="cpu_buffer_size=-1"):
        device_put(_batches(), jax.devices()[0], cpu_buffer_size=-1)


def test_without_jax_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)  # makes `import jax` raise ImportError
    with pytest.raises(ImportError, match=r"pip install jax"):
        device_put(_batches(), object())
    with pytest.raises(ImportError, match=r"pip install jax"):
        make_global_batch(np.zeros(2), object())


def test_execution_summary_through_a_data_loader() -> None:
    from grain_core.experimental import (
        DatasetOptions,
        ExecutionTrackingMode,
        WithOptionsIterDataset,
        get_execution_summary,
    )

    loader = grain.DataLoader(
        data_source=np.arange(64, dtype=np.int32),
        sampler=grain.samplers.SequentialSampler(64),
        operations=[grain.transforms.Batch(8)],
    )
    options = DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING)
    device = jax.devices()[0]
    with iter(WithOptionsIterDataset(device_put(loader, device), options)) as it:
        assert len(list(it)) == 8
        names = [stage.name for stage in get_execution_summary(it).stages]
    assert f"Map(device_put({device}))" in names
    assert "DataLoader" in names

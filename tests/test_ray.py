"""grainpipe-ray: mp_prefetch workers as Ray actors, against a real local Ray instance (started
once for the session by a fixture, two CPUs, no dashboard, and shut down after it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import cloudpickle
import numpy as np
import pytest
from conftest import fails_after

ray = pytest.importorskip("ray")
grain_ray = pytest.importorskip("grain_ray")

import grain_core as grain  # noqa: E402
from grain_core._ipc.errors import WorkerDiedError  # noqa: E402
from grain_core.options import MultiprocessingOptions  # noqa: E402
from grain_core.plugins import WorkerGroup, WorkerJob  # noqa: E402

# The test's functions travel by value: Ray's worker processes cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

_OBJECT_STORE_BYTES = 100 * 1024 * 1024


@pytest.fixture(scope="session")
def ray_instance() -> Iterator[None]:
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=2,
        object_store_memory=_OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


class _RecordingBackend(grain_ray.RayBackend):
    """A RayBackend that keeps the groups it started (their actors, for the tests)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: list[Any] = []

    def start(self, job: WorkerJob) -> WorkerGroup:
        group = super().start(job)
        self.groups.append(group)
        return group


def _heavy(x: int) -> dict[str, Any]:
    rng = np.random.default_rng(x)
    image = rng.random((16, 16)).astype(np.float32)
    return {"image": image @ image.T, "label": x % 10}


def _pipeline(length: int = 40) -> grain.IterDataset:
    return grain.MapDataset.range(length).map(_heavy).to_iter_dataset().batch(4)


def _opts(n: int, backend: Any = "local") -> MultiprocessingOptions:
    return MultiprocessingOptions(num_workers=n, backend=backend)


def _equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def local_output() -> list[Any]:
    return list(_pipeline().mp_prefetch(_opts(2)))


def test_output_equals_local_workers_and_zero_workers(
    ray_instance: None, local_output: list[Any]
) -> None:
    got = list(_pipeline().mp_prefetch(_opts(2, "ray")))
    assert _equal(got, local_output)
    elements = grain.MapDataset.range(30).map(_heavy).batch(4).to_iter_dataset()
    assert _equal(list(elements.mp_prefetch(_opts(2, "ray"))), list(elements))
    # One actor computing both classes: the same output.
    one_actor = list(_pipeline().mp_prefetch(_opts(2, grain_ray.RayBackend(1))))
    assert _equal(one_actor, local_output)


def test_checkpoints_are_the_local_workers_and_restore_across_backends(
    ray_instance: None, local_output: list[Any]
) -> None:
    on_ray = iter(_pipeline().mp_prefetch(_opts(2, "ray")))
    local = iter(_pipeline().mp_prefetch(_opts(2)))
    for _ in range(3):
        next(on_ray)
        next(local)
    state = on_ray.get_state()
    assert state == local.get_state()
    on_ray.close()
    local.set_state(state)
    assert _equal(list(local), local_output[3:])
    restored = iter(_pipeline().mp_prefetch(_opts(2, grain_ray.RayBackend(1))))
    restored.set_state(state)
    assert _equal(list(restored), local_output[3:])


def _small_tasks() -> grain.IterDataset:
    """Tasks of at most two batches (the read-ahead) and more batches than the window of tasks
    in flight: actors killed after the first batches are given more, and found dead."""
    return (
        grain.MapDataset.range(160)
        .map(_heavy)
        .to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
        .batch(4)
    )


def test_a_killed_actor_has_its_positions_reassigned(ray_instance: None) -> None:
    expected = list(_small_tasks().mp_prefetch(_opts(2)))
    backend = _RecordingBackend()
    it = iter(_small_tasks().mp_prefetch(_opts(2, backend)))
    got = [next(it) for _ in range(2)]
    group = backend.groups[0]
    ray.kill(group.actors[0])
    got += list(it)
    assert _equal(got, expected)
    assert group.workers() == [1]


def test_every_actor_killed_is_an_error_naming_them(ray_instance: None) -> None:
    expected = list(_small_tasks().mp_prefetch(_opts(2)))
    backend = _RecordingBackend()
    it = iter(_small_tasks().mp_prefetch(_opts(2, backend)))
    got = [next(it)]
    for actor in backend.groups[0].actors:
        ray.kill(actor)
    with pytest.raises(WorkerDiedError, match="Ray actor 0 of 2") as info:
        while True:
            got.append(next(it))
    assert "Ray actor 1 of 2" in str(info.value)
    assert _equal(got, expected[: len(got)])  # nothing lost or repeated before


def _large(x: int) -> np.ndarray:
    return np.full((256, 1024), x, np.float32)  # 1 MiB: Ray keeps it in the object store


def test_large_arrays_arrive_as_views_of_the_object_store(ray_instance: None) -> None:
    ds = grain.MapDataset.range(6).map(_large).to_iter_dataset()
    got = list(ds.mp_prefetch(_opts(2, "ray")))
    assert [int(a[0, 0]) for a in got] == list(range(6))
    # Not copied out of the store: read-only views (np.array(a) makes a writable copy).
    assert not any(a.flags.writeable for a in got)


class _UnknownLabelError(LookupError):
    pass


def _fails_at_nine(x: int) -> int:
    if x == 9:
        raise _UnknownLabelError(f"record {x} has no label")
    return x


def test_user_exceptions_arrive_with_type_and_remote_traceback(ray_instance: None) -> None:
    ds = grain.MapDataset.range(20).map(_fails_at_nine).to_iter_dataset()
    it = iter(ds.mp_prefetch(_opts(2, "ray")))
    got = []
    with pytest.raises(_UnknownLabelError, match="record 9") as info:
        while True:
            got.append(next(it))
    assert got == list(range(9))
    notes = "\n".join(info.value.__notes__)
    assert "Raised in Ray actor" in notes and "on node" in notes and "_fails_at_nine" in notes
    it.close()


class _CountsUnpickling:
    """A map function that counts, in the process's environment, how often it was unpickled."""

    def __init__(self) -> None:
        self.unpickled = False  # a state, so that unpickling calls __setstate__

    def __call__(self, x: int) -> tuple[int, str, int]:
        return x, os.environ.get("JAX_PLATFORMS", ""), int(os.environ["GRAIN_TEST_UNPICKLED"])

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.unpickled = True
        count = int(os.environ.get("GRAIN_TEST_UNPICKLED", "0")) + 1
        os.environ["GRAIN_TEST_UNPICKLED"] = str(count)


def test_actors_get_the_pipeline_once_and_cpu_jax_and_are_killed_on_close(
    ray_instance: None,
) -> None:
    backend = _RecordingBackend()
    ds = grain.MapDataset.range(200).map(_CountsUnpickling()).to_iter_dataset()
    it = iter(ds.mp_prefetch(_opts(2, backend)))
    got = list(it)
    assert [x for x, _, _ in got] == list(range(200))
    assert {(platforms, unpickled) for _, platforms, unpickled in got} == {("cpu", 1)}
    actors = backend.groups[0].actors
    assert len(actors) == 2 and ray.get(actors[0].where.remote())  # still running
    it.close()
    for actor in actors:
        # ray.kill returns before the process is gone: a call may still be answered until
        # then, and the first after its death fails.
        with fails_after(120), pytest.raises(ray.exceptions.RayActorError):
            while True:
                ray.get(actor.where.remote())


def test_actors_that_cannot_be_placed_are_an_error_saying_what_the_cluster_has(
    ray_instance: None,
) -> None:
    backend = grain_ray.RayBackend(resources={"no_such_accelerator": 1}, start_timeout_s=1)
    it = iter(_pipeline().mp_prefetch(_opts(2, backend)))
    with pytest.raises(RuntimeError, match="no_such_accelerator") as info:
        next(it)
    assert "did not start" in str(info.value) and "CPU" in str(info.value)


def test_the_data_loader_runs_its_workers_on_ray(ray_instance: None) -> None:
    def loader(backend: str) -> grain.DataLoader:
        return grain.DataLoader(
            data_source=grain.sources.RangeDataSource(0, 24, 1),
            sampler=grain.samplers.IndexSampler(
                24, grain.sharding.NoSharding(), shuffle=True, seed=3, num_epochs=1
            ),
            operations=[grain.transforms.Batch(5)],
            worker_count=2,
            worker_backend=backend,
        )

    local = [b.tolist() for b in loader("local")]
    on_ray = [b.tolist() for b in loader("ray")]
    assert on_ray == local


def test_stream_pipelines_are_refused_naming_the_node() -> None:
    ds = grain.MapDataset.range(10).to_iter_dataset().filter(lambda x: x % 2 == 0)
    with pytest.raises(ValueError, match='FilterIterDataset.*backend="local"'):
        ds.mp_prefetch(_opts(2, "ray"))


def test_backend_options_are_checked() -> None:
    with pytest.raises(ValueError, match="num_actors"):
        grain_ray.RayBackend(0)
    with pytest.raises(ValueError, match="num_cpus"):
        grain_ray.RayBackend(num_cpus=-1)
    with pytest.raises(ValueError, match="'gpu'"):
        grain_ray.RayBackend(resources={"gpu": -1})


_ALIAS_CLIENT = """
import grain


def double(x):
    return 2 * x


def alias_in_force():
    import grain_core

    return grain is grain_core
"""

# docs/compatibility.md's recipe for Ray, in a driver of its own (the set-up hook is the
# job's, given to ray.init): tasks and actors unpickle functions of a module that imports
# grain, and import grain themselves.
_ALIAS_DRIVER = """
import ray

import grain_core

grain_core.install_as_grain()
import client

ray.init(
    address="local",
    num_cpus=1,
    include_dashboard=False,
    log_to_driver=False,
    object_store_memory={object_store_bytes},
    runtime_env={{
        "worker_process_setup_hook": "grain_core.install_as_grain",
        "env_vars": {{"GRAIN_CORE_AS_GRAIN": "1"}},
    }},
)
try:

    @ray.remote
    def task(x):
        import grain

        return client.alias_in_force(), client.double(x), list(grain.MapDataset.range(3))

    @ray.remote
    class Reader:
        def read(self):
            import grain

            return client.alias_in_force(), list(grain.MapDataset.range(4).map(client.double))

    print(ray.get(task.remote(21)))
    print(ray.get(Reader.remote().read.remote()))
finally:
    ray.shutdown()
"""


def test_tasks_and_actors_import_grain_core_as_grain_under_the_documented_recipe(
    tmp_path: Any,
) -> None:
    (tmp_path / "client.py").write_text(_ALIAS_CLIENT)
    driver = tmp_path / "driver.py"
    driver.write_text(_ALIAS_DRIVER.format(object_store_bytes=_OBJECT_STORE_BYTES))
    environment = {k: v for k, v in os.environ.items() if k != "GRAIN_CORE_AS_GRAIN"}
    environment["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, sys.path)])
    done = subprocess.run(
        [sys.executable, str(driver)], cwd=tmp_path, env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["(True, 42, [0, 1, 2])", "(True, [0, 2, 4, 6])"]

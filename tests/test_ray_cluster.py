"""grainpipe-ray on a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``):
actors placed on the nodes their resources name, and a node lost mid-stream. Slow (two Ray
nodes start): CI runs these only with GRAIN_CORE_SLOW_TESTS=1 (tests/conftest.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import cloudpickle
import numpy as np
import pytest

ray = pytest.importorskip("ray")
grain_ray = pytest.importorskip("grain_ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

import grain_core as grain  # noqa: E402
from grain_core.options import MultiprocessingOptions  # noqa: E402
from grain_core.plugins import WorkerGroup, WorkerJob  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster() -> Iterator[Any]:
    """A head node and a second node, one CPU and one unit of resource ``preprocessing`` each;
    a lost node is noticed after about two failed health checks of 0.5 s."""
    if ray.is_initialized():
        ray.shutdown()  # another module's instance; its fixture ends with a shutdown anyway
    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"preprocessing": 1},
            "object_store_memory": 80 * 1024 * 1024,
            "include_dashboard": False,
            "_system_config": {
                "health_check_initial_delay_ms": 0,
                "health_check_period_ms": 500,
                "health_check_failure_threshold": 2,
            },
        },
    )
    cluster.add_node(
        num_cpus=1, resources={"preprocessing": 1}, object_store_memory=80 * 1024 * 1024
    )
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class _RecordingBackend(grain_ray.RayBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: list[Any] = []

    def start(self, job: WorkerJob) -> WorkerGroup:
        group = super().start(job)
        self.groups.append(group)
        return group


def _square_rows(x: int) -> np.ndarray:
    return np.arange(256, dtype=np.float32) * x


def _pipeline() -> grain.IterDataset:
    return (
        grain.MapDataset.range(240)
        .map(_square_rows)
        .to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
        .batch(4)
    )


def test_one_actor_per_node_and_a_node_lost_midstream(cluster: Any) -> None:
    expected = list(_pipeline().mp_prefetch(MultiprocessingOptions(num_workers=2)))
    # Each actor needs the unit of `preprocessing` a node has: one actor per node.
    backend = _RecordingBackend(2, num_cpus=0.5, resources={"preprocessing": 1})
    it = iter(_pipeline().mp_prefetch(MultiprocessingOptions(num_workers=2, backend=backend)))
    got = [next(it) for _ in range(3)]
    group = backend.groups[0]
    head, second = cluster.head_node, cluster.list_all_nodes()[1]
    on_second = [w for w in (0, 1) if second.node_id[:12] in group.describe(w)]
    assert len(on_second) == 1 and head.node_id[:12] in group.describe(1 - on_second[0])
    cluster.remove_node(second)
    got += list(it)
    assert len(got) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert group.workers() == [1 - on_second[0]]

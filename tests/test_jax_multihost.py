"""Multi-host on JAX's own runtime: 2 and 3 processes joined by ``jax.distributed.initialize``.

Each process (tests/_jax_host.py) reads its ``ShardByJaxProcess`` shard of one DataLoader,
checkpoints it with ``CheckpointHandler`` into a shared directory, and is killed; fresh
processes restore and must produce exactly the rest. The 3-process cluster also feeds global
``jax.Array``s through ``device_put`` with a ``NamedSharding`` over all processes' devices.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jax")

HOST_SCRIPT = Path(__file__).with_name("_jax_host.py")
DEVICES_PER_PROCESS = 2
# Generous: each process imports JAX and joins the cluster, on a loaded 2-core CI machine.
PHASE_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _host_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GRAIN_CORE_WORKER_JAX_PLATFORMS", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    return env


class Cluster:
    """``n`` host processes of one phase; every process is killed on exit, whatever happened."""

    def __init__(self, tmp: Path, phase: str, cfg: dict[str, Any]) -> None:
        self.tmp, self.phase, self.n = tmp, phase, cfg["num_processes"]
        self.logs = [tmp / f"{phase}-{i}.log" for i in range(self.n)]
        port = _free_port()
        self.procs = []
        for i in range(self.n):
            host_cfg = dict(cfg, process_id=i, phase=phase, port=port, out_dir=str(tmp))
            with self.logs[i].open("wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(HOST_SCRIPT), json.dumps(host_cfg)],
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=_host_env(),
                    )
                )

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)

    def _failure(self, what: str) -> str:
        logs = "\n".join(
            f"--- process {i} (exit {p.poll()}):\n{log.read_text(errors='replace')[-3000:]}"
            for i, (p, log) in enumerate(zip(self.procs, self.logs, strict=True))
        )
        return f"{self.phase}: {what}\n{logs}"

    def reports(self) -> list[dict[str, Any]]:
        """Waits (bounded) until every process has written its report; fails on a crash."""
        paths = [self.tmp / f"{self.phase}-{i}.json" for i in range(self.n)]
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while not all(p.exists() for p in paths):
            crashed = [p for p in self.procs if p.poll() not in (None, 0)]
            if crashed:
                pytest.fail(self._failure("a process crashed"))
            if time.monotonic() > deadline:
                pytest.fail(self._failure(f"no report after {PHASE_TIMEOUT_S:.0f} s"))
            time.sleep(0.05)
        return [json.loads(p.read_text()) for p in paths]

    def wait_success(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=PHASE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(self._failure("did not exit"))
        if any(p.returncode != 0 for p in self.procs):
            pytest.fail(self._failure("a process failed"))


def _indices(steps: list[dict[str, Any]]) -> list[int]:
    return [i for step in steps for i in step["index"]]


def _without_pids(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in step.items() if k != "pid"} for step in steps]


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; an exited process nobody has reaped yet (a zombie) is dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not Path("/proc/self").exists()  # no procfs: trust os.kill
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _write_single_process_elastic_checkpoint(directory: Path) -> None:
    from grain_core import MapDataset
    from grain_core.checkpoint import CheckpointHandler
    from grain_core.experimental import ElasticIterator
    from grain_core.sharding import ShardOptions

    it = ElasticIterator(MapDataset.range(60), 6, ShardOptions(0, 1))
    next(it), next(it)
    CheckpointHandler().save(directory, it)
    assert [p.name for p in directory.iterdir()] == ["process_0-of-1.json"]


def _run_preempted_and_resumed(
    tmp_path: Path, cfg: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    n = cfg["num_processes"]
    cfg = dict(
        cfg,
        checkpoint_dir=str(tmp_path / "ckpt"),
        other_count_dir=str(tmp_path / "other"),
        elastic_dir=str(tmp_path / "elastic"),
    )
    _write_single_process_elastic_checkpoint(tmp_path / "elastic")
    other = tmp_path / "other"
    other.mkdir()
    for i in range(n + 1):  # a checkpoint written by a cluster of another size
        (other / f"process_{i}-of-{n + 1}.json").write_text("{}")
    with Cluster(tmp_path, "first", cfg) as cluster:
        first = cluster.reports()
        cluster.kill()  # preemption: every host, with its workers, at once
    worker_pids = {pid for r in first for step in r["head"] for pid in step["pid"]} - {
        r["pid"] for r in first
    }
    deadline = time.monotonic() + 30
    while any(_pid_alive(pid) for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_pid_alive(pid) for pid in worker_pids), "workers outlived their killed host"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        f"process_{i}-of-{n}.json" for i in range(n)
    ]
    with Cluster(tmp_path, "resume", cfg) as cluster:
        resumed = cluster.reports()
        cluster.wait_success()
    for i, (before, after) in enumerate(zip(first, resumed, strict=True)):
        assert before["process_index"] == after["process_index"] == i
        assert before["process_count"] == after["process_count"] == n
        # Everything but the pids of the (new) processes that ran the map must match.
        assert _without_pids(after["tail"]) == _without_pids(before["tail"]), (
            f"process {i} did not resume where it stopped"
        )
        assert f"written by {n + 1} processes, and this run has {n}" in after["other_count_error"]
    # The single-process elastic checkpoint stood after 2 global batches of 6: every process
    # continues with its share of global batch 3, elements 12..17.
    shares = [r["elastic_batch"] for r in resumed]
    assert all(len(share) == 6 // n for share in shares)
    assert sorted(x for share in shares for x in share) == list(range(12, 18))
    return first, resumed


def test_two_hosts_with_a_worker_each_shard_checkpoint_and_resume(tmp_path: Path) -> None:
    cfg = {
        "num_processes": 2,
        "num_records": 27,
        "batch_size": 4,
        "drop_remainder": False,
        "worker_count": 1,
        "global_arrays": False,
        "checkpoint_step": 2,
    }
    first, _ = _run_preempted_and_resumed(tmp_path, cfg)
    shards = [_indices(r["head"] + r["tail"]) for r in first]
    assert [len(s) for s in shards] == [14, 13]  # the first 27 % 2 shards get one extra
    assert set(shards[0]).isdisjoint(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(27))
    for report in first:
        for step in report["head"] + report["tail"]:
            # The map ran in a worker process, which never imported (let alone initialised)
            # JAX and would only ever see the CPU platform.
            assert report["pid"] not in step["pid"]
            assert not any(step["jax_imported"]) and all(step["cpu_only"])


def test_three_hosts_global_arrays_drop_remainder(tmp_path: Path) -> None:
    n, per_process_batch = 3, 4
    cfg = {
        "num_processes": n,
        "num_records": 50,
        "batch_size": per_process_batch,
        "drop_remainder": True,
        "worker_count": 0,
        "global_arrays": True,
        "checkpoint_step": 2,
    }
    first, resumed = _run_preempted_and_resumed(tmp_path, cfg)
    shards = [_indices(r["head"] + r["tail"]) for r in first]
    assert [len(s) for s in shards] == [16, 16, 16]  # 50 // 3 each; 2 records dropped
    assert len(set().union(*shards)) == 48 and set().union(*shards) <= set(range(50))
    steps = len(first[0]["head"] + first[0]["tail"])
    assert steps == 4
    for step in range(steps):
        rows = [(r["head"] + r["tail"])[step] for r in first]
        expected_sum = sum(sum(row["index"]) for row in rows)
        for i, row in enumerate(rows):
            assert row["global_shape"] == [n * per_process_batch]
            assert row["row_start"] == i * per_process_batch  # process i owns its rows
            assert row["global_sum"] == expected_sum  # computed on all processes' devices
    for report in resumed:
        assert all(row["global_shape"] == [n * per_process_batch] for row in report["tail"])

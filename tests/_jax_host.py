"""One JAX process of the multi-host tests (tests/test_jax_multihost.py); not a test module.

Usage: ``python _jax_host.py CONFIG_JSON``. The process joins a CPU-only JAX cluster through
``jax.distributed.initialize``, reads its shard of a DataLoader (``ShardByJaxProcess``) and
writes what it saw to ``{out_dir}/{phase}-{process_id}.json``.

* phase ``first``: reads ``checkpoint_step`` batches, saves the loader with
  ``CheckpointHandler`` into ``checkpoint_dir``, reads the rest, reports, then waits to be
  killed (a preemption; the test kills every process).
* phase ``resume``: restores from ``checkpoint_dir`` and reads the rest; also tries to restore
  ``other_count_dir`` (written by another process count) and reports the error, and restores
  an ``ElasticIterator`` from ``elastic_dir`` (written by a single process).

With ``global_arrays`` the loader goes through ``device_put`` onto a ``NamedSharding`` over
every process's devices, so each step is one global ``jax.Array``, summed by a jitted
all-process computation.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

import grain_core as grain
from grain_core.checkpoint import CheckpointHandler
from grain_core.experimental import ElasticIterator, device_put
from grain_core.sharding import ShardByJaxProcess


class Describe(grain.transforms.Map):
    """Tags each record with facts about the process that ran the map (a worker if any)."""

    def map(self, element: Any) -> dict[str, Any]:
        jax_module = sys.modules.get("jax")
        return {
            "index": np.int32(element),
            "pid": np.int32(os.getpid()),
            "jax_imported": np.bool_(jax_module is not None),
            "cpu_only": np.bool_(os.environ.get("JAX_PLATFORMS") == "cpu"),
        }


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _make_loader(cfg: dict[str, Any]) -> grain.DataLoader:
    sampler = grain.samplers.IndexSampler(
        cfg["num_records"],
        shard_options=ShardByJaxProcess(drop_remainder=cfg["drop_remainder"]),
        shuffle=True,
        num_epochs=1,
        seed=7,
    )
    return grain.DataLoader(
        data_source=np.arange(cfg["num_records"], dtype=np.int32),
        sampler=sampler,
        operations=[
            Describe(),
            grain.transforms.Batch(cfg["batch_size"], drop_remainder=cfg["global_arrays"]),
        ],
        worker_count=cfg["worker_count"],
    )


def _describe_step(batch: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(batch["index"], jax.Array):
        return {key: np.asarray(value).tolist() for key, value in batch.items()}
    index = batch["index"]
    shards = sorted(index.addressable_shards, key=lambda s: s.index[0].start)
    total = jax.jit(lambda x: x.sum())(index)
    return {
        "index": np.concatenate([np.asarray(s.data) for s in shards]).tolist(),
        "row_start": shards[0].index[0].start,
        "global_shape": list(index.shape),
        "global_sum": int(total.addressable_data(0)),
        "pid": np.asarray(batch["pid"].addressable_data(0)).tolist(),
        "jax_imported": np.asarray(batch["jax_imported"].addressable_data(0)).tolist(),
        "cpu_only": np.asarray(batch["cpu_only"].addressable_data(0)).tolist(),
    }


def main() -> None:
    cfg = json.loads(sys.argv[1])
    process_id, count = cfg["process_id"], cfg["num_processes"]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{cfg['port']}",
        num_processes=count,
        process_id=process_id,
        initialization_timeout=120,
    )
    loader = _make_loader(cfg)
    if cfg["global_arrays"]:
        mesh = jax.make_mesh((len(jax.devices()),), ("data",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        it: Any = iter(device_put(loader, sharding))
    else:
        it = iter(loader)
    handler = CheckpointHandler()
    report: dict[str, Any] = {
        "pid": os.getpid(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
    }
    if cfg["phase"] == "first":
        head = [_describe_step(next(it)) for _ in range(cfg["checkpoint_step"])]
        handler.save(cfg["checkpoint_dir"], it)
        report.update(head=head, tail=[_describe_step(b) for b in it])
    else:
        handler.restore(cfg["checkpoint_dir"], it)
        report["tail"] = [_describe_step(b) for b in it]
        try:
            handler.restore(cfg["other_count_dir"], iter(loader))
        except ValueError as err:
            report["other_count_error"] = str(err)
        # Written by one process; an ElasticIterator restores it under this process count.
        elastic = ElasticIterator(grain.MapDataset.range(60), 6, ShardByJaxProcess())
        handler.restore(cfg["elastic_dir"], elastic)
        report["elastic_batch"] = next(elastic).tolist()
    _write_json(Path(cfg["out_dir"]) / f"{cfg['phase']}-{process_id}.json", report)
    if cfg["phase"] == "first":
        # Preempted here, iterator and workers alive: the test kills every process.
        sys.stdin.read()
    it.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

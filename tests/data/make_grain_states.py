"""Writes ``grain_states.json``: DataLoader checkpoints taken by Google Grain, with the stream
Grain produced after each, for ``tests/test_data_loader.py`` and ``tests/test_arrayrecord.py``.

Run it in a virtualenv with Google Grain and array_record installed (never grain_core's own):
``python tests/data/make_grain_states.py tests/data/grain_states.json``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import tempfile
from typing import Any

import absl.flags
import numpy as np

absl.flags.FLAGS.mark_as_parsed()  # Grain's worker processes need parsed flags

import grain.python as gp  # noqa: E402 - after the flags


class TimesTen(gp.MapTransform):
    def map(self, x: Any) -> Any:
        return x * 10


class NotThirds(gp.FilterTransform):
    def filter(self, x: Any) -> bool:
        return bool(x % 3 != 0)


class Twice(gp.experimental.FlatMapTransform):
    max_fan_out = 2

    def flat_map(self, x: Any) -> list[Any]:
        return [x, x + 100]


class ToInt(gp.MapTransform):
    def map(self, x: Any) -> Any:
        return int(x)


OPERATIONS = {
    "none": lambda: [],
    "batch4": lambda: [gp.Batch(4)],
    "batch3_drop": lambda: [gp.Batch(3, drop_remainder=True)],
    "map_batch4": lambda: [TimesTen(), gp.Batch(4)],
    "filter_batch4": lambda: [NotThirds(), gp.Batch(4)],
    "flat_map_batch3": lambda: [Twice(), gp.Batch(3)],
}


def _run(
    source: Any, records: int, operations: list[Any], workers: int, steps: int, shard: Any = None
) -> Any:
    loader = gp.DataLoader(
        data_source=source,
        sampler=gp.IndexSampler(
            num_records=records,
            shard_options=gp.ShardOptions(*shard) if shard else gp.NoSharding(),
            shuffle=True,
            num_epochs=1,
            seed=3,
        ),
        operations=operations,
        worker_count=workers,
    )
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = json.loads(it.get_state())
    return state, [np.asarray(x).tolist() for x in it]


def main() -> None:
    out_path = os.path.abspath(sys.argv[1])  # before the chdir below
    cases = []
    for workers in (0, 2, 3):
        for ops, make in OPERATIONS.items():
            for source in ("list", "range"):
                if source == "range" and ops != "batch4":
                    continue
                for steps in (1, 3):
                    data = list(range(40)) if source == "list" else gp.RangeDataSource(0, 40, 1)
                    state, rest = _run(data, 40, make(), workers, steps)
                    case = {"workers": workers, "ops": ops, "source": source, "steps": steps}
                    cases.append({**case, "shard": None, "state": state, "rest": rest})
    # Shard 1 of 2 (IndexSampler's shard options), workers batching their own records.
    for steps in (1, 3):
        state, rest = _run(list(range(40)), 40, [gp.Batch(4)], 2, steps, shard=(1, 2))
        case = {"workers": 2, "ops": "batch4", "source": "list", "steps": steps}
        cases.append({**case, "shard": [1, 2], "state": state, "rest": rest})
    # ArrayRecord: Grain names the source by a hash of its file names, given relative here.
    from array_record.python.array_record_module import ArrayRecordWriter

    paths = ["part-0.array_record", "part-1.array_record"]
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        for i, path in enumerate(paths):
            writer = ArrayRecordWriter(path, "group_size:1")
            for j in range(12):
                writer.write(b"%d" % (i * 12 + j))
            writer.close()
        state, rest = _run(gp.ArrayRecordDataSource(paths), 24, [ToInt(), gp.Batch(4)], 2, 3)
    array_record = {"paths": paths, "state": state, "rest": rest}
    out = {
        "grain": importlib.metadata.version("grain"),
        "cases": cases,
        "array_record": array_record,
    }
    with open(out_path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()

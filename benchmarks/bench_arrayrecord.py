"""ArrayRecord random access: 200,000 records of 1 KiB in 4 files, read in shuffled order.

Needs the grainpipe-arrayrecord plugin (skipped without it). Each workload keeps one iterator
alive and every timed pass pulls the next ``PASS_BATCHES`` batches of 256 from it, so the
figures are steady-state records/s: start-up (worker processes, thread pools, file opening)
is paid in the untimed setup and warm-up pass. Baselines in the same run:

* ``array_record reader (physical limit)``: array_record's own reader reading the same
  shuffled index order in batches of 256 with no pipeline around it, one range read per
  record (the cheaper of its two ways for ~64 records of a 50,000-record file). Target:
  grain_core >= 70 % of it.
* ``array_record indexed reads``: the same with one indexed (parallel) read per file per
  batch, array_record's other way, for comparison.
* ``grain``: Google Grain reading the same files through the same pipeline. Target: >= 5x.

The data is written once per run into a temporary directory with the plugin's writer
(``group_size=1``) and deleted at exit.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _harness import import_google_grain, steady_pass, workload

import grain_core

RECORDS = 200_000
FILES = 4
RECORD_BYTES = 1024
BATCH = 256
SEED = 0
PASS_BATCHES = 32
PASS_RECORDS = PASS_BATCHES * BATCH
PHYSICAL_LIMIT = "array_record reader (physical limit)"
INDEXED_READS = "array_record indexed reads"
_HAVE_PLUGIN = importlib.util.find_spec("grain_arrayrecord") is not None


def decode(record: bytes) -> dict[str, Any]:
    """An 8-byte label and 1016 bytes of features."""
    return {
        "label": int.from_bytes(record[:8], "little"),
        "features": np.frombuffer(record, dtype=np.uint8, offset=8),
    }


@functools.cache
def _paths() -> list[str]:
    from grain_arrayrecord import ArrayRecordWriter

    directory = Path(tempfile.mkdtemp(prefix="grain_core-bench-arrayrecord-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    rng = np.random.default_rng(SEED)
    per_file = RECORDS // FILES
    paths = []
    for k in range(FILES):
        path = directory / f"data.array_record-{k:05d}-of-{FILES:05d}"
        payload = rng.bytes(per_file * (RECORD_BYTES - 8))
        with ArrayRecordWriter(path, group_size=1) as writer:
            for i in range(per_file):
                label = (k * per_file + i).to_bytes(8, "little")
                features = payload[i * (RECORD_BYTES - 8) : (i + 1) * (RECORD_BYTES - 8)]
                writer.write(label + features)
        paths.append(str(path))
    return paths


@functools.cache
def _shuffled_order() -> np.ndarray:
    """The record order of ``MapDataset.source(src).shuffle(SEED)``, epoch 0."""
    return np.asarray(list(grain_core.MapDataset.range(RECORDS).shuffle(seed=SEED)), dtype=np.int64)


def _steady(make_iterator: Callable[[], Iterator[Any]]) -> Callable[[], None]:
    """One timed pass = the next PASS_BATCHES batches of a long-lived iterator."""
    return steady_pass(make_iterator, PASS_BATCHES)


def _raw_reads(indexed: bool) -> Callable[[], None]:
    """array_record's reader alone: each batch's records, file by file, with one indexed read
    per file or one range read per record."""
    from array_record.python import array_record_module

    readers = [
        array_record_module.ArrayRecordReader(p, "readahead_buffer_size:0") for p in _paths()
    ]
    per_file = RECORDS // FILES

    def read(reader: Any, positions: list[int]) -> list[bytes]:
        if indexed:
            return reader.read(positions)  # type: ignore[no-any-return]
        return [reader.read(p, p + 1)[0] for p in positions]

    def batches() -> Iterator[list[bytes]]:
        order = _shuffled_order()
        for start in range(0, RECORDS, BATCH):
            keys = order[start : start + BATCH]
            files, positions = np.divmod(keys, per_file)
            out: list[Any] = [None] * len(keys)
            for k in np.unique(files).tolist():
                slots = np.flatnonzero(files == k)
                records = read(readers[k], positions[slots].tolist())
                for slot, record in zip(slots.tolist(), records, strict=True):
                    out[slot] = record
            yield out

    return _steady(batches)


def _physical_limit() -> Callable[[], None]:
    return _raw_reads(indexed=False)


def _indexed_reads() -> Callable[[], None]:
    return _raw_reads(indexed=True)


def _grain_core_loader(worker_count: int) -> Callable[[], None]:
    from grain_arrayrecord import ArrayRecordDataSource

    class Decode(grain_core.transforms.Map):
        def map(self, element: bytes) -> dict[str, Any]:
            return decode(element)

    source = ArrayRecordDataSource(_paths())

    def make() -> Iterator[Any]:
        loader = grain_core.DataLoader(
            data_source=source,
            sampler=grain_core.samplers.IndexSampler(
                RECORDS, shuffle=True, num_epochs=1, seed=SEED
            ),
            operations=[Decode(), grain_core.transforms.Batch(BATCH)],
            worker_count=worker_count,
        )
        return iter(loader)

    return _steady(make)


def _grain_loader(worker_count: int) -> Callable[[], None]:
    grain: Any = import_google_grain()

    class Decode(grain.transforms.Map):  # type: ignore[misc, name-defined]
        def map(self, element: bytes) -> dict[str, Any]:
            return decode(element)

    source = grain.sources.ArrayRecordDataSource(_paths())

    def make() -> Iterator[Any]:
        loader = grain.DataLoader(
            data_source=source,
            sampler=grain.samplers.IndexSampler(RECORDS, shuffle=True, num_epochs=1, seed=SEED),
            operations=[Decode(), grain.transforms.Batch(BATCH)],
            worker_count=worker_count,
        )
        return iter(loader)

    return _steady(make)


if _HAVE_PLUGIN:

    @workload(
        "arrayrecord_shuffle_map_batch",
        elements=PASS_RECORDS,
        description=(
            "ArrayRecord 200k x 1 KiB in 4 files: source.shuffle().map(decode).batch(256), "
            f"{PASS_BATCHES} batches per pass, one process"
        ),
    )
    def arrayrecord_shuffle_map_batch() -> Callable[[], None]:
        from grain_arrayrecord import ArrayRecordDataSource

        ds = (
            grain_core.MapDataset.source(ArrayRecordDataSource(_paths()))
            .shuffle(seed=SEED)
            .map(decode)
            .batch(BATCH)
        )
        return _steady(lambda: iter(ds.to_iter_dataset()))

    arrayrecord_shuffle_map_batch.baseline(PHYSICAL_LIMIT)(_physical_limit)
    arrayrecord_shuffle_map_batch.baseline(INDEXED_READS)(_indexed_reads)

    @arrayrecord_shuffle_map_batch.baseline("grain", requires="grain")
    def _grain_map_dataset() -> Callable[[], None]:
        grain: Any = import_google_grain()
        ds = (
            grain.MapDataset.source(grain.sources.ArrayRecordDataSource(_paths()))
            .shuffle(seed=SEED)
            .map(decode)
            .batch(BATCH)
        )
        return _steady(lambda: iter(ds.to_iter_dataset()))

    for _workers in (0, 2):
        _loader_workload = workload(
            f"arrayrecord_dataloader_{_workers}w",
            elements=PASS_RECORDS,
            description=(
                "ArrayRecord 200k x 1 KiB: DataLoader(IndexSampler(shuffle=True), [Map, "
                f"Batch(256)], worker_count={_workers}), {PASS_BATCHES} batches per pass"
            ),
        )(functools.partial(_grain_core_loader, _workers))
        _loader_workload.baseline(PHYSICAL_LIMIT)(_physical_limit)
        _loader_workload.baseline(INDEXED_READS)(_indexed_reads)
        _loader_workload.baseline("grain", requires="grain")(
            functools.partial(_grain_loader, _workers)
        )

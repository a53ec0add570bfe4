"""TFRecord (grainpipe-tfrecord, issue 7): 200,000 records of 1 KiB in 4 files.

Needs the grainpipe-tfrecord plugin (skipped without it). Workloads and their same-run baselines:

* ``tfrecord_full_pass_crc``: ``TFRecordIterDataset(4 files)`` reads everything, checking
  both CRCs of every record. Baselines: a minimal plain-Python framing loop with no
  checksum (target: grain_core >= 0.5x of it) and Google Grain's ``TFRecordIterDataset``
  (no checksums; one dataset per file, chained) — target: grain_core >= 1x.
* ``tfrecord_full_pass_crc_varied``: the same with record sizes drawn from 512-1535 bytes
  (mean 1 KiB), so no two neighbours share a length: frames are checked one by one instead
  of as runs of equal-length frames. Same baselines; no target, reported for visibility.
* ``tfrecord_interleave_4_files``: the general API a user writes,
  ``InterleaveIterDataset([TFRecordIterDataset(f) for f in files], cycle_length=4)``, with
  CRCs checked, against the plugin's own multi-file reader ``TFRecordIterDataset(files)`` on
  the same files (target: >= 0.8x of it), timed in alternation.
* ``tfrecord_random_access``: ``MapDataset.source(TFRecordDataSource).shuffle().batch(256)``,
  steady state (``PASS_BATCHES`` batches per timed pass of a long-lived iterator), against
  the same pipeline over ArrayRecord files holding the same records (when grainpipe-arrayrecord
  is installed).
* ``example_decode_scalars`` / ``example_decode_lists``: ``decode_example`` of records with
  5 features, against the protobuf runtime with the published schema followed by the same
  conversion to NumPy (the codec the plugin does not use).

The files are written once per run into a temporary directory and deleted at exit.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import itertools
import shutil
import struct
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
PASS_BATCHES = 64
PASS_RECORDS = PASS_BATCHES * BATCH
DECODE_RECORDS = 20_000
_HAVE_PLUGIN = importlib.util.find_spec("grain_tfrecord") is not None
_HAVE_ARRAYRECORD = importlib.util.find_spec("grain_arrayrecord") is not None


def _record_batches(varied: bool = False) -> Iterator[tuple[int, list[bytes]]]:
    """The records of each file: an 8-byte label and random bytes, 1016 of them or (varied)
    504-1527 of them."""
    rng = np.random.default_rng(SEED)
    per_file = RECORDS // FILES
    for k in range(FILES):
        sizes = (
            rng.integers(RECORD_BYTES // 2, RECORD_BYTES * 3 // 2, per_file) - 8
            if varied
            else np.full(per_file, RECORD_BYTES - 8)
        )
        ends = np.cumsum(sizes).tolist()
        payload = rng.bytes(ends[-1])
        yield (
            k,
            [
                (k * per_file + i).to_bytes(8, "little") + payload[end - size : end]
                for i, (end, size) in enumerate(zip(ends, sizes.tolist(), strict=True))
            ],
        )


@functools.cache
def _directory() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="grain_core-bench-tfrecord-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


@functools.cache
def _tfrecord_paths(varied: bool = False) -> list[str]:
    from grain_tfrecord import TFRecordWriter

    paths = []
    for k, records in _record_batches(varied):
        name = "varied" if varied else "data"
        path = _directory() / f"{name}.tfrecord-{k:05d}-of-{FILES:05d}"
        with TFRecordWriter(path) as writer:
            for record in records:
                writer.write(record)
        paths.append(str(path))
    return paths


@functools.cache
def _arrayrecord_paths() -> list[str]:
    from grain_arrayrecord import ArrayRecordWriter

    paths = []
    for k, records in _record_batches():
        path = _directory() / f"data.array_record-{k:05d}-of-{FILES:05d}"
        with ArrayRecordWriter(path, group_size=1) as writer:
            for record in records:
                writer.write(record)
        paths.append(str(path))
    return paths


def _count(records: Iterator[Any]) -> None:
    count = 0
    for _ in records:
        count += 1
    if count != RECORDS:
        raise AssertionError(f"read {count} records, expected {RECORDS}")


def _plain_framing_loop(path: str) -> Iterator[bytes]:
    """The least a Python TFRecord reader does: read each frame, check nothing."""
    unpack_length = struct.Struct("<Q").unpack_from
    with open(path, "rb") as file:
        read = file.read
        while header := read(12):
            (length,) = unpack_length(header)
            yield read(length)
            read(4)


def _plain(varied: bool) -> Callable[[], None]:
    paths = _tfrecord_paths(varied)
    return lambda: _count(itertools.chain.from_iterable(map(_plain_framing_loop, paths)))


def _grain_reader(varied: bool) -> Callable[[], None]:
    grain: Any = import_google_grain()
    datasets = [grain.experimental.TFRecordIterDataset(p) for p in _tfrecord_paths(varied)]
    return lambda: _count(itertools.chain.from_iterable(map(iter, datasets)))


def _steady(make_iterator: Callable[[], Iterator[Any]]) -> Callable[[], None]:
    """One timed pass = the next PASS_BATCHES batches of a long-lived iterator."""
    return steady_pass(make_iterator, PASS_BATCHES)


def _shuffled_batches(source: Any) -> Callable[[], None]:
    ds = grain_core.MapDataset.source(source).shuffle(seed=SEED).batch(BATCH, batch_fn=list)
    return _steady(lambda: iter(ds.to_iter_dataset()))


# ------------------------------------------------------------------------ Example decoding
def _example_records(long_lists: bool) -> list[bytes]:
    from grain_tfrecord import encode_example

    rng = np.random.default_rng(SEED)
    records = []
    for i in range(DECODE_RECORDS):
        features: dict[str, Any] = {
            "image": rng.bytes(784),
            "label": i % 1000,
            "caption": f"caption number {i}",
        }
        if long_lists:
            features["embedding"] = rng.random(256, dtype=np.float32)
            features["token_ids"] = rng.integers(0, 50_000, 128)
        else:
            features["box"] = rng.random(4, dtype=np.float32)
            features["token_ids"] = rng.integers(0, 30_000, 16)
        records.append(encode_example(features))
    return records


def _protobuf_decoder() -> Callable[[bytes], dict[str, np.ndarray]]:
    from grain_tfrecord import example_message_classes

    example = example_message_classes().Example

    def decode(data: bytes) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, feature in example.FromString(data).features.feature.items():
            kind = feature.WhichOneof("kind")
            if kind == "bytes_list":
                values = np.empty(len(feature.bytes_list.value), dtype=object)
                values[:] = list(feature.bytes_list.value)
            elif kind == "float_list":
                values = np.array(feature.float_list.value, dtype=np.float32)
            elif kind == "int64_list":
                values = np.array(feature.int64_list.value, dtype=np.int64)
            else:
                values = np.empty(0, dtype=np.float32)
            out[name] = values
        return out

    return decode


def _decode_all(decode: Callable[[bytes], Any], records: list[bytes]) -> Callable[[], None]:
    def run() -> None:
        for record in records:
            decode(record)

    return run


def _our_decoding(long_lists: bool) -> Callable[[], None]:
    from grain_tfrecord import decode_example

    return _decode_all(decode_example, _example_records(long_lists))


def _protobuf_decoding(long_lists: bool) -> Callable[[], None]:
    return _decode_all(_protobuf_decoder(), _example_records(long_lists))


if _HAVE_PLUGIN:

    @workload(
        "tfrecord_full_pass_crc",
        elements=RECORDS,
        description="TFRecordIterDataset over 4 files x 50k x 1 KiB, both CRCs checked",
    )
    def tfrecord_full_pass_crc() -> Callable[[], None]:
        from grain_tfrecord import TFRecordIterDataset

        ds = TFRecordIterDataset(_tfrecord_paths())
        return lambda: _count(iter(ds))

    @workload(
        "tfrecord_full_pass_crc_varied",
        elements=RECORDS,
        description="TFRecordIterDataset over 4 files x 50k x 0.5-1.5 KiB, both CRCs checked",
    )
    def tfrecord_full_pass_crc_varied() -> Callable[[], None]:
        from grain_tfrecord import TFRecordIterDataset

        ds = TFRecordIterDataset(_tfrecord_paths(varied=True))
        return lambda: _count(iter(ds))

    for _full_pass, _varied in (
        (tfrecord_full_pass_crc, False),
        (tfrecord_full_pass_crc_varied, True),
    ):
        _full_pass.baseline("plain framing loop (no CRC)")(functools.partial(_plain, _varied))
        _full_pass.baseline("grain TFRecordIterDataset (no CRC)", requires="grain")(
            functools.partial(_grain_reader, _varied)
        )

    @workload(
        "tfrecord_interleave_4_files",
        elements=RECORDS,
        description="InterleaveIterDataset of 4 TFRecordIterDatasets (one per file), cycle 4",
        alternate=True,
    )
    def tfrecord_interleave_4_files() -> Callable[[], None]:
        from grain_tfrecord import TFRecordIterDataset

        from grain_core.experimental import InterleaveIterDataset

        files = [TFRecordIterDataset(p) for p in _tfrecord_paths()]
        ds = InterleaveIterDataset(files, cycle_length=FILES)
        return lambda: _count(iter(ds))

    @tfrecord_interleave_4_files.baseline("plugin's multi-file TFRecordIterDataset")
    def _plugin_reader() -> Callable[[], None]:
        from grain_tfrecord import TFRecordIterDataset

        ds = TFRecordIterDataset(_tfrecord_paths())
        return lambda: _count(iter(ds))

    @workload(
        "tfrecord_random_access",
        elements=PASS_RECORDS,
        description=(
            "TFRecordDataSource 200k x 1 KiB: source.shuffle().batch(256), "
            f"{PASS_BATCHES} batches per pass, CRCs checked"
        ),
    )
    def tfrecord_random_access() -> Callable[[], None]:
        from grain_tfrecord import TFRecordDataSource

        return _shuffled_batches(TFRecordDataSource(_tfrecord_paths()))

    if _HAVE_ARRAYRECORD:

        @tfrecord_random_access.baseline("ArrayRecordDataSource, same records")
        def _arrayrecord() -> Callable[[], None]:
            from grain_arrayrecord import ArrayRecordDataSource

            return _shuffled_batches(ArrayRecordDataSource(_arrayrecord_paths()))

    for _long_lists in (False, True):
        _decode_workload = workload(
            f"example_decode_{'lists' if _long_lists else 'scalars'}",
            elements=DECODE_RECORDS,
            description="decode_example, 5 features: image bytes, label, caption, "
            + ("256 floats, 128 token ids" if _long_lists else "4 floats, 16 token ids"),
        )(functools.partial(_our_decoding, _long_lists))
        _decode_workload.baseline("protobuf runtime + numpy", requires="google.protobuf")(
            functools.partial(_protobuf_decoding, _long_lists)
        )

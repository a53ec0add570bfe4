"""tf.train.Example parsing (grainpipe-tfrecord): batched and per record, against protobuf and tf.data.

Needs the grainpipe-tfrecord plugin (skipped without it). Records are built once in memory; every
pass decodes all of them into NumPy. Workloads (passes alternate between implementations):

* ``example_parse_batch``: 100,000 Examples of 5 features (an int64 label, a float weight,
  a 16-byte key, an int64 index, a 256-float embedding) in batches of 256:
  ``MapDataset.source(records).batch(256, batch_fn=list).map(ParseExamples(spec))``.
  Baselines: the protobuf runtime per record (``Example.FromString`` + the conversion to
  NumPy), the same then stacked per batch, ``decode_example`` per record then stacked, and
  tf.data's ``from_tensor_slices(records).batch(256).map(tf.io.parse_example)`` as NumPy
  when tensorflow is importable. Targets: >= 1x tf.data, >= 2x protobuf per record.
* ``example_parse_batch_stacked``: the same with a plain ``.batch(256)``, as the docs' stream
  example writes it (the records stacked into a fixed-width ``S`` array), against tf.data and
  the ``batch_fn=list`` form. Target: >= 1x tf.data.
* ``example_decode_long_floats``: ``decode_example`` per record of Examples holding a label
  and a 256-float list, against the protobuf runtime per record (target >= 1x).
* ``example_decode_long_ints``: the same with 128 int64 token ids (up to 50,000) instead.

tf.data is never a dependency: ``nox -s bench-tf`` runs these workloads in a virtualenv with
``tensorflow-cpu`` added (or: ``pip install tensorflow-cpu`` into any environment that has
grain_core and its plugins, then ``python benchmarks/run.py --only example_parse_batch``).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from _harness import workload

import grain_core

RECORDS = 100_000
LONG_RECORDS = 20_000
BATCH = 256
EMBEDDING = 256
SEED = 0
_HAVE_PLUGIN = importlib.util.find_spec("grain_tfrecord") is not None


@functools.cache
def _records() -> list[bytes]:
    from grain_tfrecord import encode_example

    rng = np.random.default_rng(SEED)
    labels = rng.integers(0, 1000, RECORDS)
    weights = rng.random(RECORDS, dtype=np.float32)
    embeddings = rng.random((RECORDS, EMBEDDING), dtype=np.float32)
    return [
        encode_example(
            {
                "label": labels[i],
                "weight": weights[i],
                "key": f"key-{i:012d}".encode(),
                "index": i,
                "embedding": embeddings[i],
            }
        )
        for i in range(RECORDS)
    ]


def _spec() -> dict[str, Any]:
    from grain_tfrecord import FixedLenFeature

    return {
        "label": FixedLenFeature((), np.int64),
        "weight": FixedLenFeature((), np.float32),
        "key": FixedLenFeature((), bytes),
        "index": FixedLenFeature((), np.int64),
        "embedding": FixedLenFeature((EMBEDDING,), np.float32),
    }


def _consume(batches: Iterable[dict[str, Any]]) -> None:
    count, last = 0, {}
    for count, last in enumerate(batches, 1):  # noqa: B007 (the last batch is checked)
        pass
    _check_batches(count, last)


def _check_batches(count: int, last: dict[str, Any]) -> None:
    if count != -(-RECORDS // BATCH) or int(last["index"][-1]) != RECORDS - 1:
        raise AssertionError(f"parsed {count} batches ending at {last['index'][-1]}")


def _protobuf_to_numpy() -> Callable[[bytes], dict[str, Any]]:
    """The protobuf runtime's decoding of one record into NumPy, as a user writes it."""
    from grain_tfrecord import example_message_classes

    from_string = example_message_classes().Example.FromString

    def decode(data: bytes) -> dict[str, Any]:
        features = from_string(data).features.feature
        return {
            "label": np.array(features["label"].int64_list.value[0], np.int64),
            "weight": np.array(features["weight"].float_list.value[0], np.float32),
            "key": features["key"].bytes_list.value[0],
            "index": np.array(features["index"].int64_list.value[0], np.int64),
            "embedding": np.array(features["embedding"].float_list.value, np.float32),
        }

    return decode


def _stacked(decode: Callable[[bytes], dict[str, Any]]) -> Callable[[], None]:
    records = _records()

    def run() -> None:
        count, batch = 0, {}
        for start in range(0, RECORDS, BATCH):
            decoded = [decode(r) for r in records[start : start + BATCH]]
            batch = {name: np.stack([d[name] for d in decoded]) for name in decoded[0]}
            count += 1
        _check_batches(count, batch)

    return run


if _HAVE_PLUGIN:

    def _parse_batches(batch_fn: Callable[[Any], Any] | None) -> Callable[[], None]:
        from grain_tfrecord import ParseExamples

        ds = grain_core.MapDataset.source(_records()).batch(BATCH, batch_fn=batch_fn)
        ds = ds.map(ParseExamples(_spec()))
        return lambda: _consume(ds)

    example_parse_batch = workload(
        "example_parse_batch",
        elements=RECORDS,
        description=(
            "100k tf.train.Example (4 scalars + 256 floats) -> NumPy, batches of 256: "
            "source.batch(256, batch_fn=list).map(ParseExamples)"
        ),
        alternate=True,
    )(functools.partial(_parse_batches, list))
    # The docs' stream example: a plain batch stacks the records into a fixed-width S array.
    example_parse_batch_stacked = workload(
        "example_parse_batch_stacked",
        elements=RECORDS,
        description="the same as the docs write it: source.batch(256).map(ParseExamples)",
        alternate=True,
    )(functools.partial(_parse_batches, None))
    example_parse_batch_stacked.baseline("batch_fn=list")(functools.partial(_parse_batches, list))

    @example_parse_batch.baseline("protobuf runtime per record", requires="google.protobuf")
    def _protobuf_per_record() -> Callable[[], None]:
        decode = _protobuf_to_numpy()
        records = _records()

        def run() -> None:
            for record in records:
                decode(record)

        return run

    @example_parse_batch.baseline("protobuf runtime + stack", requires="google.protobuf")
    def _protobuf_batched() -> Callable[[], None]:
        return _stacked(_protobuf_to_numpy())

    @example_parse_batch.baseline("decode_example per record + stack")
    def _decode_example_stacked() -> Callable[[], None]:
        from grain_tfrecord import FeatureSpec, decode_example

        spec = {
            "label": FeatureSpec(np.int64, ()),
            "weight": FeatureSpec(np.float32, ()),
            "key": FeatureSpec(bytes, ()),
            "index": FeatureSpec(np.int64, ()),
            "embedding": FeatureSpec(np.float32, (EMBEDDING,)),
        }
        return _stacked(functools.partial(decode_example, features=spec))

    @example_parse_batch_stacked.baseline(
        "tf.data batch + tf.io.parse_example", requires="tensorflow"
    )
    @example_parse_batch.baseline("tf.data batch + tf.io.parse_example", requires="tensorflow")
    def _tf_data() -> Callable[[], None]:
        import tensorflow as tf  # optional peer, in its own virtualenv

        spec = {
            "label": tf.io.FixedLenFeature((), tf.int64),
            "weight": tf.io.FixedLenFeature((), tf.float32),
            "key": tf.io.FixedLenFeature((), tf.string),
            "index": tf.io.FixedLenFeature((), tf.int64),
            "embedding": tf.io.FixedLenFeature((EMBEDDING,), tf.float32),
        }
        ds = (
            tf.data.Dataset.from_tensor_slices(tf.constant(_records()))
            .batch(BATCH)
            .map(lambda records: tf.io.parse_example(records, spec))
        )

        return lambda: _consume(ds.as_numpy_iterator())

    @functools.cache
    def _long_records(ints: bool) -> list[bytes]:
        from grain_tfrecord import encode_example

        rng = np.random.default_rng(SEED)
        return [
            encode_example(
                {
                    "label": i % 1000,
                    "values": rng.integers(0, 50_000, 128)
                    if ints
                    else rng.random(EMBEDDING, dtype=np.float32),
                }
            )
            for i in range(LONG_RECORDS)
        ]

    def _per_record(decode: Callable[[bytes], Any], records: list[bytes]) -> Callable[[], None]:
        def run() -> None:
            for record in records:
                decode(record)

        return run

    def _protobuf_values(data: bytes, from_string: Callable[[bytes], Any]) -> dict[str, Any]:
        features = from_string(data).features.feature
        values = features["values"]
        kind = values.WhichOneof("kind")
        dtype = np.int64 if kind == "int64_list" else np.float32
        return {
            "label": np.array(features["label"].int64_list.value, np.int64),
            "values": np.array(getattr(values, kind).value, dtype),
        }

    def _ours_long(ints: bool) -> Callable[[], None]:
        from grain_tfrecord import decode_example

        return _per_record(decode_example, _long_records(ints))

    def _protobuf_long(ints: bool) -> Callable[[], None]:
        from grain_tfrecord import example_message_classes

        from_string = example_message_classes().Example.FromString
        decode = functools.partial(_protobuf_values, from_string=from_string)
        return _per_record(decode, _long_records(ints))

    for _ints in (False, True):
        _long = workload(
            f"example_decode_long_{'ints' if _ints else 'floats'}",
            elements=LONG_RECORDS,
            description="decode_example per record: a label and "
            + ("128 int64 ids (< 50k)" if _ints else f"{EMBEDDING} floats"),
            alternate=True,
        )(functools.partial(_ours_long, _ints))
        _long.baseline("protobuf runtime per record", requires="google.protobuf")(
            functools.partial(_protobuf_long, _ints)
        )

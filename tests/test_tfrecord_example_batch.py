"""grain-tfrecord: batched tf.train.Example parsing (``parse_example_batch``, ``ParseExamples``).

The differential tests decode each record with the protobuf runtime (the published schema,
``grain_tfrecord.example_message_classes``) and compare element for element; they skip where
protobuf is not installed. The others compare with the per-record ``decode_example``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from conftest import encode_varint, varint_size
from hypothesis import given, settings
from hypothesis import strategies as st

grain_tfrecord = pytest.importorskip("grain_tfrecord")

from grain_tfrecord import (  # noqa: E402
    ExampleDecodeError,
    FixedLenFeature,
    FixedLenSequenceFeature,
    ParseExamples,
    RaggedValues,
    TFRecordDataSource,
    TFRecordIterDataset,
    TFRecordWriter,
    VarLenFeature,
    decode_example,
    encode_example,
    parse_example_batch,
)
from grain_tfrecord._example_batch import _Walk  # noqa: E402
from grain_tfrecord._example_wire import WireBatch  # noqa: E402

import grain_core  # noqa: E402

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# The schema of the generated batches: name -> list kind.
_SCHEMA = {"label": "int", "score": "float", "image": "bytes", "ids": "int", "vec": "float"}
_DTYPES = {"int": np.int64, "float": np.float32, "bytes": bytes}


def _walked_without_fallback(records: list[bytes] | np.ndarray, spec: dict) -> bool:  # type: ignore[type-arg]
    """Whether the lock-step walk decoded every record (none went to the exact decoder)."""
    batch = WireBatch(records)
    _Walk(batch, {name: s._resolved[0] for name, s in spec.items()}).run()
    return not batch.fallback.any()


def _stacked_by_batch(records: list[bytes]) -> np.ndarray:
    """The records as the documented plain ``batch`` stacks them: an ``S`` array."""
    stacked = grain_core.MapDataset.source(records).batch(len(records))[0]
    assert stacked.dtype.kind == "S"
    return stacked


# The forms a batch of records reaches the parser in: a list, an S array NumPy made, an S
# array ``batch`` made.
_FORMS = {"list": list, "numpy": np.array, "batch": _stacked_by_batch}


# ------------------------------------------------------------------------ wire generation
# A record layout shared by the records of a batch: its features in order, each with its
# number of values (and, for bytes, the size of every item).
_Layout = list[tuple[str, int, int]]


@st.composite
def _record(
    draw: st.DrawFn, canonical: bool, layout: _Layout | None = None
) -> tuple[bytes, dict[str, list]]:  # type: ignore[type-arg]
    """One Example of ``_SCHEMA`` (features may be missing), encoded canonically or not, or
    canonically in ``layout`` with values drawn anew; returns its bytes and its values as a
    reference for the tests without protobuf."""

    def varint(value: int, limit: int = 10) -> bytes:
        size = varint_size(value)
        if canonical or size >= limit or draw(st.integers(0, 4)):
            return encode_varint(value)
        return encode_varint(value, draw(st.integers(1, limit - size)))

    def field(number: int, payload: bytes) -> bytes:
        return varint(number << 3 | 2, 5) + varint(len(payload), 5) + payload

    def values_of(kind: str, count: int | None = None, width: int | None = None) -> list:  # type: ignore[type-arg]
        sizes = {} if count is None else {"min_size": count, "max_size": count}
        if kind == "int":
            # 1 to 10 bytes each: small, up to the 8-byte words the walk reads, negative.
            ints = st.integers(INT64_MIN, INT64_MAX) | st.integers(0, 300)
            return draw(st.lists(ints | st.integers(0, 1 << 57), **{"max_size": 5, **sizes}))
        if kind == "float":
            floats = st.floats(width=32, allow_nan=False)
            return draw(st.lists(floats, **{"max_size": 5, **sizes}))
        items = (
            st.binary(max_size=6) if width is None else st.binary(min_size=width, max_size=width)
        )
        return draw(st.lists(items, **{"max_size": 3, **sizes}))

    def list_bytes(kind: str, values: list) -> bytes:  # type: ignore[type-arg]
        if kind == "bytes":
            return b"".join(field(1, v) for v in values)
        if not values:
            return b""
        if kind == "float":
            packed = np.array(values, "<f4").tobytes()
            if not canonical and draw(st.booleans()):
                return b"".join(
                    varint(0x0D, 5) + packed[i : i + 4] for i in range(0, len(packed), 4)
                )
            return field(1, packed)
        split = draw(st.integers(0, len(values))) if not canonical else len(values)
        head = field(1, b"".join(varint(v) for v in values[:split])) if split else b""
        if not canonical and draw(st.booleans()):
            return head + b"".join(varint(0x08, 5) + varint(v) for v in values[split:])
        return head + (
            field(1, b"".join(varint(v) for v in values[split:])) if values[split:] else b""
        )

    kinds = {"bytes": 1, "float": 2, "int": 3}
    # Any feature may be missing: records of one batch then differ in their features.
    if layout is None:
        present = {name: values_of(kind) for name, kind in _SCHEMA.items() if draw(st.booleans())}
    else:
        present = {name: values_of(_SCHEMA[name], count, width) for name, count, width in layout}
    names = list(present)
    if not canonical:
        names = draw(st.permutations(names))
    entries = []
    for name in names:
        kind = _SCHEMA[name]
        feature = field(kinds[kind], list_bytes(kind, present[name]))
        key = field(1, name.encode())
        value = field(2, feature)
        entries.append(
            field(1, value + key if not canonical and draw(st.booleans()) else key + value)
        )
    return field(1, b"".join(entries)), present


def _batches(canonical: bool | None = None) -> st.SearchStrategy:  # type: ignore[type-arg]
    flags = st.booleans() if canonical is None else st.just(canonical)
    return st.lists(flags.flatmap(_record), min_size=1, max_size=12)


@st.composite
def _shared_layout_batch(draw: st.DrawFn) -> list[tuple[bytes, dict[str, list]]]:  # type: ignore[type-arg]
    """A batch whose records mostly share one layout (the walk's record template) with
    values of other sizes, among records of any other layout, canonical or not."""
    names = draw(st.permutations(list(_SCHEMA)))[: draw(st.integers(0, len(_SCHEMA)))]
    layout = [(name, draw(st.integers(0, 3)), draw(st.integers(0, 4))) for name in names]
    others = st.booleans().flatmap(_record)
    return draw(
        st.lists(
            st.integers(0, 5).flatmap(lambda k: _record(True, layout) if k else others),
            min_size=1,
            max_size=40,
        )
    )


def _reference(pb, data: bytes) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    out = {}
    for name, feature in pb.Example.FromString(data).features.feature.items():
        kind = feature.WhichOneof("kind")
        values = list(getattr(feature, kind).value) if kind else []
        dtype = {"bytes_list": object, "float_list": np.float32}.get(kind or "", np.int64)
        array = np.empty(len(values), dtype=dtype)
        array[:] = values
        out[name] = array
    return out


def _var_len_spec() -> dict[str, VarLenFeature]:
    return {name: VarLenFeature(_DTYPES[kind]) for name, kind in _SCHEMA.items()}


def _assert_ragged_rows(ragged: RaggedValues, expected: list[np.ndarray], name: str) -> None:
    rows = ragged.rows()
    assert len(rows) == len(expected), name
    for i, (row, want) in enumerate(zip(rows, expected, strict=True)):
        np.testing.assert_array_equal(row, want.astype(row.dtype), err_msg=f"{name} record {i}")


# ------------------------------------------------------------------------ differential tests
def _assert_parsed_as_protobuf_parses(
    records: list[tuple[bytes, dict]],  # type: ignore[type-arg]
    form: str,
) -> None:
    """Each feature of each record of the batch (in ``form``) as protobuf decodes it."""
    pytest.importorskip("google.protobuf")
    pb = grain_tfrecord.example_message_classes()
    serialized = [data for data, _ in records]
    expected = [_reference(pb, data) for data in serialized]
    batch = _FORMS[form](serialized)
    parsed = parse_example_batch(batch, _var_len_spec())
    for name, kind in _SCHEMA.items():
        empty = np.empty(0, dtype=object if kind == "bytes" else _DTYPES[kind])
        rows = [e.get(name, empty) for e in expected]
        _assert_ragged_rows(parsed[name], rows, name)  # type: ignore[arg-type]


@settings(max_examples=150)
@given(_batches(), st.sampled_from(sorted(_FORMS)))
def test_fuzz_batches_agree_with_the_protobuf_runtime(
    records: list[tuple[bytes, dict]],  # type: ignore[type-arg]
    form: str,
) -> None:
    """Canonical and non-canonical records mixed in one batch: each feature of each record
    as protobuf decodes it (the walk for the canonical ones, the exact decoder for others)."""
    _assert_parsed_as_protobuf_parses(records, form)


@settings(max_examples=60)
@given(_batches(canonical=True))
def test_canonical_batches_take_the_vectorised_walk(records: list[tuple[bytes, dict]]) -> None:  # type: ignore[type-arg]
    serialized = [data for data, _ in records]
    spec = _var_len_spec()
    assert _walked_without_fallback(serialized, spec)
    assert _walked_without_fallback(np.array(serialized), spec)
    assert _walked_without_fallback(_stacked_by_batch(serialized), spec)
    parsed = parse_example_batch(serialized, spec)
    for name, kind in _SCHEMA.items():
        empty = np.empty(0, dtype=object if kind == "bytes" else _DTYPES[kind])
        expected = [decode_example(data).get(name, empty) for data in serialized]
        _assert_ragged_rows(parsed[name], expected, name)  # type: ignore[arg-type]


@settings(max_examples=150)
@given(_shared_layout_batch(), st.sampled_from(sorted(_FORMS)))
def test_batches_sharing_a_layout_agree_with_the_protobuf_runtime(
    records: list[tuple[bytes, dict]],  # type: ignore[type-arg]
    form: str,
) -> None:
    """The record-template fast path (records laid out alike, their value sizes and varint
    widths differing: scalars read as one word, equal-sized bytes items, empty lists, long
    or negative ints) and the records that leave it (other layouts, missing features,
    unpacked lists) decode as protobuf decodes each record."""
    _assert_parsed_as_protobuf_parses(records, form)


# What may follow a record's features field: nothing, an unknown field, the features field
# again (protobuf merges the two maps), an empty one.
_AFTER_FEATURES = [b"", b"\x10\x05", b"\x0a\x00", encode_example({"label": 7})]


@settings(max_examples=100)
@given(
    _shared_layout_batch(),
    st.lists(st.sampled_from(_AFTER_FEATURES), min_size=40, max_size=40),
    st.sampled_from(sorted(_FORMS)),
)
def test_records_with_more_after_their_features_field_leave_the_record_layout(
    records: list[tuple[bytes, dict]],  # type: ignore[type-arg]
    after: list[bytes],
    form: str,
) -> None:
    """The record layout reads a record only where its features field ends it (or the NUL
    padding of an S array follows): records laid out alike but followed by more fields
    decode as protobuf decodes them."""
    longer = [(data + more, values) for (data, values), more in zip(records, after, strict=False)]
    _assert_parsed_as_protobuf_parses(longer, form)


@settings(max_examples=80)
@given(
    st.lists(st.sampled_from([0, 1, 30, 31, 40]), min_size=1, max_size=30),
    st.sampled_from(sorted(_FORMS)),
)
def test_length_prefixes_of_several_widths_in_one_batch(
    sizes: list[int],
    form: str,
) -> None:
    """Records alike but for their list sizes, whose features field and entries need one-
    or two-byte length prefixes: each reads as protobuf decodes it (a row whose prefixes
    are wider than the layout's leaves it), whichever layout an earlier batch left."""
    rng = np.random.default_rng(len(sizes))
    records = []
    for i, size in enumerate(sizes):
        values = {"label": i * 1000, "vec": rng.random(size, dtype=np.float32)}
        records.append((encode_example(values), values))
    _assert_parsed_as_protobuf_parses(records, form)


def test_a_features_field_ending_before_its_entries_leaves_the_record_layout() -> None:
    """Bytes laid out as a record's entries but after its features field ends are read as
    protobuf reads them (here: a second features field, whose map entry is the name's
    bytes), not as the entries of a record laid out alike."""
    pytest.importorskip("google.protobuf")

    def field(number: int, payload: bytes) -> bytes:
        return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload

    def entry(name: bytes, value: int) -> bytes:
        return field(1, field(1, name) + field(2, field(3, field(1, bytes([value])))))

    name = b"\n\x01a"  # as a map entry: the key "a" without a value
    alike = field(1, entry(b"label", 1) + entry(name, 2))
    shorter = field(1, entry(b"label", 3)) + entry(name, 4)
    pb = grain_tfrecord.example_message_classes()
    assert "a" in pb.Example.FromString(shorter).features.feature
    spec = {"label": VarLenFeature(np.int64), name.decode(): VarLenFeature(np.int64)}
    for batch in ([alike, shorter], np.array([alike, shorter])):
        parsed = parse_example_batch(batch, spec)
        assert parsed[name.decode()].rows()[1].tolist() == []  # type: ignore[union-attr]
        assert parsed["label"].rows()[1].tolist() == [3]  # type: ignore[union-attr]


def test_a_list_ending_inside_a_varint_is_refused_in_a_shared_layout() -> None:
    """A packed int64 list whose last byte continues a varint, among records laid out
    alike, is an error naming the record (not an empty list, not a value)."""

    def field(number: int, payload: bytes) -> bytes:
        return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload

    def record(packed: bytes) -> bytes:
        feature = field(3, field(1, packed))
        return field(1, field(1, field(1, b"label") + field(2, feature)))

    records = [record(b"\x05"), record(b"\x85\x01"), record(b"\x85"), record(b"\x07")]
    for batch in (records, np.array(records)):
        with pytest.raises(ExampleDecodeError, match="record 2 of the batch"):
            parse_example_batch(batch, {"label": VarLenFeature(np.int64)})
        good = parse_example_batch(batch[:2], {"label": FixedLenFeature((), np.int64)})
        assert good["label"].tolist() == [5, 133]  # type: ignore[union-attr]


def test_records_written_by_protobuf_take_the_walk_and_match() -> None:
    pytest.importorskip("google.protobuf")
    pb = grain_tfrecord.example_message_classes()
    rng = np.random.default_rng(0)
    serialized = []
    for i in range(40):
        message = pb.Example()
        feature = message.features.feature
        feature["label"].int64_list.value.append(int(rng.integers(-5, 1 << 40)))
        feature["score"].float_list.value.append(float(rng.random()))
        feature["image"].bytes_list.value.append(rng.bytes(int(rng.integers(0, 300))))
        feature["vec"].float_list.value.extend(rng.random(256).tolist())
        feature["ids"].int64_list.value.extend(rng.integers(0, 50_000, i % 7).tolist())
        serialized.append(message.SerializeToString())
    spec = {
        "label": FixedLenFeature((), np.int64),
        "score": FixedLenFeature((), np.float32),
        "image": FixedLenFeature((), bytes),
        "vec": FixedLenFeature((16, 16), np.float32),
        "ids": VarLenFeature(np.int64),
    }
    parsed = parse_example_batch(serialized, spec)
    for i, data in enumerate(serialized):
        reference = _reference(pb, data)
        assert parsed["label"][i] == reference["label"][0]
        assert parsed["score"][i] == reference["score"][0]
        assert parsed["image"][i] == reference["image"][0]
        np.testing.assert_array_equal(parsed["vec"][i].ravel(), reference["vec"])
    _assert_ragged_rows(parsed["ids"], [_reference(pb, d)["ids"] for d in serialized], "ids")  # type: ignore[arg-type]


# ------------------------------------------------------------------------ feature kinds
def _examples() -> list[bytes]:
    return [
        encode_example({"label": 1, "tokens": [1, 2, 3], "name": "caf\u00e9", "pair": [0.5, 1.5]}),
        encode_example({"label": 2, "tokens": [4], "name": "b"}),
        encode_example(
            {"label": 3, "tokens": np.zeros(0, np.int64), "name": "c", "pair": [2, 3.0]}
        ),
    ]


def test_fixed_len_features_with_defaults_and_casts() -> None:
    parsed = parse_example_batch(
        _examples(),
        {
            "label": FixedLenFeature((), np.int32),
            "name": FixedLenFeature([], str),
            "pair": FixedLenFeature((2,), np.float32, default_value=-1.0),
            "absent": FixedLenFeature((1, 2), np.int64, default_value=[[7, 8]]),
        },
    )
    assert list(parsed) == ["label", "name", "pair", "absent"]
    assert parsed["label"].dtype == np.int32 and parsed["label"].tolist() == [1, 2, 3]
    assert parsed["name"].tolist() == ["caf\u00e9", "b", "c"]
    assert parsed["pair"].tolist() == [[0.5, 1.5], [-1, -1], [2, 3]]
    assert parsed["absent"].shape == (3, 1, 2) and parsed["absent"].tolist() == [[[7, 8]]] * 3


def test_var_len_and_sequence_features_pad_like_tf_io() -> None:
    parsed = parse_example_batch(
        _examples(),
        {
            "tokens": VarLenFeature(np.int64),
            "steps": FixedLenSequenceFeature((), np.int64, allow_missing=True, default_value=-1),
            "pairs": FixedLenSequenceFeature((2,), np.float32, allow_missing=True),
        },
    )
    tokens = parsed["tokens"]
    assert isinstance(tokens, RaggedValues)
    assert tokens.values.tolist() == [1, 2, 3, 4] and tokens.row_splits.tolist() == [0, 3, 4, 4]
    assert [r.tolist() for r in tokens.rows()] == [[1, 2, 3], [4], []]
    assert parsed["steps"].shape == (3, 0) and parsed["pairs"].shape == (3, 0, 2)
    parsed = parse_example_batch(
        _examples(),
        {
            "tokens": FixedLenSequenceFeature((), np.int64, default_value=-1),
            "pair": FixedLenSequenceFeature((2,), np.float32, allow_missing=True),
        },
    )
    assert parsed["tokens"].tolist() == [[1, 2, 3], [4, -1, -1], [-1, -1, -1]]
    assert parsed["pair"].shape == (3, 1, 2)
    assert parsed["pair"].tolist() == [[[0.5, 1.5]], [[0, 0]], [[2, 3]]]


def test_errors_name_the_record_and_the_feature() -> None:
    records = _examples()
    with pytest.raises(
        ExampleDecodeError, match="record 1 of the batch: feature 'pair' is missing"
    ):
        parse_example_batch(records, {"pair": FixedLenFeature((2,), np.float32)})
    with pytest.raises(
        ExampleDecodeError,
        match="record 0 of the batch: feature 'tokens' has 3 values, which do not fit",
    ):
        parse_example_batch(records, {"tokens": FixedLenFeature((), np.int64)})
    with pytest.raises(
        ExampleDecodeError, match="record 0 of the batch: feature 'label' holds a int64_list"
    ):
        parse_example_batch(records, {"label": FixedLenFeature((), np.float32)})
    with pytest.raises(
        ExampleDecodeError, match="record 1 of the batch: feature 'pair' is missing"
    ):
        parse_example_batch(records, {"pair": FixedLenSequenceFeature((2,), np.float32)})
    with pytest.raises(
        ExampleDecodeError, match="record 0 of the batch: feature 'pair' has 2 values"
    ):
        parse_example_batch(records, {"pair": FixedLenSequenceFeature((3,), np.float32)})
    bad_text = encode_example({"name": b"\xff"})
    with pytest.raises(
        ExampleDecodeError, match="record 3 of the batch: feature 'name' is not UTF-8"
    ):
        parse_example_batch([*records, bad_text], {"name": FixedLenFeature((), str)})
    cut = encode_example({"label": 5})[:-1]
    with pytest.raises(
        ExampleDecodeError, match="record 2 of the batch: .*Not a valid tf.train.Example"
    ):
        parse_example_batch([records[0], records[1], cut], {"label": FixedLenFeature((), np.int64)})
    with pytest.raises(TypeError, match="not a FixedLenFeature"):
        parse_example_batch(records, {"label": np.int64})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="does not fit shape"):
        FixedLenFeature((2,), np.int64, default_value=[1, 2, 3])
    with pytest.raises(TypeError, match="not stored by tf.train.Example"):
        VarLenFeature(np.complex64)


def test_fixed_width_bytes_arrays_keep_trailing_nul_bytes() -> None:
    """``batch`` stacks bytes into a NumPy ``S`` array, which drops trailing NULs; a record
    ending in 0x00 (an int64 0, a float 0.0) still parses exactly."""
    records = [
        encode_example({"x": [5, 0]}),
        encode_example({"x": [0]}),
        encode_example({"y": 0.0}),
    ]
    assert all(r.endswith(b"\x00") for r in records)
    stacked = np.array(records)
    assert stacked[0] != records[0]  # NumPy dropped the NUL
    spec = {
        "x": VarLenFeature(np.int64),
        "y": FixedLenFeature((), np.float32, default_value=1.0),
    }
    for batch in (records, stacked, _stacked_by_batch(records)):
        parsed = parse_example_batch(batch, spec)
        assert [r.tolist() for r in parsed["x"].rows()] == [[5, 0], [0], []]  # type: ignore[union-attr]
        assert parsed["y"].tolist() == [1.0, 1.0, 0.0]  # type: ignore[union-attr]
    for padded in (np.array, _stacked_by_batch):
        with pytest.raises(ExampleDecodeError, match="record 1 of the batch"):
            parse_example_batch(padded([records[0], records[0] + b"\x00\x05"]), spec)


def test_empty_batches_and_empty_records() -> None:
    spec = {"x": FixedLenFeature((2,), np.int64, default_value=[0, 0]), "v": VarLenFeature(bytes)}
    parsed = parse_example_batch([], spec)
    assert parsed["x"].shape == (0, 2) and parsed["v"].row_splits.tolist() == [0]  # type: ignore[union-attr]
    records = [b"", encode_example({"v": [b"a", b"b"]})]
    for batch in (records, np.array(records), _stacked_by_batch(records)):
        parsed = parse_example_batch(batch, spec)
        assert parsed["x"].tolist() == [[0, 0], [0, 0]]
        assert [r.tolist() for r in parsed["v"].rows()] == [[], [b"a", b"b"]]  # type: ignore[union-attr]
    parsed = parse_example_batch(_stacked_by_batch([b"", b""]), spec)
    assert parsed["x"].tolist() == [[0, 0], [0, 0]]


def test_repeated_feature_names_keep_the_last() -> None:
    def entry(name: bytes, value: int) -> bytes:
        body = b"\x0a" + bytes([len(name)]) + name + b"\x12\x05\x1a\x03\x0a\x01" + bytes([value])
        return b"\x0a" + bytes([len(body)]) + body

    body = entry(b"a", 1) + entry(b"b", 2) + entry(b"a", 3)
    record = b"\x0a" + bytes([len(body)]) + body
    spec = {"a": FixedLenFeature((), np.int64), "b": FixedLenFeature((), np.int64)}
    assert _walked_without_fallback([record, record], spec)
    parsed = parse_example_batch([record, encode_example({"a": 4, "b": 5}), record], spec)
    assert parsed["a"].tolist() == [3, 4, 3] and parsed["b"].tolist() == [2, 5, 2]


# ------------------------------------------------------------------------ in pipelines
def test_parse_examples_after_batch_and_on_data_source_reads(tmp_path: Path) -> None:
    path = tmp_path / "examples.tfrecord"
    rng = np.random.default_rng(3)
    rows = [
        {"label": i, "vec": rng.random(8, dtype=np.float32), "tags": [b"t"] * (i % 3)}
        for i in range(30)
    ]
    with TFRecordWriter(path) as writer:
        for row in rows:
            writer.write(row)
    spec = {
        "label": FixedLenFeature((), np.int64),
        "vec": FixedLenFeature((8,), np.float32),
        "tags": VarLenFeature(bytes),
    }
    transform = pickle.loads(pickle.dumps(ParseExamples(spec)))
    batches = list(TFRecordIterDataset(path).batch(8).map(transform))
    assert [b["label"].tolist() for b in batches] == [
        list(range(i, min(i + 8, 30))) for i in range(0, 30, 8)
    ]
    np.testing.assert_array_equal(
        np.concatenate([b["vec"] for b in batches]), np.stack([r["vec"] for r in rows])
    )
    assert [len(t) for b in batches for t in b["tags"].rows()] == [i % 3 for i in range(30)]
    source = TFRecordDataSource(path)
    keys = [29, 3, 17, 3]
    parsed = ParseExamples(spec).map(source.__getitems__(keys))
    assert parsed["label"].tolist() == keys
    mapped = list(
        grain_core.MapDataset.source(source).batch(10, batch_fn=list).map(ParseExamples(spec))
    )
    assert np.concatenate([b["label"] for b in mapped]).tolist() == list(range(30))

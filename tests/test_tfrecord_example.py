"""grain-tfrecord: tf.train.Example / SequenceExample codec and feature specs.

The cross-checks build the published Example schema with the protobuf runtime
(``grain_tfrecord.example_message_classes``) and compare in both directions: bytes one
writes are read identically by the other. They skip where protobuf is not installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import numpy as np
import pytest
from conftest import encode_varint, varint_size
from hypothesis import given, settings
from hypothesis import strategies as st

grain_tfrecord = pytest.importorskip("grain_tfrecord")

from grain_tfrecord import (  # noqa: E402
    ExampleDecodeError,
    FeatureSpec,
    decode_example,
    decode_sequence_example,
    encode_example,
    encode_sequence_example,
)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _proto():  # type: ignore[no-untyped-def]
    pytest.importorskip("google.protobuf")
    return grain_tfrecord.example_message_classes()


def _assert_features_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, name
        np.testing.assert_array_equal(actual[name], value, err_msg=name)


# ------------------------------------------------------------------------- round trips
def test_round_trip_of_every_kind() -> None:
    features = {
        "bytes": [b"", b"\x00tail\x00", "text \u00e9"],
        "one_bytes": b"raw",
        "floats": np.array([[1.5, -0.0], [np.inf, 3e38]], dtype=np.float64),
        "ints": [0, 1, 127, 128, 300, -1, INT64_MIN, INT64_MAX],
        "uint8": np.arange(5, dtype=np.uint8),
        "bools": [True, False],
        "scalar": 7,
        "empty_floats": np.zeros(0, np.float32),
        "empty_ints": np.zeros(0, np.int64),
    }
    decoded = decode_example(encode_example(features))
    assert sorted(decoded) == sorted(features)
    assert decoded["bytes"].dtype == object
    assert decoded["bytes"].tolist() == [b"", b"\x00tail\x00", "text \u00e9".encode()]
    assert decoded["one_bytes"].tolist() == [b"raw"]
    np.testing.assert_array_equal(
        decoded["floats"], np.array([1.5, -0.0, np.inf, 3e38], np.float32)
    )
    assert decoded["floats"].dtype == np.float32
    assert decoded["ints"].tolist() == features["ints"] and decoded["ints"].dtype == np.int64
    assert decoded["uint8"].tolist() == [0, 1, 2, 3, 4]
    assert decoded["bools"].tolist() == [1, 0] and decoded["scalar"].tolist() == [7]
    assert decoded["empty_floats"].dtype == np.float32 and decoded["empty_floats"].size == 0
    assert decoded["empty_ints"].dtype == np.int64 and decoded["empty_ints"].size == 0
    assert decode_example(encode_example({})) == {}
    assert decode_example(b"") == {}


def test_long_integer_lists_decode_vectorised() -> None:
    values = np.random.default_rng(0).integers(INT64_MIN, INT64_MAX, 500, dtype=np.int64)
    values[:3] = [INT64_MIN, -1, INT64_MAX]
    np.testing.assert_array_equal(decode_example(encode_example({"v": values}))["v"], values)


# Where protobuf's compiled runtime is installed the codec parses a whole Example with it;
# the codec's own framing (with protobuf's Int64List parser, or with none) reads SequenceExamples,
# records protobuf refuses, and everything where protobuf is absent: each path is tested.
DECODERS = ["protobuf-example", "own-framing", "own-parser"]


@contextlib.contextmanager
def _decoded_by(decoder: str) -> Iterator[None]:
    from grain_tfrecord import _example as codec

    if decoder == "protobuf-example":
        pytest.importorskip("google.protobuf")
        assert codec._compiled_example() is not None
        yield
        return
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(codec, "_compiled_example", lambda: None))
        if decoder == "own-framing":
            pytest.importorskip("google.protobuf")
            assert codec._compiled_int64_list() is not None
        else:
            patches.enter_context(mock.patch.object(codec, "_compiled_int64_list", lambda: None))
        yield


@pytest.mark.parametrize("decoder", DECODERS)
def test_long_integer_lists_decode_the_same_with_or_without_protobuf(decoder: str) -> None:
    values = np.random.default_rng(1).integers(-(1 << 40), 1 << 40, 300, dtype=np.int64)
    # 40 two-byte varints, one 11-byte varint: longer than protobuf allows.
    packed = b"\x80\x01" * 40 + b"\xff" * 10 + b"\x01"
    int64_list = b"\x0a" + bytes([len(packed)]) + packed
    feature = b"\x1a" + bytes([len(int64_list)]) + int64_list
    with _decoded_by(decoder):
        np.testing.assert_array_equal(decode_example(encode_example({"v": values}))["v"], values)
        with pytest.raises(ExampleDecodeError, match="feature 'v'.*longer than 10 bytes"):
            decode_example(_example(_entry(b"v", feature)))


def test_encoder_errors_name_the_feature() -> None:
    with pytest.raises(TypeError, match="feature 'mixed' mixes bytes/str with int"):
        encode_example({"mixed": [b"a", 3]})
    with pytest.raises(TypeError, match="feature 'c'.*complex128"):
        encode_example({"c": np.array([1j])})
    with pytest.raises(ValueError, match="feature 'big' holds an integer above the int64 range"):
        encode_example({"big": np.array([1 << 63], dtype=np.uint64)})


def test_sequence_example_round_trip() -> None:
    data = encode_sequence_example(
        {"id": b"seq-1", "length": 3},
        {"tokens": [[1, 2], [3, 4], [5, 6]], "ragged": [[1.0], [2.0, 3.0]], "words": [b"a", b"bc"]},
    )
    context, sequences = decode_sequence_example(data)
    assert context["id"].tolist() == [b"seq-1"] and context["length"].tolist() == [3]
    np.testing.assert_array_equal(sequences["tokens"], np.array([[1, 2], [3, 4], [5, 6]]))
    assert [s.tolist() for s in sequences["ragged"]] == [[1.0], [2.0, 3.0]]
    assert sequences["words"].tolist() == [[b"a"], [b"bc"]]
    context, sequences = decode_sequence_example(
        data,
        context_features={"length": FeatureSpec(np.int32, ())},
        sequence_features={
            "tokens": FeatureSpec(np.int64, (2,)),
            "missing": FeatureSpec(np.float32, (4,)),
        },
    )
    assert context == {"length": np.int32(3)} and context["length"].dtype == np.int32
    assert sequences["tokens"].shape == (3, 2)
    assert sequences["missing"].shape == (0, 4) and sequences["missing"].dtype == np.float32


# ---------------------------------------------------------------------------- feature spec
def test_feature_spec_checks_dtype_shape_and_defaults() -> None:
    data = encode_example({"image": np.arange(6, dtype=np.uint8), "label": 4, "name": "caf\u00e9"})
    spec = {
        "image": FeatureSpec(np.uint8, (2, -1)),
        "label": FeatureSpec(np.int32, ()),
        "name": FeatureSpec(str, ()),
        "weight": FeatureSpec(np.float32, (2,), default=1.0),
        "tags": FeatureSpec(bytes, None, default=[]),
    }
    decoded = decode_example(data, spec)
    assert list(decoded) == list(spec)
    np.testing.assert_array_equal(decoded["image"], np.arange(6, dtype=np.uint8).reshape(2, 3))
    assert decoded["image"].dtype == np.uint8
    assert decoded["label"].shape == () and decoded["label"].dtype == np.int32
    assert decoded["name"].item() == "caf\u00e9"
    np.testing.assert_array_equal(decoded["weight"], np.ones(2, np.float32))
    assert decoded["tags"].shape == (0,) and decoded["tags"].dtype == object
    decoded["weight"][0] = 5  # defaults are copies, not shared
    assert decode_example(data, spec)["weight"][0] == 1.0


def test_feature_spec_errors_name_the_feature() -> None:
    data = encode_example({"label": [1, 2, 3], "score": 0.5, "blob": b"\xff\xfe"})
    with pytest.raises(
        ExampleDecodeError, match="feature 'missing' is missing and its FeatureSpec has no default"
    ):
        decode_example(data, {"missing": FeatureSpec(np.int64)})
    with pytest.raises(
        ExampleDecodeError, match="feature 'label' holds a int64_list, but its FeatureSpec asks for"
    ):
        decode_example(data, {"label": FeatureSpec(np.float32)})
    with pytest.raises(
        ExampleDecodeError,
        match="feature 'label' has 3 values, which do not fit the FeatureSpec shape \\(2,\\)",
    ):
        decode_example(data, {"label": FeatureSpec(np.int64, (2,))})
    with pytest.raises(ExampleDecodeError, match="feature 'blob' is not UTF-8 text"):
        decode_example(data, {"blob": FeatureSpec(str)})
    with pytest.raises(TypeError, match="not stored by tf.train.Example"):
        FeatureSpec(np.complex64)
    with pytest.raises(ValueError, match="at most one -1"):
        FeatureSpec(np.int64, (-1, -1))
    with pytest.raises(ValueError, match="does not fit shape"):
        FeatureSpec(np.int64, (3,), default=[1, 2])


# ----------------------------------------------------------------------- malformed input
def _entry(name: bytes, feature: bytes) -> bytes:
    entry = b"\x0a" + bytes([len(name)]) + name + b"\x12" + bytes([len(feature)]) + feature
    return b"\x0a" + bytes([len(entry)]) + entry


def _example(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return b"\x0a" + bytes([len(body)]) + body


def test_malformed_examples_raise_with_the_feature_name() -> None:
    # An int64_list whose packed varint runs off its end.
    bad_ints = _example(_entry(b"label", b"\x1a\x03\x0a\x01\x80"))
    with pytest.raises(ExampleDecodeError, match="feature 'label'"):
        decode_example(bad_ints)
    # A float_list of 3 bytes is not whole floats.
    with pytest.raises(ExampleDecodeError, match="feature 'x'.*not whole floats"):
        decode_example(_example(_entry(b"x", b"\x12\x05\x0a\x03abc")))
    # A length that runs past the message.
    with pytest.raises(ExampleDecodeError, match="feature 'img'.*runs past the end"):
        decode_example(_example(_entry(b"img", b"\x0a\x04\x0a\x09ab")))
    # A group that never ends, and an invalid wire type, inside a feature.
    with pytest.raises(ExampleDecodeError, match="feature 'g'.*group 1 has no end"):
        decode_example(_example(_entry(b"g", b"\x0b")))
    with pytest.raises(ExampleDecodeError, match="feature 'w'.*invalid wire type 7"):
        decode_example(_example(_entry(b"w", b"\x0f")))
    # A message cut off right after a tag.
    with pytest.raises(ExampleDecodeError, match="Not a valid tf.train.Example"):
        decode_example(_example(_entry(b"a", b"\x1a\x00"))[:-1])
    with pytest.raises(ExampleDecodeError, match="Not a valid tf.train.Example"):
        decode_example(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
    with pytest.raises(ExampleDecodeError, match="not UTF-8"):
        decode_example(_example(_entry(b"\xff", b"")))


def test_field_number_zero_is_skipped_inside_an_unknown_group_only() -> None:
    # protobuf (upb) skips a group's fields without checking their numbers, and refuses field
    # number 0 everywhere else; found by the differential fuzz test below.
    group_with_field_zero = b"\x0b\x01" + bytes(8) + b"\x0c"
    assert decode_example(group_with_field_zero) == {}
    assert decode_example(b"\x8b\x00\x01" + bytes(8) + b"\x0c") == {}
    with pytest.raises(ExampleDecodeError, match="invalid number 0"):
        decode_example(b"\x01" + bytes(8))
    with pytest.raises(ExampleDecodeError, match="invalid number 0"):
        decode_example(b"\x0a\x02\x00\x00")


def test_unknown_fields_unpacked_lists_and_merge_rules() -> None:
    float_unpacked = b"\x0d" + np.float32(1.5).tobytes() + b"\x0d" + np.float32(-2).tobytes()
    ints_unpacked = b"\x08\x05\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"
    unknown = b"\x28\x07" + b"\x31" + bytes(8) + b"\x3d" + bytes(4)  # varint, fixed64, fixed32
    data = (
        _example(
            _entry(b"f", b"\x12" + bytes([len(float_unpacked)]) + float_unpacked + unknown),
            _entry(b"i", b"\x1a" + bytes([len(ints_unpacked)]) + ints_unpacked),
            _entry(b"dup", b"\x1a\x03\x0a\x01\x01"),
            _entry(b"dup", b"\x1a\x03\x0a\x01\x02"),  # the last value of a map key wins
            _entry(b"none", b""),  # a Feature with no list
            _entry(
                b"merged", b"\x1a\x03\x0a\x01\x01\x1a\x03\x0a\x01\x02"
            ),  # same list twice: merged
        )
        + unknown
    )
    decoded = decode_example(data)
    assert decoded["f"].tolist() == [1.5, -2.0]
    assert decoded["i"].tolist() == [5, -1]
    assert decoded["dup"].tolist() == [2]
    assert decoded["none"].dtype == np.float32 and decoded["none"].size == 0
    assert decoded["merged"].tolist() == [1, 2]
    assert decode_example(data, {"none": FeatureSpec(np.int64, None)})["none"].dtype == np.int64


# ------------------------------------------------------------- cross-check with protobuf
def test_bytes_match_the_protobuf_runtime_both_ways() -> None:
    pb = _proto()
    message = pb.Example()
    feature = message.features.feature
    feature["image"].bytes_list.value.extend([b"\x00\x01", b""])
    feature["label"].int64_list.value.extend([INT64_MIN, -1, 0, 300, INT64_MAX])
    feature["score"].float_list.value.extend([0.25, -1e-30])
    feature["empty"].float_list.SetInParent()
    serialized = message.SerializeToString(deterministic=True)
    decoded = decode_example(serialized)
    assert decoded["image"].tolist() == [b"\x00\x01", b""]
    assert decoded["label"].tolist() == [INT64_MIN, -1, 0, 300, INT64_MAX]
    np.testing.assert_array_equal(decoded["score"], np.array([0.25, -1e-30], np.float32))
    assert decoded["empty"].size == 0
    assert encode_example(decoded) == serialized


@pytest.mark.parametrize("size", [127, 128, 129, 16383, 16384])
def test_lengths_around_one_and_two_byte_prefixes_match_the_protobuf_runtime(size: int) -> None:
    pb = _proto()
    blob = (bytes(range(256)) * 65)[:size]
    message = pb.Example()
    message.features.feature["blob"].bytes_list.value.append(blob)
    message.features.feature["ids"].int64_list.value.extend(range(size // 2))
    serialized = message.SerializeToString(deterministic=True)
    decoded = decode_example(serialized)
    assert decoded["blob"].tolist() == [blob]
    assert decoded["ids"].tolist() == list(range(size // 2))
    assert encode_example(decoded) == serialized


def test_two_byte_lengths_cut_off_or_too_long_are_malformed() -> None:
    with pytest.raises(ExampleDecodeError, match="cut off"):
        decode_example(b"\x0a\x81")
    with pytest.raises(ExampleDecodeError, match="128 bytes .* runs past the end"):
        decode_example(b"\x0a\x80\x01" + bytes(127))


def test_sequence_example_matches_the_protobuf_runtime() -> None:
    pb = _proto()
    message = pb.SequenceExample()
    message.context.feature["id"].bytes_list.value.append(b"x")
    steps = message.feature_lists.feature_list["tokens"].feature
    for row in ([1, 2], [3, 4]):
        steps.add().int64_list.value.extend(row)
    serialized = message.SerializeToString(deterministic=True)
    context, sequences = decode_sequence_example(serialized)
    assert context["id"].tolist() == [b"x"]
    assert sequences["tokens"].tolist() == [[1, 2], [3, 4]]
    assert encode_sequence_example(context, sequences) == serialized
    parsed = pb.SequenceExample.FromString(
        encode_sequence_example({"a": 1.0}, {"s": [[b"p"], [b"q"]]})
    )
    assert [list(f.bytes_list.value) for f in parsed.feature_lists.feature_list["s"].feature] == [
        [b"p"],
        [b"q"],
    ]


_names = st.text(max_size=8)
_values = st.one_of(
    st.lists(st.binary(max_size=20), max_size=5).map(lambda v: ("bytes", v)),
    st.lists(st.floats(width=32, allow_nan=False), max_size=8).map(lambda v: ("float", v)),
    st.lists(st.integers(INT64_MIN, INT64_MAX), max_size=8).map(lambda v: ("int", v)),
)


def _to_proto(pb, features: dict[str, tuple[str, list]]):  # type: ignore[no-untyped-def]
    message = pb.Example()
    message.features.SetInParent()
    for name, (kind, values) in features.items():
        target = message.features.feature[name]
        {"bytes": target.bytes_list, "float": target.float_list, "int": target.int64_list}[
            kind
        ].SetInParent()
        getattr(target, f"{'int64' if kind == 'int' else kind}_list").value.extend(values)
    return message


def _typed(kind: str, values: list) -> np.ndarray:
    if kind == "bytes":
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out
    return np.array(values, dtype=np.float32 if kind == "float" else np.int64)


@given(st.dictionaries(_names, _values, max_size=5))
def test_property_protobuf_and_codec_agree(features: dict[str, tuple[str, list]]) -> None:
    pb = _proto()
    expected = {name: _typed(kind, values) for name, (kind, values) in sorted(features.items())}
    serialized = _to_proto(pb, features).SerializeToString(deterministic=True)
    _assert_features_equal(dict(sorted(decode_example(serialized).items())), expected)
    ours = encode_example(expected)
    assert pb.Example.FromString(ours) == _to_proto(pb, features)
    if not any(a != b and b.startswith(a) for a in features for b in features):
        # Both sort map keys; upb puts a key after the longer keys it prefixes, C++
        # protobuf and this codec before them, so bytes are compared without such pairs.
        assert ours == serialized


# ------------------------------------------- differential fuzzing against the protobuf runtime
# Wire bytes are built field by field, canonically or not: over-long varints (within and past
# protobuf's limits), packed and unpacked chunks of one list, map entries with the value
# before the key or split in several value fields, repeated keys, lists of another kind
# replacing a oneof, Features split over several fields, and unknown fields of every wire
# type (groups nested) everywhere. Each message must decode exactly as protobuf decodes it,
# or fail where protobuf fails.
_FUZZ_KEYS = ["a", "b", "label", "", "\u00e9t\u00e9"]


@st.composite
def _wire_example(draw: st.DrawFn) -> bytes:
    canonical = draw(st.booleans())

    def varint(value: int, limit: int = 10) -> bytes:
        if canonical or draw(st.integers(0, 3)):
            return encode_varint(value)
        # Over-long: the same value with zero groups added, sometimes past the limit.
        size = varint_size(value)
        return encode_varint(
            value, draw(st.integers(1, limit + 1 - size) if size < limit else st.just(1))
        )

    def field(number: int, wire_type: int, payload: bytes = b"") -> bytes:
        tag = varint(number << 3 | wire_type, 5)
        if wire_type == 2:
            return tag + varint(len(payload), 5) + payload
        return tag + payload

    def unknown(depth: int = 0) -> bytes:
        number = draw(st.sampled_from([1, 2, 3, 4, 9, 16, 1000, (1 << 29) - 1]))
        wire_type = draw(st.sampled_from([0, 1, 2, 5] + ([3] if depth < 2 else [])))
        if wire_type == 0:
            return field(number, 0, varint(draw(st.integers(0, (1 << 64) - 1))))
        if wire_type in (1, 5):
            return field(
                number,
                wire_type,
                draw(
                    st.binary(
                        min_size=8 if wire_type == 1 else 4, max_size=8 if wire_type == 1 else 4
                    )
                ),
            )
        if wire_type == 2:
            return field(number, 2, draw(st.binary(max_size=6)))
        inner = b"".join(unknown(depth + 1) for _ in range(draw(st.integers(0, 2))))
        return field(number, 3) + inner + field(number, 4)

    def unknowns() -> bytes:
        return b"".join(unknown() for _ in range(draw(st.integers(0, 1)))) if not canonical else b""

    def shuffled(parts: list[bytes]) -> bytes:
        return b"".join(draw(st.permutations(parts)) if not canonical else parts)

    def int64_list() -> bytes:
        # Short lists, and long ones past the codec's switch to NumPy conversion and its
        # one-byte-run path.
        values = draw(
            st.lists(st.integers(INT64_MIN, INT64_MAX), max_size=6)
            | st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=48, max_size=64)
            | st.lists(st.integers(0, 127), min_size=48, max_size=64)
        )
        chunks, i = [], 0
        while i < len(values):
            size = draw(st.integers(1, len(values) - i)) if not canonical else len(values)
            part = values[i : i + size]
            if not canonical and draw(st.booleans()):
                chunks += [field(1, 0, varint(v)) for v in part]
            else:
                chunks.append(field(1, 2, b"".join(varint(v) for v in part)))
            i += size
        return b"".join(chunks) + unknowns()

    def float_list() -> bytes:
        values = draw(
            st.lists(st.binary(min_size=4, max_size=4), max_size=6)
            | st.lists(st.binary(min_size=4, max_size=4), min_size=48, max_size=64)
        )
        if canonical or draw(st.booleans()):
            return (field(1, 2, b"".join(values)) if values else b"") + unknowns()
        return b"".join(field(1, 5, v) for v in values) + unknowns()

    def bytes_list() -> bytes:
        values = draw(st.lists(st.binary(max_size=5), max_size=4))
        return b"".join(field(1, 2, v) for v in values) + unknowns()

    def feature() -> bytes:
        lists = {1: bytes_list, 2: float_list, 3: int64_list}
        kinds = draw(st.lists(st.sampled_from([1, 2, 3]), max_size=1 if canonical else 3))
        return b"".join(field(k, 2, lists[k]()) for k in kinds) + unknowns()

    def entry() -> bytes:
        key = draw(st.sampled_from(_FUZZ_KEYS)).encode()
        parts = [field(1, 2, key)]
        parts += [
            field(2, 2, feature()) for _ in range(1 if canonical else draw(st.integers(0, 3)))
        ]
        if not canonical and draw(st.integers(0, 5)) == 0:
            parts.append(field(1, 2, draw(st.sampled_from([b"\xff", b"b"]))))
        return shuffled(parts + [unknowns()])

    def features() -> bytes:
        return b"".join(field(1, 2, entry()) for _ in range(draw(st.integers(0, 4)))) + unknowns()

    count = 1 if canonical else draw(st.integers(0, 2))
    return shuffled([field(1, 2, features()) for _ in range(count)] + [unknowns()])


def _protobuf_reference(pb, data: bytes) -> dict[str, np.ndarray] | None:  # type: ignore[no-untyped-def]
    from google.protobuf.message import DecodeError

    try:
        message = pb.Example.FromString(data)
    except DecodeError:
        return None
    out = {}
    for name, feature in message.features.feature.items():
        kind = feature.WhichOneof("kind")
        if kind == "bytes_list":
            out[name] = _typed("bytes", list(feature.bytes_list.value))
        elif kind == "float_list":
            out[name] = _typed("float", list(feature.float_list.value))
        elif kind == "int64_list":
            out[name] = _typed("int", list(feature.int64_list.value))
        else:
            out[name] = np.empty(0, np.float32)
    return out


def _ours(data: bytes) -> dict[str, np.ndarray] | None:
    try:
        return decode_example(data)
    except ExampleDecodeError:
        return None


def _assert_agrees_with_protobuf(pb, data: bytes) -> None:  # type: ignore[no-untyped-def]
    expected = _protobuf_reference(pb, data)
    actual = _ours(data)
    assert (actual is None) == (expected is None), (data, actual, expected)
    if expected is not None and actual is not None:
        _assert_features_equal(dict(sorted(actual.items())), dict(sorted(expected.items())))


@pytest.mark.parametrize("decoder", DECODERS)
@settings(max_examples=400)
@given(data=_wire_example())
def test_fuzz_decoding_agrees_with_the_protobuf_runtime(decoder: str, data: bytes) -> None:
    pb = _proto()
    with _decoded_by(decoder):
        _assert_agrees_with_protobuf(pb, data)


@pytest.mark.parametrize("decoder", DECODERS)
@settings(max_examples=200)
@given(data=_wire_example(), draw=st.data())
def test_fuzz_damaged_messages_agree_with_the_protobuf_runtime(
    decoder: str, data: bytes, draw: st.DataObject
) -> None:
    """Cut short, a byte changed or inserted: protobuf and the codec still agree."""
    pb = _proto()
    damaged = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 3))):
        at = draw.draw(st.integers(0, len(damaged)))
        action = draw.draw(st.sampled_from(["cut", "set", "insert"]))
        byte = draw.draw(st.integers(0, 255))
        if action == "cut":
            del damaged[at:]
        elif action == "set" and at < len(damaged):
            damaged[at] = byte
        else:
            damaged.insert(at, byte)
    with _decoded_by(decoder):
        _assert_agrees_with_protobuf(pb, bytes(damaged))

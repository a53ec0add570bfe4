"""``tf.train.Example`` / ``SequenceExample`` to and from NumPy, without TensorFlow.

A small codec of the protobuf wire format of the published schema::

    Example         { Features features = 1; }
    SequenceExample { Features context = 1; FeatureLists feature_lists = 2; }
    Features        { map<string, Feature> feature = 1; }
    FeatureLists    { map<string, FeatureList> feature_list = 1; }
    FeatureList     { repeated Feature feature = 1; }
    Feature         { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                                   Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }   FloatList { repeated float value = 1; }
    Int64List { repeated int64 value = 1; }

Where the protobuf runtime's compiled parser is installed (``upb`` or ``cpp``), an Example
is parsed whole by it and each list converted to NumPy once; a record protobuf refuses goes
to the codec's own parser, which names the fault and the feature. The own parser (used
without protobuf, for SequenceExamples, and for those refused records) decodes float lists
with one ``np.frombuffer``; integer lists, whose varints a Python loop reads slowly, go to
protobuf's C parser of an ``Int64List`` where installed, except a packed run of one-byte
values, which NumPy reads directly; without protobuf, short lists decode in a Python loop
and long ones with NumPy. Measured per record against the protobuf runtime (published
schema, then the conversion to NumPy; ``benchmarks/bench_example.py``), the codec is faster
on Examples of scalars and of lists and on par on long integer and float lists (the same C
parse and conversion); for a batch of records, :func:`grain_tfrecord.parse_example_batch`
is several times faster still.

It decodes as the protobuf runtime does, which a differential fuzz test checks: packed and
unpacked encodings, over-long varints, unknown fields of every wire type skipped (groups
included), and protobuf's merge rules: a repeated map key keeps the last entry, repeated
value fields of one entry merge, a oneof list of another kind replaces the earlier one, and
a map entry holding an unknown field is left out (protobuf's C runtime keeps it as an
unknown field). The encoder writes map keys sorted, as protobuf's
``SerializeToString(deterministic=True)`` does, so equal inputs give equal bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from grain_tfrecord._proto import example_message_classes

__all__ = [
    "ExampleDecodeError",
    "FeatureSpec",
    "decode_example",
    "decode_sequence_example",
    "encode_example",
    "encode_sequence_example",
]

# Feature.kind field numbers.
_BYTES, _FLOAT, _INT64 = 1, 2, 3
_KIND_NAMES = {_BYTES: "bytes_list", _FLOAT: "float_list", _INT64: "int64_list"}
_UINT64 = 1 << 64
_UINT64_MASK = _UINT64 - 1
_UINT32_MAX = (1 << 32) - 1
# protobuf reads a tag from at most 5 bytes and a length from at most 5 bytes (longer
# encodings, even of small values, fail its parse); other varints take up to 10.
_MAX_TAG_BYTES = 5
_MAX_LENGTH_BYTES = 5
_INT64_MAX = (1 << 63) - 1
_LE_FLOAT32 = np.dtype("<f4")
_SEVEN_BITS = np.arange(10, dtype=np.uint64) * np.uint64(7)
# Packed varint lists up to this many bytes decode faster in a Python loop than with NumPy.
_SHORT_VARINTS = 96
# Where the protobuf runtime's C parser is installed, it decodes every int64_list but one
# packed run of one-byte values longer than this, which NumPy reads directly; it is faster
# for every other shape, from one value up (benchmarks/bench_example.py).
_ONE_BYTE_RUN_MIN_BYTES = 8
_FROMITER_MAX_VALUES = 48

Parsed = tuple[int, np.ndarray | None]  # (kind, values); kind 0 = a Feature with no list set


class ExampleDecodeError(ValueError):
    """A record is not a valid Example / SequenceExample, or does not fit the feature spec.

    The message names the feature when it is known.
    """


class _Malformed(Exception):
    """Raised by the parser; becomes an ExampleDecodeError with the feature name added."""


# --------------------------------------------------------------------------- feature spec
@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """How to decode one feature: dtype, shape and the value used when it is missing.

    Args:
      dtype: A float dtype for ``float_list``; an integer dtype or bool for ``int64_list``;
        ``bytes`` (bytes objects) or ``str`` (UTF-8 decoded) for ``bytes_list``, both as
        object arrays.
      shape: Shape of the values (one dimension may be -1; ``()`` is a scalar); None keeps
        the 1-D list as stored. For a sequence feature: the shape of one step.
      default: Value for a missing feature, broadcast to ``shape``; None makes a missing
        feature an error. Unused for sequence features (a missing one has zero steps).

    Raises:
      TypeError: If ``dtype`` is none of the above.
      ValueError: If ``shape`` has several -1 or ``default`` does not fit it.
    """

    dtype: Any
    shape: tuple[int, ...] | None = None
    default: Any = None
    _kind: int = dataclasses.field(init=False, repr=False, compare=False)
    _numpy_dtype: np.dtype[Any] = dataclasses.field(init=False, repr=False, compare=False)
    _utf8: bool = dataclasses.field(init=False, repr=False, compare=False)
    _default_array: np.ndarray | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kind, numpy_dtype, utf8 = resolve_dtype(self.dtype)
        set_field = object.__setattr__
        set_field(self, "_kind", kind)
        set_field(self, "_numpy_dtype", numpy_dtype)
        set_field(self, "_utf8", utf8)
        if self.shape is not None:
            shape = tuple(int(d) for d in self.shape)
            if sum(d == -1 for d in shape) > 1 or any(d < -1 for d in shape):
                raise ValueError(
                    f"FeatureSpec shape {self.shape} is invalid: sizes >= 0 and at most one -1."
                )
            set_field(self, "shape", shape)
        set_field(self, "_default_array", None if self.default is None else self._fit_default())

    def _fit_default(self) -> np.ndarray:
        value = np.asarray(self.default, dtype=self._numpy_dtype)
        try:
            if self.shape is None:
                return value.reshape(-1)
            if -1 in self.shape:
                return value.reshape(self.shape)
            return np.broadcast_to(value, self.shape).copy()
        except ValueError:
            raise ValueError(
                f"FeatureSpec default {self.default!r} does not fit shape {self.shape}."
            ) from None

    def apply(self, name: str, parsed: Parsed | None) -> np.ndarray:
        """Returns the checked and reshaped values of feature ``name`` (None: missing).

        Raises:
          ExampleDecodeError: If the feature is missing without a default, holds another
            kind of list, or its number of values does not fit the shape.
        """
        if parsed is None:
            if self._default_array is None:
                raise ExampleDecodeError(
                    f"feature {name!r} is missing and its FeatureSpec has no default."
                )
            return self._default_array.copy()
        kind, values = parsed
        if values is None or not values.size:  # no list, or an empty one of any kind
            values = np.empty(0, dtype=self._numpy_dtype)
        elif kind != self._kind:
            raise ExampleDecodeError(
                f"feature {name!r} holds a {_KIND_NAMES[kind]}, but its FeatureSpec asks for "
                f"{self.dtype!r}, stored as a {_KIND_NAMES[self._kind]}."
            )
        elif self._utf8:
            try:
                values = np.array([v.decode("utf-8") for v in values] or [], dtype=object)
            except UnicodeDecodeError as err:
                raise ExampleDecodeError(f"feature {name!r} is not UTF-8 text: {err}") from None
        elif values.dtype != self._numpy_dtype:
            values = values.astype(self._numpy_dtype)
        if self.shape is None:
            return values
        try:
            return values.reshape(self.shape)
        except ValueError:
            raise ExampleDecodeError(
                f"feature {name!r} has {values.size} values, which do not fit the FeatureSpec "
                f"shape {self.shape}."
            ) from None


def resolve_dtype(dtype: Any) -> tuple[int, np.dtype[Any], bool]:
    """Returns the Feature list kind storing ``dtype``, its NumPy dtype, and whether bytes
    are decoded as UTF-8 text.

    Raises:
      TypeError: If ``tf.train.Example`` does not store ``dtype``.
    """
    if dtype is str or dtype is np.str_:
        return _BYTES, np.dtype(object), True
    if dtype in (bytes, object, np.bytes_):
        return _BYTES, np.dtype(object), False
    numpy_dtype = np.dtype(dtype)
    if numpy_dtype.kind == "f":
        return _FLOAT, numpy_dtype, False
    if numpy_dtype.kind in "iub":
        return _INT64, numpy_dtype, False
    raise TypeError(
        f"dtype {dtype!r} is not stored by tf.train.Example; use a float or integer dtype, "
        "bool, bytes or str."
    )


# ---------------------------------------------------------------------------- decoding
def decode_example(
    data: bytes, features: Mapping[str, FeatureSpec] | None = None
) -> dict[str, np.ndarray]:
    """Decodes a serialized ``tf.train.Example`` into ``{feature name: array}``.

    ``bytes_list`` becomes an object array of bytes, ``float_list`` float32 and
    ``int64_list`` int64 (a Feature with no list set: an empty float32 array).

    Args:
      data: The serialized message (a TFRecord record).
      features: Optional spec: only these features are returned, in this order, checked and
        shaped by their :class:`FeatureSpec`; the others are skipped without being converted.
        Without a spec every feature is returned, sorted by name (the message's map has no
        order).

    Raises:
      ExampleDecodeError: If ``data`` is not a valid Example (naming the feature when it can)
        or does not fit ``features``.
    """
    parse = _compiled_example()
    if parse is not None:
        compiled = parse(data, features)
        if compiled is not None:
            return _assemble(compiled, features)
    parsed = _decode(data, "tf.train.Example", lambda buf: _parse_example(buf, features))
    return _assemble(parsed, features)


def decode_sequence_example(
    data: bytes,
    context_features: Mapping[str, FeatureSpec] | None = None,
    sequence_features: Mapping[str, FeatureSpec] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray | list[np.ndarray]]]:
    """Decodes a serialized ``tf.train.SequenceExample`` into ``(context, sequences)``.

    ``context`` is decoded as by :func:`decode_example`. Each sequence feature becomes an
    array ``[steps, ...]`` when its steps have equal lengths (or a spec shape), else a list
    of 1-D arrays, one per step. A sequence feature missing from the record has zero steps.

    Args:
      data: The serialized message.
      context_features: Optional spec of the context features.
      sequence_features: Optional spec of the sequence features (shape = one step's shape).

    Raises:
      ExampleDecodeError: If ``data`` is not a valid SequenceExample or does not fit a spec.
    """
    context, feature_lists = _decode(data, "tf.train.SequenceExample", _parse_sequence_example)
    sequences: dict[str, np.ndarray | list[np.ndarray]] = {}
    if sequence_features is None:
        for name, steps in feature_lists.items():
            sequences[name] = _stack_steps([_values_or_empty(p) for p in steps])
    else:
        for name, spec in sequence_features.items():
            steps = feature_lists.get(name, [])
            values = [spec.apply(name, p) for p in steps]
            if not values and spec.shape is not None:
                shape = tuple(0 if d == -1 else d for d in spec.shape)
                sequences[name] = np.empty((0, *shape), dtype=spec._numpy_dtype)
            else:
                sequences[name] = _stack_steps(values)
    return _assemble(context, context_features), sequences


def _decode(data: bytes, what: str, parse: Callable[[bytes], Any]) -> Any:
    if not isinstance(data, bytes):
        data = bytes(data)
    try:
        return parse(data)
    except IndexError:
        # Only the inlined length reads can run off the buffer: a message is cut off.
        raise ExampleDecodeError(
            f"Not a valid {what} ({len(data)} bytes): a field is cut off at the end. "
            f"Is the record a {what}?"
        ) from None
    except _Malformed as err:
        raise ExampleDecodeError(
            f"Not a valid {what} ({len(data)} bytes): {err}. Is the record a {what}?"
        ) from None


def _assemble(
    parsed: dict[str, Parsed], features: Mapping[str, FeatureSpec] | None
) -> dict[str, np.ndarray]:
    if features is None:  # a map has no order: features come sorted by name
        return {name: _values_or_empty(parsed[name]) for name in sorted(parsed)}
    return {name: spec.apply(name, parsed.get(name)) for name, spec in features.items()}


def _values_or_empty(parsed: Parsed) -> np.ndarray:
    values = parsed[1]
    return np.empty(0, dtype=np.float32) if values is None else values


def _stack_steps(values: list[np.ndarray]) -> np.ndarray | list[np.ndarray]:
    if values and all(v.shape == values[0].shape and v.dtype == values[0].dtype for v in values):
        return np.stack(values)
    return values


def _varint(buf: bytes, pos: int, end: int, limit: int = 10) -> tuple[int, int]:
    """Reads a varint of at most ``limit`` bytes; the value keeps its low 64 bits, as
    protobuf does with an over-long encoding."""
    result = 0
    shift = 0
    stop = min(end, pos + limit)
    while pos < stop:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _UINT64_MASK, pos
        shift += 7
    if pos < end:
        raise _Malformed(f"a varint is longer than {limit} bytes at byte {pos - limit}")
    raise _Malformed(f"a varint is cut off at byte {pos}")


def _length(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Reads a length prefix at ``pos``; returns (start, stop) of the delimited bytes."""
    if pos >= end:
        raise _Malformed(f"a length is missing at byte {pos}")
    length = buf[pos]
    if length < 0x80:
        pos += 1
    elif pos + 1 < end and buf[pos + 1] < 0x80:  # two-byte length (128 B to 16 KiB): inlined
        length = (length & 0x7F) | buf[pos + 1] << 7
        pos += 2
    else:
        length, pos = _varint(buf, pos, end, _MAX_LENGTH_BYTES)
    stop = pos + length
    if stop > end:
        raise _Malformed(
            f"a field of {length} bytes at byte {pos} runs past the end of its message (byte {end})"
        )
    return pos, stop


def _long_tag(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Reads a tag that does not fit one byte (a field number above 15, or an over-long
    encoding of any tag, which protobuf accepts up to 5 bytes)."""
    tag, pos = _varint(buf, pos, end, _MAX_TAG_BYTES)
    if tag > _UINT32_MAX:
        raise _Malformed(f"a field tag above 32 bits ends at byte {pos}")
    return tag, pos


def _skip(buf: bytes, pos: int, end: int, tag: int) -> int:
    """Skips the value of an unknown field (any wire type; groups with what they hold)."""
    if tag < 8:
        raise _Malformed(f"a field has the invalid number 0 before byte {pos}")
    return _skip_value(buf, pos, end, tag)


def _skip_value(buf: bytes, pos: int, end: int, tag: int) -> int:
    """Skips one field's value. Field number 0 is not refused here: inside a skipped group
    the protobuf runtime (upb) skips fields without checking their numbers."""
    wire_type = tag & 7
    if wire_type == 0:
        return _varint(buf, pos, end)[1]
    if wire_type == 2:
        return _length(buf, pos, end)[1]
    if wire_type == 1 or wire_type == 5:
        pos += 8 if wire_type == 1 else 4
        if pos > end:
            raise _Malformed(f"a fixed-size field runs past the end of its message (byte {end})")
        return pos
    if wire_type == 3:  # a group: fields up to the end-group tag of the same number
        while pos < end:
            inner = buf[pos]
            if inner < 0x80:
                pos += 1
            else:
                inner, pos = _long_tag(buf, pos, end)
            if inner == tag + 1:
                return pos
            pos = _skip_value(buf, pos, end, inner)
        raise _Malformed(f"group {tag >> 3} has no end before byte {end}")
    if wire_type == 4:
        raise _Malformed(f"an end of group {tag >> 3} has no start, before byte {pos}")
    raise _Malformed(f"field {tag >> 3} has the invalid wire type {wire_type}")


def _parse_example(
    buf: bytes, wanted: Container[str] | None = None, padded: bool = False
) -> dict[str, Parsed]:
    """Parses an Example; ``wanted``: parse only these features (others are skipped by
    length); ``padded``: ``buf`` may end in NUL bytes that are not part of the message (a
    row of a NumPy bytes array), which a valid message never has where a tag starts."""
    features: dict[str, Parsed] = {}
    pos, end = 0, len(buf)
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            if tag == 0 and padded and not buf[pos:].strip(b"\0"):
                break
            pos += 1
        else:
            tag, pos = _long_tag(buf, pos, end)
        if tag == 0x0A:  # Example.features
            start, pos = _length(buf, pos, end)
            _parse_map(buf, start, pos, _parse_feature, features, wanted)
        else:
            pos = _skip(buf, pos, end, tag)
    return features


def _parse_sequence_example(buf: bytes) -> tuple[dict[str, Parsed], dict[str, list[Parsed]]]:
    context: dict[str, Parsed] = {}
    feature_lists: dict[str, list[Parsed]] = {}
    pos, end = 0, len(buf)
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _long_tag(buf, pos, end)
        if tag == 0x0A:  # SequenceExample.context
            start, pos = _length(buf, pos, end)
            _parse_map(buf, start, pos, _parse_feature, context)
        elif tag == 0x12:  # SequenceExample.feature_lists
            start, pos = _length(buf, pos, end)
            _parse_map(buf, start, pos, _parse_feature_list, feature_lists)
        else:
            pos = _skip(buf, pos, end, tag)
    return context, feature_lists


def _parse_map(
    buf: bytes,
    pos: int,
    end: int,
    parse_value: Callable[[bytes, int, int, Any], Any],
    out: dict[str, Any],
    wanted: Container[str] | None = None,
) -> None:
    """Parses the map entries (field 1: key 1, value 2) of a Features/FeatureLists message.

    As protobuf does: a key seen again replaces the earlier entry; within one entry, a
    repeated key field keeps the last, and repeated value fields merge (their lists join);
    an entry holding an unknown field is checked but left out of the map (protobuf's C
    runtime keeps such an entry as an unknown field of the map's message).
    """
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _long_tag(buf, pos, end)
        if tag != 0x0A:
            pos = _skip(buf, pos, end, tag)
            continue
        size = buf[pos] if pos < end else 0x80
        if size < 0x80 and pos + 1 + size <= end:  # one-byte length: inlined _length
            entry, pos = pos + 1, pos + 1 + size
        else:
            entry, pos = _length(buf, pos, end)
        name = ""
        values: list[tuple[int, int]] = []
        unknown = False
        while entry < pos:
            tag = buf[entry]
            if tag < 0x80:
                entry += 1
            else:
                tag, entry = _long_tag(buf, entry, pos)
            if tag == 0x0A or tag == 0x12:
                size = buf[entry] if entry < pos else 0x80
                if size < 0x80 and entry + 1 + size <= pos:
                    start, entry = entry + 1, entry + 1 + size
                else:
                    start, entry = _length(buf, entry, pos)
                if tag == 0x12:
                    values.append((start, entry))
                    continue
                try:
                    name = buf[start:entry].decode("utf-8")
                except UnicodeDecodeError:
                    raise _Malformed(f"a feature name at byte {start} is not UTF-8") from None
            else:
                entry = _skip(buf, entry, pos, tag)
                unknown = True
        if wanted is not None and name not in wanted:
            continue
        value = None
        try:
            for start, stop in values:
                value = parse_value(buf, start, stop, value)
            if value is None:  # an entry without a value holds the empty message
                value = parse_value(buf, 0, 0, None)
        except _Malformed as err:
            raise _Malformed(f"feature {name!r}: {err}" if name else str(err)) from None
        if not unknown:
            out[name] = value


def _parse_feature_list(buf: bytes, pos: int, end: int, steps: list[Parsed] | None) -> list[Parsed]:
    """Parses a FeatureList, appending its steps to ``steps`` (a FeatureList merged into)."""
    steps = [] if steps is None else steps
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _long_tag(buf, pos, end)
        if tag == 0x0A:
            start, pos = _length(buf, pos, end)
            steps.append(_parse_feature(buf, start, pos, None))
        else:
            pos = _skip(buf, pos, end, tag)
    return steps


def _parse_feature(buf: bytes, pos: int, end: int, merged: Parsed | None) -> Parsed:
    """Parses a Feature, merged into ``merged`` (the Feature read so far, or None)."""
    kind, values = (0, None) if merged is None else merged
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _long_tag(buf, pos, end)
        if tag == 0x0A or tag == 0x12 or tag == 0x1A:
            field = tag >> 3
            size = buf[pos] if pos < end else 0x80
            if size < 0x80 and pos + 1 + size <= end:
                start, pos = pos + 1, pos + 1 + size
            else:
                start, pos = _length(buf, pos, end)
            parsed = _LIST_PARSERS[field](buf, start, pos)
            # oneof: a later list replaces another kind; the same kind again merges.
            if field == kind and values is not None:
                parsed = np.concatenate([values, parsed])
            kind, values = field, parsed
        else:
            pos = _skip(buf, pos, end, tag)
    return kind, values


def _parse_bytes_list(buf: bytes, pos: int, end: int) -> np.ndarray:
    items = []
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _long_tag(buf, pos, end)
        if tag == 0x0A:
            start, pos = _length(buf, pos, end)
            items.append(buf[start:pos])
        else:
            pos = _skip(buf, pos, end, tag)
    values = np.empty(len(items), dtype=object)
    values[:] = items
    return values


def _parse_float_list(buf: bytes, pos: int, end: int) -> np.ndarray:
    chunks = []
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _long_tag(buf, pos, end)
        if tag == 0x0A:  # packed
            start, pos = _length(buf, pos, end)
            if (pos - start) % 4:
                raise _Malformed(f"a packed float_list of {pos - start} bytes is not whole floats")
            chunks.append(np.frombuffer(buf, _LE_FLOAT32, (pos - start) // 4, start))
        elif tag == 0x0D:  # one unpacked float
            if pos + 4 > end:
                raise _Malformed(f"a float runs past the end of its list (byte {end})")
            chunks.append(np.frombuffer(buf, _LE_FLOAT32, 1, pos))
            pos += 4
        else:
            pos = _skip(buf, pos, end, tag)
    if len(chunks) == 1:
        return chunks[0].astype(np.float32)
    return np.concatenate(chunks).astype(np.float32) if chunks else np.empty(0, np.float32)


def _parse_int64_list(buf: bytes, pos: int, end: int) -> np.ndarray:
    parse = _compiled_int64_list()
    if parse is not None:
        if end - pos > _ONE_BYTE_RUN_MIN_BYTES and buf[pos] == 0x0A:
            start, stop = _length(buf, pos + 1, end)
            if stop == end and buf[start:stop].isascii():  # one packed run of one-byte values
                return np.frombuffer(buf, np.uint8, stop - start, start).astype(np.int64)
        values = parse(buf[pos:end])
        if values is not None:
            return values
    chunks = []
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _long_tag(buf, pos, end)
        if tag == 0x0A:  # packed
            start, pos = _length(buf, pos, end)
            chunks.append(_packed_varints(buf[start:pos]))
        elif tag == 0x08:  # one unpacked varint
            value, pos = _varint(buf, pos, end)
            chunks.append(np.array([value], np.uint64).view(np.int64))
        else:
            pos = _skip(buf, pos, end, tag)
    if len(chunks) == 1:
        return chunks[0]
    return np.concatenate(chunks) if chunks else np.empty(0, np.int64)


def _packed_varints(packed: bytes) -> np.ndarray:
    """Decodes packed int64 varints (two's complement, as protobuf stores negatives)."""
    if not packed:
        return np.empty(0, np.int64)
    if packed.isascii():  # every byte below 0x80: one byte per value
        return np.frombuffer(packed, np.uint8).astype(np.int64)
    if packed[-1] >= 0x80:
        raise _Malformed("a packed int64_list ends inside a varint")
    if len(packed) > _SHORT_VARINTS:
        return decode_varints(np.frombuffer(packed, np.uint8)).view(np.int64)
    values = []
    value = shift = 0
    for byte in packed:
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            values.append(value & _UINT64_MASK)
            value = shift = 0
        elif shift == 63:
            raise _Malformed("a varint in an int64_list is longer than 10 bytes")
        else:
            shift += 7
    return np.array(values, dtype=np.uint64).view(np.int64)


def decode_varints(raw: np.ndarray) -> np.ndarray:
    """Decodes a run of whole varints (uint8 bytes, the last one ending the last varint) into
    their uint64 values, vectorised.

    Raises:
      _Malformed: If a varint is longer than 10 bytes.
    """
    ends = np.flatnonzero(raw < 0x80)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    if int((ends - starts).max()) >= 10:
        raise _Malformed("a varint in an int64_list is longer than 10 bytes")
    # Byte k of a varint carries bits 7k..7k+6; uint64 arithmetic wraps like int64.
    position = np.arange(raw.size) - np.repeat(starts, ends - starts + 1)
    parts = (raw & 0x7F).astype(np.uint64) << _SEVEN_BITS[position]
    return np.add.reduceat(parts, starts)


@functools.cache
def _compiled_from_string(message: str) -> tuple[Callable[[bytes], Any], type[Exception]] | None:
    """``FromString`` of the message class ``message`` and protobuf's ``DecodeError``, where
    the protobuf runtime's compiled parser (``upb`` or ``cpp``) is installed; else None."""
    try:
        # protobuf is only used where installed.
        from google.protobuf.internal import api_implementation  # type: ignore[import-untyped]  # optional dependency
        from google.protobuf.message import DecodeError  # type: ignore[import-untyped]  # optional dependency
    except ModuleNotFoundError:
        return None
    if api_implementation.Type() not in ("upb", "cpp"):
        return None
    return getattr(example_message_classes(), message).FromString, DecodeError


def _repeated_to_numpy(values: Any, dtype: type[np.generic]) -> np.ndarray:
    """Copies a protobuf repeated numeric field into a 1-D array."""
    count = len(values)
    # np.array costs about 2 us whatever the length (it probes the container's type first);
    # np.fromiter costs 0.35 us plus 35 ns a value.
    if count < _FROMITER_MAX_VALUES:
        return np.fromiter(values, dtype, count)
    return np.array(values, dtype=dtype)


@functools.cache
def _compiled_int64_list() -> Callable[[bytes], np.ndarray | None] | None:
    """The protobuf runtime's compiled parser of an ``Int64List`` message, or None where
    protobuf is absent or pure Python. The parser returns None for a message protobuf
    refuses: the codec's own parser then finds the fault and names it."""
    compiled = _compiled_from_string("Int64List")
    if compiled is None:
        return None
    from_string, decode_error = compiled

    def parse(message: bytes) -> np.ndarray | None:
        try:
            values = from_string(message).value
        except decode_error:
            return None
        return _repeated_to_numpy(values, np.int64)

    return parse


@functools.cache
def _compiled_example() -> Callable[[bytes, Iterable[str] | None], dict[str, Parsed] | None] | None:
    """The protobuf runtime's compiled parser of a whole Example, giving the codec's parsed
    features, or None where protobuf is absent or pure Python. The parser returns None for a
    record protobuf refuses: the codec's own parser then finds the fault and names it."""
    compiled = _compiled_from_string("Example")
    if compiled is None:
        return None
    from_string, decode_error = compiled

    def parse(data: bytes, wanted: Iterable[str] | None) -> dict[str, Parsed] | None:
        try:
            feature_map = from_string(data).features.feature
        except decode_error:
            return None
        names = feature_map if wanted is None else [n for n in wanted if n in feature_map]
        parsed: dict[str, Parsed] = {}
        for name in names:
            feature = feature_map[name]
            kind = feature.WhichOneof("kind")
            if kind == "int64_list":
                parsed[name] = _INT64, _repeated_to_numpy(feature.int64_list.value, np.int64)
            elif kind == "float_list":
                parsed[name] = _FLOAT, _repeated_to_numpy(feature.float_list.value, np.float32)
            elif kind == "bytes_list":
                values = feature.bytes_list.value
                items = np.empty(len(values), dtype=object)
                items[:] = values[:]  # a list: assigning the container itself is slower
                parsed[name] = _BYTES, items
            else:
                parsed[name] = 0, None
        return parsed

    return parse


_LIST_PARSERS: dict[int, Callable[[bytes, int, int], np.ndarray]] = {
    _BYTES: _parse_bytes_list,
    _FLOAT: _parse_float_list,
    _INT64: _parse_int64_list,
}


# ---------------------------------------------------------------------------- encoding
def encode_example(features: Mapping[str, Any]) -> bytes:
    """Serializes ``{feature name: value}`` as a ``tf.train.Example``.

    Values are bytes or str (one ``bytes_list`` entry), sequences/arrays of them
    (``bytes_list``), or anything NumPy turns into a float array (``float_list``, stored as
    float32) or an integer/bool array (``int64_list``); arrays are flattened.

    Raises:
      TypeError: If a value has another type; the message names the feature.
      ValueError: If an integer does not fit int64.
    """
    return _field(0x0A, _encode_features(features))


def encode_sequence_example(
    context: Mapping[str, Any], feature_lists: Mapping[str, Sequence[Any]]
) -> bytes:
    """Serializes a ``tf.train.SequenceExample``.

    Args:
      context: Context features, as for :func:`encode_example`.
      feature_lists: ``{name: steps}``; each step is a value as for :func:`encode_example`
        (a 2-D array is a sequence of rows).

    Raises:
      TypeError / ValueError: As :func:`encode_example`.
    """
    lists = b"".join(
        _field(
            0x0A,
            _field(0x0A, name.encode())
            + _field(
                0x12,
                b"".join(_field(0x0A, _encode_feature(name, step)) for step in feature_lists[name]),
            ),
        )
        for name in sorted(feature_lists)
    )
    return _field(0x0A, _encode_features(context)) + _field(0x12, lists)


def _varint_bytes(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + _varint_bytes(len(payload)) + payload


def _encode_features(features: Mapping[str, Any]) -> bytes:
    return b"".join(
        _field(
            0x0A, _field(0x0A, name.encode()) + _field(0x12, _encode_feature(name, features[name]))
        )
        for name in sorted(features)
    )


def _encode_feature(name: str, value: Any) -> bytes:
    """Returns the serialized Feature message holding ``value``."""
    if isinstance(value, bytes | bytearray | memoryview | str):
        return _field(0x0A, _encode_bytes_list(name, [value]))
    if (
        isinstance(value, list | tuple)
        and value
        and isinstance(value[0], bytes | bytearray | memoryview | str)
    ):
        return _field(0x0A, _encode_bytes_list(name, value))
    array = np.asarray(value)
    kind = array.dtype.kind
    if kind in "SUO":
        return _field(0x0A, _encode_bytes_list(name, array.ravel().tolist()))
    if kind == "f":
        packed = array.astype(_LE_FLOAT32).tobytes()
        return _field(0x12, _field(0x0A, packed) if packed else b"")
    if kind in "iub":
        return _field(0x1A, _encode_int64_list(name, array.ravel()))
    raise TypeError(
        f"feature {name!r}: cannot store a {array.dtype} value in a tf.train.Example; use "
        "bytes/str, floats or integers."
    )


def _encode_bytes_list(name: str, items: Sequence[Any]) -> bytes:
    parts = []
    for item in items:
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, bytes | bytearray | memoryview):
            raise TypeError(
                f"feature {name!r} mixes bytes/str with {type(item).__name__}; a bytes_list "
                "holds only bytes or str."
            )
        parts.append(_field(0x0A, bytes(item)))
    return b"".join(parts)


def _encode_int64_list(name: str, values: np.ndarray) -> bytes:
    if values.size == 0:
        return b""
    if values.dtype.kind == "u" and int(values.max()) > _INT64_MAX:
        raise ValueError(f"feature {name!r} holds an integer above the int64 range.")
    ints = values.astype(np.int64)
    if int(ints.min()) >= 0 and int(ints.max()) < 0x80:
        packed = ints.astype(np.uint8).tobytes()
    else:
        packed = b"".join(_varint_bytes(v % _UINT64) for v in ints.tolist())
    return _field(0x0A, packed)

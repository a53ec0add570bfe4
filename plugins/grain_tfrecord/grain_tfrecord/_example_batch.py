"""Batched ``tf.train.Example`` parsing: a batch of serialized records to one array per feature.

The feature spec follows ``tf.io.parse_example``: :class:`FixedLenFeature` (a dense
``[batch, *shape]`` array, a default for records without the feature),
:class:`FixedLenSequenceFeature` (``[batch, steps, *shape]``, padded to the longest record)
and :class:`VarLenFeature` (:class:`RaggedValues`: the values of all records and where each
record's start).

The wire bytes of the whole batch are walked in lock-step with NumPy: each parse step (read
a tag, a length, a feature name, gather the values) is one array operation over all records
at once, so the per-record Python cost of :func:`decode_example` is paid once per batch.
Records laid out alike are first read whole by a record layout (``_example_wire``, which
also holds the batch's bytes); the others are walked entry by entry here. A record whose
layout differs from the others at some step (another field order, a split
list, unknown fields, over-long lengths...) leaves the walk and is decoded by the exact
per-record decoder, so the result is always protobuf's decoding of each record. Features
that the spec does not name are skipped by their length without being parsed, as
``tf.io.parse_example`` does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import numpy as np

from grain_core.transforms import Map
from grain_tfrecord._example import (
    _BYTES,
    _FLOAT,
    _INT64,
    _KIND_NAMES,
    _LE_FLOAT32,
    ExampleDecodeError,
    Parsed,
    _decode,
    _Malformed,
    _parse_example,
    decode_varints,
    resolve_dtype,
)
from grain_tfrecord._example_wire import (
    EntryTemplate,
    RecordLayout,
    WireBatch,
    delimited,
    gather,
    last_layout,
    new_layout,
    ragged_index,
)

__all__ = [
    "FixedLenFeature",
    "FixedLenSequenceFeature",
    "ParseExamples",
    "RaggedValues",
    "VarLenFeature",
    "parse_example_batch",
]

# Lists of up to 8 bytes read as one word: per list size, the mask of its bytes, of their
# continuation bits, and the continuation bits of a list holding one varint.
_WORD_BYTES = 8
_LIST_BYTES = np.array([(1 << 8 * s) - 1 for s in range(9)], dtype=np.uint64)
_CONTINUATION_BITS = np.array([int.from_bytes(b"\x80" * s, "little") for s in range(9)], np.uint64)
_ONE_VARINT = np.array(
    [int.from_bytes(b"\x80" * (s - 1), "little") if s else 0 for s in range(9)], np.uint64
)
# Joins the 7-bit groups of a little-endian word pairwise: bytes, then 16- and 32-bit lanes.
_PACK_STEPS = tuple(
    (np.uint64(low), np.uint64(low << width), np.uint64(width - bits))
    for low, width, bits in (
        (0x007F007F007F007F, 8, 7),
        (0x00003FFF00003FFF, 16, 14),
        (0x0FFFFFFF, 32, 28),
    )
)
# Distinct feature names at one step of the walk before the remaining records leave it.
_MAX_NAMES_PER_STEP = 8


class RaggedValues(NamedTuple):
    """Values of a :class:`VarLenFeature` over a batch: record ``i`` holds
    ``values[row_splits[i]:row_splits[i + 1]]``."""

    values: np.ndarray
    row_splits: np.ndarray

    def rows(self) -> list[np.ndarray]:
        """The values of each record, as views of ``values``."""
        return np.split(self.values, self.row_splits[1:-1])


class _Spec:
    """What the three feature kinds share: the stored list kind and the NumPy dtype."""

    dtype: Any

    def _resolve(self) -> None:
        """Checks ``dtype`` and keeps what it resolves to (before any default is fitted)."""
        object.__setattr__(self, "_resolved", resolve_dtype(self.dtype))

    def _fit(self, value: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
        numpy_dtype = self._resolved[1]
        try:
            return np.broadcast_to(np.asarray(value, dtype=numpy_dtype), shape).copy()
        except ValueError:
            raise ValueError(f"{what} {value!r} does not fit shape {shape}.") from None

    if TYPE_CHECKING:
        _resolved: tuple[int, np.dtype[Any], bool]


@dataclasses.dataclass(frozen=True)
class FixedLenFeature(_Spec):
    """A feature with the same number of values in every record: ``[batch, *shape]``.

    Args:
      shape: Shape of one record's values (``()``: one value).
      dtype: A float dtype (``float_list``), an integer dtype or bool (``int64_list``),
        ``bytes`` or ``str`` (``bytes_list``; object arrays, ``str`` decoded as UTF-8).
      default_value: Used for records without the feature, broadcast to ``shape``; None
        makes a missing feature an error.

    Raises:
      TypeError: If ``dtype`` is not stored by ``tf.train.Example``.
      ValueError: If ``shape`` has a negative size or ``default_value`` does not fit it.
    """

    shape: tuple[int, ...]
    dtype: Any
    default_value: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _checked_shape(self.shape))
        self._resolve()
        if self.default_value is not None:
            self._fit(self.default_value, self.shape, "FixedLenFeature default_value")


@dataclasses.dataclass(frozen=True)
class FixedLenSequenceFeature(_Spec):
    """A feature holding a variable number of steps of ``shape`` each:
    ``[batch, steps, *shape]``, shorter records padded to the longest with ``default_value``.

    Args:
      shape: Shape of one step.
      dtype: As for :class:`FixedLenFeature`.
      allow_missing: Records without the feature have zero steps; else that is an error.
      default_value: The padding value (a scalar); None pads with 0, ``b""`` or ``""``.

    Raises:
      TypeError / ValueError: As :class:`FixedLenFeature`.
    """

    shape: tuple[int, ...]
    dtype: Any
    allow_missing: bool = False
    default_value: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _checked_shape(self.shape))
        self._resolve()
        if self.default_value is not None:
            self._fit(self.default_value, (), "FixedLenSequenceFeature default_value")


@dataclasses.dataclass(frozen=True)
class VarLenFeature(_Spec):
    """A feature with any number of values per record: :class:`RaggedValues`.

    Args:
      dtype: As for :class:`FixedLenFeature`.

    Raises:
      TypeError: If ``dtype`` is not stored by ``tf.train.Example``.
    """

    dtype: Any

    def __post_init__(self) -> None:
        self._resolve()


FeatureSpecs: TypeAlias = Mapping[str, FixedLenFeature | FixedLenSequenceFeature | VarLenFeature]


def _checked_shape(shape: Any) -> tuple[int, ...]:
    shape = (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {shape} has a negative size.")
    return shape


class ParseExamples(Map):
    """A transform parsing a batch of serialized ``tf.train.Example`` records, for
    ``.batch(n).map(ParseExamples(spec))`` or on a ``TFRecordDataSource.__getitems__`` list.

    Args:
      features: ``{name: FixedLenFeature | FixedLenSequenceFeature | VarLenFeature}``.
    """

    def __init__(self, features: FeatureSpecs) -> None:
        self.features = dict(features)

    def map(self, element: Any) -> dict[str, np.ndarray | RaggedValues]:
        """Returns :func:`parse_example_batch` of the batch ``element``."""
        return parse_example_batch(element, self.features)


def parse_example_batch(
    serialized: Sequence[bytes] | np.ndarray, features: FeatureSpecs
) -> dict[str, np.ndarray | RaggedValues]:
    """Parses a batch of serialized ``tf.train.Example`` records, as ``tf.io.parse_example``.

    Args:
      serialized: The records: a sequence of bytes, or a NumPy array of them (an object
        array, or a fixed-width ``S`` array as ``batch`` stacks bytes: its NUL padding is
        told apart from the message exactly, since a message never has a NUL where a field
        starts).
      features: ``{name: FixedLenFeature | FixedLenSequenceFeature | VarLenFeature}``.

    Returns:
      ``{name: array}`` in the order of ``features``: ``[batch, *shape]`` for a
      :class:`FixedLenFeature`, ``[batch, steps, *shape]`` for a
      :class:`FixedLenSequenceFeature`, :class:`RaggedValues` for a :class:`VarLenFeature`.

    Raises:
      ExampleDecodeError: If a record is not a valid Example or does not fit ``features``;
        the message names the record's index in the batch and the feature.
    """
    for name, spec in features.items():
        if not isinstance(spec, _Spec):
            raise TypeError(
                f"feature {name!r}: {spec!r} is not a FixedLenFeature, FixedLenSequenceFeature "
                "or VarLenFeature."
            )
    batch = WireBatch(serialized)
    kinds = {name: spec._resolved[0] for name, spec in features.items()}
    walk = _Walk(batch, kinds)
    walk.run()
    found = walk.found
    if batch.fallback.any():
        # What the walk found in records that later left it is decoded again below.
        found = {
            name: [_rows_of(part, ~batch.fallback[part[0]]) for part in parts]
            for name, parts in found.items()
        }
        for row in np.flatnonzero(batch.fallback).tolist():
            _decode_one(batch, row, kinds, found)
    return {name: _assemble(name, spec, batch.size, found[name]) for name, spec in features.items()}


# What the walk found of one feature: (rows, their value counts, their values in row order).
_Found = tuple[np.ndarray, np.ndarray, np.ndarray]


def _rows_of(part: _Found, keep: np.ndarray) -> _Found:
    rows, counts, values = part
    return rows[keep], counts[keep], values[np.repeat(keep, counts)]


def _decode_one(
    batch: WireBatch, row: int, kinds: dict[str, int], found: dict[str, list[_Found]]
) -> None:
    """Decodes record ``row`` with the exact per-record decoder."""
    try:
        parsed = _decode(
            batch.record(row),
            "tf.train.Example",
            lambda buf: _parse_example(buf, kinds, batch.padded),
        )
    except ExampleDecodeError as err:
        raise ExampleDecodeError(f"record {row} of the batch: {err}") from None
    for name, kind in kinds.items():
        feature: Parsed | None = parsed.get(name)
        if feature is None:
            continue
        stored, values = feature
        if values is None or not values.size:  # no list, or an empty one of any kind
            values = np.empty(0, dtype=_EMPTY_DTYPES[kind])
        elif stored != kind:
            raise ExampleDecodeError(
                f"record {row} of the batch: feature {name!r} holds a {_KIND_NAMES[stored]}, "
                f"but its spec asks for a {_KIND_NAMES[kind]}."
            )
        found[name].append((np.array([row]), np.array([values.size]), values))


_EMPTY_DTYPES = {_BYTES: np.dtype(object), _FLOAT: np.dtype(np.float32), _INT64: np.dtype(np.int64)}


def _assemble(
    name: str,
    spec: FixedLenFeature | FixedLenSequenceFeature | VarLenFeature,
    size: int,
    parts: list[_Found],
) -> np.ndarray | RaggedValues:
    """The batch array of one feature from what was found of it, per the spec."""
    kind, numpy_dtype, utf8 = spec._resolved
    rows, counts, values = _merge(parts, kind)
    if utf8:
        try:
            text = [v.decode("utf-8") for v in values.tolist()]
        except UnicodeDecodeError as err:
            bad = next(i for i, v in enumerate(values.tolist()) if not _is_utf8(v))
            row = int(rows[np.searchsorted(np.cumsum(counts), bad, side="right")])
            raise ExampleDecodeError(
                f"record {row} of the batch: feature {name!r} is not UTF-8 text: {err}"
            ) from None
        values = np.empty(len(text), dtype=object)
        values[:] = text
    elif values.dtype != numpy_dtype:
        values = values.astype(numpy_dtype)
    everywhere = rows.size == size
    if isinstance(spec, VarLenFeature):
        lengths = counts if everywhere else np.bincount(rows, counts, size).astype(np.int64)
        row_splits = np.zeros(size + 1, dtype=np.int64)
        np.cumsum(lengths, out=row_splits[1:])
        return RaggedValues(values, row_splits)
    step = math.prod(spec.shape)
    if isinstance(spec, FixedLenFeature):
        wrong = counts != step
        if wrong.any():
            at = int(np.argmax(wrong))
            raise ExampleDecodeError(
                f"record {int(rows[at])} of the batch: feature {name!r} has {int(counts[at])} "
                f"values, which do not fit the FixedLenFeature shape {spec.shape}."
            )
        if everywhere:
            return values.reshape(size, *spec.shape)
        if spec.default_value is None:
            missing = int(np.flatnonzero(np.isin(np.arange(size), rows, invert=True))[0])
            raise ExampleDecodeError(
                f"record {missing} of the batch: feature {name!r} is missing and its "
                "FixedLenFeature has no default_value."
            )
        out = np.empty((size, *spec.shape), dtype=numpy_dtype)
        out[:] = spec._fit(spec.default_value, spec.shape, "default_value")
        out[rows] = values.reshape(-1, *spec.shape)
        return out
    assert isinstance(spec, FixedLenSequenceFeature)
    wrong = counts % step != 0 if step else counts != 0
    if wrong.any():
        at = int(np.argmax(wrong))
        raise ExampleDecodeError(
            f"record {int(rows[at])} of the batch: feature {name!r} has {int(counts[at])} "
            f"values, which are not whole steps of the FixedLenSequenceFeature shape "
            f"{spec.shape}."
        )
    if not everywhere and not spec.allow_missing:
        missing = int(np.flatnonzero(np.isin(np.arange(size), rows, invert=True))[0])
        raise ExampleDecodeError(
            f"record {missing} of the batch: feature {name!r} is missing and its "
            "FixedLenSequenceFeature does not allow_missing."
        )
    steps = counts // step if step else np.zeros_like(counts)
    longest = int(steps.max(initial=0))
    if everywhere and int(steps.min(initial=0)) == longest:
        return values.reshape(size, longest, *spec.shape)
    padding = spec.default_value
    if padding is None:
        padding = "" if utf8 else b"" if kind == _BYTES else 0
    out = np.empty((size * longest, *spec.shape), dtype=numpy_dtype)
    out[:] = spec._fit(padding, spec.shape, "default_value")
    out[ragged_index(rows * longest, steps)] = values.reshape(-1, *spec.shape)
    return out.reshape(size, longest, *spec.shape)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _merge(parts: list[_Found], kind: int) -> _Found:
    """One (rows, counts, values) from several, rows ascending; where a row was found more
    than once (a repeated feature name), the last one, as protobuf's map keeps."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        empty = np.empty(0, np.int64)
        return empty, empty, np.empty(0, dtype=_EMPTY_DTYPES[kind])
    rows = np.concatenate([p[0] for p in parts])
    counts = np.concatenate([p[1] for p in parts])
    values = np.concatenate([p[2] for p in parts])
    offsets = np.cumsum(counts) - counts
    _, last = np.unique(rows[::-1], return_index=True)
    chosen = rows.size - 1 - last
    rows, counts, offsets = rows[chosen], counts[chosen], offsets[chosen]
    return rows, counts, values[ragged_index(offsets, counts)]


class _Walk:
    """The lock-step walk over a batch; ``found`` collects the wanted features' values."""

    def __init__(self, batch: WireBatch, kinds: dict[str, int]) -> None:
        self.batch = batch
        self.raw = batch.raw
        self.kinds = kinds
        self.found: dict[str, list[_Found]] = {name: [] for name in kinds}

    def leave(self, rows: np.ndarray, valid: np.ndarray) -> None:
        """The rows where ``valid`` is false leave the walk for the exact decoder."""
        self.batch.fallback[rows[~valid]] = True

    def run(self) -> None:
        batch, raw = self.batch, self.raw
        rows = np.arange(batch.size)
        starts, ends, content_ends = batch.starts, batch.ends, batch.content_ends
        if rows.size:
            whole = self.by_record_layout(rows, starts, ends, content_ends)
            if whole.all():
                return
            if whole.any():
                rest = ~whole
                rows, starts, ends, content_ends = (
                    rows[rest],
                    starts[rest],
                    ends[rest],
                    content_ends[rest],
                )
        # An empty record (or all padding) is an Example without features: the exact decoder.
        valid = (ends > starts) & (raw[starts] != 0)
        start, stop, ok = delimited(raw, starts, 0x0A, ends)  # Example.features
        # Nothing may follow that field but the NUL padding of a fixed-width array.
        valid &= ok & (stop >= content_ends)
        self.leave(rows, valid)
        rows, pos, end = rows[valid], start[valid], stop[valid]
        while rows.size:
            going = pos < end  # the others have no more features
            if not going.all():
                rows, pos, end = rows[going], pos[going], end[going]
                if not rows.size:
                    break
            matched, after = self.by_template(rows, pos, end)
            if not matched.all():
                other = ~matched
                after[other] = self.entry(rows[other], pos[other], end[other])
            pos = after
            keep = ~self.batch.fallback[rows]
            if not keep.all():
                rows, pos, end = rows[keep], pos[keep], end[keep]

    def by_record_layout(
        self, rows: np.ndarray, start: np.ndarray, end: np.ndarray, content_end: np.ndarray
    ) -> np.ndarray:
        """Reads the whole records laid out entry for entry as one record (the common case:
        every record has the same features in the same order): the layout that the last
        batch with these features had, else the first row's. Returns which rows it read;
        the others are left for the entry-by-entry walk."""
        layout = last_layout(self.kinds)
        matched = np.zeros(rows.size, dtype=bool)
        if layout is not None:
            matched = self.read_layout(layout, rows, start, end, content_end)
            if matched.all():
                return matched
        first = int(np.argmax(~matched))
        layout = new_layout(self.batch.data, int(start[first]), int(end[first]), self.kinds)
        if layout is None:
            return matched
        rest = np.flatnonzero(~matched)
        matched[rest] = self.read_layout(
            layout, rows[rest], start[rest], end[rest], content_end[rest]
        )
        return matched

    def read_layout(
        self,
        layout: RecordLayout,
        rows: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        content_end: np.ndarray,
    ) -> np.ndarray:
        """Reads the values of the rows laid out as ``layout``; returns which rows are."""
        matched, value_starts, sizes = layout.locate(self.batch, start, end, content_end)
        if not matched.any():
            return matched
        if not matched.all():
            rows, value_starts, sizes = rows[matched], value_starts[matched], sizes[matched]
        # The scalar int64 features of all entries as one word per row and entry.
        scalars = layout.scalar_entries
        words = None
        if scalars.size:
            words = _one_varint_each(
                self.batch, value_starts[:, scalars].T.ravel(), sizes[:, scalars].T.ravel()
            )
        for k, template in enumerate(layout.entries):
            if template.empty:
                no_values = np.empty(0, dtype=_EMPTY_DTYPES[template.kind])
                self.found[template.name].append((rows, np.zeros_like(rows), no_values))
            elif words is not None and k in layout.scalar_column:
                column = layout.scalar_column[k] * rows.size
                self.one_varint_each(
                    template.name, rows, sizes[:, k], words[column : column + rows.size]
                )
            elif template.wanted:
                start = value_starts[:, k]
                self.values(template.name, template.kind, rows, start, sizes[:, k])
        return matched

    def by_template(
        self, rows: np.ndarray, pos: np.ndarray, end: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Reads the next map entry of the rows laid out as the first row's: the same bytes
        up to the values (tags, name) but for the lengths, which must agree with the size of
        the values. Returns which rows matched and where their entries end."""
        template = EntryTemplate.of(self.batch.data, int(pos[0]), int(end[0]), self.kinds)
        if template is None:
            return np.zeros(rows.size, dtype=bool), pos.copy()
        matched, data_size = template.match(self.batch.windows(template.size)[pos])
        start = pos + template.size
        stop = start + data_size
        matched &= stop <= end
        if template.kind == _FLOAT:
            matched &= data_size % 4 == 0
        if template.empty:
            matched &= data_size == 0
            rows_found = rows[matched]
            no_values = np.empty(0, dtype=_EMPTY_DTYPES[template.kind])
            self.found[template.name].append((rows_found, np.zeros_like(rows_found), no_values))
        elif template.wanted and matched.any():
            self.values(
                template.name, template.kind, rows[matched], start[matched], data_size[matched]
            )
        return matched, np.where(matched, stop, pos)

    def entry(self, rows: np.ndarray, pos: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Reads the next map entry of each row field by field; returns where each ends."""
        raw = self.raw
        # A map entry in the canonical layout: key, then value, then nothing else.
        entry, entry_stop, valid = delimited(raw, pos, 0x0A, end)
        key, key_stop, ok = delimited(raw, entry, 0x0A, entry_stop)
        valid &= ok
        value, value_stop, ok = delimited(raw, np.where(valid, key_stop, 0), 0x12, entry_stop)
        valid &= ok & (value_stop == entry_stop)
        if not valid.all():
            self.leave(rows, valid)
            rows, key, key_stop, value, value_stop = (
                a[valid] for a in (rows, key, key_stop, value, value_stop)
            )
        if rows.size:
            self.entries(rows, key, key_stop, value, value_stop)
        return entry_stop

    def entries(
        self,
        rows: np.ndarray,
        key: np.ndarray,
        key_stop: np.ndarray,
        value: np.ndarray,
        value_stop: np.ndarray,
    ) -> None:
        """One map entry of each row: grouped by feature name, the wanted ones parsed."""
        data, raw = self.batch.data, self.raw
        key_size = key_stop - key
        pending = np.ones(rows.size, dtype=bool)
        for _ in range(_MAX_NAMES_PER_STEP):
            first = int(np.argmax(pending))
            size = int(key_size[first])
            name_bytes = data[int(key[first]) : int(key[first]) + size]
            same = pending & (key_size == size)
            if size:
                at = np.where(same, key, 0)
                expected = np.frombuffer(name_bytes, np.uint8)
                same &= (raw[at[:, None] + np.arange(size)] == expected).all(axis=1)
            pending &= ~same
            try:
                name = name_bytes.decode("utf-8")
            except UnicodeDecodeError:
                self.leave(rows, ~same)
            else:
                kind = self.kinds.get(name)
                if kind is not None:
                    self.feature(name, kind, rows[same], value[same], value_stop[same])
            if not pending.any():
                return
        self.leave(rows, ~pending)

    def feature(
        self, name: str, kind: int, rows: np.ndarray, start: np.ndarray, stop: np.ndarray
    ) -> None:
        """A Feature holding one list of the wanted kind, in each of ``rows``."""
        raw = self.raw
        start, list_stop, valid = delimited(raw, start, kind << 3 | 2, stop)
        valid &= list_stop == stop
        if kind == _BYTES:
            self.bytes_list(name, rows, start, list_stop, valid)
            return
        # A packed list, or nothing (an empty list).
        empty = start == list_stop
        packed, packed_stop, ok = delimited(raw, np.where(empty, 0, start), 0x0A, list_stop)
        valid &= empty | (ok & (packed_stop == list_stop))
        packed = np.where(empty, start, packed)
        if kind == _FLOAT:
            valid &= (list_stop - packed) % 4 == 0
        if not valid.all():
            self.leave(rows, valid)
            rows, packed, list_stop = rows[valid], packed[valid], list_stop[valid]
        if rows.size:
            self.values(name, kind, rows, packed, list_stop - packed)

    def values(
        self, name: str, kind: int, rows: np.ndarray, start: np.ndarray, sizes: np.ndarray
    ) -> None:
        """The values of a packed numeric list, or the one item of a bytes list, in each of
        ``rows``: ``sizes`` bytes from ``start``."""
        if kind == _BYTES:
            self.found[name].append((rows, np.ones(rows.size, np.int64), self.items(start, sizes)))
            return
        if kind == _INT64:
            words = _one_varint_each(self.batch, start, sizes)
            if words is not None:
                self.one_varint_each(name, rows, sizes, words)
                return
        data = gather(self.batch, start, sizes)
        if kind == _FLOAT:
            floats = data.view(_LE_FLOAT32).astype(np.float32, copy=False)
            self.found[name].append((rows, sizes // 4, floats))
            return
        ends_varint = self.raw[np.where(sizes > 0, start + sizes - 1, 0)] < 0x80
        if not ends_varint.all():
            self.leave(rows, ends_varint)
            keep = np.repeat(ends_varint, sizes)
            rows, sizes, data = rows[ends_varint], sizes[ends_varint], data[keep]
        last = data < 0x80
        if last.all():
            self.found[name].append((rows, sizes, data.astype(np.int64)))
            return
        try:
            values = decode_varints(data).view(np.int64)
        except _Malformed:
            self.leave(rows, np.zeros(rows.size, dtype=bool))
            return
        ends = np.cumsum(sizes)
        counted = np.concatenate(([0], np.cumsum(last)))
        counts = counted[ends] - counted[ends - sizes]
        self.found[name].append((rows, counts, values))

    def one_varint_each(
        self, name: str, rows: np.ndarray, sizes: np.ndarray, values: np.ndarray
    ) -> None:
        """Keeps the values :func:`_one_varint_each` read (none where a list is empty)."""
        present = sizes > 0
        if present.all():
            self.found[name].append((rows, np.ones(rows.size, np.int64), values))
        else:
            self.found[name].append((rows, present.astype(np.int64), values[present]))

    def items(self, start: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """The ``sizes`` bytes from ``start`` of each row, as an object array."""
        width = int(sizes[0]) if start.size else 0
        if width and bool((sizes == width).all()):
            same_size = self.batch.windows(width)[start]
            # An S item drops trailing NULs: only items that end otherwise go this way.
            if bool(same_size[:, -1].all()):
                return same_size.view(f"S{width}").ravel().astype(object)
        values = np.empty(start.size, dtype=object)
        wire = self.batch.data
        stop = start + sizes
        values[:] = [wire[a:b] for a, b in zip(start.tolist(), stop.tolist(), strict=True)]
        return values

    def bytes_list(
        self, name: str, rows: np.ndarray, start: np.ndarray, stop: np.ndarray, valid: np.ndarray
    ) -> None:
        """A BytesList of ``value`` fields in each row, read one field per step."""
        raw = self.raw
        item_rows, item_starts, item_stops = [], [], []
        where = np.arange(rows.size)
        pos = start
        going = valid & (pos < stop)
        while going.any():
            at = where[going]
            item, item_stop, ok = delimited(raw, pos[at], 0x0A, stop[at])
            valid[at[~ok]] = False
            at, item, item_stop = at[ok], item[ok], item_stop[ok]
            item_rows.append(at)
            item_starts.append(item)
            item_stops.append(item_stop)
            pos[at] = item_stop
            going = valid & (pos < stop)
        if not valid.all():
            self.leave(rows, valid)
        if len(item_rows) == 1:
            at, item, item_stop = item_rows[0], item_starts[0], item_stops[0]
        elif item_rows:
            at = np.concatenate(item_rows)
            order = np.argsort(at, kind="stable")
            at = at[order]
            item = np.concatenate(item_starts)[order]
            item_stop = np.concatenate(item_stops)[order]
        else:
            at = item = item_stop = np.empty(0, np.int64)
        keep = valid[at]
        at, item, item_stop = at[keep], item[keep], item_stop[keep]
        values = self.items(item, item_stop - item)
        counts = np.bincount(at, minlength=rows.size)[valid]
        self.found[name].append((rows[valid], counts, values))


def _one_varint_each(batch: WireBatch, start: np.ndarray, sizes: np.ndarray) -> np.ndarray | None:
    """Reads packed lists of at most one varint of up to 8 bytes each (a scalar int64
    feature, the usual case) as one little-endian word per list, without gathering the
    bytes: the values (0 for an empty list), or None where some list is otherwise."""
    if int(sizes.max(initial=0)) > _WORD_BYTES:
        return None
    words = batch.windows(_WORD_BYTES)[start].view("<u8").ravel() & _LIST_BYTES[sizes]
    # One varint: every byte of the list continues but its last.
    if not bool(((words & _CONTINUATION_BITS[sizes]) == _ONE_VARINT[sizes]).all()):
        return None
    for low, high, shift in _PACK_STEPS:  # squeezes out the continuation bits
        words = (words & low) | ((words & high) >> shift)
    return words.view(np.int64)

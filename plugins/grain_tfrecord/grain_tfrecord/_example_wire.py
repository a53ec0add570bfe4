"""The wire bytes of a batch of serialized Examples, and the record layouts read from them.

:class:`WireBatch` holds a batch's records in one buffer (a list of bytes joined, or the
buffer of a fixed-width ``S`` array) with the primitives that read a field at every record
at once. A :class:`RecordLayout` is the header bytes of each map entry of one record; the
records of a batch laid out alike (the same features in the same order, the usual case) are
located entry by entry with it and their headers checked in one comparison, so that the
walk of ``_example_batch`` only reads their values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_tfrecord._example import _FLOAT, _INT64, _Malformed

__all__ = [
    "EntryTemplate",
    "RecordLayout",
    "WireBatch",
    "delimited",
    "gather",
    "last_layout",
    "new_layout",
    "ragged_index",
    "varints",
]

_PAD = 16  # zero bytes after the batch's wire bytes: a window read never leaves the buffer


class WireBatch:
    """The records' bytes in one buffer, where each record starts and ends, and which records
    the lock-step walk gave up on (``fallback``)."""

    def __init__(self, serialized: Sequence[bytes] | np.ndarray) -> None:
        self.padded = isinstance(serialized, np.ndarray) and serialized.dtype.kind == "S"
        if self.padded:
            assert isinstance(serialized, np.ndarray)
            width = serialized.dtype.itemsize
            self.size = serialized.size
            # One copy: the array's buffer joined with the padding the windows read past.
            self.data = b"".join((np.ascontiguousarray(serialized).data, bytes(_PAD)))
            self.starts = np.arange(self.size, dtype=np.int64) * width
            self.ends = self.starts + width
            # Where each record's bytes end before its NUL padding (NumPy's length of an S
            # item leaves trailing NULs out; the message itself may end in NULs).
            self.content_ends = self.starts + np.char.str_len(serialized).ravel()
        else:
            records = (
                serialized.ravel().tolist()
                if isinstance(serialized, np.ndarray)
                else serialized
                if isinstance(serialized, list)
                else list(serialized)
            )
            self.size = len(records)
            sizes = np.fromiter(map(len, records), np.int64, self.size)
            self.ends = np.cumsum(sizes)
            self.starts = self.ends - sizes
            self.data = b"".join([*records, bytes(_PAD)])
            self.content_ends = self.ends
        self.raw = np.frombuffer(self.data, np.uint8)
        self.view = memoryview(self.data)
        self.fallback = np.zeros(self.size, dtype=bool)

    def windows(self, width: int) -> np.ndarray:
        """A read-only view whose row ``i`` is the ``width`` bytes from byte ``i``: indexing
        it with start positions gathers equal-sized regions with one row copy each."""
        return np.ndarray((len(self.data) - width + 1, width), np.uint8, self.data, 0, (1, 1))

    def record(self, row: int) -> bytes:
        return self.data[int(self.starts[row]) : int(self.ends[row])]


# What the walk found of one feature: (rows, their value counts, their values in row order).


def varints(raw: np.ndarray, pos: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, Any]:
    """Reads one varint (at most ``limit`` bytes) at each of ``pos``: (values, positions
    after them, mask of the valid ones, or None when all are)."""
    byte = raw[pos]
    going = byte >= 0x80
    values = byte.astype(np.int64)
    if not going.any():
        return values, pos + 1, None
    # Byte by byte, while some varint goes on: lengths are one to three bytes long.
    values &= 0x7F
    size = np.ones_like(pos)
    for k in range(1, limit):
        byte = raw[pos + np.where(going, k, 0)]
        values |= np.where(going, (byte & 0x7F).astype(np.int64) << 7 * k, 0)
        size += going
        going &= byte >= 0x80
        if not going.any():
            return values, pos + size, None
    return values, pos + size, ~going


def delimited(
    raw: np.ndarray, pos: np.ndarray, tag: int, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reads, at each of ``pos``, the tag of a length-delimited field and its length:
    (start, stop) of its bytes and whether it is that field and ends by ``end``."""
    found, pos, ok = varints(raw, pos, 5)
    valid = (found == tag) & (pos < end)
    if ok is not None:
        valid &= ok
    pos = np.where(valid, pos, 0)
    length, start, ok = varints(raw, pos, 5)
    stop = start + length
    valid &= stop <= end
    if ok is not None:
        valid &= ok
    return start, stop, valid


def gather(batch: WireBatch, start: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The ``lengths`` bytes from ``start`` of each row, concatenated in row order."""
    if not lengths.size:
        return np.empty(0, np.uint8)
    width = int(lengths[0])
    if bool((lengths == width).all()):
        return batch.windows(width)[start].reshape(-1)
    if int(lengths.sum()) >= 32 * lengths.size:
        # Long regions of several sizes: joining slices copies at memcpy speed.
        view, stop = batch.view, start + lengths
        return np.frombuffer(
            b"".join([view[a:b] for a, b in zip(start.tolist(), stop.tolist(), strict=True)]),
            np.uint8,
        )
    return batch.raw[ragged_index(start, lengths)]


def ragged_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of ``lengths[i]`` consecutive items from each ``starts[i]``, concatenated."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


def _field(data: bytes, pos: int, tag: int, limit: int) -> tuple[int, int, int]:
    """Reads a length-delimited field with the one-byte ``tag`` and a length of at most
    three bytes at ``pos``, within ``limit``: (the length's width, start, stop of its bytes).

    Raises:
      _Malformed: If it is not there so.
    """
    if pos >= limit or data[pos] != tag:
        raise _Malformed
    length = 0
    for width in range(1, 4):
        if pos + width >= limit:
            raise _Malformed
        byte = data[pos + width]
        length |= (byte & 0x7F) << 7 * (width - 1)
        if byte < 0x80:
            start = pos + 1 + width
            if start + length > limit:
                raise _Malformed
            return width, start, start + length
    raise _Malformed


@dataclasses.dataclass(frozen=True)
class EntryTemplate:
    """The bytes of one map entry before its values, as one record has them.

    Each length prefix in the header is the size of the values plus the header bytes after
    that prefix; the last prefix is the size of the values. A row matches when its header
    has the same bytes but for the length prefixes, and each length prefix, at the same
    width, encodes the row's size of the values plus that constant.

    Attributes:
      fixed, fixed_bytes: offsets and bytes of the header that are equal in every row.
      size_offset, size_width: where the last length prefix is.
      length_offsets: offsets of every length-prefix byte; ``beyond``, ``shift``, ``more``:
        per such byte, the constant added to the size, the bits it holds (7 * k) and its
        continuation bit.
      max_size: the size from which some prefix would need more bytes.
    """

    name: str
    kind: int
    wanted: bool
    empty: bool  # the list is empty: the values' size (its length) must be 0
    end: int  # where the entry ends in the record it was made from
    size: int
    fixed: np.ndarray
    fixed_bytes: np.ndarray
    size_offset: int
    size_width: int
    length_offsets: np.ndarray
    beyond: np.ndarray
    shift: np.ndarray
    more: np.ndarray
    max_size: int

    @staticmethod
    def of(data: bytes, pos: int, end: int, kinds: Mapping[str, int]) -> EntryTemplate | None:
        """The template of the entry at ``pos``, or None if it is not canonical: one-byte
        tags; key, then value; a Feature with one list; a packed list or one bytes item."""
        lengths: list[tuple[int, int]] = []
        start = pos
        try:
            width, pos, entry_end = _field(data, pos, 0x0A, end)
            lengths.append((pos - width - start, width))
            _, pos, key_end = _field(data, pos, 0x0A, entry_end)  # the name: fixed bytes
            name = data[pos:key_end].decode("utf-8")
            width, pos, value_end = _field(data, key_end, 0x12, entry_end)
            lengths.append((pos - width - start, width))
            kind = kinds.get(name)
            if value_end != entry_end:
                return None
            empty = False
            if kind is not None:
                width, pos, list_end = _field(data, pos, kind << 3 | 2, value_end)
                lengths.append((pos - width - start, width))
                if list_end != value_end:
                    return None
                empty = pos == list_end
                if not empty:
                    width, pos, packed_end = _field(data, pos, 0x0A, list_end)
                    lengths.append((pos - width - start, width))
                    if packed_end != list_end:
                        return None
        except (_Malformed, UnicodeDecodeError):
            return None
        return EntryTemplate._of_header(
            name, kind or 0, kind is not None, empty, entry_end, data, start, pos, lengths
        )

    @staticmethod
    def features_field(data: bytes, pos: int, end: int) -> EntryTemplate | None:
        """The template of the tag and length of an Example's ``features`` field at ``pos``
        (its values: the map entries), or None if it is not there."""
        try:
            width, start, stop = _field(data, pos, 0x0A, end)
        except _Malformed:
            return None
        return EntryTemplate._of_header("", 0, False, False, stop, data, pos, start, [(1, width)])

    @staticmethod
    def _of_header(
        name: str,
        kind: int,
        wanted: bool,
        empty: bool,
        end: int,
        data: bytes,
        start: int,
        stop: int,
        lengths: list[tuple[int, int]],
    ) -> EntryTemplate:
        """The template of the header from ``start`` to ``stop`` with length prefixes at
        ``lengths`` (offset, width), the last one the size of the values."""
        size = stop - start
        header = np.frombuffer(data, np.uint8, size, start)
        fixed = np.ones(size, dtype=bool)
        offsets, beyond, shift, more = [], [], [], []
        max_size = 1 << 62
        for offset, width in lengths:
            fixed[offset : offset + width] = False
            after = size - offset - width
            max_size = min(max_size, (1 << 7 * width) - after)
            for k in range(width):
                offsets.append(offset + k)
                beyond.append(after)
                shift.append(7 * k)
                more.append(0x80 if k < width - 1 else 0)
        return EntryTemplate(
            name,
            kind,
            wanted,
            empty,
            end,
            size,
            np.flatnonzero(fixed),
            header[fixed],
            lengths[-1][0],
            lengths[-1][1],
            np.array(offsets),
            np.array(beyond, dtype=np.int64),
            np.array(shift, dtype=np.int64),
            np.array(more, dtype=np.int64),
            max_size,
        )

    def match(self, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which rows' headers (``window``: their first ``size`` bytes) match, and their
        sizes of the values."""
        at = self.size_offset
        data_size = window[:, at].astype(np.int64)
        if self.size_width > 1:
            data_size &= 0x7F
            for k in range(1, self.size_width):
                data_size |= (window[:, at + k].astype(np.int64) & 0x7F) << (7 * k)
        matched = (window[:, self.fixed] == self.fixed_bytes).all(axis=1)
        expected = ((data_size[:, None] + self.beyond) >> self.shift) & 0x7F | self.more
        matched &= (window[:, self.length_offsets] == expected).all(axis=1)
        matched &= data_size < self.max_size
        return matched, data_size


@dataclasses.dataclass(frozen=True)
class _RecordChecks:
    """The checks of :meth:`EntryTemplate.match` for a record's headers at once: the headers
    side by side (``sizes``: each one's size), compared with the bytes they must hold: the
    templates' fixed bytes (``expected``) and, at ``length_columns``, the length prefixes
    that the sizes of the values give. ``size_bits``: per header, the bits its size of the
    values must not have (3 for float values, all for an empty list)."""

    sizes: tuple[int, ...]
    expected: np.ndarray
    length_columns: np.ndarray
    length_entry: np.ndarray
    beyond: np.ndarray
    shift: np.ndarray
    more: np.ndarray
    max_size: np.ndarray
    size_bits: np.ndarray

    @staticmethod
    def of(templates: Sequence[EntryTemplate]) -> _RecordChecks:
        first = np.cumsum([0] + [t.size for t in templates])
        expected = np.zeros(int(first[-1]), dtype=np.uint8)
        for k, t in enumerate(templates):
            expected[t.fixed + first[k]] = t.fixed_bytes
        return _RecordChecks(
            tuple(t.size for t in templates),
            expected,
            np.concatenate([t.length_offsets + first[k] for k, t in enumerate(templates)]),
            np.repeat(np.arange(len(templates)), [t.length_offsets.size for t in templates]),
            np.concatenate([t.beyond for t in templates]),
            np.concatenate([t.shift for t in templates]),
            np.concatenate([t.more for t in templates]),
            np.array([t.max_size for t in templates]),
            np.array([-1 if t.empty else 3 if t.kind == _FLOAT else 0 for t in templates]),
        )

    def match(self, batch: WireBatch, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Which rows (header ``k`` at ``starts[:, k]`` with values of ``sizes[:, k]`` bytes)
        have every header as the templates say."""
        # Each header is copied row by row (one memcpy each), not byte by byte.
        headers = np.concatenate(
            [batch.windows(size)[starts[:, k]] for k, size in enumerate(self.sizes)], axis=1
        )
        expected = np.repeat(self.expected[None, :], len(starts), axis=0)
        lengths = sizes[:, self.length_entry]  # a copy, computed on in place
        lengths += self.beyond
        lengths >>= self.shift
        lengths &= 0x7F
        lengths |= self.more
        expected[:, self.length_columns] = lengths
        if headers.tobytes() == expected.tobytes():  # the usual case: every row matches
            matched = np.ones(len(starts), dtype=bool)
        else:
            matched = (headers == expected).all(axis=1)
        unfit = sizes >= self.max_size
        unfit |= (sizes & self.size_bits) != 0
        if unfit.any():
            matched &= ~unfit.any(axis=1)
        return matched


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """A record's layout: the tag and length of its ``features`` field, then the templates
    of its map entries in order (``columns``), and their checks at once.

    Attributes:
      entries: the map entries' templates (``columns`` but the first).
      before: per column, the size of the headers before it: where it starts after the
        record's start and the sizes of the entries' values before it.
      header_sizes: per entry, the size of its header.
      scalar_entries: the entries of wanted, non-empty int64 lists, whose values the walk
        reads as one word each; ``scalar_column``: entry -> its place among them.
    """

    columns: tuple[EntryTemplate, ...]
    entries: tuple[EntryTemplate, ...]
    checks: _RecordChecks
    before: np.ndarray
    header_sizes: np.ndarray
    scalar_entries: np.ndarray
    scalar_column: dict[int, int]

    @staticmethod
    def of(data: bytes, pos: int, end: int, kinds: Mapping[str, int]) -> RecordLayout | None:
        """The layout of the record from ``pos`` to ``end`` (a ``features`` field there,
        whatever follows it); None if it is not there or an entry is not canonical."""
        features = EntryTemplate.features_field(data, pos, end)
        if features is None:
            return None
        columns = [features]
        pos += features.size
        while pos < features.end:
            template = EntryTemplate.of(data, pos, features.end, kinds)
            if template is None:
                return None
            columns.append(template)
            pos = template.end
        entries = tuple(columns[1:])
        scalars = [
            k for k, t in enumerate(entries) if t.wanted and t.kind == _INT64 and not t.empty
        ]
        return RecordLayout(
            tuple(columns),
            entries,
            _RecordChecks.of(columns),
            np.cumsum([0] + [t.size for t in columns[:-1]]),
            np.array([t.size for t in entries], dtype=np.int64),
            np.array(scalars, dtype=np.int64),
            {k: column for column, k in enumerate(scalars)},
        )

    def locate(
        self, batch: WireBatch, start: np.ndarray, end: np.ndarray, content_end: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Follows each row's sizes from header to header, from the record's ``start``,
        then checks every header at once. Returns which rows are laid out so, their
        ``features`` field ending at or after ``content_end`` and at most at ``end`` (an
        ``S`` array's NUL padding may follow), and per row and entry where the entry's
        values start and their size."""
        raw = batch.raw
        sizes = np.empty((start.size, len(self.columns)), dtype=np.int64)
        starts = np.empty_like(sizes)
        limit = len(batch.data) - int(self.before[-1]) - self.columns[-1].size
        if limit < 0:  # the headers alone are longer than the batch
            return np.zeros(start.size, dtype=bool), starts[:, 1:], sizes[:, 1:]
        # The record's start plus the sizes of the entries' values read so far.
        reached = start
        for k, template in enumerate(self.columns):
            # Rows laid out otherwise wander off; keep their reads inside the buffer.
            reached = np.minimum(reached, limit)
            starts[:, k] = reached
            prefix = raw[int(self.before[k]) + template.size_offset :]
            if template.size_width == 1:
                sizes[:, k] = prefix[reached]
            else:
                size = prefix[reached].astype(np.int64) & 0x7F
                for j in range(1, template.size_width):
                    size |= (prefix[reached + j].astype(np.int64) & 0x7F) << (7 * j)
                sizes[:, k] = size
            if k:  # the features field's size holds the entries
                reached = reached + sizes[:, k]
        starts += self.before
        stop = reached + int(self.before[-1]) + self.columns[-1].size
        matched = self.checks.match(batch, starts, sizes)
        matched &= starts[:, 0] + self.columns[0].size + sizes[:, 0] == stop
        matched &= (stop >= content_end) & (stop <= end)
        return matched, starts[:, 1:] + self.header_sizes, sizes[:, 1:]


# The last record layout seen per feature spec (its kinds), tried first on the next batch:
# consecutive batches of one dataset nearly always share it.
_LAYOUTS: dict[tuple[tuple[str, int], ...], RecordLayout] = {}
_MAX_LAYOUTS = 64


def last_layout(kinds: Mapping[str, int]) -> RecordLayout | None:
    """The layout :func:`new_layout` last made for these wanted features, if any."""
    return _LAYOUTS.get(tuple(kinds.items()))


def new_layout(data: bytes, pos: int, end: int, kinds: Mapping[str, int]) -> RecordLayout | None:
    """The layout of the record from ``pos`` to ``end`` (see :meth:`RecordLayout.of`), kept
    as the last one for these wanted features."""
    layout = RecordLayout.of(data, pos, end, kinds)
    if layout is not None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[tuple(kinds.items())] = layout
    return layout

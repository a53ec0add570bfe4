"""Concat-then-split packing: fill one buffer of target lengths, splitting inputs.

Inputs are concatenated into a single buffer per feature; an input that does not fit is cut at the
remaining capacity and its remainder starts the next output, so no cell is padding except at the
very end (or where a meta feature, which is never cut, runs out of room first).

With ``split_full_length_features=False``, inputs that already fill some feature exactly (and
exceed none) are emitted whole, queued behind the buffer being filled when they arrive: the
order Grain's tests pin.

Checkpoints hold no data. The iterator records a checkpoint whenever it starts filling a buffer
with nothing left to hand out: the parent state before the element whose remainder is carried
over, that remainder's slice per feature, and how many outputs were handed out since. Restoring
re-reads that element and replays those outputs (a handful in practice; a warning is logged when
the replay is long).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from grain_core import _tree
from grain_core._checks import positive_int
from grain_core.dataset.base import DatasetIterator, IterDataset

__all__ = ["BOSHandling", "ConcatThenSplitIterDataset"]

_LOG = logging.getLogger(__name__)

# A feature slice meaning "the whole feature" in checkpoints (Grain's encoding).
_WHOLE = (-1, -1)
# Restores that replay more than this many outputs, or take longer, are logged.
_SLOW_REPLAY_ELEMENTS = 50
_SLOW_REPLAY_SECONDS = 30.0


class BOSHandling(enum.Enum):
    """What to do with the beginning-of-sequence token of packed segments."""

    DO_NOTHING = enum.auto()
    REPLACE_FIRST_TOKEN_WITH_BOS = enum.auto()


@dataclasses.dataclass(frozen=True, slots=True)
class _Piece:
    """An input element, or the part of it not yet packed.

    Attributes:
      parent_state: the parent's state before this element was read.
      features: the element's features as arrays (sequence features at least 1-D).
      slices: ``(start, stop)`` per sequence feature still to pack; ``None`` = all of it.
        Meta features are never sliced.
    """

    parent_state: Any
    features: Mapping[str, np.ndarray]
    slices: Mapping[str, tuple[int, int]] | None

    def part(self, key: str) -> np.ndarray:
        value = self.features[key]
        if self.slices is None or key not in self.slices:
            return value
        start, stop = self.slices[key]
        return value[start:stop]

    def split(self, take: Mapping[str, int]) -> tuple[_Piece, _Piece]:
        """Cuts off the first ``take[key]`` tokens of every sequence feature."""
        left: dict[str, tuple[int, int]] = {}
        right: dict[str, tuple[int, int]] = {}
        for key, n in take.items():
            if self.slices is None:
                start, stop = 0, len(self.features[key])
            else:
                start, stop = self.slices[key]
            left[key] = (start, start + n)
            right[key] = (start + n, stop)
        return (
            dataclasses.replace(self, slices=left),
            dataclasses.replace(self, slices=right),
        )


def _length(value: np.ndarray) -> int:
    return value.shape[0] if value.ndim else 1


class ConcatThenSplitIterDataset(IterDataset[dict[str, Any]]):
    """Concatenates flat dict inputs into outputs of exactly the target lengths, splitting them.

    Each output has, per feature ``k`` of ``length_struct``, ``k`` (values, zero-padded only at
    the end), and unless ``k`` is a meta feature ``k_segment_ids`` (int32, 1-based per output,
    0 = padding) and ``k_positions`` (int32, restarting at 0 in every segment).
    """

    def __init__(
        self,
        parent: IterDataset[Any],
        *,
        length_struct: Mapping[str, int],
        meta_features: Collection[str] = (),
        split_full_length_features: bool = True,
        bos_handling: BOSHandling = BOSHandling.DO_NOTHING,
        bos_features: Collection[str] = (),
        bos_token_id: int | None = None,
    ) -> None:
        """Creates the packer.

        Args:
          parent: dataset of flat dicts with exactly the keys of ``length_struct``; values are
            arrays with a leading sequence axis (scalars count as length 1).
          length_struct: target length per feature.
          meta_features: features that are never split: when one does not fit, the output is
            closed early (logged), and a split input repeats them in both outputs. They get no
            segment ids or positions.
          split_full_length_features: when False, inputs filling some feature exactly (and
            exceeding none) are emitted whole instead of being cut across two outputs.
          bos_handling: ``REPLACE_FIRST_TOKEN_WITH_BOS`` overwrites the first token of every
            segment of ``bos_features`` (also of remainders) with ``bos_token_id``.
          bos_features: features to which BOS handling applies.
          bos_token_id: the BOS token.

        Raises:
          ValueError: inconsistent BOS options, features not in ``length_struct`` or
            non-positive target lengths.
        """
        super().__init__(parent)
        if not isinstance(length_struct, Mapping) or not length_struct:
            raise ValueError(
                "`length_struct` must be a non-empty dict of feature name -> target length, got "
                f"{length_struct!r}."
            )
        for key, target in length_struct.items():
            positive_int(f"Target length of feature {key!r}", target)
        for what, names in (("meta_features", meta_features), ("bos_features", bos_features)):
            if isinstance(names, str):
                raise ValueError(
                    f"`{what}` must be a collection of names, got the string {names!r}."
                )
            unknown = sorted(set(names) - set(length_struct))
            if unknown:
                raise ValueError(
                    f"`{what}` {unknown} are not features of `length_struct` "
                    f"({list(length_struct)})."
                )
        if bos_handling == BOSHandling.DO_NOTHING and (bos_token_id is not None or bos_features):
            raise ValueError(
                f"bos_handling={bos_handling} means no BOS handling, so `bos_token_id` and "
                "`bos_features` must not be set; pass "
                "bos_handling=BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS to use them."
            )
        if bos_handling != BOSHandling.DO_NOTHING and bos_token_id is None:
            raise ValueError(f"`bos_token_id` must be set when bos_handling={bos_handling}.")
        overlap = sorted(set(meta_features) & set(bos_features))
        if overlap:
            raise ValueError(
                f"`bos_features` and `meta_features` must not overlap; both contain {overlap}."
            )
        self._length_struct = {k: int(v) for k, v in length_struct.items()}
        self._meta = frozenset(meta_features)
        self._split_full_length = bool(split_full_length_features)
        self._bos_features = frozenset(bos_features)
        self._bos_token_id = bos_token_id

    def __iter__(self) -> _ConcatThenSplitIterator:
        return _ConcatThenSplitIterator(self._parents[0].__iter__(), self)

    def __repr__(self) -> str:
        return (
            f"ConcatThenSplitIterDataset(length_struct={self._length_struct}, "
            f"meta_features={sorted(self._meta)}, "
            f"split_full_length_features={self._split_full_length})"
        )


class _ConcatThenSplitIterator(DatasetIterator[dict[str, Any]]):
    """State ``{"parent_state", "remainder_slices", "elements_from_buffer_after_checkpoint"}``."""

    def __init__(self, parent: DatasetIterator[Any], ds: ConcatThenSplitIterDataset) -> None:
        super().__init__(parent)
        self._targets = ds._length_struct
        self._meta = ds._meta
        self._sequence_keys = [k for k in self._targets if k not in self._meta]
        self._split_full_length = ds._split_full_length
        self._bos_features = ds._bos_features
        self._bos_token_id = ds._bos_token_id
        self._positions = np.arange(max(self._targets.values()), dtype=np.int32)
        self._warned_meta: set[str] = set()
        self._reset(None)

    def _reset(self, carry: _Piece | None) -> None:
        self._ready: collections.deque[dict[str, Any]] = collections.deque()
        self._carry = carry
        self._exhausted = False
        self._checkpoint()

    def _checkpoint(self) -> None:
        carry = self._carry
        if carry is None:
            self._checkpoint_parent = self._parents[0].get_state()
            self._checkpoint_slices = None
        else:
            self._checkpoint_parent = carry.parent_state
            self._checkpoint_slices = carry.slices
        self._handed_out = 0

    def __next__(self) -> dict[str, Any]:
        self._check_open()
        if not self._ready:
            if self._exhausted:
                raise StopIteration
            self._checkpoint()
            self._fill()
            if not self._ready:
                self._checkpoint()
                raise StopIteration
        self._handed_out += 1
        return self._ready.popleft()

    def _fill(self) -> None:
        """Packs one buffer (plus any whole full-length inputs met meanwhile) into ``_ready``."""
        parent = self._parents[0]
        pieces: list[_Piece] = []
        used = dict.fromkeys(self._targets, 0)
        while True:
            if self._carry is not None:
                self._carry = self._add(self._carry, pieces, used)
                if self._carry is not None:
                    break
            state = parent.get_state()
            try:
                element = next(parent)
            except StopIteration:
                self._exhausted = True
                break
            piece = _Piece(state, self._features(element), None)
            if not self._split_full_length and self._is_full_length(piece):
                self._ready.append(self._pack([piece]))
                continue
            self._carry = self._add(piece, pieces, used)
            if self._carry is not None:
                break
        if pieces:
            self._ready.appendleft(self._pack(pieces))

    def _features(self, element: Any) -> dict[str, np.ndarray]:
        """Validates one input and converts its features to arrays.

        Raises:
          ValueError: not a flat dict with exactly the keys of ``length_struct``, or a meta
            feature longer than its target.
        """
        if not isinstance(element, Mapping) or set(element) != set(self._targets):
            raise ValueError(
                f"Parent element has structure {_tree.spec_str(element)} but `length_struct` is "
                f"{self._targets}: inputs must be flat dicts with exactly one target length per "
                "feature (add or drop features with a map first)."
            )
        features = {}
        for key, target in self._targets.items():
            value = element[key]
            if isinstance(value, Mapping) or np.asarray(value).dtype == object:
                raise ValueError(
                    f"Feature {key!r} is not an array of numbers ({_tree.spec_str(element[key])}); "
                    "parent elements must be unnested dicts of arrays or scalars."
                )
            value = np.asarray(value)
            if key in self._meta:
                if _length(value) > target:
                    raise ValueError(
                        f"Meta feature {key!r} has length {_length(value)} but its target length "
                        f"is {target}; meta features are never split, so they must fit."
                    )
            elif value.ndim == 0:
                value = value.reshape(1)
            features[key] = value
        return features

    def _is_full_length(self, piece: _Piece) -> bool:
        full = False
        for key, target in self._targets.items():
            n = _length(piece.features[key])
            if n > target:
                return False
            full = full or n == target
        return full

    def _add(self, piece: _Piece, pieces: list[_Piece], used: dict[str, int]) -> _Piece | None:
        """Adds as much of ``piece`` to the buffer as fits; returns what is left (or None)."""
        take: dict[str, int] = {}
        meta_lengths: dict[str, int] = {}
        needs_split = False
        for key, target in self._targets.items():
            n = _length(piece.part(key))
            available = target - used[key]
            if key in self._meta:
                if n > available:
                    self._log_meta_limit(key, n, available, target)
                    return piece
                meta_lengths[key] = n
            elif n > available:
                needs_split = True
                take[key] = available
            else:
                take[key] = n
        remainder = None
        if needs_split:
            if not any(take.values()):
                return piece
            piece, remainder = piece.split(take)
        pieces.append(piece)
        for key, n in take.items():
            used[key] += n
        for key, n in meta_lengths.items():
            used[key] += n
        return remainder

    def _log_meta_limit(self, key: str, n: int, available: int, target: int) -> None:
        if key in self._warned_meta:
            return
        self._warned_meta.add(key)
        _LOG.error(
            "Meta feature %r limited packing: an element needs %d cells but only %d of %d are "
            "left, so the output is closed early and padded. Consider a larger target length for "
            "%r. (Logged once per iterator.)",
            key,
            n,
            available,
            target,
            key,
        )

    def _pack(self, pieces: list[_Piece]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, target in self._targets.items():
            first = pieces[0].features[key]
            values = np.zeros((target, *first.shape[1:]), dtype=first.dtype)
            is_sequence = key not in self._meta
            segment_ids = np.zeros(target if is_sequence else 0, dtype=np.int32)
            positions = np.zeros(target if is_sequence else 0, dtype=np.int32)
            bos = key in self._bos_features
            end = 0
            for segment_id, piece in enumerate(pieces, 1):
                part = piece.part(key)
                n = _length(part)
                start, end = end, end + n
                try:
                    values[start:end] = part
                except ValueError as e:
                    raise ValueError(
                        f"Feature {key!r} of shape {part.shape} cannot be packed with earlier "
                        f"elements of shape {first.shape}: dimensions after the sequence axis "
                        "must agree."
                    ) from e
                if is_sequence:
                    segment_ids[start:end] = segment_id
                    positions[start:end] = self._positions[:n]
                if bos and n:
                    values[start] = self._bos_token_id
            out[key] = values
            if is_sequence:
                out[f"{key}_segment_ids"] = segment_ids
                out[f"{key}_positions"] = positions
        return out

    def get_state(self) -> dict[str, Any]:
        slices = self._checkpoint_slices
        return {
            "parent_state": copy.deepcopy(self._checkpoint_parent),
            "remainder_slices": {
                k: list(_WHOLE if slices is None else slices[k]) for k in self._sequence_keys
            },
            "elements_from_buffer_after_checkpoint": self._handed_out,
        }

    def _progress_held(self) -> str | None:
        if self._checkpoint_slices is None and not self._handed_out:
            return None
        return (
            f"ConcatThenSplitIterDataset has handed out {self._handed_out} packed elements of a "
            "buffer whose inputs it read (or is splitting an input)"
        )

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a state, re-reading the carried-over element and replaying outputs.

        Raises:
          ValueError: the state belongs to a different configuration, or the parent ends where
            the carried-over element should be.
        """
        raw_slices = state["remainder_slices"]
        if set(raw_slices) != set(self._sequence_keys):
            raise ValueError(
                f"Checkpoint has remainder slices for {sorted(raw_slices)} but this "
                f"ConcatThenSplitIterDataset packs sequence features {sorted(self._sequence_keys)}."
            )
        slices = {k: (int(v[0]), int(v[1])) for k, v in raw_slices.items()}
        parent = self._parents[0]
        parent_state = state["parent_state"]
        parent.set_state(parent_state)
        carry = None
        if any(sl != _WHOLE for sl in slices.values()):
            try:
                element = next(parent)
            except StopIteration as e:
                raise ValueError(
                    "Cannot restore ConcatThenSplitIterDataset: the parent is exhausted where the "
                    "checkpoint expects the element being split. Restore with the same input "
                    "pipeline that produced the checkpoint."
                ) from e
            carry = _Piece(copy.deepcopy(parent_state), self._features(element), slices)
        self._reset(carry)
        replay = self._state_int(state, "elements_from_buffer_after_checkpoint")
        started = time.perf_counter()
        for _ in range(replay):
            next(self)
        elapsed = time.perf_counter() - started
        if replay > _SLOW_REPLAY_ELEMENTS or elapsed > _SLOW_REPLAY_SECONDS:
            _LOG.warning(
                "Restoring ConcatThenSplitIterDataset replayed %d outputs in %.1f s.",
                replay,
                elapsed,
            )

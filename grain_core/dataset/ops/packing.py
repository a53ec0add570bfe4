"""Bin packing of variable-length sequences: first-fit and best-fit.

A *group* is ``num_packing_bins`` bins preallocated per feature as one ``(bins, target_len,
*feature_shape)`` array (plus int32 segment-id and position arrays). Each input sequence is
placed whole into one bin: first-fit takes the lowest-index bin where every feature has room,
best-fit the feasible bin with the most cells already used. The first input that fits nowhere
closes the group; its non-empty bins are emitted one per ``next`` (optionally in a seeded
shuffled order) and that input starts the next group.

Hot path: the feasibility test is one NumPy comparison over all bins, and placing a sequence is
three slice writes per feature; nothing loops over tokens in Python.

Checkpoints hold no data: the parent's state before the group's first input, the number of rows
of that group already emitted and the total row counter (which also seeds the bin shuffle).
Restoring re-reads and re-packs that one group.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from grain_core import _tree
from grain_core._checks import as_int, non_negative_int, positive_int
from grain_core.dataset.base import DatasetIterator, IterDataset
from grain_core.record import Record

__all__ = [
    "BestFitPackIterDataset",
    "FirstFitPackIterDataset",
    "PackAndBatchOperation",
    "non_sequence_meta_features",
]

_LOG = logging.getLogger(__name__)

T = TypeVar("T")
Path = _tree.TreePath


def non_sequence_meta_features(
    length_struct: Mapping[str, Any], meta_features: Sequence[str]
) -> list[str]:
    """The meta features that are not packed: those absent from ``length_struct``, which a
    packer returns per bin as the list of the values packed into it (in ``meta_features``
    order)."""
    return [k for k in meta_features if k not in length_struct]


def _path_name(path: Path) -> str:
    return "/".join(map(str, path)) if path else "<element>"


def _value_at(tree: Any, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _check_max_sequences(max_sequences_per_bin: int | None) -> int | None:
    if max_sequences_per_bin is None:
        return None
    n = as_int("`max_sequences_per_bin`", max_sequences_per_bin)
    if n <= 0:  # Grain's text: users match on it
        raise ValueError(
            f"If specified, `max_sequences_per_bin` must be a positive integer, but got {n}."
        )
    return n


class _Layout:
    """The packed features of ``length_struct`` flattened to leaves, with their settings.

    Each leaf is addressed by its path in the element; leaves are in canonical tree order.
    """

    def __init__(
        self,
        length_struct: Any,
        *,
        segmented: Callable[[Path], bool],
        alignment_struct: Any = None,
        padding_struct: Any = None,
    ) -> None:
        pairs = _tree.leaf_paths(length_struct)
        if not pairs:
            raise ValueError(f"`length_struct` has no target lengths: {length_struct!r}.")
        self.paths: list[Path] = [p for p, _ in pairs]
        self.names = [_path_name(p) for p in self.paths]
        self.capacities = [
            positive_int(f"Target length of feature {n!r}", t)
            for n, (_, t) in zip(self.names, pairs, strict=True)
        ]
        self.alignments = [
            1
            if alignment_struct is None
            else positive_int(
                f"Alignment of feature {_path_name(p)!r}",
                self._setting(alignment_struct, p, "pack_alignment_struct"),
            )
            for p in self.paths
        ]
        self.paddings = [
            None if padding_struct is None else self._setting(padding_struct, p, "padding_struct")
            for p in self.paths
        ]
        self.segmented = [segmented(p) for p in self.paths]
        self.positions = np.arange(max(self.capacities), dtype=np.int32)
        self.positions.flags.writeable = False
        self._lookups = list(zip(self.paths, self.names, self.capacities, strict=True))

    @staticmethod
    def _setting(struct: Any, path: Path, what: str) -> Any:
        try:
            return _value_at(struct, path)
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(
                f"`{what}` must have the structure of `length_struct`; it has no entry for "
                f"feature {_path_name(path)!r}: {struct!r}."
            ) from e

    def extract(self, element: Any) -> tuple[list[np.ndarray], list[int]]:
        """Returns the packed leaves of ``element`` as arrays and their sequence lengths.

        Raises:
          ValueError: a feature is missing or longer than its target length.
        """
        leaves: list[np.ndarray] = []
        lengths: list[int] = []
        for path, name, capacity in self._lookups:
            value = element
            try:
                for key in path:
                    value = value[key]
            except (KeyError, IndexError, TypeError) as e:
                raise ValueError(
                    f"Element has no feature {name!r} required by `length_struct`; element "
                    f"structure: {_tree.spec_str(element)}."
                ) from e
            if type(value) is not np.ndarray:
                value = np.asarray(value)
            length = value.shape[0] if value.ndim else 1
            if length > capacity:
                raise ValueError(
                    f"Feature {name!r} has length {length} but its target length is {capacity}; "
                    "inputs must be truncated to max length before packing (e.g. "
                    "`ds.map(lambda x: {k: v[:target] ...})`)."
                )
            leaves.append(value)
            lengths.append(length)
        return leaves, lengths


class _BinGroup:
    """Preallocated buffers for one group of bins, and the fill state of every bin.

    Per-bin counters live in Python lists (cheap scalar access while placing); the free room
    per (feature, bin) is mirrored in one NumPy array so the bin search is vectorised.
    """

    def __init__(
        self,
        layout: _Layout,
        num_bins: int,
        shapes_from: list[np.ndarray],
        *,
        max_sequences_per_bin: int | None,
        best_fit: bool = False,
        extra_meta: Sequence[str] = (),
    ) -> None:
        self._layout = layout
        self._max_sequences = max_sequences_per_bin
        self.values: list[np.ndarray] = []
        self.segment_ids: list[np.ndarray | None] = []
        self.positions: list[np.ndarray | None] = []
        nbytes = 0
        for leaf, capacity, padding, segmented in zip(
            shapes_from, layout.capacities, layout.paddings, layout.segmented, strict=True
        ):
            shape = (num_bins, capacity, *leaf.shape[1:])
            if padding is None:
                buffer = np.zeros(shape, dtype=leaf.dtype)
            else:
                buffer = np.full(shape, padding, dtype=leaf.dtype)
            self.values.append(buffer)
            nbytes += buffer.nbytes
            if segmented:
                self.segment_ids.append(np.zeros((num_bins, capacity), dtype=np.int32))
                self.positions.append(np.zeros((num_bins, capacity), dtype=np.int32))
                nbytes += 2 * num_bins * capacity * 4
            else:
                self.segment_ids.append(None)
                self.positions.append(None)
        self._paddings = layout.paddings
        # Free cells left per (feature, bin); may go negative when alignment overshoots.
        self._capacity_column = np.asarray(layout.capacities, dtype=np.int64)[:, None]
        self._room = np.repeat(self._capacity_column, num_bins, axis=1)
        nbytes += self._room.nbytes
        self.nbytes = nbytes
        self._num_bins = num_bins
        self._first_room = self._room[0]
        self._free_cells = [[0] * num_bins for _ in layout.capacities]
        # Cells used per bin (best-fit's score) and bins below the sequence cap, when needed.
        self._used = np.zeros(num_bins, dtype=np.int64) if best_fit else None
        self._open = None if max_sequences_per_bin is None else np.ones(num_bins, dtype=bool)
        self._extra_meta_keys = tuple(extra_meta)
        self._reset_counters()
        self._features = list(
            zip(
                self.values,
                self.segment_ids,
                self.positions,
                self._free_cells,
                self._room,
                layout.capacities,
                layout.alignments,
                layout.names,
                strict=True,
            )
        )

    def _reset_counters(self) -> None:
        self.counts = [0] * self._num_bins
        self.extra_meta: dict[str, list[list[Any]]] = {
            k: [[] for _ in range(self._num_bins)] for k in self._extra_meta_keys
        }

    def reuse(self, shapes_from: list[np.ndarray]) -> bool:
        """Empties this group for reuse if its buffers fit ``shapes_from``; returns whether so.

        Reusing resident buffers avoids the page faults of fresh allocations on every group.
        """
        for leaf, values in zip(shapes_from, self.values, strict=True):
            if leaf.dtype != values.dtype or leaf.shape[1:] != values.shape[2:]:
                return False
        for values, padding, segment_ids, positions in zip(
            self.values, self._paddings, self.segment_ids, self.positions, strict=True
        ):
            values[...] = 0 if padding is None else padding
            if segment_ids is not None:
                segment_ids.fill(0)
                positions.fill(0)  # type: ignore[union-attr]
        self._room[...] = self._capacity_column
        for free in self._free_cells:
            free[:] = [0] * self._num_bins
        if self._used is not None:
            self._used.fill(0)
        if self._open is not None:
            self._open.fill(True)
        self._reset_counters()
        return True

    def find_bin(self, lengths: list[int]) -> int:
        """Returns the bin to place a sequence of ``lengths`` into, or -1 if none has room."""
        if len(lengths) == 1:
            feasible = self._first_room >= lengths[0]
        else:
            feasible = np.all(self._room >= np.asarray(lengths, dtype=np.int64)[:, None], axis=0)
        if self._open is not None:
            feasible &= self._open
        if self._used is None:
            row = int(feasible.argmax())
        else:
            row = int(np.where(feasible, self._used, -1).argmax())
        return row if feasible[row] else -1

    def place(self, row: int, leaves: list[np.ndarray], lengths: list[int], element: Any) -> None:
        """Writes one sequence at the first free cell of every feature of bin ``row``.

        Raises:
          ValueError: a feature's trailing shape differs from the group's buffers.
        """
        counts = self.counts
        counts[row] += 1
        segment_id = counts[row]
        arange = self._layout.positions
        used = 0
        for (
            values,
            segment_ids,
            positions,
            free,
            room,
            capacity,
            alignment,
            name,
        ), leaf, length in zip(self._features, leaves, lengths, strict=True):
            start = free[row]
            end = start + length
            try:
                values[row, start:end] = leaf
            except ValueError as e:
                raise ValueError(
                    f"Feature {name!r} of shape {leaf.shape} cannot be packed into bins of "
                    f"shape {values.shape[1:]}: all elements packed together must agree on the "
                    "dimensions after the sequence axis."
                ) from e
            if segment_ids is not None:
                segment_ids[row, start:end] = segment_id
                positions[row, start:end] = arange[:length]
            if alignment != 1:
                end = -(-end // alignment) * alignment
            free[row] = end
            room[row] = capacity - end
            used += end - start
        if self._used is not None:
            self._used[row] += used
        if self._open is not None and segment_id >= self._max_sequences:  # type: ignore[operator]
            self._open[row] = False
        for key, per_bin in self.extra_meta.items():
            if key in element:
                per_bin[row].append(element[key])

    def non_empty_bins(self) -> np.ndarray:
        return np.flatnonzero(self.counts)


class _PackIterDataset(IterDataset[dict[str, Any]]):
    """Shared construction and validation of the first-fit and best-fit packers."""

    _best_fit = False

    def __init__(
        self,
        parent: IterDataset[Any],
        *,
        length_struct: Mapping[str, Any],
        num_packing_bins: int,
        seed: int = 0,
        shuffle_bins: bool = True,
        shuffle_bins_group_by_feature: str | None = None,
        meta_features: Sequence[str] = (),
        pack_alignment_struct: Any = None,
        padding_struct: Any = None,
        max_sequences_per_bin: int | None = None,
    ) -> None:
        """Creates the packer (see the module docstring).

        Args:
          parent: dataset of dicts whose ``length_struct`` features have a leading sequence axis.
          length_struct: dict (possibly nested) of target lengths, one per packed feature.
          num_packing_bins: bins per group; more bins pack tighter but hold more in memory.
          seed: seed of the bin shuffle (row order of group ``g`` uses ``seed + rows before g``).
          shuffle_bins: emit each group's bins in a seeded random order (Grain's default).
          shuffle_bins_group_by_feature: after shuffling, order bins by the mean distinct
            non-zero value of this feature (e.g. an epoch id), keeping the shuffle within ties.
          meta_features: features packed without segment ids/positions; those not in
            ``length_struct`` are returned per bin as the list of the values packed into it.
          pack_alignment_struct: per-feature alignment: after each sequence the next free cell
            is rounded up to a multiple of it.
          padding_struct: per-feature fill value of unused cells (default 0).
          max_sequences_per_bin: cap on sequences per bin.

        Raises:
          ValueError: invalid sizes, settings or structures (named in the message).
        """
        super().__init__(parent)
        if not isinstance(length_struct, Mapping):
            raise ValueError(
                "`length_struct` must be a dict mapping feature names to target lengths, got "
                f"{length_struct!r}."
            )
        if isinstance(meta_features, str):
            raise ValueError(
                f"`meta_features` must be a sequence of feature names, got the string "
                f"{meta_features!r}; did you mean [{meta_features!r}]?"
            )
        self._num_bins = positive_int("`num_packing_bins`", num_packing_bins)
        self._seed = non_negative_int("Packing `seed`", seed)
        self._shuffle_bins = bool(shuffle_bins)
        self._max_sequences = _check_max_sequences(max_sequences_per_bin)
        meta = set(meta_features)
        for key in length_struct:
            subtree = length_struct[key]
            if key not in meta and isinstance(subtree, (Mapping, list, tuple)):
                raise ValueError(
                    f"Failed to extract segment ids for {key!r}, which has type {type(subtree)} "
                    "rather than np.ndarray. Perhaps it should be marked as a meta feature?"
                )
        self._layout = _Layout(
            length_struct,
            segmented=lambda path: path[0] not in meta,
            alignment_struct=pack_alignment_struct,
            padding_struct=padding_struct,
        )
        self._extra_meta = tuple(non_sequence_meta_features(length_struct, meta_features))
        self._plan = _RowPlan(length_struct, self._layout, meta, self._extra_meta)
        if shuffle_bins_group_by_feature is not None:
            key = shuffle_bins_group_by_feature
            if key not in self._plan.leaf_of_key and key not in self._extra_meta:
                raise ValueError(
                    f"`shuffle_bins_group_by_feature`={key!r} must name a non-nested feature of "
                    f"`length_struct` ({sorted(length_struct)}) or a meta feature."
                )
        self._group_by = shuffle_bins_group_by_feature

    def __iter__(self) -> _PackDatasetIterator:
        return _PackDatasetIterator(self._parents[0].__iter__(), self)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_packing_bins={self._num_bins}, "
            f"features={self._layout.names}, shuffle_bins={self._shuffle_bins})"
        )


class FirstFitPackIterDataset(_PackIterDataset):
    """Packs each sequence into the lowest-index bin of the group where it fits."""


class BestFitPackIterDataset(_PackIterDataset):
    """Packs each sequence into the fullest bin of the group where it fits (tightest fit)."""

    _best_fit = True


class _RowPlan:
    """How one output element is read out of a group's buffers for a given bin."""

    def __init__(
        self,
        length_struct: Mapping[str, Any],
        layout: _Layout,
        meta: set[str],
        extra_meta: Sequence[str],
    ) -> None:
        # Leaves are in sorted-key order, so each top-level key owns a contiguous leaf range.
        first_leaf: dict[Any, int] = {}
        count: dict[Any, int] = {}
        for i, path in enumerate(layout.paths):
            first_leaf.setdefault(path[0], i)
            count[path[0]] = count.get(path[0], 0) + 1
        self.leaf_of_key = {
            k: first_leaf[k]
            for k in first_leaf
            if not isinstance(length_struct[k], (Mapping, list, tuple))
        }
        self.subtrees = [
            (k, length_struct[k], range(first_leaf[k], first_leaf[k] + count[k]))
            for k in first_leaf
            if k not in self.leaf_of_key
        ]
        self.segmented = [
            (i, f"{k}_segment_ids", f"{k}_positions")
            for k, i in self.leaf_of_key.items()
            if k not in meta
        ]
        self.extra_meta = tuple(extra_meta)

    def row(self, group: _BinGroup, b: int) -> dict[str, Any]:
        # Copies: the group's buffers are reused for a later group.
        values = group.values
        out: dict[str, Any] = {k: values[i][b].copy() for k, i in self.leaf_of_key.items()}
        for key, struct, leaves in self.subtrees:
            out[key] = _tree.unflatten(struct, [values[i][b].copy() for i in leaves])
        for i, seg_key, pos_key in self.segmented:
            out[seg_key] = group.segment_ids[i][b].copy()  # type: ignore[index]
            out[pos_key] = group.positions[i][b].copy()  # type: ignore[index]
        for key in self.extra_meta:
            out[key] = group.extra_meta[key][b]
        return out

    def feature_row(self, group: _BinGroup, key: str, b: int) -> np.ndarray:
        if key in self.leaf_of_key:
            return group.values[self.leaf_of_key[key]][b]
        return np.asarray(group.extra_meta[key][b])


class _PackDatasetIterator(DatasetIterator[dict[str, Any]]):
    """State ``{"parent", "next_row", "counter"}``, as Grain's."""

    def __init__(self, parent: DatasetIterator[Any], ds: _PackIterDataset) -> None:
        super().__init__(parent)
        self._ds = ds
        self._layout = ds._layout
        self._plan = ds._plan
        self._size_bytes: int | None = None
        # A fully emitted group whose buffers the next group can reuse.
        self._spare: _BinGroup | None = None
        self._start(parent.get_state(), next_row=0, counter=0)

    def _start(self, group_start_state: Any, *, next_row: int, counter: int) -> None:
        # Parent state before the first input of the group being emitted (or built).
        self._group_start_state = group_start_state
        self._next_row = next_row
        self._counter = counter
        self._building: _BinGroup | None = None
        self._building_start_state: Any = None
        self._emitting: _BinGroup | None = None
        self._emit_bins: list[int] = []

    def get_packed_batch_size_bytes(self) -> int:
        """Bytes held by one group's buffers (values, segment ids, positions, free cells).

        Raises:
          ValueError: before the first element was packed.
        """
        if self._size_bytes is None:
            raise ValueError(
                "No packed group yet: the size is known only after at least one element has "
                "been packed (call next() first)."
            )
        return self._size_bytes

    def _new_group(self, shapes_from: list[np.ndarray]) -> _BinGroup:
        spare = self._spare
        if spare is not None:
            self._spare = None
            if spare.reuse(shapes_from):
                return spare
        ds = self._ds
        group = _BinGroup(
            self._layout,
            ds._num_bins,
            shapes_from,
            max_sequences_per_bin=ds._max_sequences,
            best_fit=ds._best_fit,
            extra_meta=ds._extra_meta,
        )
        self._size_bytes = group.nbytes
        return group

    def __next__(self) -> dict[str, Any]:
        self._check_open()
        if self._emitting is None:
            self._fill()
        group = self._emitting
        assert group is not None
        element = self._plan.row(group, self._emit_bins[self._next_row])
        self._next_row += 1
        self._counter += 1
        if self._next_row == len(self._emit_bins):
            self._spare = self._emitting
            self._emitting = None
            self._group_start_state = self._building_start_state
            self._next_row = 0
        return element

    def _fill(self) -> None:
        """Reads inputs until a group is complete and ready to emit.

        Raises:
          StopIteration: the parent is exhausted and no group is open.
        """
        parent = self._parents[0]
        layout = self._layout
        while True:
            state = parent.get_state()
            try:
                element = next(parent)
            except StopIteration:
                if self._building is None:
                    raise
                self._finish_group(state, None)
                return
            leaves, lengths = layout.extract(element)
            group = self._building
            if group is None:
                group = self._building = self._new_group(leaves)
            row = group.find_bin(lengths)
            if row >= 0:
                group.place(row, leaves, lengths, element)
                continue
            # Bin 0 of an empty group always has room: lengths were checked against targets.
            following = self._new_group(leaves)
            following.place(0, leaves, lengths, element)
            self._finish_group(state, following)
            return

    def _finish_group(self, following_start_state: Any, following: _BinGroup | None) -> None:
        group = self._building
        assert group is not None
        bins = group.non_empty_bins()
        if self._ds._shuffle_bins:
            bins = bins[self._bin_order(group, bins)]
        self._emitting = group
        self._emit_bins = bins.tolist()
        self._building = following
        self._building_start_state = following_start_state

    def _bin_order(self, group: _BinGroup, bins: np.ndarray) -> np.ndarray:
        n = len(bins)
        seed = self._ds._seed + self._counter - self._next_row
        order = np.random.default_rng(seed).permuted(np.arange(n))
        key = self._ds._group_by
        if key is None:
            return order
        means = []
        for b in bins:
            distinct = np.unique(self._plan.feature_row(group, key, int(b)))
            nonzero = np.count_nonzero(distinct)
            means.append(float(distinct.sum() / nonzero) if nonzero else 0.0)
        # Grain-compatible tie-break: rows with equal means keep the order of their shuffle key.
        return np.asarray(sorted(range(n), key=lambda j: (means[j], int(order[j]), j)))

    def get_state(self) -> dict[str, Any]:
        return {
            "parent": copy.deepcopy(self._group_start_state),
            "next_row": self._next_row,
            "counter": self._counter,
        }

    def _progress_held(self) -> str | None:
        # At row 0 the state replays the group from its first input: nothing is handed out.
        if not self._next_row:
            return None
        return (
            f"{self._ds!r} has handed out {self._next_row} of the {len(self._emit_bins)} packed "
            "rows of its current group"
        )

    def set_state(self, state: dict[str, Any]) -> None:
        parent_state = state["parent"]
        self._parents[0].set_state(parent_state)
        self._start(
            copy.deepcopy(parent_state),
            next_row=self._state_int(state, "next_row"),
            counter=self._state_int(state, "counter"),
        )


@dataclasses.dataclass
class PackAndBatchOperation(Generic[T]):
    """Deprecated DataLoader operation: first-fit packs ``Record``s into batches of rows.

    ``__call__`` maps an iterator of ``Record``s whose data match ``length_struct`` to
    ``Record(metadata, (values, segmentations, positions))`` batches of ``batch_size`` rows
    (trees shaped like ``length_struct``); the final partial batch is yielded too. Use
    ``FirstFitPackIterDataset`` in new code.

    Raises:
      ValueError: non-positive ``batch_size`` or ``max_sequences_per_bin``; on iteration, an
        input longer than its target length.
    """

    length_struct: Any
    batch_size: int
    max_sequences_per_bin: int | None = None
    _layout: _Layout = dataclasses.field(init=False, repr=False, compare=False)
    #: Packing never draws from a record's rng: the DataLoader builds none for it.
    uses_record_rng: ClassVar[bool] = False

    def __post_init__(self) -> None:
        positive_int("`batch_size`", self.batch_size)
        _check_max_sequences(self.max_sequences_per_bin)
        self._layout = _Layout(self.length_struct, segmented=lambda path: True)
        _LOG.error(
            "PackAndBatchOperation is deprecated; use "
            "grain_core.experimental.FirstFitPackIterDataset instead."
        )

    def __call__(self, input_iterator: Iterable[Any]) -> Iterator[Any]:
        layout = self._layout
        group: _BinGroup | None = None
        metadata: Any = None  # of the last record placed: set before any batch is yielded
        for record in input_iterator:
            leaves, lengths = layout.extract(record.data)
            if group is None:
                group = self._new_group(leaves)
            row = group.find_bin(lengths)
            if row < 0:
                yield Record(metadata=metadata, data=self._batch(group))
                group = self._new_group(leaves)
                row = 0
            group.place(row, leaves, lengths, record.data)
            metadata = record.metadata.remove_record_key()
        if group is not None:
            yield Record(metadata=metadata, data=self._batch(group))

    def _new_group(self, leaves: list[np.ndarray]) -> _BinGroup:
        return _BinGroup(
            self._layout,
            int(self.batch_size),
            leaves,
            max_sequences_per_bin=self.max_sequences_per_bin,
        )

    def _batch(self, group: _BinGroup) -> tuple[Any, Any, Any]:
        return (
            _tree.unflatten(self.length_struct, group.values),
            _tree.unflatten(self.length_struct, group.segment_ids),
            _tree.unflatten(self.length_struct, group.positions),
        )

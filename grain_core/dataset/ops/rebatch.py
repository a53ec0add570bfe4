"""Batching helpers for already-batched or ragged data.

``RebatchIterDataset`` re-cuts a stream of batches into batches of another size, crossing
input boundaries; ``batch_and_pad`` is a ``batch_fn`` that pads a short last batch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_core import _tree
from grain_core._checks import positive_int
from grain_core.dataset.base import DatasetIterator, IterDataset
from grain_core.dataset.element_spec import rebatch_spec
from grain_core.dataset.ops.batch import make_batch

__all__ = ["RebatchIterDataset", "batch_and_pad"]


def batch_and_pad(values: Sequence[Any], *, batch_size: int, pad_value: Any = 0) -> Any:
    """Batches ``values`` like ``make_batch`` and pads to ``batch_size`` rows.

    Use as ``ds.batch(b, batch_fn=functools.partial(batch_and_pad, batch_size=b))`` so the last
    batch keeps a static shape. Padding rows are filled with ``pad_value`` in each leaf's dtype.

    Raises:
      ValueError: no values, or more than ``batch_size`` values.
    """
    if len(values) == 0:
        raise ValueError("Cannot batch and pad 0 values: batch_and_pad needs at least one.")
    if len(values) > batch_size:
        raise ValueError(
            f"batch_and_pad got {len(values)} values, more than batch_size={batch_size}."
        )
    batch = make_batch(values)
    missing = batch_size - len(values)
    if missing == 0:
        return batch

    def pad(leaf: np.ndarray) -> np.ndarray:
        filler = np.full((missing, *leaf.shape[1:]), pad_value, dtype=leaf.dtype)
        return np.concatenate([leaf, filler])

    return _tree.map_structure(pad, batch)


class RebatchIterDataset(IterDataset[Any]):
    """Turns a stream of batches (leading dimension = rows) into batches of ``batch_size``.

    Output batches take rows across input boundaries; the last one may be short unless
    ``drop_remainder``. Output structure is the first input's. State ``{"parent": <parent
    state before the current input batch>, "batch_idx": <rows of it already used>}``.

    Raises:
      ValueError: ``batch_size <= 0``; at read time, an input batch with 0 rows or leaves
        whose leading dimensions differ.
    """

    element_spec_rule = rebatch_spec

    def __init__(
        self, parent: IterDataset[Any], batch_size: int, drop_remainder: bool = False
    ) -> None:
        super().__init__(parent)
        self._batch_size = positive_int("batch_size", batch_size)
        self._drop_remainder = drop_remainder

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def drop_remainder(self) -> bool:
        return self._drop_remainder

    def __iter__(self) -> DatasetIterator[Any]:
        return _RebatchIterator(self._parents[0].__iter__(), self._batch_size, self._drop_remainder)

    def __repr__(self) -> str:
        return (
            f"RebatchIterDataset(batch_size={self._batch_size}, "
            f"drop_remainder={self._drop_remainder})"
        )


class _RebatchIterator(DatasetIterator[Any]):
    def __init__(self, parent: DatasetIterator[Any], batch_size: int, drop_remainder: bool) -> None:
        super().__init__(parent)
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder
        self._structure: Any = None  # the first input, whose structure every output takes
        self._input_state: dict[str, Any] = {}
        self._leaves: list[np.ndarray] = []
        self._rows = 0
        self._used = 0

    def _read_input(self) -> None:
        parent = self._parents[0]
        self._input_state = parent.get_state()
        batch = next(parent)
        leaves = [np.asarray(leaf) for leaf in _tree.flatten(batch)]
        if not leaves or leaves[0].ndim == 0:
            raise ValueError(
                f"RebatchIterDataset needs batched inputs (arrays with a leading batch "
                f"dimension); got {_tree.spec_str(batch)} at parent state {self._input_state}."
            )
        rows = leaves[0].shape[0]
        if rows == 0:
            raise ValueError("Rebatching with starting batch size of 0 is not supported.")
        for leaf in leaves:
            if leaf.ndim == 0 or leaf.shape[0] != rows:
                raise ValueError(
                    f"Input batch leaves have different leading dimensions: "
                    f"{_tree.spec_str(batch)} at parent state {self._input_state}."
                )
        if self._structure is None:
            self._structure = batch
        self._leaves = leaves
        self._rows = rows
        self._used = 0

    def __next__(self) -> Any:
        if self._closed:
            self._check_open()
        need = self._batch_size
        pieces: list[list[np.ndarray]] = []
        while need:
            if self._used == self._rows:
                try:
                    self._read_input()
                except StopIteration:
                    if not pieces or self._drop_remainder:
                        raise
                    break
            take = min(need, self._rows - self._used)
            stop = self._used + take
            pieces.append([leaf[self._used : stop] for leaf in self._leaves])
            self._used = stop
            need -= take
        if len(pieces) == 1:
            leaves = pieces[0]
        else:
            leaves = [np.concatenate(parts) for parts in zip(*pieces, strict=True)]
        return _tree.unflatten(self._structure, leaves)

    def get_state(self) -> dict[str, Any]:
        if self._used < self._rows:
            return {"parent": copy.deepcopy(self._input_state), "batch_idx": self._used}
        return {"parent": self._parents[0].get_state(), "batch_idx": 0}

    def _progress_held(self) -> str | None:
        if not 0 < self._used < self._rows:
            return None
        return (
            f"RebatchIterDataset(batch_size={self._batch_size}) has handed out {self._used} of "
            f"the {self._rows} rows of an input batch"
        )

    def set_state(self, state: dict[str, Any]) -> None:
        self._parents[0].set_state(state["parent"])
        self._leaves, self._rows, self._used = [], 0, 0
        batch_idx = self._state_int(state, "batch_idx")
        if batch_idx:
            try:
                self._read_input()
            except StopIteration:
                return  # Google Grain's state at the end: no input batch is left
            if batch_idx == self._rows:
                # Google Grain's state after an input batch's last row: that batch is done.
                self._leaves, self._rows, self._used = [], 0, 0
                return
            if batch_idx > self._rows:
                raise ValueError(
                    f"Checkpoint batch_idx {batch_idx} is past the {self._rows} rows of the "
                    "restored input batch: the checkpoint belongs to a different pipeline."
                )
            self._used = batch_idx

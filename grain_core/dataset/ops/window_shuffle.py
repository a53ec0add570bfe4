"""Window shuffle: permute elements within consecutive windows.

Cheaper than a global shuffle on sequential-read sources: a window is a contiguous range, so
reads stay local, and memory is O(1) (Map) or O(window) (Iter).

Unlike Grain (see docs/compatibility.md): the last, partial window of an epoch is a
permutation of exactly the elements it holds (Grain permutes it over ``window_size`` slots and
reads into the next epoch), and both datasets take their default seed from ``.seed()``.
Full windows use Grain's permutation, so their order is Grain's.
"""

from __future__ import annotations

import copy
import itertools
import operator
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_core import random as _random
from grain_core._checks import positive_int
from grain_core.dataset.base import DatasetIterator, Indices, IterDataset, MapDataset
from grain_core.dataset.element_spec import parent_spec

__all__ = ["WindowShuffleIterDataset", "WindowShuffleMapDataset"]

_SEED_MODULUS = 2**32
# index_shuffle_array answers windows up to this size from a cached whole-window table. Reader
# threads start on a new window together; the lock makes one of them build its table while the
# others wait for the cached result, instead of all building the same table at once.
_TABLE_WINDOW_LIMIT = 2**16
_table_lock = threading.Lock()


def _window_seed(seed: int, window: int) -> int:
    return (seed + window) % _SEED_MODULUS


def _shuffle_offsets(offsets: np.ndarray, window_len: int, seed: int) -> np.ndarray:
    if window_len <= _TABLE_WINDOW_LIMIT:
        with _table_lock:
            return _random.index_shuffle_array(offsets, window_len - 1, seed)
    return _random.index_shuffle_array(offsets, window_len - 1, seed)


class WindowShuffleMapDataset(MapDataset[Any]):
    """Permutes each window ``[w*S, (w+1)*S)`` of every epoch with ``index_shuffle``.

    ``ds[e*n + w*S + j] = parent[e*n + w*S + index_shuffle(j, size_w - 1, seed + e*W + w)]``
    where ``n = len(parent)``, ``W = ceil(n / S)`` windows per epoch and ``size_w`` is ``S``
    except for the last window of an epoch, which holds ``n - w*S`` elements.

    Args:
      parent: dataset to shuffle.
      window_size: ``S``, elements per window.
      seed: permutation seed; defaults to the one derived from ``.seed()`` upstream.

    Raises:
      ValueError: ``window_size <= 0``, or no seed given and none set upstream.
    """

    element_spec_rule = parent_spec

    passes_values = True

    def __init__(
        self, parent: MapDataset[Any], *, window_size: int, seed: int | None = None
    ) -> None:
        super().__init__(parent)
        self._parent = parent
        self._window_size = positive_int("window_size", window_size)
        self._seed = self._resolve_seed(seed, "WindowShuffleMapDataset")
        self._len = len(parent)
        self._windows_per_epoch = -(-self._len // self._window_size)

    def __len__(self) -> int:
        return self._len

    def _source_indices(self, indices: np.ndarray) -> np.ndarray:
        """Maps output indices to parent indices, one vectorised permutation per window."""
        n = self._len
        if n == 0:
            raise IndexError("Cannot read from an empty dataset.")
        size = self._window_size
        epochs, pos = np.divmod(indices, n)
        windows, offsets = np.divmod(pos, size)
        window_starts = epochs * n + windows * size
        window_ids = epochs * self._windows_per_epoch + windows
        out = np.empty_like(indices)
        # Blocks come in index order, so equal window ids are adjacent: split at the changes.
        cuts = (np.flatnonzero(window_ids[1:] != window_ids[:-1]) + 1).tolist()
        bounds = [0, *cuts, len(indices)]
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            in_window = min(size, n - int(windows[lo]) * size)
            seed = _window_seed(self._seed, int(window_ids[lo]))
            out[lo:hi] = window_starts[lo] + _shuffle_offsets(offsets[lo:hi], in_window, seed)
        return out

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        source = self._source_indices(np.array([operator.index(index)], dtype=np.int64))
        return self._parent[int(source[0])]

    def _getitems(self, indices: Indices) -> Sequence[Any]:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return []
        return self._parent._getitems(self._source_indices(idx))

    def __repr__(self) -> str:
        return f"WindowShuffleMapDataset(window_size={self._window_size}, seed={self._seed})"


class WindowShuffleIterDataset(IterDataset[Any]):
    """Buffers ``window_size`` consecutive elements, permutes them, hands them out.

    Window ``w`` (possibly shorter at the end) is permuted with
    ``index_shuffle(pos, len - 1, seed + w)`` and emitted from the back of the permuted list.
    State ``{"parent_window_start_state", "window_index", "pos_in_window"}``; restoring
    re-reads at most one window from the parent.

    Args:
      parent: dataset to shuffle.
      window_size: elements per window.
      seed: permutation seed; defaults to the one derived from ``.seed()`` upstream.

    Raises:
      ValueError: ``window_size <= 0``, or no seed given and none set upstream.
    """

    element_spec_rule = parent_spec

    def __init__(
        self, parent: IterDataset[Any], *, window_size: int, seed: int | None = None
    ) -> None:
        super().__init__(parent)
        self._window_size = positive_int("window_size", window_size)
        self._seed = self._resolve_seed(seed, "WindowShuffleIterDataset")

    def __iter__(self) -> DatasetIterator[Any]:
        return _WindowShuffleIterator(self._parents[0].__iter__(), self._window_size, self._seed)

    def __repr__(self) -> str:
        return f"WindowShuffleIterDataset(window_size={self._window_size}, seed={self._seed})"


class _WindowShuffleIterator(DatasetIterator[Any]):
    def __init__(self, parent: DatasetIterator[Any], window_size: int, seed: int) -> None:
        super().__init__(parent)
        self._window_size = window_size
        self._seed = seed
        self._window_index = 0  # the window being emitted, or the next one to read
        self._window_start_state: dict[str, Any] = {}
        self._remaining: list[Any] = []  # rest of the current window, emitted by pop()
        self._pos_in_window = 0

    def _load_window(self) -> None:
        parent = self._parents[0]
        self._window_start_state = parent.get_state()
        window = list(itertools.islice(parent, self._window_size))
        if window:
            order = _random.index_shuffle_array(
                np.arange(len(window)),
                len(window) - 1,
                _window_seed(self._seed, self._window_index),
            )
            window = [window[i] for i in order.tolist()]
        self._remaining = window
        self._pos_in_window = 0

    def __next__(self) -> Any:
        if self._closed:
            self._check_open()
        if not self._remaining:
            self._load_window()
            if not self._remaining:
                raise StopIteration
        element = self._remaining.pop()
        if self._remaining:
            self._pos_in_window += 1
        else:
            self._window_index += 1
            self._pos_in_window = 0
        return element

    def get_state(self) -> dict[str, Any]:
        if self._remaining:
            start = copy.deepcopy(self._window_start_state)
        else:
            start = self._parents[0].get_state()
        return {
            "parent_window_start_state": start,
            "window_index": self._window_index,
            "pos_in_window": self._pos_in_window,
        }

    def _progress_held(self) -> str | None:
        if not self._remaining:
            return None
        return (
            f"WindowShuffleIterDataset(window_size={self._window_size}) has handed out "
            f"{self._pos_in_window} of the {self._pos_in_window + len(self._remaining)} elements "
            "of its current window"
        )

    def set_state(self, state: dict[str, Any]) -> None:
        self._parents[0].set_state(state["parent_window_start_state"])
        self._window_index = self._state_int(state, "window_index")
        pos = self._state_int(state, "pos_in_window")
        self._remaining = []
        self._pos_in_window = 0
        if pos:
            self._load_window()
            if pos == len(self._remaining):
                # Google Grain's state after a window's last element: the window is done, and
                # window_index already names the next one.
                self._remaining = []
                self._pos_in_window = 0
                return
            if pos > len(self._remaining):
                raise ValueError(
                    f"Checkpoint position {pos} in window {self._window_index} is past the "
                    f"{len(self._remaining)} elements the parent now yields there: the "
                    "checkpoint belongs to a different pipeline."
                )
            del self._remaining[len(self._remaining) - pos :]
            self._pos_in_window = pos

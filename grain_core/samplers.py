"""Samplers decide which record each global step of a ``DataLoader`` reads (``grain.samplers``).

A sampler maps a **global** index (across all shards and epochs) to a :class:`RecordMetadata`
``(index, record_key, rng)``. Process ``s`` of ``S`` reads global indices ``s, s + S, ...``.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from grain_core._checks import positive_int
from grain_core.record import RecordMetadata
from grain_core.sharding import NoSharding, ShardOptions, even_split

__all__ = ["IndexSampler", "Sampler", "SequentialSampler"]


@runtime_checkable
class Sampler(Protocol):
    """``sampler[i]`` is the metadata of global index ``i``; ``IndexError`` past the end.

    ``__len__`` is optional (the DataLoader searches for the end otherwise). ``repr`` identifies
    the sampler in DataLoader checkpoints, so it must be stable and must not embed data.
    """

    def __getitem__(self, index: int) -> RecordMetadata: ...


def _check_num_records(num_records: Any) -> int:
    try:
        n = operator.index(num_records)
    except TypeError:
        raise TypeError(
            f"num_records must be an integer, got {type(num_records).__name__}."
        ) from None
    if n <= 0:
        raise ValueError(f"Invalid number of records in Sampler: {n}. It must be positive.")
    return n


def _check_seed(seed: Any) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"Seed must be an integer, got {type(seed).__name__} ({seed!r}).")
    seed = int(seed)
    if not 0 <= seed < 2**32:
        raise ValueError(f"Seed should be positive 32-bit integer, got {seed}.")
    return seed


def _check_indices(indices: Sequence[int], length: int, sampler: object) -> np.ndarray:
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= length):
        bad = int(idx[(idx < 0) | (idx >= length)][0])
        raise IndexError(f"Index {bad} out of range [0, {length}) of {sampler!r}.")
    return idx


def _rng(seed: int | None, index: int) -> np.random.Generator | None:
    if seed is None:
        return None
    return np.random.Generator(np.random.Philox(key=seed + index))


class SequentialSampler:
    """Reads records ``0, 1, ..., num_records - 1`` once.

    Args:
      num_records: Number of records in the source.
      shard_options: Sharding; with ``drop_remainder`` the length is rounded down to a multiple
        of the shard count so every shard reads as many records.
      seed: If given, each record gets ``Generator(Philox(key=seed + index))``.

    Raises:
      ValueError: If ``num_records <= 0`` or the seed is out of range.
      TypeError: If the seed is not an integer.
    """

    def __init__(
        self,
        num_records: int,
        shard_options: ShardOptions | None = None,
        seed: int | None = None,
    ) -> None:
        self._num_records = _check_num_records(num_records)
        self._shard_options = shard_options if shard_options is not None else NoSharding()
        self._seed = _check_seed(seed)
        count = self._shard_options.shard_count
        if self._shard_options.drop_remainder:
            self._len = (self._num_records // count) * count
        else:
            self._len = self._num_records

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> RecordMetadata:
        return self._metadata(index, self._seed)

    def _metadata(self, index: int, seed: int | None) -> RecordMetadata:
        if not 0 <= index < self._len:
            raise IndexError(f"Index {index} out of range [0, {self._len}) of {self!r}.")
        return RecordMetadata(index=index, record_key=index, rng=_rng(seed, index))

    def metadata_block(
        self, indices: Sequence[int], *, with_rng: bool = True
    ) -> list[RecordMetadata]:
        """``[self[i] for i in indices]`` (batched form used by the DataLoader).

        ``with_rng=False`` leaves ``rng`` as None, for pipelines without random operations.
        """
        seed = self._seed if with_rng else None
        return [self._metadata(int(i), seed) for i in indices]

    def record_keys(self, indices: Sequence[int]) -> np.ndarray:
        """``[self[i].record_key for i in indices]`` as an int64 array, without metadata.

        Raises:
          IndexError: For an index out of range.
        """
        return _check_indices(indices, self._len, self)

    def __repr__(self) -> str:
        return (
            f"SequentialSampler(num_records={self._num_records}, "
            f"shard_options={self._shard_options!r})"
        )


class IndexSampler:
    """Epochs of (optionally shuffled) record keys; every shard runs the same number of epochs.

    Keys are ``range(num_records)`` restricted to this shard's contiguous block
    (``even_split``), shuffled per epoch with seed ``seed + epoch`` if ``shuffle``. Global index
    ``i`` reads ``keys[i // shard_count]``. Unlike Grain (one global index budget, so shards run
    unequal numbers of epochs), the index budget is per shard: ``shard_count * num_epochs *
    shard_length``, so a shard with a smaller block still runs ``num_epochs`` whole epochs.

    Args:
      num_records: Number of records in the source.
      shard_options: This process's shard.
      shuffle: Shuffle each epoch (needs ``seed``).
      num_epochs: Number of epochs; None repeats forever.
      seed: Seed of the shuffle and of each record's ``Philox(key=seed + index)`` generator.

    Raises:
      ValueError: For ``num_records <= 0``, ``num_epochs <= 0``, shuffling without a seed or a
        seed outside ``[0, 2**32)``.
      TypeError: For a non-integer seed.
    """

    def __init__(
        self,
        num_records: int,
        shard_options: ShardOptions | None = None,
        shuffle: bool = False,
        num_epochs: int | None = None,
        seed: int | None = None,
    ) -> None:
        from grain_core.dataset.base import MapDataset  # import cost

        self._num_records = _check_num_records(num_records)
        self._shard_options = shard_options if shard_options is not None else NoSharding()
        if num_epochs is not None:
            num_epochs = positive_int("num_epochs", num_epochs)
        if shuffle and seed is None:
            raise ValueError("Shuffling requires specifying a seed.")
        self._seed = _check_seed(seed)
        self._shuffle = bool(shuffle)
        self._num_epochs = num_epochs
        start, end = even_split(self._num_records, self._shard_options)
        keys = MapDataset.range(start, end)
        if self._shuffle:
            keys = keys.shuffle(seed=self._seed)
        self._keys = keys
        count = self._shard_options.shard_count
        if num_epochs is None:
            self._max_index = sys.maxsize
        else:
            self._max_index = count * num_epochs * (end - start)

    def __len__(self) -> int:
        return self._max_index

    def __getitem__(self, index: int) -> RecordMetadata:
        if not 0 <= index < self._max_index:
            raise IndexError(f"Index {index} out of range [0, {self._max_index}) of {self!r}.")
        key = self._keys[index // self._shard_options.shard_count]
        assert key is not None
        return RecordMetadata(index=index, record_key=key, rng=_rng(self._seed, index))

    def metadata_block(
        self, indices: Sequence[int], *, with_rng: bool = True
    ) -> list[RecordMetadata]:
        """``[self[i] for i in indices]`` with one vectorised key lookup.

        ``with_rng=False`` leaves ``rng`` as None, for pipelines without random operations.
        """
        keys = self.record_keys(indices)
        seed = self._seed if with_rng else None
        return [
            RecordMetadata(index=i, record_key=k, rng=_rng(seed, i))
            for i, k in zip(np.asarray(indices).tolist(), keys.tolist(), strict=True)
        ]

    def record_keys(self, indices: Sequence[int]) -> np.ndarray:
        """``[self[i].record_key for i in indices]`` as an int64 array, without metadata.

        Raises:
          IndexError: For an index out of range.
        """
        idx = _check_indices(indices, self._max_index, self)
        if idx.size == 0:  # e.g. a shard with no records: nothing to look up
            return idx
        keys = self._keys._getitems(idx // self._shard_options.shard_count)  # type: ignore[arg-type]
        return np.asarray(keys, dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"IndexSampler(num_records={self._num_records}, "
            f"shard_options={self._shard_options!r}, shuffle={self._shuffle}, "
            f"num_epochs={self._num_epochs}, seed={self._seed})"
        )

"""Deterministic randomness: Grain's ``index_shuffle``, seed derivation, per-index Philox.

Everything here is bit-exact with Grain (default seeds, index_shuffle, random_map's Philox
streams, RngPool) except where Grain is defective, which is called out at the place we differ
and listed in docs/compatibility.md.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import operator
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "RngPool",
    "derive_seed",
    "index_shuffle",
    "index_shuffle_array",
    "index_shuffle_range",
    "reset_philox",
    "validate_seed",
]

_UINT32_MASK = 0xFFFFFFFF
_SEED_LIMIT = 2**32
_INDEX_LIMIT = 2**64
# Domains whose Grain block is the 16-bit floor pay ~2**16 / (max_index + 1) encryptions
# per lookup; for them the whole permutation is computed once and looked up instead.
_TABLE_LIMIT = 2**16
_TABLE_CACHE_SIZE = 32
# Larger domains get a table too, in index_shuffle_array, once the indices asked of one
# permutation would have cost about as much as building it: walking costs ~2 us an index
# (NumPy calls on small arrays), a table ~15 ns an entry of its block. A pass over the data
# then gathers from the table; a few lookups never build one. Tables of the last two
# permutations are kept (an epoch and the next, 4 MiB each at most).
_LARGE_TABLE_LIMIT = 2**20
_LARGE_TABLE_BREAK_EVEN = 128
_LARGE_TABLES_KEPT = 2
_KEY_CACHE_SIZE = 4096
_INTEGER_TYPES = (int, np.integer)


def validate_seed(seed: Any, what: str, *, below_2_32: bool = True) -> int:
    """Checks that ``seed`` is a non-negative integer, below ``2**32`` where its user needs
    32 bits, and returns it as ``int``.

    Args:
      seed: Python or NumPy integer.
      what: name of the seed's owner, used in error messages (e.g. "`shuffle`").
      below_2_32: The seed keys a 32-bit permutation (shuffle); seeds that go through NumPy's
        ``SeedSequence`` (``.seed()``, ``random_map``) take any size.

    Raises:
      TypeError: ``seed`` is not an integer (bools are rejected too).
      ValueError: ``seed`` is negative, or not below ``2**32`` with ``below_2_32``.
    """
    if isinstance(seed, bool) or not isinstance(seed, _INTEGER_TYPES):
        raise TypeError(f"{what} seed must be an integer, got {seed!r} ({type(seed).__name__}).")
    value = int(seed)
    if below_2_32 and not 0 <= value < _SEED_LIMIT:
        raise ValueError(f"{what} seed must be in [0, 2**32), got {value}.")
    if value < 0:
        raise ValueError(f"{what} seed must be non-negative, got {value}.")
    return value


def derive_seed(seeds_with_depths: Sequence[tuple[int, int]]) -> int | None:
    """Combines ``(seed, depth)`` pairs found above a node into its default seed (as Grain).

    Args:
      seeds_with_depths: pairs in breadth-first discovery order.

    Returns:
      ``SeedSequence([s0, d0, s1, d1, ...]).generate_state(1, uint32)[0]``, or ``None`` when
      no seed was found.
    """
    if not seeds_with_depths:
        return None
    flat = [int(value) for pair in seeds_with_depths for value in pair]
    return int(np.random.SeedSequence(flat).generate_state(1, dtype=np.uint32)[0])


# --------------------------------------------------------------------------------------
# index_shuffle: keyed Feistel permutation with cycle walking, bit-exact with Grain.
# --------------------------------------------------------------------------------------


def _seed_seq_generate(seed: int, count: int) -> list[int]:
    """C++ ``std::seed_seq{seed}.generate()`` of ``count`` 32-bit words ([rand.util.seedseq])."""
    entropy = [seed & _UINT32_MASK]
    size = len(entropy)
    out = [0x8B8B8B8B] * count
    if count >= 623:
        spread = 11
    elif count >= 68:
        spread = 7
    elif count >= 39:
        spread = 5
    elif count >= 7:
        spread = 3
    else:
        spread = (count - 1) // 2
    p = (count - spread) // 2
    q = p + spread
    steps = max(size + 1, count)

    def tangle(x: int) -> int:
        return x ^ (x >> 27)

    for k in range(steps):
        here, ahead, behind = k % count, (k + p) % count, (k - 1) % count
        r1 = (1664525 * tangle(out[here] ^ out[ahead] ^ out[behind])) & _UINT32_MASK
        if k == 0:
            r2 = r1 + size
        elif k <= size:
            r2 = r1 + here + entropy[k - 1]
        else:
            r2 = r1 + here
        r2 &= _UINT32_MASK
        out[ahead] = (out[ahead] + r1) & _UINT32_MASK
        out[(k + q) % count] = (out[(k + q) % count] + r2) & _UINT32_MASK
        out[here] = r2
    for k in range(steps, steps + count):
        here, ahead, behind = k % count, (k + p) % count, (k - 1) % count
        r3 = (
            1566083941 * tangle((out[here] + out[ahead] + out[behind]) & _UINT32_MASK)
        ) & _UINT32_MASK
        r4 = (r3 - here) & _UINT32_MASK
        out[ahead] ^= r3
        out[(k + q) % count] ^= r4
        out[here] = r4
    return out


def _block_bits(max_index: int) -> int:
    """Feistel block size in bits for the domain ``[0, max_index]`` (``max_index >= 1``).

    Grain uses ``ceil(log2(max_index))`` rounded up to even, at least 16. That cannot
    represent ``max_index`` itself when ``max_index == 2**k`` with even ``k >= 16``: Grain
    then drops the input's top bit and its map is not a bijection (one element twice, one lost).
    Only in exactly those cases we take the next even size, ``k + 2``; every other domain
    keeps Grain's block size, so its orders are identical to Grain's.
    """
    bits = (max_index - 1).bit_length()  # == ceil(log2(max_index))
    bits = max(bits + (bits & 1), 16)
    if max_index >> bits:  # Grain's defect: max_index == 2**bits is not representable.
        bits += 2
    return bits


@functools.lru_cache(maxsize=_KEY_CACHE_SIZE)
def _round_keys(seed: int, rounds: int, half_bits: int) -> tuple[tuple[int, int], ...]:
    """Round keys as ``(k1, k2)`` pairs, truncated to the half-word (cached per seed)."""
    mask = (1 << half_bits) - 1
    words = [word & mask for word in _seed_seq_generate(seed, rounds)]
    return tuple(zip(words[0::2], words[1::2], strict=True))


def _encrypt(x: int, half_bits: int, keys: tuple[tuple[int, int], ...]) -> int:
    """One Feistel encryption of ``x`` on ``2 * half_bits`` bits (SIMON-style round function)."""
    w = half_bits
    mask = (1 << w) - 1
    left = x >> w
    right = x & mask
    for k1, k2 in keys:
        r = right
        left ^= (
            (((r << 1) | (r >> (w - 1))) & ((r << 8) | (r >> (w - 8))))
            ^ ((r << 2) | (r >> (w - 2)))
        ) & mask ^ k1
        v = left
        right ^= (
            (((v << 1) | (v >> (w - 1))) & ((v << 8) | (v >> (w - 8))))
            ^ ((v << 2) | (v >> (w - 2)))
        ) & mask ^ k2
    return (left << w) | right


def _encrypt_array(x: np.ndarray, half_bits: int, keys: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Vectorised :func:`_encrypt` of a uint64 array.

    Halves are held in the narrowest unsigned type that fits ``W`` (less memory traffic).
    Left shifts past that type's width drop bits, which is harmless: every round-function
    result is masked to ``W`` bits.
    """
    half = np.uint8 if half_bits <= 8 else np.uint16 if half_bits <= 16 else np.uint32
    mask = half((1 << half_bits) - 1)
    left = (x >> np.uint64(half_bits)).astype(half)
    right = (x & np.uint64(mask)).astype(half)
    mixed = np.empty_like(right)
    scratch = np.empty_like(right)
    spare = np.empty_like(right)
    shifts = [(half(r), half(half_bits - r)) for r in (1, 8, 2)]

    def round_function(v: np.ndarray) -> np.ndarray:
        (l1, r1), (l8, r8), (l2, r2) = shifts
        np.left_shift(v, l1, out=mixed)
        np.right_shift(v, r1, out=scratch)
        np.bitwise_or(mixed, scratch, out=mixed)
        np.left_shift(v, l8, out=scratch)
        np.right_shift(v, r8, out=spare)
        np.bitwise_or(scratch, spare, out=scratch)
        np.bitwise_and(mixed, scratch, out=mixed)
        np.left_shift(v, l2, out=scratch)
        np.right_shift(v, r2, out=spare)
        np.bitwise_or(scratch, spare, out=scratch)
        np.bitwise_xor(mixed, scratch, out=mixed)
        np.bitwise_and(mixed, mask, out=mixed)
        return mixed

    for k1, k2 in keys:
        np.bitwise_xor(left, round_function(right), out=left)
        np.bitwise_xor(left, half(k1), out=left)
        np.bitwise_xor(right, round_function(left), out=right)
        np.bitwise_xor(right, half(k2), out=right)
    out = left.astype(np.uint64)
    np.left_shift(out, np.uint64(half_bits), out=out)
    np.bitwise_or(out, right, out=out)
    return out


def _walk_array(
    x: np.ndarray, max_index: int, half_bits: int, keys: tuple[tuple[int, int], ...]
) -> np.ndarray:
    """Cycle walking: encrypts ``x`` and re-encrypts only the lanes still above ``max_index``."""
    out = _encrypt_array(x, half_bits, keys)
    limit = np.uint64(max_index)
    lanes = np.flatnonzero(out > limit)
    while lanes.size:
        walked = _encrypt_array(out[lanes], half_bits, keys)
        out[lanes] = walked
        lanes = lanes[walked > limit]
    return out


def _build_permutation(max_index: int, seed: int, rounds: int) -> np.ndarray:
    """Whole permutation of ``[0, max_index]`` (read-only int64 array).

    Encrypts the full block once, then resolves every cycle walk by pointer jumping:
    ``jump[x]`` is the first in-range value among the next ``2**i`` encryptions of ``x``
    (or the ``2**i``-th one), so each pass doubles the reach instead of stepping once.
    """
    bits = _block_bits(max_index)
    half_bits = bits // 2
    jump = _encrypt_array(
        np.arange(1 << bits, dtype=np.uint64), half_bits, _round_keys(seed, rounds, half_bits)
    )
    jump = jump.astype(np.int64)
    while True:
        pending = jump > max_index
        if not pending[: max_index + 1].any():
            break
        jump = np.where(pending, jump[jump], jump)
    table = jump[: max_index + 1].copy()
    table.flags.writeable = False
    return table


_permutation_table = functools.lru_cache(maxsize=_TABLE_CACHE_SIZE)(_build_permutation)


class _LargeTables:
    """Tables of domains below ``_LARGE_TABLE_LIMIT``, built once the indices asked of a
    permutation reach ``1 / _LARGE_TABLE_BREAK_EVEN`` of its block (int32: half the memory)."""

    def __init__(self) -> None:
        self._tables: collections.OrderedDict[tuple[int, int, int], np.ndarray] = (
            collections.OrderedDict()
        )
        self._asked: dict[tuple[int, int, int], int] = {}
        # Reader threads ask together: one builds the table while the others wait for it.
        self._lock = threading.Lock()

    def get(self, max_index: int, seed: int, rounds: int, count: int) -> np.ndarray | None:
        """The table of this permutation, or None while walking is still cheaper."""
        key = (max_index, seed, rounds)
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
                return table
            asked = self._asked.get(key, 0) + count
            if asked * _LARGE_TABLE_BREAK_EVEN < 1 << _block_bits(max_index):
                if key not in self._asked and len(self._asked) >= 64:
                    self._asked.clear()  # bounded: permutations asked a few times each
                self._asked[key] = asked
                return None
            self._asked.pop(key, None)
            table = _build_permutation(max_index, seed, rounds).astype(np.int32)
            table.flags.writeable = False
            self._tables[key] = table
            while len(self._tables) > _LARGE_TABLES_KEPT:
                self._tables.popitem(last=False)
            return table


_large_tables = _LargeTables()


def _check_rounds(rounds: int) -> None:
    if rounds % 2 or not 4 <= rounds <= 1024:
        raise ValueError(f"rounds must be an even integer between 4 and 1024, got {rounds}.")


def _check_max_index(max_index: int, limit: int) -> None:
    if not 0 <= max_index < limit:
        raise ValueError(f"max_index must be in [0, {limit - 1}], got {max_index}.")


def index_shuffle(index: int, max_index: int, seed: int, rounds: int = 4) -> int:
    """Image of ``index`` under the ``seed``-keyed permutation of ``[0, max_index]``.

    Bit-exact with Grain's ``index_shuffle`` wherever Grain's map is a bijection (see
    ``_block_bits`` for the one family of domains where we differ). Small domains
    (``max_index < 2**16``) are answered from a cached permutation table, domains below
    ``2**20`` once enough of them was asked (as in :func:`index_shuffle_array`).

    Args:
      index: value to permute, in ``[0, max_index]``.
      max_index: largest value of the domain, in ``[0, 2**64)``.
      seed: key, in ``[0, 2**32)``.
      rounds: Feistel rounds, even, in ``[4, 1024]``.

    Raises:
      TypeError: an argument is not an integer.
      ValueError: ``rounds``, ``index``, ``max_index`` or ``seed`` out of range.
    """
    index = operator.index(index)
    max_index = operator.index(max_index)
    rounds = operator.index(rounds)
    seed = validate_seed(seed, "index_shuffle")
    _check_rounds(rounds)
    if not 0 <= index <= max_index:
        raise ValueError(f"index must be in [0, max_index] = [0, {max_index}], got {index}.")
    if max_index < _TABLE_LIMIT:
        return _permutation_table(max_index, seed, rounds).item(index) if max_index else 0
    if max_index < _LARGE_TABLE_LIMIT:
        table = _large_tables.get(max_index, seed, rounds, 1)
        if table is not None:
            return table.item(index)  # type: ignore[no-any-return]
    _check_max_index(max_index, _INDEX_LIMIT)
    half_bits = _block_bits(max_index) // 2
    keys = _round_keys(seed, rounds, half_bits)
    index = _encrypt(index, half_bits, keys)
    while index > max_index:
        index = _encrypt(index, half_bits, keys)
    return index


def index_shuffle_array(
    indices: np.ndarray, max_index: int, seed: int, rounds: int = 4
) -> np.ndarray:
    """Vectorised :func:`index_shuffle`: same results, element by element.

    Domains below ``2**20`` are answered from a table of the whole permutation once the
    indices asked of it add up to 1/128 of its block (a pass over the data); before, and for
    larger domains, each index is encrypted.

    Args:
      indices: integer array (any shape) of values in ``[0, max_index]``.
      max_index: largest value of the domain, in ``[0, 2**63)``.
      seed: key, in ``[0, 2**32)``.
      rounds: Feistel rounds, even, in ``[4, 1024]``.

    Returns:
      int64 array with the shape of ``indices``.

    Raises:
      TypeError: ``indices`` is not an integer array, or a scalar argument is not an integer.
      ValueError: an argument is out of range (the first offending index is named).
    """
    values = np.asarray(indices)
    max_index, seed, rounds = _checked_domain(max_index, seed, rounds, "index_shuffle_array")
    if values.dtype.kind not in "iu":
        raise TypeError(f"indices must be an integer array, got dtype {values.dtype}.")
    if values.size:
        outside = (values < 0) | (values > max_index)
        if outside.any():
            position = int(np.flatnonzero(outside.ravel())[0])
            raise ValueError(
                f"index must be in [0, max_index] = [0, {max_index}], got {values.ravel()[position]} "
                f"at position {position}."
            )
    return _shuffle_array(values, max_index, seed, rounds)


def index_shuffle_range(
    start: int, stop: int, max_index: int, seed: int, rounds: int = 4
) -> np.ndarray:
    """``index_shuffle_array(np.arange(start, stop), ...)``, checked in constant time and, where
    the permutation's table is built, a copy of a slice of it instead of a gather.

    Args:
      start: first value to permute, in ``[0, max_index]``.
      stop: one past the last, in ``[start, max_index + 1]``.
      max_index: largest value of the domain, in ``[0, 2**63)``.
      seed: key, in ``[0, 2**32)``.
      rounds: Feistel rounds, even, in ``[4, 1024]``.

    Returns:
      1-D int64 array of ``stop - start`` values.

    Raises:
      TypeError: a scalar argument is not an integer.
      ValueError: an argument is out of range.
    """
    start, stop = operator.index(start), operator.index(stop)
    max_index, seed, rounds = _checked_domain(max_index, seed, rounds, "index_shuffle_range")
    if not 0 <= start <= stop <= max_index + 1:
        raise ValueError(
            f"start and stop must satisfy 0 <= start <= stop <= max_index + 1 = {max_index + 1}, "
            f"got start={start}, stop={stop}."
        )
    if 0 < max_index < _TABLE_LIMIT:
        return _permutation_table(max_index, seed, rounds)[start:stop].astype(np.int64)
    if _TABLE_LIMIT <= max_index < _LARGE_TABLE_LIMIT:
        table = _large_tables.get(max_index, seed, rounds, stop - start)
        if table is not None:
            return table[start:stop].astype(np.int64)
    return _shuffle_array(np.arange(start, stop, dtype=np.int64), max_index, seed, rounds)


def _checked_domain(max_index: int, seed: int, rounds: int, what: str) -> tuple[int, int, int]:
    max_index = operator.index(max_index)
    rounds = operator.index(rounds)
    seed = validate_seed(seed, what)
    _check_rounds(rounds)
    _check_max_index(max_index, 2**63)
    return max_index, seed, rounds


def _shuffle_array(values: np.ndarray, max_index: int, seed: int, rounds: int) -> np.ndarray:
    """``index_shuffle_array`` of checked arguments."""
    if max_index < _TABLE_LIMIT:
        if not max_index:
            return np.zeros(values.shape, dtype=np.int64)
        return _permutation_table(max_index, seed, rounds)[values]
    if max_index < _LARGE_TABLE_LIMIT:
        table = _large_tables.get(max_index, seed, rounds, values.size)
        if table is not None:
            return table[values].astype(np.int64)
    half_bits = _block_bits(max_index) // 2
    keys = _round_keys(seed, rounds, half_bits)
    flat = values.astype(np.uint64).ravel()
    return _walk_array(flat, max_index, half_bits, keys).astype(np.int64).reshape(values.shape)


# --------------------------------------------------------------------------------------
# Per-index Philox generators, bit-exact with Grain's random_map streams.
# --------------------------------------------------------------------------------------

# NumPy's C ``philox_state`` on 64-bit little-endian platforms, as eight uint64 words:
# ``ctr`` pointer, ``key`` pointer, ``buffer_pos`` (int, padded), ``buffer[4]``,
# ``has_uint32 | uinteger << 32``. Writing it directly costs ~1 us instead of ~7 us for the
# ``bit_generator.state`` setter (which also needs the key read back first), and the reset
# runs once per element. The layout is private to NumPy, so it is probed once against the
# public setter; if it ever differs we use the setter.
_PhiloxWords = ctypes.c_uint64 * 8
_CounterWords = ctypes.c_uint64 * 4


def _raw_reset(bit_generator: Any, index: int, op_seed: int) -> None:
    words = _PhiloxWords.from_address(bit_generator.ctypes.state_address)
    counter = _CounterWords.from_address(words[0])
    counter[0] = 0
    counter[1] = 0
    counter[2] = op_seed
    counter[3] = index
    words[2] = 4  # buffer_pos: buffer exhausted, next draw runs Philox on the counter.
    words[3] = 0
    words[4] = 0
    words[5] = 0
    words[6] = 0
    words[7] = 0  # has_uint32 = 0, uinteger = 0


def _philox_state(
    key: np.ndarray,
    counter: list[int],
    buffer: list[int],
    buffer_pos: int,
    has_uint32: int,
    uinteger: int,
) -> dict[str, Any]:
    """A ``Philox.state`` dict for the public setter."""
    return {
        "bit_generator": "Philox",
        "state": {"counter": np.array(counter, dtype=np.uint64), "key": key},
        "buffer": np.array(buffer, dtype=np.uint64),
        "buffer_pos": buffer_pos,
        "has_uint32": has_uint32,
        "uinteger": uinteger,
    }


def _setter_reset(bit_generator: Any, index: int, op_seed: int) -> None:
    key = bit_generator.state["state"]["key"]
    bit_generator.state = _philox_state(key, [0, 0, op_seed, index], [0, 0, 0, 0], 4, 0, 0)


def _philox_layout_matches() -> bool:
    """Whether NumPy's Philox state struct has the layout ``_raw_reset`` writes."""
    if ctypes.sizeof(ctypes.c_void_p) != 8 or sys.byteorder != "little":
        return False
    probe: Any = np.random.Philox(0)
    key = probe.state["state"]["key"]
    probe.state = _philox_state(key, [11, 12, 13, 14], [21, 22, 23, 24], 3, 1, 31)
    words = _PhiloxWords.from_address(probe.ctypes.state_address)
    if list(words[2:8]) != [3, 21, 22, 23, 24, 1 | 31 << 32]:
        return False
    if list(_CounterWords.from_address(words[0])) != [11, 12, 13, 14]:
        return False
    _raw_reset(probe, 7, 5)
    after = probe.state
    return (
        after["state"]["counter"].tolist() == [0, 0, 5, 7]
        and after["buffer"].tolist() == [0, 0, 0, 0]
        and (after["buffer_pos"], after["has_uint32"], after["uinteger"]) == (4, 0, 0)
    )


_reset_bit_generator = _raw_reset if _philox_layout_matches() else _setter_reset


def reset_philox(rng: np.random.Generator, index: int, op_seed: int = 0) -> None:
    """Resets a Philox-backed generator to counter ``[0, 0, op_seed, index]``, as Grain does.

    The output buffer is zeroed, ``buffer_pos=4``, ``has_uint32=0``, ``uinteger=0``; the key
    is kept. The next draw is then a pure function of (key, op_seed, index).

    Args:
      rng: generator whose bit generator is ``np.random.Philox``.
      index: element index, in ``[0, 2**64)``.
      op_seed: per-operation stream selector, in ``[0, 2**64)``.

    Raises:
      TypeError: ``rng`` is not Philox-backed.
      ValueError: ``index`` or ``op_seed`` out of range.
    """
    bit_generator = rng.bit_generator
    if type(bit_generator) is not np.random.Philox:
        raise TypeError(
            f"reset_philox needs a Philox generator, got {type(bit_generator).__name__}."
        )
    if not (0 <= index < _INDEX_LIMIT and 0 <= op_seed < _INDEX_LIMIT):
        raise ValueError(
            f"index and op_seed must be in [0, 2**64), got index={index}, op_seed={op_seed}."
        )
    _reset_bit_generator(bit_generator, index, op_seed)


class RngPool:
    """Thread-safe free list of ``Generator(Philox(seed))`` objects.

    Pickles as just the seed: unpickling yields a fresh, empty pool.
    """

    def __init__(self, seed: int) -> None:
        """Args:
          seed: non-negative integer Philox seed.

        Raises:
          TypeError: ``seed`` is not an integer.
          ValueError: ``seed`` is negative.
        """
        if isinstance(seed, bool) or not isinstance(seed, _INTEGER_TYPES):
            raise TypeError(f"RngPool seed must be an integer, got {seed!r}.")
        if seed < 0:
            raise ValueError(f"RngPool seed must be non-negative, got {seed}.")
        self._seed = int(seed)
        self._free: list[np.random.Generator] = []
        self._lock = threading.Lock()

    @property
    def seed(self) -> int:
        return self._seed

    def acquire_rng(self, index: int, *, op_seed: int = 0) -> np.random.Generator:
        """Returns a generator reset to counter ``[0, 0, op_seed, index]``.

        Raises:
          ValueError: ``index`` or ``op_seed`` outside ``[0, 2**64)``.
        """
        with self._lock:
            rng = self._free.pop() if self._free else None
        if rng is None:
            rng = np.random.Generator(np.random.Philox(self._seed))
        try:
            reset_philox(rng, index, op_seed)
        except BaseException:
            self.release_rng(rng)
            raise
        return rng

    def release_rng(self, rng: np.random.Generator) -> None:
        """Returns a generator obtained from :meth:`acquire_rng` to the pool."""
        with self._lock:
            self._free.append(rng)

    def __reduce__(self) -> tuple[type[RngPool], tuple[int]]:
        return (RngPool, (self._seed,))

    def __repr__(self) -> str:
        return f"RngPool(seed={self._seed})"

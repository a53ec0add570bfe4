"""Shared checks of block reading (``next_block``) for the operators that read their inputs
in blocks (interleave, mix): the elements, errors and states must be those of ``next``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from grain_core.dataset.base import IterDataset, MapDataset

__all__ = ["assert_blocks_read_as_elements", "block_inputs", "element_by_element"]


def _fails_at(bad: int) -> Callable[[int], int]:
    def read(x: int) -> int:
        if x == bad:
            raise KeyError(f"element {x}")
        return x

    return read


def element_by_element(x: Any) -> Any:
    """An identity map: an input behind it has no ``next_block`` and is read with ``next``."""
    return x


def block_inputs(sizes: Sequence[int], bad: int | None) -> list[IterDataset[Any]]:
    """to_iter_dataset readers (next_block) over consecutive ranges with holes (multiples of
    5); the element ``bad`` raises ``KeyError``."""
    inputs = []
    start = 0
    for size in sizes:
        ds = MapDataset.range(start, start + size).filter(lambda x: x % 5 != 0)
        if bad is not None:
            ds = ds.map(_fails_at(bad))
        inputs.append(ds.to_iter_dataset())
        start += size
    return inputs


def _drain(it: Any) -> tuple[list[Any], list[dict[str, Any]], str | None]:
    out, states = [], [it.get_state()]
    try:
        for x in it:
            out.append(x)
            states.append(it.get_state())
    except KeyError as e:
        return out, states, str(e)
    return out, states, None


def assert_blocks_read_as_elements(
    blockwise: IterDataset[Any], reference: IterDataset[Any], restore_at: int
) -> None:
    """``blockwise`` (over :func:`block_inputs`) gives the elements, error and states of
    ``reference`` (the same inputs behind :func:`element_by_element`), restores from its own
    states, and a state taken after ``restore_at`` elements restores in ``reference``."""
    expected = _drain(iter(reference))
    assert _drain(iter(blockwise)) == expected
    out, states, _ = expected
    k = min(restore_at, len(out))
    restored = iter(blockwise)
    restored.set_state(states[k])
    assert _drain(restored)[0] == out[k:]
    it = iter(blockwise)
    for _ in range(k):
        next(it)
    ref = iter(reference)
    ref.set_state(it.get_state())
    assert _drain(ref)[0] == out[k:]

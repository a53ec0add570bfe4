"""Public conformance helpers for dataset and plugin authors.

Every first-party iterator and source runs through these checks in grain_core's own tests; a
plugin calls the same functions on its datasets to prove it keeps the library's promises:
determinism, exact checkpoint/restore at any position, JSON-serialisable states and the
random-access source contract.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from grain_core._checkpoint_io import decode_state, encode_state

__all__ = [
    "assert_equal_output_after_checkpoint",
    "assert_trees_equal",
    "check_iterator_conformance",
    "check_random_access_source",
]


def assert_trees_equal(actual: Any, expected: Any, path: str = "element") -> None:
    """Asserts two elements are equal, comparing NumPy leaves by value, shape and dtype.

    Raises:
      AssertionError: naming the path of the first difference.
    """
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping) or set(actual) != set(expected):
            raise AssertionError(f"{path}: keys differ: {_keys(actual)} != {_keys(expected)}")
        for k in expected:
            assert_trees_equal(actual[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            raise AssertionError(f"{path}: {actual!r} != {expected!r}")
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_trees_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, np.ndarray) or isinstance(actual, np.ndarray):
        a, e = np.asarray(actual), np.asarray(expected)
        if (
            a.shape != e.shape
            or a.dtype != e.dtype
            or not np.array_equal(a, e, equal_nan=_nan_ok(e))
        ):
            raise AssertionError(f"{path}: {a!r} != {e!r}")
    elif actual != expected and not (_is_nan(actual) and _is_nan(expected)):
        raise AssertionError(f"{path}: {actual!r} != {expected!r}")


def _keys(x: Any) -> Any:
    return sorted(map(str, x)) if isinstance(x, Mapping) else type(x).__name__


def _nan_ok(e: np.ndarray) -> bool:
    return e.dtype.kind in "fc"


def _is_nan(x: Any) -> bool:
    return isinstance(x, float) and x != x


def _iterate(ds: Any) -> Any:
    return iter(ds.to_iter_dataset()) if hasattr(ds, "to_iter_dataset") else iter(ds)


def _close_unless_given(it: Any, ds: Any) -> None:
    """Closes an iterator built here; one the caller passed stays theirs to close."""
    if it is not ds:
        it.close()


def _state_spec(state: Any) -> Any:
    if isinstance(state, Mapping):
        return {k: _state_spec(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_state_spec(v) for v in state]
    return type(state).__name__


def _take(it: Iterable[Any], limit: int) -> list[Any]:
    out = []
    for x in it:
        out.append(x)
        if len(out) >= limit:
            raise AssertionError(
                f"The dataset produced more than {limit} elements; pass a finite dataset or a "
                "larger max_elements."
            )
    return out


def assert_equal_output_after_checkpoint(ds: Any, *, max_elements: int = 10_000) -> None:
    """Checks that restoring the state recorded before every element reproduces the rest.

    Iterates ``ds`` to the end recording ``get_state()`` before each element, checks the state's
    structure never changes, then for every recorded state builds a fresh iterator, restores the
    state, checks ``get_state()`` round-trips exactly and the remaining output matches. ``ds``
    may be an iterator that is its own iterable (``ElasticIterator``): it is restored in place
    and left open for the caller.

    Raises:
      AssertionError: on the first mismatch, naming the position.
    """
    it = _iterate(ds)
    states, outputs = [], []
    spec = None
    while True:
        state = it.get_state()
        if spec is None:
            spec = _state_spec(state)
        elif _state_spec(state) != spec:
            raise AssertionError(
                f"State structure changed at position {len(states)}: {_state_spec(state)} != {spec}"
            )
        states.append(state)
        try:
            outputs.append(next(it))
        except StopIteration:
            break
        if len(outputs) > max_elements:
            raise AssertionError(f"More than {max_elements} elements; pass a finite dataset.")
    _close_unless_given(it, ds)
    for pos, state in enumerate(states):
        fresh = _iterate(ds)
        fresh.set_state(state)
        if fresh.get_state() != state:
            raise AssertionError(
                f"get_state() after set_state() differs at position {pos}: "
                f"{fresh.get_state()} != {state}"
            )
        rest = _take(fresh, max_elements + 1)
        _close_unless_given(fresh, ds)
        if len(rest) != len(outputs) - pos:
            raise AssertionError(
                f"Restored at position {pos}: got {len(rest)} remaining elements, expected "
                f"{len(outputs) - pos}."
            )
        for k, (a, e) in enumerate(zip(rest, outputs[pos:], strict=True)):
            assert_trees_equal(a, e, f"restored at {pos}, element {pos + k}")


def check_iterator_conformance(
    make_dataset: Callable[[], Any] | Any,
    *,
    positions: Sequence[int] | None = None,
    max_elements: int = 100_000,
) -> list[Any]:
    """Checks determinism and checkpoint/restore of a dataset's iterator.

    Args:
      make_dataset: a dataset, or a zero-argument function building one (called twice, to prove
        two independently built pipelines give the same output).
      positions: element positions at which to checkpoint. Defaults to the start, a middle
        position, the last element and the end (after exhaustion). Positions past one epoch
        (for repeated datasets) are valid when the stream is long enough.
      max_elements: guard against infinite datasets.

    Returns:
      The full output, for further assertions by the caller.

    Raises:
      AssertionError: describing the first violated promise.
    """
    build = (
        make_dataset
        if callable(make_dataset) and not _is_dataset(make_dataset)
        else (lambda: make_dataset)
    )
    first_it = _iterate(build())
    expected = _take(first_it, max_elements)
    again = _take(_iterate(build()), max_elements)
    if len(again) != len(expected):
        raise AssertionError(f"Not deterministic: {len(expected)} then {len(again)} elements.")
    for k, (a, e) in enumerate(zip(again, expected, strict=True)):
        assert_trees_equal(a, e, f"second run, element {k}")
    n = len(expected)
    if positions is None:
        positions = sorted({0, n // 2, max(n - 1, 0), n})
    for pos in positions:
        if not 0 <= pos <= n:
            raise ValueError(f"Checkpoint position {pos} is outside the stream of {n} elements.")
        it = _iterate(build())
        for _ in range(pos):
            next(it)
        state = it.get_state()
        restored_state = decode_state(encode_state(state), f"The state at {pos}")
        if restored_state != state:
            raise AssertionError(f"State at {pos} does not survive JSON: {state!r}")
        tail_same = _take(it, max_elements)
        for label, target in (("a fresh iterator", _iterate(build())), ("the same iterator", it)):
            target.set_state(restored_state)
            if target.get_state() != restored_state:
                raise AssertionError(
                    f"get_state() right after set_state() at {pos} on {label} differs: "
                    f"{target.get_state()} != {restored_state}"
                )
            tail = _take(target, max_elements)
            if len(tail) != n - pos:
                raise AssertionError(
                    f"Restoring at {pos} on {label} gave {len(tail)} elements, expected {n - pos}."
                )
            for k, (a, e) in enumerate(zip(tail, expected[pos:], strict=True)):
                assert_trees_equal(a, e, f"restored at {pos} on {label}, element {pos + k}")
            target.close()
        if len(tail_same) != n - pos:
            raise AssertionError(f"get_state() at {pos} changed the stream.")
    first_it.close()
    return expected


def _is_dataset(x: Any) -> bool:
    from grain_core.dataset.base import IterDataset, MapDataset  # import cost

    return isinstance(x, (IterDataset, MapDataset))


def check_random_access_source(source: Any, *, sample: int = 64) -> None:
    """Checks the ``RandomAccessDataSource`` contract of ``source``.

    Length is a non-negative int; ``source[i]`` is deterministic; ``__getitems__`` (when
    present) equals per-index reads in the requested order, duplicates included; reading
    ``len(source)`` raises ``IndexError``; the source pickles, and the copy reads the same
    records and has the same ``repr`` (its checkpoint fingerprint).

    Raises:
      AssertionError: describing the first violated promise.
    """
    n = len(source)
    if not isinstance(n, int) or n < 0:
        raise AssertionError(f"len(source) must be a non-negative int, got {n!r}.")
    rng = np.random.default_rng(0)
    indices = rng.integers(0, n, size=min(sample, n)).tolist() if n else []
    if n:
        indices += [0, n - 1, indices[0]]
    singles = [source[i] for i in indices]
    for i, v in zip(indices, singles, strict=True):
        assert_trees_equal(source[i], v, f"source[{i}] read twice")
    getitems = getattr(source, "__getitems__", None)
    if getitems is not None:
        batch = list(getitems(indices))
        if len(batch) != len(indices):
            raise AssertionError("__getitems__ returned a different number of records.")
        for i, (a, e) in enumerate(zip(batch, singles, strict=True)):
            assert_trees_equal(a, e, f"__getitems__ position {i} (index {indices[i]})")
    try:
        source[n]
    except IndexError:
        pass
    else:
        raise AssertionError(f"source[{n}] (== len) must raise IndexError.")
    copy = pickle.loads(pickle.dumps(source))
    if repr(copy) != repr(source):
        raise AssertionError(f"repr changes over pickling: {copy!r} != {source!r}")
    for i, v in zip(indices, singles, strict=True):
        assert_trees_equal(copy[i], v, f"unpickled source[{i}]")

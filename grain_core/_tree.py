"""The one tree (PyTree) walker used everywhere in grain_core.

Grain switches between ``jax.tree_util`` and a pure-Python fallback depending on whether JAX is
importable, and the two disagree (rough edge 10). grain_core always uses this module, with the
semantics JAX users already see:

* ``dict`` (and any ``Mapping``) children are visited in **sorted key order**, and rebuilt dicts
  have their keys in sorted order. Keys must therefore be mutually comparable.
* ``list``, ``tuple`` and namedtuples are visited in order and rebuilt with their own type.
* ``None`` is an **empty subtree**: it has no leaves and is returned unchanged by
  :func:`map_structure`.
* Everything else (NumPy arrays, scalars, strings, bytes, arbitrary objects) is a leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["flatten", "map_structure", "spec_str", "unflatten"]


def _is_namedtuple(x: object) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _sorted_keys(mapping: Mapping[Any, Any]) -> list[Any]:
    try:
        return sorted(mapping)
    except TypeError as e:
        raise TypeError(
            f"Dict keys must be mutually comparable to define a deterministic order; got "
            f"{list(mapping)!r}."
        ) from e


def flatten(tree: Any) -> list[Any]:
    """Returns the leaves of ``tree`` in canonical order (sorted dict keys, ``None`` skipped)."""
    leaves: list[Any] = []
    _flatten_into(tree, leaves)
    return leaves


def _flatten_into(tree: Any, out: list[Any]) -> None:
    if tree is None:
        return
    if isinstance(tree, Mapping):
        for k in _sorted_keys(tree):
            _flatten_into(tree[k], out)
    elif isinstance(tree, (list, tuple)):
        for child in tree:
            _flatten_into(child, out)
    else:
        out.append(tree)


def unflatten(structure: Any, leaves: list[Any]) -> Any:
    """Rebuilds ``structure`` with its leaves replaced, in order, by ``leaves``.

    Raises:
      ValueError: if the number of leaves does not match the structure.
    """
    it = iter(leaves)
    result = map_structure(lambda _: next(it), structure)
    if next(it, _SENTINEL) is not _SENTINEL:
        raise ValueError("Too many leaves for the given structure.")
    return result


_SENTINEL = object()


def map_structure(fn: Callable[..., Any], *trees: Any) -> Any:
    """Applies ``fn`` to corresponding leaves of ``trees`` (which must share one structure).

    Raises:
      ValueError: if the trees differ in structure; the message shows both structures.
    """
    first = trees[0]
    kind = type(first)
    # Exact-type checks first: this runs once per node per batch, and ABC isinstance checks
    # would dominate batching small elements.
    if kind is dict or (kind not in _LEAF_TYPES and isinstance(first, Mapping)):
        keys = first.keys()
        for t in trees[1:]:
            if t is None or t.__class__ not in _MAPPING_TYPES and not isinstance(t, Mapping):
                raise _mismatch(trees)
            if t.keys() != keys:
                raise _mismatch(trees)
        return {k: map_structure(fn, *[t[k] for t in trees]) for k in _sorted_keys(first)}
    if kind is list or kind is tuple or (kind not in _LEAF_TYPES and isinstance(first, tuple)):
        n = len(first)
        for t in trees[1:]:
            if type(t) is not kind or len(t) != n:
                raise _mismatch(trees)
        children = [map_structure(fn, *[t[i] for t in trees]) for i in range(n)]
        if _is_namedtuple(first):
            return kind(*children)
        return kind(children)
    if first is None:
        for t in trees[1:]:
            if t is not None:
                raise _mismatch(trees)
        return None
    for t in trees[1:]:
        if t is None or (t.__class__ not in _LEAF_TYPES and isinstance(t, _CONTAINERS)):
            raise _mismatch(trees)
    return fn(*trees)


_LEAF_TYPES = frozenset({np.ndarray, int, float, bool, str, bytes, complex})
_MAPPING_TYPES = frozenset({dict})
_CONTAINERS = (Mapping, list, tuple)


def spec_str(tree: Any) -> str:
    """A short description of a tree's structure with leaf types/shapes, for error messages."""
    if tree is None:
        return "None"
    if isinstance(tree, Mapping):
        inner = ", ".join(f"{k!r}: {spec_str(tree[k])}" for k in _sorted_keys(tree))
        return "{" + inner + "}"
    if isinstance(tree, (list, tuple)):
        inner = ", ".join(spec_str(c) for c in tree)
        if _is_namedtuple(tree):
            return f"{type(tree).__name__}({inner})"
        return f"[{inner}]" if isinstance(tree, list) else f"({inner})"
    shape = getattr(tree, "shape", None)
    dtype = getattr(tree, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(tree).__name__}[{dtype}{list(shape)}]"
    return type(tree).__name__


def _mismatch(trees: tuple[Any, ...]) -> ValueError:
    shown = "\n".join(f"  element {i}: {spec_str(t)}" for i, t in enumerate(trees[:4]))
    return ValueError(f"Expected all input elements to have the same structure, got:\n{shown}")

"""The one tree (PyTree) walker used everywhere in grain_core.

Grain switches between ``jax.tree_util`` and a pure-Python fallback depending on whether JAX is
importable, and the two disagree (see docs/compatibility.md). grain_core always uses this
module, with the semantics JAX users already see:

* ``dict`` (and any ``Mapping``) children are visited in **sorted key order**, and rebuilt dicts
  have their keys in sorted order. Keys must therefore be mutually comparable.
* ``list``, ``tuple`` and namedtuples are visited in order and rebuilt with their own type.
* ``None`` is an **empty subtree**: it has no leaves and is returned unchanged by
  :func:`map_structure`.
* Everything else (NumPy arrays, scalars, strings, bytes, arbitrary objects) is a leaf.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "TreePath",
    "flatten",
    "leaf_paths",
    "map_structure",
    "map_structure_with_path",
    "same_structure",
    "spec_str",
    "unflatten",
]

#: A leaf's address in a tree: the dict keys and sequence indices from the root down.
TreePath = tuple[Any, ...]


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


def leaf_paths(tree: Any) -> list[tuple[TreePath, Any]]:
    """Returns ``(path, leaf)`` pairs of ``tree`` in the order of :func:`flatten`."""
    out: list[tuple[TreePath, Any]] = []
    _leaf_paths_into(tree, (), out)
    return out


def _leaf_paths_into(tree: Any, path: TreePath, out: list[tuple[TreePath, Any]]) -> None:
    if tree is None:
        return
    if isinstance(tree, Mapping):
        for k in _sorted_keys(tree):
            _leaf_paths_into(tree[k], (*path, k), out)
    elif isinstance(tree, (list, tuple)):
        for i, child in enumerate(tree):
            _leaf_paths_into(child, (*path, i), out)
    else:
        out.append((path, tree))


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
    global _kinds_token
    token = abc.get_cache_token()
    if token != _kinds_token or len(_kinds) > _KINDS_MAX:
        # A class registered with an ABC since (``Mapping.register``) may have changed kind.
        _kinds.clear()
        _kinds_token = token
    return _map(fn, trees)


def map_structure_with_path(fn: Callable[..., Any], *trees: Any) -> Any:
    """Like :func:`map_structure`, with each leaf's path (:func:`leaf_paths`) passed to ``fn``
    before the leaves: ``fn(path, *leaves)``.

    Raises:
      ValueError: if the trees differ in structure; the message shows both structures.
    """
    paths = iter([path for path, _ in leaf_paths(trees[0])])
    return map_structure(lambda *leaves: fn(next(paths), *leaves), *trees)


def same_structure(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have one structure (as ``map_structure`` requires)."""
    try:
        map_structure(_ignore, a, b)
    except ValueError:
        return False
    return True


def _ignore(*leaves: Any) -> None:
    return None


def _map(fn: Callable[..., Any], trees: Sequence[Any]) -> Any:
    # Runs once per node per batch: the per-tree checks are C-level passes (set, map, zip,
    # itemgetter) and the kind of a class is looked up once per distinct class, so batching
    # many small elements does not pay an ABC isinstance check per leaf.
    first = trees[0]
    kind = _kind(type(first))
    classes = set(map(type, trees))
    if any(_kind(cls) != kind for cls in classes):
        raise _mismatch(trees)
    if kind == _LEAF:
        return fn(*trees)
    if kind == _NONE:
        return None
    n = len(first)
    if len(set(map(len, trees))) > 1:
        raise _mismatch(trees)
    if kind == _MAPPING:
        keys = _sorted_keys(first)
        if n == 0:
            return {}
        # A missing key raises KeyError from a plain dict; other mappings (defaultdict's
        # __missing__) might answer it, so their keys are compared.
        if classes != {dict} and any(t.keys() != first.keys() for t in trees):
            raise _mismatch(trees)
        try:
            values = list(map(operator.itemgetter(*keys), trees))
        except KeyError:
            raise _mismatch(trees) from None
        columns = [values] if n == 1 else zip(*values, strict=True)
        return {k: _map(fn, column) for k, column in zip(keys, columns, strict=True)}
    if len(classes) > 1:  # a list and a tuple, or two tuple types
        raise _mismatch(trees)
    children = [_map(fn, column) for column in zip(*trees, strict=True)]
    cls = type(first)
    return cls(*children) if _is_namedtuple(first) else cls(children)


_LEAF, _MAPPING, _SEQUENCE, _NONE = range(4)
_kinds: dict[type, int] = {}
_kinds_token = abc.get_cache_token()
# Classes made on the fly (local classes in a loop) must not pile up in the cache.
_KINDS_MAX = 1024


def _kind(cls: type) -> int:
    kind = _kinds.get(cls)
    if kind is None:
        if cls is type(None):
            kind = _NONE
        elif issubclass(cls, Mapping):
            kind = _MAPPING
        elif issubclass(cls, (list, tuple)):
            kind = _SEQUENCE
        else:
            kind = _LEAF
        _kinds[cls] = kind
    return kind


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


def _mismatch(trees: Sequence[Any]) -> ValueError:
    shown = "\n".join(f"  element {i}: {spec_str(t)}" for i, t in enumerate(trees[:4]))
    return ValueError(f"Expected all input elements to have the same structure but got:\n{shown}")

"""A progress bar for the command-line tools (``grain-core convert``, ``demo``, ``profile``)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

__all__ = ["progress"]

_T = TypeVar("_T")


def progress(iterable: Iterable[_T], total: int | None, unit: str) -> Iterable[_T]:
    """Wraps ``iterable`` in a tqdm progress bar when stderr is a terminal and tqdm exists.

    tqdm is optional (``pip install tqdm``): without it, or when output is redirected, the
    iterable is returned unchanged so logs stay clean.

    Args:
      iterable: What to iterate over.
      total: How many items it has; None counts without an end.
      unit: The unit the bar names (``"rec"``, ``"steps"``).
    """
    if not sys.stderr.isatty():
        return iterable
    try:
        from tqdm import tqdm  # optional dependency
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, unit=unit, file=sys.stderr, leave=False)

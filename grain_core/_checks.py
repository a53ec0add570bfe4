"""Argument checks shared by the core's modules: one message for each kind of bad count."""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["as_flag", "as_int", "non_negative_int", "positive_int"]


def as_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` (NumPy integers included).

    Raises:
      TypeError: ``value`` is not an integer; a ``bool`` is not one here.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got a bool ({value!r}).")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {type(value).__name__} ({value!r})."
        ) from None


def as_flag(name: str, value: Any) -> bool:
    """``value`` as a ``bool``: ``True``/``False`` or the integers 0 and 1 (as states store them).

    Raises:
      TypeError: any other value.
    """
    if isinstance(value, bool):
        return value
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n not in (0, 1):
        raise TypeError(f"{name} must be a bool or 0/1, got {type(value).__name__} ({value!r}).")
    return bool(n)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` of at least 1.

    Raises:
      TypeError: ``value`` is not an integer.
      ValueError: ``value <= 0``.
    """
    n = as_int(name, value)
    if n <= 0:
        raise ValueError(f"{name} must be a positive integer, got {n}.")
    return n


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` of at least 0.

    Raises:
      TypeError: ``value`` is not an integer.
      ValueError: ``value < 0``.
    """
    n = as_int(name, value)
    if n < 0:
        raise ValueError(f"{name} must be non-negative, got {n}.")
    return n

"""Tests for grain_core.profiling: the public name of grain-core profile's Python API."""

from __future__ import annotations

from grain_core import profiling
from grain_core.observe import profile


def test_the_public_module_names_the_implementations_objects() -> None:
    assert sorted(profiling.__all__) == sorted(profile.__all__)
    for name in profiling.__all__:
        assert getattr(profiling, name) is getattr(profile, name)

"""Shared pytest configuration."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "grain_core", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# CI runs the same examples every time (a property failure there is reproducible from the
# log, never a coin toss that blocks a merge); local runs keep exploring new examples.
settings.register_profile("ci", parent=settings.get_profile("grain_core"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "grain_core")

"""Shared pytest configuration."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "grain_core", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("grain_core")

"""pytest plugin for the reference run (``run.py --reference``): Grain's tests on Google Grain,
with absl's flags parsed as Grain's own test set-up expects."""

from __future__ import annotations

import pytest

__all__: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    from absl import flags  # optional dependency: Grain's tests use absl

    flags.FLAGS.mark_as_parsed()

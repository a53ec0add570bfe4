"""Processes that Grain's tests start (``spawn`` pools) see Grain's paths as the test process
does: ``run.py`` puts this folder on ``PYTHONPATH``, so every interpreter of the run imports
this module at start-up."""

from __future__ import annotations

import os

__all__: list[str] = []

if os.environ.get("GRAIN_TESTS_WHEEL_ROOT") and not os.environ.get("GRAIN_TESTS_REFERENCE"):
    import grain_paths

    grain_paths.install_private_paths()

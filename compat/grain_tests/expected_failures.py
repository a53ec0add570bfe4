"""Grain's tests that fail on grain_core, each with its reason: deliberate differences
(``docs/compatibility.md``) and known gaps (with the issue that tracks them). ``grain_paths``
marks them ``xfail(strict=True)``: a new failure, or a listed test that passes, is red.

Keys are substrings of pytest node ids (``<module>.py::<Class>::<test>``).
"""

from __future__ import annotations

__all__ = ["EXPECTED_FAILURES"]

EXPECTED_FAILURES: dict[str, str] = {}

"""``grain_core.python.experimental`` is ``grain_core.experimental`` (legacy module path of
``grain.python.experimental``): this module replaces itself with it, so the two never differ."""

from __future__ import annotations

import sys

from grain_core import experimental

sys.modules[__name__] = experimental

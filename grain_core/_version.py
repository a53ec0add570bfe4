"""grain_core's version, in a leaf that the plugin manager and the package both read."""

from __future__ import annotations

__all__ = ["__version__", "__version_info__"]

__version__ = "0.1.0"
__version_info__ = (0, 1, 0)

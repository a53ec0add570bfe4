"""Global configuration (``grain.config``).

Grain backs these options with absl flags; grain_core keeps them in this object (seeded from
``GRAIN_<NAME>`` environment variables) so the core needs no absl.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["Config", "config"]

_TRACEBACK_MODES = ("auto", "off", "tracebackhide", "quiet_remove_frames", "remove_frames")

_DEFAULTS: dict[str, Any] = {
    "py_debug_mode": False,
    "py_dataset_visualization_output_dir": None,
    "py_traceback_filtering": "auto",
    "py_relay_sigterm_to_main": False,
    # grain_core's own: mp_prefetch over to_iter_dataset() hands positions to free workers
    # (grain_core.dataset.mp_dispatch). False: each worker computes its fixed strided share.
    "py_mp_prefetch_dispatch": True,
}


def _from_env(name: str, default: Any) -> Any:
    raw = os.environ.get(f"GRAIN_{name.upper()}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return raw


class Config:
    """Attribute access to options; change them with :meth:`update`.

    Raises:
      ValueError: for an unknown option, direct attribute assignment, or an invalid value.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_values", {k: _from_env(k, v) for k, v in _DEFAULTS.items()})

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name not in values:
            if name.startswith("__"):
                # Protocol lookups (copy, pickle, pytest ids) expect AttributeError.
                raise AttributeError(name)
            raise ValueError(f"Unrecognized config option: {name}. Known: {sorted(values)}.")
        return values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        raise ValueError(f"Please use update(): config.update({name!r}, {value!r}).")

    def update(self, name: str, value: Any) -> None:
        """Sets option ``name`` to ``value``."""
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise ValueError(f"Unrecognized config option: {name}. Known: {sorted(values)}.")
        if name == "py_traceback_filtering" and value not in _TRACEBACK_MODES:
            raise ValueError(f"py_traceback_filtering must be one of {_TRACEBACK_MODES}.")
        values[name] = value

    def get_or_default(self, name: str) -> Any:
        """Returns the option's value (there are no unparsed flags in grain_core)."""
        return getattr(self, name)


config = Config()

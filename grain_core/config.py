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
    # grain_core's own: worker processes copy arrays of at least this many bytes with
    # streaming (non-temporal) stores (glibc on x86); 0 leaves glibc's choice. Read when the
    # workers' forkserver starts (grain_core._worker).
    "py_mp_worker_streaming_copy_bytes": 2 * 1024 * 1024,
}

#: The smallest threshold glibc accepts for ``x86_non_temporal_threshold``.
_MIN_STREAMING_COPY_BYTES = 0x4040


def _from_env(name: str, default: Any) -> Any:
    raw = os.environ.get(f"GRAIN_{name.upper()}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(
                f"Environment variable GRAIN_{name.upper()}={raw!r} must be an integer."
            ) from None
        return _checked(name, value)
    return raw


def _checked(name: str, value: Any) -> Any:
    """``value`` for option ``name``, validated.

    Raises:
      ValueError: If ``value`` is not valid for ``name``.
    """
    if name == "py_traceback_filtering" and value not in _TRACEBACK_MODES:
        raise ValueError(f"py_traceback_filtering must be one of {_TRACEBACK_MODES}.")
    if name == "py_mp_worker_streaming_copy_bytes" and (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not (value == 0 or value >= _MIN_STREAMING_COPY_BYTES)
    ):
        raise ValueError(
            f"py_mp_worker_streaming_copy_bytes must be 0 (glibc's own threshold) or an int of "
            f"at least {_MIN_STREAMING_COPY_BYTES} bytes, got {value!r}."
        )
    return value


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
        values[name] = _checked(name, value)

    def get_or_default(self, name: str) -> Any:
        """Returns the option's value (there are no unparsed flags in grain_core)."""
        return getattr(self, name)


config = Config()

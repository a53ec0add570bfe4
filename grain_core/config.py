"""Global configuration (``grain.config``).

Grain backs these options with absl flags; grain_core keeps them in this object (seeded from
``GRAIN_<NAME>`` environment variables) so the core needs no absl. Every option listed in
``_DEFAULTS`` has an effect; a value grain_core cannot honour is refused by :meth:`Config.update`
with the reason, never accepted and ignored.

What the debugging options do is described in ``docs/debugging.md``.
"""

from __future__ import annotations

import math
import os
from typing import Any

from grain_core.options import IN_PROCESS_MODES

__all__ = ["Config", "config"]

#: Traceback modes Grain accepts. grain_core never removes frames from tracebacks, so only
#: the modes that keep every frame are accepted (``auto`` is the default: grain_core's choice).
_TRACEBACK_MODES = ("auto", "off", "tracebackhide", "quiet_remove_frames", "remove_frames")
_SUPPORTED_TRACEBACK_MODES = ("auto", "off")

_DEFAULTS: dict[str, Any] = {
    # Stage timing on every pipeline built while it is on, and the execution summary logged
    # periodically and at the end of iteration (grain_core.dataset.debug).
    "py_debug_mode": False,
    # grain_core's own: seconds between two execution summaries in debug mode (Grain: 60).
    "py_debug_summary_interval": 60.0,
    # None: off. "": log the dataset graph when the first element is produced. A directory:
    # log it and write it there (grain_core.dataset.debug).
    "py_dataset_visualization_output_dir": None,
    "py_traceback_filtering": "auto",
    "py_relay_sigterm_to_main": False,
    # grain_core's own: mp_prefetch over to_iter_dataset() hands positions to free workers
    # (grain_core.dataset.mp.dispatch). False: each worker computes its fixed strided share.
    "py_mp_prefetch_dispatch": True,
    # grain_core's own: whether a dispatched mp_prefetch pipeline may run in the parent
    # process (grain_core.dataset.mp.in_process) when its MultiprocessingOptions.in_process
    # is None. "never": in the workers asked for; "auto": in the parent while its first
    # results show that workers would not deliver faster; "always": never in workers (same
    # output and checkpoints either way; docs/workers.md says what the parent gives up).
    "py_mp_prefetch_in_process": "never",
    # grain_core's own: worker processes copy arrays of at least this many bytes with
    # streaming (non-temporal) stores (glibc on x86); 0 leaves glibc's choice. Read when the
    # workers' forkserver starts (grain_core._ipc.pool).
    "py_mp_worker_streaming_copy_bytes": 2 * 1024 * 1024,
}


#: The smallest threshold glibc accepts for ``x86_non_temporal_threshold``.
_MIN_STREAMING_COPY_BYTES = 0x4040


def _from_env(name: str, default: Any) -> Any:
    variable = f"GRAIN_{name.upper()}"
    raw = os.environ.get(variable)
    if raw is None:
        return default
    if isinstance(default, bool):
        return _checked(name, raw.strip().lower() in ("1", "true", "yes", "on"))
    if isinstance(default, (int, float)):
        try:
            value: Any = type(default)(raw)
        except ValueError:
            kind = "an integer" if isinstance(default, int) else "a number"
            raise ValueError(f"Environment variable {variable}={raw!r} must be {kind}.") from None
        return _checked(name, value)
    return _checked(name, raw)


def _checked(name: str, value: Any) -> Any:
    """``value`` for option ``name``, validated.

    Raises:
      ValueError: If ``value`` is not valid for ``name``, or is a setting grain_core does not
        support.
    """
    if name == "py_traceback_filtering":
        if value not in _TRACEBACK_MODES:
            raise ValueError(f"py_traceback_filtering must be one of {_TRACEBACK_MODES}.")
        if value not in _SUPPORTED_TRACEBACK_MODES:
            raise ValueError(
                f"py_traceback_filtering={value!r} is not supported: grain_core never removes "
                f"frames from tracebacks. Use one of {_SUPPORTED_TRACEBACK_MODES}."
            )
    elif name == "py_relay_sigterm_to_main":
        if value not in (False, True):
            raise ValueError(f"py_relay_sigterm_to_main must be a bool, got {value!r}.")
        if value:
            raise ValueError(
                "py_relay_sigterm_to_main=True is not supported: grain_core worker processes "
                "do not relay SIGTERM to the main process. Handle SIGTERM in the main process "
                "(workers exit when it closes the iterator or exits)."
            )
    elif name == "py_debug_mode" and value not in (False, True):
        raise ValueError(f"py_debug_mode must be a bool, got {value!r}.")
    elif name == "py_debug_summary_interval" and (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"py_debug_summary_interval must be a positive number of seconds, got {value!r}."
        )
    elif name == "py_dataset_visualization_output_dir":
        _check_output_dir(value)
    elif name == "py_mp_prefetch_dispatch" and value not in (False, True):
        raise ValueError(f"py_mp_prefetch_dispatch must be a bool, got {value!r}.")
    elif name == "py_mp_prefetch_in_process" and value not in IN_PROCESS_MODES:
        raise ValueError(
            f"py_mp_prefetch_in_process must be one of {IN_PROCESS_MODES}, got {value!r}."
        )
    elif name == "py_mp_worker_streaming_copy_bytes" and (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not (value == 0 or value >= _MIN_STREAMING_COPY_BYTES)
    ):
        raise ValueError(
            f"py_mp_worker_streaming_copy_bytes must be 0 (glibc's own threshold) or an int of "
            f"at least {_MIN_STREAMING_COPY_BYTES} bytes, got {value!r}."
        )
    return value


def _check_output_dir(value: Any) -> None:
    """Creates the visualization directory if needed and checks that it can be written.

    Raises:
      ValueError: If ``value`` is not ``None`` or a string, or names a directory that cannot
        be created or written.
    """
    if value is None or value == "":
        return
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(
            f"py_dataset_visualization_output_dir must be None, '' or a directory path, got "
            f"{value!r}."
        )
    try:
        os.makedirs(value, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"py_dataset_visualization_output_dir={os.fspath(value)!r} cannot be created: "
            f"{e.strerror or e}. Choose a writable directory, or '' to only log the graph."
        ) from e
    if not os.access(value, os.W_OK | os.X_OK):
        raise ValueError(
            f"py_dataset_visualization_output_dir={os.fspath(value)!r} is not writable. "
            "Choose a writable directory, or '' to only log the graph."
        )


def _unknown(name: str, known: Any) -> ValueError:
    hint = (
        " Options starting with tf_ belong to Grain's TensorFlow backend, which grain_core "
        "does not have."
        if name.startswith("tf_")
        else ""
    )
    return ValueError(f"Unrecognized config option: {name}. Known: {sorted(known)}.{hint}")


class Config:
    """Attribute access to options; change them with :meth:`update`.

    Raises:
      ValueError: for an unknown option, direct attribute assignment, an invalid value, or a
        value grain_core does not support (the message says which and why).
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_values", {k: _from_env(k, v) for k, v in _DEFAULTS.items()})

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name not in values:
            if name.startswith("__"):
                # Protocol lookups (copy, pickle, pytest ids) expect AttributeError.
                raise AttributeError(name)
            raise _unknown(name, values)
        return values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        raise ValueError(f"Please use update(): config.update({name!r}, {value!r}).")

    def update(self, name: str, value: Any) -> None:
        """Sets option ``name`` to ``value``.

        Raises:
          ValueError: for an unknown option or a value that is invalid or not supported.
        """
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise _unknown(name, values)
        values[name] = _checked(name, value)

    def get_or_default(self, name: str) -> Any:
        """Returns the option's value (there are no unparsed flags in grain_core)."""
        return getattr(self, name)


config = Config()

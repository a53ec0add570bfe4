"""Global configuration (``grain.config``).

grain_core keeps these options in this object (seeded from ``GRAIN_<NAME>`` environment
variables), so the core needs no absl. Where absl is installed, each option is also the absl flag
``--grain_<name>`` as in Grain (``--grain_py_debug_mode``), defined when ``absl.flags`` is
imported, before or after grain_core: from then on the flag holds the value, so command lines,
``config.update`` and absl's ``flagsaver`` all set the same option. Every option listed in
``_DEFAULTS`` has an effect; a value grain_core cannot honour is refused by :meth:`Config.update`
with the reason, never accepted and ignored.

What the debugging options do is described in ``docs/debugging.md``.
"""

from __future__ import annotations

import importlib.machinery
import math
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

from grain_core.options import IN_PROCESS_MODES

__all__ = ["Config", "config"]

#: Traceback modes Grain accepts. All are accepted (code and flags written for Grain set them);
#: grain_core never removes frames from a traceback, so every mode keeps them all.
_TRACEBACK_MODES = ("auto", "off", "tracebackhide", "quiet_remove_frames", "remove_frames")

_DEFAULTS: dict[str, Any] = {
    # Stage timing on every pipeline built while it is on, and the execution summary logged
    # periodically and at the end of iteration (grain_core.observe.graph).
    "py_debug_mode": False,
    # grain_core's own: seconds between two execution summaries in debug mode (Grain: 60).
    "py_debug_summary_interval": 60.0,
    # None: off. "": log the dataset graph when the first element is produced. A directory:
    # log it and write it there (grain_core.observe.graph).
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
        # absl's FlagValues once the options are absl flags (they then hold the values).
        object.__setattr__(self, "_flags", None)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name not in values:
            if name.startswith("__"):
                # Protocol lookups (copy, pickle, pytest ids) expect AttributeError.
                raise AttributeError(name)
            raise _unknown(name, values)
        flag_values = object.__getattribute__(self, "_flags")
        if flag_values is not None:
            return flag_values[_FLAG_PREFIX + name].value
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
        flag_values = object.__getattribute__(self, "_flags")
        if flag_values is not None:
            flag_values[_FLAG_PREFIX + name].value = values[name]

    def get_or_default(self, name: str) -> Any:
        """Returns the option's value (there are no unparsed flags in grain_core)."""
        return getattr(self, name)


config = Config()

#: Grain's flag names: ``--grain_`` and the option's name.
_FLAG_PREFIX = "grain_"


def _define_absl_flags(flags: Any) -> None:
    """Defines every option as the absl flag ``grain_<name>``, its default the option's current
    value, checked as :meth:`Config.update` checks it."""
    for name, value in object.__getattribute__(config, "_values").items():
        flag = _FLAG_PREFIX + name
        if flag in flags.FLAGS:
            continue
        default = _DEFAULTS[name]
        if isinstance(default, bool):
            define = flags.DEFINE_bool
        elif isinstance(default, int):
            define = flags.DEFINE_integer
        elif isinstance(default, float):
            define = flags.DEFINE_float
        else:
            define = flags.DEFINE_string
        # Google Grain, imported into the same process (a side-by-side comparison, a library
        # that imports it), defines these names again: its definition then replaces ours
        # instead of stopping the import with DuplicateFlagError.
        define(flag, value, f"grain_core.config.{name} (docs/debugging.md).", allow_override=True)
        flags.register_validator(flag, _flag_checker(name, flags.ValidationError))
    object.__setattr__(config, "_flags", flags.FLAGS)


def _flag_checker(name: str, error: type[Exception]) -> Any:
    def check(value: Any) -> bool:
        try:
            _checked(name, value)
        except ValueError as e:
            raise error(str(e)) from None
        return True

    return check


class _DefineFlagsOnAbslImport:
    """Defines the flags right after ``absl.flags`` is imported (absl is optional and costs
    time to import, so grain_core never imports it itself). A finder with only ``find_spec``
    (a ``PathFinder`` subclass would list every distribution twice to importlib.metadata)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "absl.flags":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            loader: Any = spec.loader
            execute = loader.exec_module

            def exec_then_define(module: types.ModuleType) -> None:
                execute(module)
                _define_absl_flags(module)

            loader.exec_module = exec_then_define
        return spec


if "absl.flags" in sys.modules:
    _define_absl_flags(sys.modules["absl.flags"])
else:
    sys.meta_path.insert(0, _DefineFlagsOnAbslImport())

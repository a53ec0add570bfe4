"""Pipeline-wide options (``grain.experimental.DatasetOptions``) and the filter-ratio checker."""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from typing import Any

from grain_core.config import config

__all__ = [
    "DatasetOptions",
    "ExecutionTrackingMode",
    "FilterRatioChecker",
    "pipeline_options",
    "trace_pipelines",
]

_logger = logging.getLogger("grain_core")


class ExecutionTrackingMode(enum.Enum):
    """Whether iterators record per-stage timing (see ``grain_core.experimental`` stats).

    ``STAGE_TRACING`` (grain_core's own) is ``STAGE_TIMING`` plus one timeline span per stage
    call (``grain_core.experimental.Trace`` sets it on the pipelines built while it is open).
    """

    DISABLED = "DISABLED"
    STAGE_TIMING = "STAGE_TIMING"
    STAGE_TRACING = "STAGE_TRACING"


#: Whether pipelines built now trace their stages: a ``Trace`` is open in this process.
_tracing = False


def trace_pipelines(on: bool) -> None:
    """Makes the pipelines built from now on trace their stages (``on``) or not: what opening
    and closing a ``grain_core.observe.spans.Trace`` does."""
    global _tracing
    _tracing = on


def pipeline_options() -> DatasetOptions:
    """The options a new pipeline starts from: the defaults, with stage timing set explicitly
    while ``py_debug_mode`` or ``py_dataset_visualization_output_dir`` is on (stage tracing while
    a ``Trace`` is open), so that the mode reaches worker processes with the pipeline's options.
    """
    if _tracing:
        return _TRACING_OPTIONS
    if config.py_debug_mode or config.py_dataset_visualization_output_dir is not None:
        return _TIMING_OPTIONS
    return _DEFAULT_OPTIONS


_UNSET: Any = object()


@dataclasses.dataclass(kw_only=True, frozen=True)
class DatasetOptions:
    """Options that apply to a whole pipeline.

    Attributes:
      filter_warn_threshold_ratio: warn when a filtering point drops at least this share of a
        window of elements (``None`` disables; ``0.0`` is a real threshold).
      filter_raise_threshold_ratio: raise ``ValueError`` at this dropped share (``None``
        disables).
      execution_tracking_mode: ``STAGE_TIMING`` records per-stage element counts and self time,
        ``STAGE_TRACING`` also timeline spans.
      min_shm_size: arrays smaller than this many bytes travel through the worker queue instead
        of shared memory.
    """

    filter_warn_threshold_ratio: float | None = _UNSET
    filter_raise_threshold_ratio: float | None = _UNSET
    execution_tracking_mode: ExecutionTrackingMode = _UNSET
    min_shm_size: int = _UNSET

    _DEFAULTS = {
        "filter_warn_threshold_ratio": 0.9,
        "filter_raise_threshold_ratio": None,
        "execution_tracking_mode": ExecutionTrackingMode.DISABLED,
        "min_shm_size": 0,
    }

    def __post_init__(self) -> None:
        explicit = []
        for name, default in self._DEFAULTS.items():
            if getattr(self, name) is _UNSET:
                object.__setattr__(self, name, default)
            else:
                explicit.append(name)
        object.__setattr__(self, "_explicit", frozenset(explicit))
        for name in ("filter_warn_threshold_ratio", "filter_raise_threshold_ratio"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"DatasetOptions.{name} must be in [0, 1] or None, got {value}.")
        if self.min_shm_size < 0:
            raise ValueError(f"DatasetOptions.min_shm_size must be >= 0, got {self.min_shm_size}.")

    def merge(self, other: DatasetOptions | None) -> DatasetOptions:
        """Returns options where fields set explicitly on ``self`` win over those set on ``other``."""
        if other is None:
            return self
        values = {}
        for name in self._DEFAULTS:
            if name in self._explicit:  # type: ignore[attr-defined]
                values[name] = getattr(self, name)
            elif name in other._explicit:  # type: ignore[attr-defined]
                values[name] = getattr(other, name)
        return DatasetOptions(**values)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._DEFAULTS)
        return f"DatasetOptions({fields})"


_TIMING_OPTIONS = DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING)
_TRACING_OPTIONS = DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TRACING)


class FilterRatioChecker:
    """Counts kept/dropped elements at one filtering point and enforces the options' thresholds.

    Checks run every ``window`` consumed elements, so the cost per element is one increment.
    Messages start with Grain's text (``Transformation <name> skipped <p> % of the last seen
    <n> elements``), which users' log monitoring matches; ``where`` follows it.

    Args:
      name: The filtering iterator, as Grain names it.
      where: What it reads, named after Grain's text ("" for nothing more).
      window: Elements between checks.
    """

    __slots__ = ("_name", "_where", "_window", "_seen", "_dropped", "_last_warning")

    def __init__(self, name: str, where: str = "", window: int = 1000) -> None:
        self._name = name
        self._where = f" ({where})" if where else ""
        self._window = window
        self._seen = 0
        self._dropped = 0
        self._last_warning = -float("inf")

    def record(self, seen: int, dropped: int, options: DatasetOptions | None) -> None:
        """Records ``seen`` consumed elements of which ``dropped`` were removed."""
        self._seen += seen
        self._dropped += dropped
        if self._seen < self._window:
            return
        seen = self._seen
        ratio = self._dropped / seen
        self._seen = self._dropped = 0
        opts = options if options is not None else _DEFAULT_OPTIONS
        raise_at = opts.filter_raise_threshold_ratio
        if raise_at is not None and ratio >= raise_at and ratio > 0:
            raise ValueError(
                f"Transformation {self._name} skipped {100 * ratio:.2f} % of the last seen "
                f"{seen} elements{self._where}, at or above filter_raise_threshold_ratio="
                f"{raise_at}. Check the filter predicate, or change the threshold with "
                "grain_core.experimental.DatasetOptions(filter_raise_threshold_ratio=...)."
            )
        warn_at = opts.filter_warn_threshold_ratio
        if warn_at is not None and ratio >= warn_at and ratio > 0:
            now = time.monotonic()
            if now - self._last_warning >= 60:
                self._last_warning = now
                _logger.warning(
                    "Transformation %s skipped %.2f %% of the last seen %d elements%s "
                    "(filter_warn_threshold_ratio=%s).",
                    self._name,
                    100 * ratio,
                    seen,
                    self._where,
                    warn_at,
                )


_DEFAULT_OPTIONS = DatasetOptions()

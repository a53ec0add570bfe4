"""``grain_core.profiling``: the Python API of ``grain-core profile`` under its public name.

The implementation is ``grain_core.observe.profile`` (see ``docs/debugging.md``); these are
the same objects.
"""

from __future__ import annotations

from grain_core.observe.profile import (
    PipelineError,
    ProcessTime,
    ProfileData,
    StageTime,
    analyze,
    format_share,
    load_pipeline,
    profile,
    report_from_trace,
    stage_label,
)

__all__ = [
    "PipelineError",
    "ProcessTime",
    "ProfileData",
    "StageTime",
    "analyze",
    "format_share",
    "load_pipeline",
    "profile",
    "report_from_trace",
    "stage_label",
]

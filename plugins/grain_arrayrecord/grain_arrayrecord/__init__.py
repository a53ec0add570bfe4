"""grainpipe-arrayrecord: ArrayRecord files for grain_core.

``ArrayRecordDataSource`` reads blocks of records with one parallel C++ read per file;
``ArrayRecordWriter`` writes files for fast random access (``group_size=1``);
``inspect_array_record`` describes a file set.
"""

from __future__ import annotations

# The package index's `grain-core` is an unrelated project that also installs a top-level
# grain_core package; this plugin extends the grain_core of the `grainpipe` distribution.
try:
    import grain_core.plugins  # noqa: F401
except ModuleNotFoundError as err:
    if err.name not in ("grain_core", "grain_core.plugins"):
        raise
    raise ImportError(
        "grain_arrayrecord needs grain_core from the `grainpipe` distribution, "
        + (
            "which is not installed: pip install . (in a clone of grain_core)"
            if err.name == "grain_core"
            else "but the grain_core installed here has no grain_core.plugins: it is another "
            "project's (the package index's `grain-core`). Replace it: "
            "pip uninstall grain-core && pip install . (in a clone of grain_core)"
        ),
        name="grain_core",
    ) from err

from grain_arrayrecord._inspect import inspect_array_record
from grain_arrayrecord._paths import FileInstructionLike
from grain_arrayrecord._source import ArrayRecordDataSource, RecordIndexError
from grain_arrayrecord._writer import ArrayRecordWriter

__version__ = "0.1.0"

__all__ = [
    "ArrayRecordDataSource",
    "ArrayRecordWriter",
    "FileInstructionLike",
    "RecordIndexError",
    "inspect_array_record",
]

"""grain-arrayrecord: ArrayRecord files for grain_core.

``ArrayRecordDataSource`` reads blocks of records with one parallel C++ read per file;
``ArrayRecordWriter`` writes files for fast random access (``group_size=1``);
``inspect_array_record`` describes a file set.
"""

from __future__ import annotations

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

"""``inspect_array_record``: what an ArrayRecord file (or file set) holds."""

from __future__ import annotations

from grain_arrayrecord._source import ArrayRecordDataSource, writer_group_size
from grain_core import storage
from grain_core.plugins import FormatInfo

__all__ = ["inspect_array_record"]

_PREVIEW_BYTES = 64


def inspect_array_record(path: str, sample_size: int) -> FormatInfo:
    """Describes ArrayRecord data: record count, files, size, group size and a sample.

    Args:
      path: Anything ``ArrayRecordDataSource`` accepts as one path (file, glob, range).
      sample_size: How many leading records to return in ``sample``.

    Raises:
      FileNotFoundError / ValueError: As for :class:`ArrayRecordDataSource`.
    """
    with ArrayRecordDataSource(path) as source:
        count = min(max(sample_size, 0), len(source))
        sample = tuple(source.__getitems__(range(count)))
        first = sample[0] if sample else (source[0] if len(source) else None)
        files = sorted(set(source.paths))
        group_sizes = sorted(
            {size for size in (writer_group_size(source._reader(f)) for f in files) if size}
        )
    details = {
        "files": files,
        "bytes": sum(storage.size(f) for f in files),
        "group_size": group_sizes[0] if len(group_sizes) == 1 else group_sizes or None,
        "first_record_preview": None if first is None else _preview(first),
    }
    return FormatInfo(num_records=len(source), schema="bytes", sample=sample, details=details)


def _preview(record: bytes) -> str:
    shown = repr(record[:_PREVIEW_BYTES])
    return shown + (f" ... ({len(record)} bytes)" if len(record) > _PREVIEW_BYTES else "")

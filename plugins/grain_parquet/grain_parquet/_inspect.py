"""``inspect_parquet``: what a Parquet file holds, from its footer and first rows."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from grain_core.plugins import FormatInfo
from grain_parquet._files import (
    column_to_numpy,
    open_parquet,
    read_error,
    resolve_paths,
    rows_from_columns,
)

__all__ = ["inspect_parquet"]


def inspect_parquet(path: str, sample_size: int) -> FormatInfo:
    """Describes a Parquet file or file set: rows, schema, row groups, sizes, the first rows.

    Args:
      path: A path or URI (every file the sources resolve it to is described together).
      sample_size: How many leading rows to return in ``sample``.

    Raises:
      FileNotFoundError / ValueError: If a file is missing, not Parquet, or its first rows
        cannot be decoded (the message names the file).
    """
    files = resolve_paths(path, what="inspect_parquet")
    sample: list[Any] = []
    row_groups = []
    num_rows = 0
    created_by, format_version, schema = set(), set(), None
    for file in files:
        with open_parquet(file, {}) as handle:
            metadata = handle.metadata
            schema = schema or handle.schema_arrow
            count = min(max(sample_size - len(sample), 0), metadata.num_rows)
            if count:
                try:
                    batch = next(handle.iter_batches(batch_size=count))
                except (pa.ArrowException, OSError) as err:  # the first rows: row group 0
                    raise read_error(file, 0, err, {}, None) from err
                sample += rows_from_columns(
                    batch.schema.names, [column_to_numpy(c) for c in batch.columns]
                )
        row_groups += [metadata.row_group(g) for g in range(metadata.num_row_groups)]
        num_rows += metadata.num_rows
        created_by.add(str(metadata.created_by))
        format_version.add(str(metadata.format_version))
    compressed = sum(
        rg.column(c).total_compressed_size for rg in row_groups for c in range(rg.num_columns)
    )
    codecs = sorted({rg.column(c).compression for rg in row_groups for c in range(rg.num_columns)})
    details = {
        "files": [file.display for file in files],
        "bytes": sum(file.size() for file in files),
        "row_groups": len(row_groups),
        "rows_per_row_group": [rg.num_rows for rg in row_groups],
        "compressed_bytes": compressed,
        "uncompressed_bytes": sum(rg.total_byte_size for rg in row_groups),
        "compression": codecs,
        "created_by": " | ".join(sorted(created_by)),
        "format_version": " | ".join(sorted(format_version)),
    }
    return FormatInfo(
        num_records=num_rows,
        schema={field.name: str(field.type) for field in schema or ()},
        sample=tuple(sample),
        details=details,
    )

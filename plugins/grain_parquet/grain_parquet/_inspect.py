"""``inspect_parquet``: what a Parquet file holds, from its footer and first rows."""

from __future__ import annotations

from typing import Any

from grain_core.plugins import FormatInfo
from grain_parquet._files import column_to_numpy, open_parquet, resolve_paths, rows_from_columns

__all__ = ["inspect_parquet"]


def inspect_parquet(path: str, sample_size: int) -> FormatInfo:
    """Describes a Parquet file: rows, schema, row groups, sizes and the first rows.

    Args:
      path: A path or URI.
      sample_size: How many leading rows to return in ``sample``.

    Raises:
      FileNotFoundError / ValueError: If the file is missing or not Parquet.
    """
    (file,) = resolve_paths(path, what="inspect_parquet")
    with open_parquet(file, {}) as handle:
        metadata = handle.metadata
        schema = handle.schema_arrow
        count = min(max(sample_size, 0), metadata.num_rows)
        sample: tuple[Any, ...] = ()
        if count:
            batch = next(handle.iter_batches(batch_size=count))
            sample = tuple(
                rows_from_columns(schema.names, [column_to_numpy(c) for c in batch.columns])
            )
    row_groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
    compressed = sum(
        rg.column(c).total_compressed_size for rg in row_groups for c in range(rg.num_columns)
    )
    codecs = sorted({rg.column(c).compression for rg in row_groups for c in range(rg.num_columns)})
    details = {
        "files": [file.display],
        "bytes": file.size(),
        "row_groups": metadata.num_row_groups,
        "rows_per_row_group": [rg.num_rows for rg in row_groups],
        "compressed_bytes": compressed,
        "uncompressed_bytes": sum(rg.total_byte_size for rg in row_groups),
        "compression": codecs,
        "created_by": metadata.created_by,
        "format_version": metadata.format_version,
    }
    return FormatInfo(
        num_records=metadata.num_rows,
        schema={field.name: str(field.type) for field in schema},
        sample=sample,
        details=details,
    )

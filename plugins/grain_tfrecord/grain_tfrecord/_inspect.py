"""The ``tfrecord`` format's inspector: record count, sizes, and a schema read from a sample of
the Examples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_core import storage
from grain_core.plugins import FormatInfo
from grain_tfrecord._dataset import TFRecordIterDataset
from grain_tfrecord._example import ExampleDecodeError, decode_example
from grain_tfrecord._framing import FRAME_OVERHEAD, compression_for, expand_paths
from grain_tfrecord._source import scan_offsets

__all__ = ["inspect_tfrecord"]


def inspect_tfrecord(
    path: str,
    sample_size: int,
    *,
    compression: str | None = None,
    verify_crc: bool = True,
    schema_sample: int = 100,
) -> FormatInfo:
    """Describes a TFRecord file or file set (any path or pattern ``TFRecordIterDataset``
    takes: ``x@4``, ``x-*-of-00004``, globs).

    ``num_records`` and the record sizes come from the frame headers of uncompressed files
    (nothing is written: no index beside the data) and from a full verified pass over
    compressed ones. When the records are ``tf.train.Example``, ``schema`` describes each
    feature over the first ``schema_sample`` records: its dtype, its ``shape`` (``[None]``
    with the ``lengths`` seen when the number of values varies) and, if some records lack
    it, in how many of them it is ``missing``; the sample holds decoded Examples.

    Raises:
      FileNotFoundError: If a file does not exist.
      ValueError: If a pattern matches no file, or for an unknown compression.
      CorruptRecordError: If a file is damaged.
    """
    files = expand_paths(path, "inspect_tfrecord")
    wanted = max(sample_size, schema_sample, 1)
    head: list[bytes] = []
    sizes: list[np.ndarray] = []
    compressions = set()
    for file in files:
        file_compression = compression_for(file, compression)
        compressions.add(file_compression or "none")
        if file_compression is None:
            size = storage.size(file)
            offsets = scan_offsets(file, None, size)
            ends = np.append(offsets[1:], size)
            sizes.append(ends - offsets - FRAME_OVERHEAD)
            if len(head) < wanted and len(offsets):
                head += _records(file, compression, verify_crc, wanted - len(head))
        else:
            file_sizes = []
            for record in _records(file, compression, verify_crc, None):
                if len(head) < wanted:
                    head.append(record)
                file_sizes.append(len(record))
            sizes.append(np.array(file_sizes, dtype=np.int64))
    all_sizes = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
    details: dict[str, Any] = {
        "files": len(files) if len(files) > 3 else files,
        "compression": " ".join(sorted(compressions)),
        "file_bytes": sum(storage.size(f) for f in files),
    }
    if len(all_sizes):
        details["record_bytes"] = {
            "min": int(all_sizes.min()),
            "mean": round(float(all_sizes.mean()), 1),
            "max": int(all_sizes.max()),
        }
    examples = [_as_example(r) for r in head[:schema_sample]]
    if not examples or any(e is None for e in examples):
        schema: Any = "bytes" if len(all_sizes) else None
        shown: tuple[Any, ...] = tuple(head[:sample_size])
    else:
        schema = _schema([e for e in examples if e is not None])
        details["records"] = "tf.train.Example"
        details["schema_from_records"] = len(examples)
        shown = tuple(_as_example(r) or r for r in head[:sample_size])
    return FormatInfo(num_records=len(all_sizes), schema=schema, sample=shown, details=details)


def _records(
    path: str, compression: str | None, verify_crc: bool, count: int | None
) -> list[bytes]:
    """The first ``count`` records of ``path`` (all with None), CRCs checked."""
    out: list[bytes] = []
    dataset = TFRecordIterDataset(path, compression=compression, verify_crc=verify_crc)
    with iter(dataset) as records:
        for record in records:
            out.append(record)
            if count is not None and len(out) == count:
                break
    return out


def _schema(examples: Sequence[dict[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
    """Each feature of ``examples``: dtype, shape (``[None]`` when its length varies, with the
    ``lengths`` seen) and, when some Examples lack it, in how many it is ``missing``."""
    names = sorted({name for example in examples for name in example})
    schema: dict[str, dict[str, Any]] = {}
    for name in names:
        values = [e[name] for e in examples if name in e]
        dtypes = sorted({_dtype_name(v) for v in values})
        lengths = sorted({len(v) for v in values})
        entry: dict[str, Any] = {"dtype": " | ".join(dtypes)}
        if len(lengths) == 1:
            entry["shape"] = [lengths[0]]
        else:
            entry["shape"] = [None]
            entry["lengths"] = [lengths[0], lengths[-1]]
        if len(values) < len(examples):
            entry["missing"] = f"in {len(examples) - len(values)} of {len(examples)} records"
        schema[name] = entry
    return schema


def _as_example(record: bytes) -> dict[str, np.ndarray] | None:
    """The record decoded as an Example, or None if it is not one (or holds no feature)."""
    try:
        decoded = decode_example(record)
    except ExampleDecodeError:
        return None
    return decoded or None


def _dtype_name(values: np.ndarray) -> str:
    return "bytes" if values.dtype == object else str(values.dtype)

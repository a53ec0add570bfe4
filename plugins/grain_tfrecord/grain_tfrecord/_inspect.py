"""The ``tfrecord`` format's inspector: record count, sizes and the first Example decoded."""

from __future__ import annotations

from typing import Any

import numpy as np

from grain_core import storage
from grain_core.plugins import FormatInfo
from grain_tfrecord._dataset import TFRecordIterDataset
from grain_tfrecord._example import ExampleDecodeError, decode_example
from grain_tfrecord._framing import FRAME_OVERHEAD, compression_for
from grain_tfrecord._source import load_or_build_index

__all__ = ["inspect_tfrecord"]


def inspect_tfrecord(path: str, sample_size: int) -> FormatInfo:
    """Describes one TFRecord file (a local path or a URL).

    ``num_records`` and the record sizes come from the offset index for an uncompressed
    file (headers only) and from a full verified pass for a compressed one. When the first
    record is a ``tf.train.Example``, ``schema`` maps each feature to its dtype and shape
    and the sample holds decoded Examples; otherwise records are shown as bytes.

    Raises:
      FileNotFoundError: If the file does not exist.
      CorruptRecordError: If the file is damaged.
    """
    compression = compression_for(path, None)
    version = storage.version(path)
    sample: list[bytes] = []
    if compression is None:
        offsets = load_or_build_index(path, version=version)
        ends = np.append(offsets[1:], version[0])
        sizes = ends - offsets - FRAME_OVERHEAD
        if len(offsets) and sample_size:
            sample = _first_records(path, max(sample_size, 1))
    else:
        sizes_list = []
        with iter(TFRecordIterDataset(path)) as records:
            for record in records:
                if len(sample) < max(sample_size, 1):
                    sample.append(record)
                sizes_list.append(len(record))
        sizes = np.array(sizes_list, dtype=np.int64)
    if not sample and len(sizes):
        sample = _first_records(path, 1)
    first = _as_example(sample[0]) if sample else None
    details: dict[str, Any] = {
        "compression": compression or "none",
        "file_bytes": version[0],
    }
    if len(sizes):
        details["record_bytes"] = {
            "min": int(sizes.min()),
            "mean": round(float(sizes.mean()), 1),
            "max": int(sizes.max()),
        }
    if first is None:
        schema: Any = "bytes" if len(sizes) else None
        shown: tuple[Any, ...] = tuple(sample[:sample_size])
    else:
        schema = {
            name: {"dtype": _dtype_name(v), "shape": list(v.shape)} for name, v in first.items()
        }
        details["records"] = "tf.train.Example"
        shown = tuple(_as_example(r) or r for r in sample[:sample_size])
    return FormatInfo(num_records=len(sizes), schema=schema, sample=shown, details=details)


def _first_records(path: str, count: int) -> list[bytes]:
    out = []
    with iter(TFRecordIterDataset(path)) as records:
        for record in records:
            out.append(record)
            if len(out) == count:
                break
    return out


def _as_example(record: bytes) -> dict[str, np.ndarray] | None:
    """The record decoded as an Example, or None if it is not one (or holds no feature)."""
    try:
        decoded = decode_example(record)
    except ExampleDecodeError:
        return None
    return decoded or None


def _dtype_name(values: np.ndarray) -> str:
    return "bytes" if values.dtype == object else str(values.dtype)

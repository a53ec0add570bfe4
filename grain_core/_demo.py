"""The seed document's pipeline over generated in-memory records.

Shared by ``grain-core demo`` and the benchmarks, which also run it on Google Grain: the
pipeline is built from whichever module is passed as ``api`` (``grain_core`` or ``grain``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["BATCH_SIZE", "IMAGE_SHAPE", "make_records", "normalise", "seed_pipeline"]

IMAGE_SHAPE = (28, 28, 1)
BATCH_SIZE = 128


def make_records(num_records: int, seed: int = 0) -> list[dict[str, Any]]:
    """Returns ``num_records`` MNIST-like records ``{"image": uint8[28,28,1], "label": int}``.

    Raises:
      ValueError: If ``num_records`` is negative.
    """
    if num_records < 0:
        raise ValueError(f"num_records must be non-negative, got {num_records}.")
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(num_records, *IMAGE_SHAPE), dtype=np.uint8)
    labels = rng.integers(0, 10, size=num_records).tolist()
    return [{"image": image, "label": label} for image, label in zip(images, labels, strict=True)]


def normalise(record: dict[str, Any]) -> dict[str, Any]:
    """Scales the image to float32 in [0, 1]."""
    return {"image": record["image"].astype(np.float32) / 255.0, "label": record["label"]}


def seed_pipeline(api: ModuleType, records: Any) -> Any:
    """``source → seed(42) → shuffle → repeat → map(normalise) → batch(128, drop_remainder)``.

    Args:
      api: A module with Grain's ``MapDataset`` (``grain_core``, or Google's ``grain``).
      records: Any random-access source of records.
    """
    return (
        api.MapDataset.source(records)
        .seed(42)
        .shuffle()
        .repeat()
        .map(normalise)
        .batch(BATCH_SIZE, drop_remainder=True)
    )

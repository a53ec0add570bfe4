"""Record and RecordMetadata."""

from __future__ import annotations

import numpy as np

from grain_core import Record, RecordMetadata


def test_remove_record_key() -> None:
    rng = np.random.default_rng(0)
    meta = RecordMetadata(index=3, record_key=7, rng=rng)
    stripped = meta.remove_record_key()
    assert stripped == RecordMetadata(index=3, record_key=None, rng=rng)
    assert meta.record_key == 7  # a copy, not a mutation
    assert stripped.remove_record_key() is stripped


def test_str_and_slots() -> None:
    meta = RecordMetadata(index=1, record_key=2)
    assert str(meta) == "RecordMetadata(index=1, record_key=2, rng=None)"
    record = Record(meta, {"x": 1})
    assert record.data == {"x": 1} and record.metadata is meta
    assert not hasattr(record, "__dict__") and not hasattr(meta, "__dict__")
    assert (
        str(record)
        == "Record(metadata=RecordMetadata(index=1, record_key=2, rng=None), data={'x': 1})"
    )

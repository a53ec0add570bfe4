"""grain_tfrecord's record-at-a-time reader (``TFRecordReader``) and its iterator: every
record in order, checkpoints, both CRCs checked, truncation named."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

grain_tfrecord = pytest.importorskip("grain_tfrecord")

from grain_tfrecord import (  # noqa: E402
    CorruptRecordError,
    TFRecordReader,
    TFRecordReaderIterator,
    TFRecordWriter,
)


def _write(path: Path, records: list[bytes]) -> Path:
    with TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    return path


@given(st.lists(st.binary(max_size=300), max_size=20), st.data())
def test_reads_every_record_and_resumes_anywhere(
    tmp_path_factory: pytest.TempPathFactory, records: list[bytes], data: st.DataObject
) -> None:
    path = _write(tmp_path_factory.mktemp("r") / "x.tfrecord", records)
    assert list(TFRecordReader(path)) == records
    stop = data.draw(st.integers(0, len(records)))
    it = TFRecordReaderIterator(path)
    head = [next(it) for _ in range(stop)]
    resumed = TFRecordReaderIterator(path)
    resumed.set_state(it.get_state())
    assert head + list(resumed) == records


@pytest.mark.parametrize(("flip_at", "which"), [(9, "length CRC"), (13, "data CRC")])
def test_a_damaged_record_is_named(tmp_path: Path, flip_at: int, which: str) -> None:
    path = _write(tmp_path / "x.tfrecord", [b"first", b"second"])
    raw = bytearray(path.read_bytes())
    second = 12 + len(b"first") + 4
    raw[second + flip_at] ^= 0xFF
    path.write_bytes(bytes(raw))
    reader = TFRecordReader(path)
    assert next(reader) == b"first"
    with pytest.raises(CorruptRecordError, match=f"{which} mismatch .* byte offset {second}"):
        next(reader)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.tfrecord", [b"record"])
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CorruptRecordError, match=r"x\.tfrecord ends .* offset 0"):
        next(TFRecordReader(path))


def test_a_subclass_may_hand_over_its_own_stream(tmp_path: Path) -> None:
    """Subclasses written for Grain's reader skip ``__init__`` and set ``_reader``."""
    path = _write(tmp_path / "x.tfrecord", [b"a", b"b"])

    class OwnStream(TFRecordReader):
        def __init__(self, name: Path) -> None:
            self._reader = open(name, "rb")  # noqa: SIM115 - the reader closes it

    reader = OwnStream(path)
    assert list(reader) == [b"a", b"b"]
    reader.close()

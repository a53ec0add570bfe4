"""grainpipe-tfrecord: framing, streaming reader, indexed source, writer, plugin registration.

Runs where the plugin is installed (``nox -s tests-tfrecord``, ``tests-all``).
"""

from __future__ import annotations

import functools
import gzip
import itertools
import os
import pickle
import struct
import tempfile
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

grain_tfrecord = pytest.importorskip("grain_tfrecord")

from grain_tfrecord import (  # noqa: E402
    CorruptRecordError,
    FeatureSpec,
    TFRecordDataSource,
    TFRecordIterDataset,
    TFRecordWriter,
    decode_example,
    encode_example,
)
from grain_tfrecord._dataset import TFRecordFileIterator  # noqa: E402
from grain_tfrecord._source import _cached_index_path, index_path_for  # noqa: E402
from grain_tfrecord._stream import Block, FrameReader  # noqa: E402

import grain_core  # noqa: E402
from grain_core import plugins  # noqa: E402
from grain_core.experimental import InterleaveIterDataset, SupportsNextBlock  # noqa: E402
from grain_core.options import MultiprocessingOptions  # noqa: E402
from grain_core.testing import (  # noqa: E402
    assert_equal_output_after_checkpoint,
    check_iterator_conformance,
    check_random_access_source,
)


@pytest.fixture(autouse=True)
def _fresh_global_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAIN_CORE_PLUGINS", raising=False)
    monkeypatch.delenv("GRAIN_CORE_DISABLE_PLUGINS", raising=False)
    plugins.reset()


def _records(file_index: int, count: int) -> list[bytes]:
    return [f"file{file_index}-record{i}-".encode() * (i % 5) for i in range(count)]


def _write(path: Path, records: list[bytes], compression: str | None = None) -> Path:
    with TFRecordWriter(path, compression=compression) as writer:
        for record in records:
            writer.write(record)
    return path


@pytest.fixture
def shards(tmp_path: Path) -> tuple[list[Path], list[list[bytes]]]:
    contents = [_records(k, n) for k, n in enumerate((7, 3, 5, 4))]
    paths = [
        _write(tmp_path / f"train.tfrecord-{k:05d}-of-00004", records)
        for k, records in enumerate(contents)
    ]
    return paths, contents


def _masked(crc: int) -> int:
    # The TFRecord masking rule, written out independently of the package.
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


# ------------------------------------------------------------------------------- writer
def test_writer_exact_bytes_of_a_small_known_file(tmp_path: Path) -> None:
    # RFC 3720 (iSCSI) CRC32C test vectors: 32 zero bytes and 32 0xFF bytes.
    zeros, ones = bytes(32), b"\xff" * 32
    path = _write(tmp_path / "known.tfrecord", [zeros, ones, b""])
    data = path.read_bytes()
    length_32 = struct.pack("<Q", 32)
    length_0 = struct.pack("<Q", 0)
    import crc32c

    assert crc32c.crc32c(zeros) == 0x8A9136AA and crc32c.crc32c(ones) == 0x62A8AB43
    expected = (
        length_32
        + struct.pack("<I", _masked(crc32c.crc32c(length_32)))
        + zeros
        + struct.pack("<I", _masked(0x8A9136AA))
        + length_32
        + struct.pack("<I", _masked(crc32c.crc32c(length_32)))
        + ones
        + struct.pack("<I", _masked(0x62A8AB43))
        + length_0
        + struct.pack("<I", _masked(crc32c.crc32c(length_0)))
        + struct.pack("<I", _masked(0))
    )
    assert data == expected
    assert len(data) == 3 * 16 + 64
    # Pinned bytes of the 32-zero-byte frame: length 32, then both masked CRCs.
    assert (
        data[:12].hex()
        == "2000000000000000" + struct.pack("<I", _masked(crc32c.crc32c(length_32))).hex()
    )
    assert data[44:48] == struct.pack("<I", _masked(0x8A9136AA))


@pytest.mark.parametrize(
    ("suffix", "compression", "decompress"),
    [
        (".tfrecord.gz", None, gzip.decompress),
        (".tfrecord", "GZIP", gzip.decompress),
        (".tfrecord", "ZLIB", zlib.decompress),
        (".tfrecord.zlib", None, zlib.decompress),
    ],
)
def test_compressed_files_hold_the_plain_frames(
    tmp_path: Path, suffix: str, compression: str | None, decompress: object
) -> None:
    records = _records(0, 300)
    plain = _write(tmp_path / "plain.tfrecord", records)
    packed = _write(tmp_path / f"packed{suffix}", records, compression)
    assert decompress(packed.read_bytes()) == plain.read_bytes()  # type: ignore[operator]
    assert list(TFRecordIterDataset(packed, compression=compression)) == records


def test_writer_encodes_mappings_as_examples_and_rejects_other_records(tmp_path: Path) -> None:
    path = tmp_path / "ex.tfrecord"
    with TFRecordWriter(path) as writer:
        writer.write({"label": 3, "text": "hi"})
        with pytest.raises(TypeError, match="record 1 is a int"):
            writer.write(5)
    (record,) = list(TFRecordIterDataset(path))
    assert record == encode_example({"label": 3, "text": "hi"})


def test_writer_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "atomic.tfrecord"
    with pytest.raises(RuntimeError), TFRecordWriter(path) as writer:
        writer.write(b"a")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_writer_never_follows_a_symlink_at_the_old_temporary_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out.tfrecord"
    (tmp_path / f"out.tfrecord.tmp-{os.getpid()}").symlink_to(victim)
    _write(out, [b"a", b"b"])
    assert victim.read_bytes() == b"precious"
    assert list(TFRecordIterDataset(out)) == [b"a", b"b"]


# ------------------------------------------------------------------------ streaming reader
def test_single_file_reads_in_order_and_checkpoints_anywhere(
    shards: tuple[list[Path], list[list[bytes]]],
) -> None:
    paths, contents = shards
    ds = TFRecordIterDataset(path=paths[0])  # the keyword Grain's dataset has
    out = check_iterator_conformance(ds, positions=range(len(contents[0]) + 1))
    assert out == contents[0]
    assert_equal_output_after_checkpoint(ds)
    it = iter(ds)
    assert it.get_state() == {"reader_offset": 0}
    next(it)
    assert it.get_state() == {"reader_offset": 16 + len(contents[0][0])}


def test_multiple_files_chain_or_interleave_with_interleave_state(
    shards: tuple[list[Path], list[list[bytes]]],
) -> None:
    paths, contents = shards
    chained = TFRecordIterDataset([str(p) for p in paths])
    assert list(chained) == [r for records in contents for r in records]
    interleaved = TFRecordIterDataset(paths, cycle_length=2)
    out = check_iterator_conformance(interleaved, positions=[0, 1, 5, 10, 18, 19])
    assert out[:4] == [contents[0][0], contents[1][0], contents[0][1], contents[1][1]]
    assert sorted(out) == sorted(r for records in contents for r in records)
    assert_equal_output_after_checkpoint(interleaved)
    state = iter(interleaved).get_state()
    assert set(state) == {
        "next_index_in_cycle",
        "next_index_in_datasets",
        "iterators_in_use_indices",
        "iterators_in_use_states",
        "exhausted",
        "future_states",
    }
    assert state["iterators_in_use_states"][0] == {"reader_offset": 0}


def test_patterns_and_shard_specs_expand_in_order(
    shards: tuple[list[Path], list[list[bytes]]],
) -> None:
    paths, contents = shards
    everything = [r for records in contents for r in records]
    base = str(paths[0]).rsplit("-00000-of-00004", 1)[0]
    assert list(TFRecordIterDataset(f"{base}@4")) == everything
    assert list(TFRecordIterDataset(f"{base}-*-of-00004")) == everything
    with pytest.raises(FileNotFoundError, match="matches no file"):
        TFRecordIterDataset(f"{base}-*-of-00099")
    with pytest.raises(ValueError, match="at least one path"):
        TFRecordIterDataset([])


def test_with_slice_gives_workers_whole_files(
    shards: tuple[list[Path], list[list[bytes]]],
) -> None:
    paths, contents = shards
    ds = TFRecordIterDataset(paths)
    assert list(ds.with_slice(slice(1, None, 2))) == contents[1] + contents[3]
    assert list(ds.with_slice(slice(5, None, 8))) == []
    assert ds.paths == tuple(map(str, paths))  # the original is untouched
    with pytest.raises(ValueError, match="single file"):
        TFRecordIterDataset(paths[0]).with_slice(slice(0, None, 2))


def test_mp_prefetch_reads_files_in_worker_processes(
    shards: tuple[list[Path], list[list[bytes]]],
) -> None:
    paths, contents = shards
    ds = TFRecordIterDataset(paths).map(len)
    with iter(ds.mp_prefetch(MultiprocessingOptions(num_workers=2))) as it:
        head = [next(it) for _ in range(5)]
        state = it.get_state()
        rest = list(it)
    out = head + rest
    assert sorted(out) == sorted(len(r) for records in contents for r in records)
    with iter(ds.mp_prefetch(MultiprocessingOptions(num_workers=2))) as resumed:
        resumed.set_state(state)
        assert list(resumed) == rest


def _run_records(runs: list[tuple[int, int]], file_index: int = 0) -> list[bytes]:
    """Records in runs of equal lengths (``(length, count)`` per run), each record distinct."""
    records = []
    for length, count in runs:
        for _ in range(count):
            tag = f"{file_index}:{len(records)}:".encode()
            records.append((tag * (length // len(tag) + 1))[:length])
    return records


_RUNS = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 70)), min_size=1, max_size=5)


@given(runs=_RUNS, chunk_size=st.sampled_from([64, 1000, 4096]))
def test_runs_of_equal_lengths_read_exactly_across_chunks_and_blocks(
    runs: list[tuple[int, int]], chunk_size: int
) -> None:
    # Small chunks and blocks: frames cut by the end of a buffer, runs cut by block ends.
    records = _run_records(runs)
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "runs.tfrecord", records)
        with (
            mock.patch.object(grain_tfrecord._stream, "CHUNK_SIZE", chunk_size),
            mock.patch.object(grain_tfrecord._stream, "_BLOCK_BYTES", 2048),
        ):
            ds = TFRecordIterDataset(path)
            positions = sorted({0, len(records) // 3, len(records) - 1, len(records)})
            assert check_iterator_conformance(ds, positions=positions) == records


def test_restoring_within_a_file_moves_the_open_reader(tmp_path: Path) -> None:
    # Any offset, before or after the bytes read, in a file read in small chunks: the reader
    # seeks instead of being opened again, and the records from there are the file's.
    records = _records(0, 200)
    path = _write(tmp_path / "seek.tfrecord", records)
    with mock.patch.object(grain_tfrecord._stream, "CHUNK_SIZE", 1000):
        it = iter(TFRecordIterDataset(path))
        states = [it.get_state()]
        for _ in records:
            next(it)
            states.append(it.get_state())
        reader = it._reader
        for k in [150, 3, 0, 199, 200, 77, 78, 5]:
            it.set_state(states[k])
            assert it._reader is reader
            assert list(itertools.islice(it, 4)) == records[k : k + 4]


# Where a flipped bit lands in a frame (byte range; negative: from the end) and which check
# must catch it.
_DAMAGED_FIELDS = {
    "length": (0, 8, "length CRC"),
    "length CRC": (8, 12, "length CRC"),
    "payload": (12, -4, "data CRC"),
    "data CRC": (-4, 0, "data CRC"),
}


@given(
    runs=_RUNS,
    pick=st.floats(0, 1, exclude_max=True),
    field=st.sampled_from(sorted(_DAMAGED_FIELDS)),
    byte=st.integers(0, 1000),
    bit=st.integers(0, 7),
    chunk_size=st.sampled_from([1000, 1 << 20]),
)
def test_any_flipped_bit_stops_the_reader_at_the_damaged_record(
    runs: list[tuple[int, int]], pick: float, field: str, byte: int, bit: int, chunk_size: int
) -> None:
    records = _run_records(runs)
    damaged = int(pick * len(records))
    frame_offset = _frame_offset(records, damaged)
    frame_size = len(records[damaged]) + 16
    start, stop, reason = _DAMAGED_FIELDS[field]
    first, last = start % frame_size, (stop - 1) % frame_size + 1
    assume(last > first)  # an empty payload has no byte to flip
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "damaged.tfrecord", records)
        data = bytearray(path.read_bytes())
        data[frame_offset + first + byte % (last - first)] ^= 1 << bit
        path.write_bytes(bytes(data))
        with (
            mock.patch.object(grain_tfrecord._stream, "CHUNK_SIZE", chunk_size),
            mock.patch.object(grain_tfrecord._stream, "_BLOCK_BYTES", 2048),
        ):
            it = iter(TFRecordIterDataset(path))
            read = []
            with pytest.raises(CorruptRecordError) as caught:
                for record in it:
                    read.append(record)
            assert read == records[:damaged]
            assert (caught.value.offset, caught.value.reason) == (frame_offset, reason)
            assert it.get_state() == {"reader_offset": frame_offset}


def test_equal_length_frames_are_checked_as_runs_and_unchecked_when_asked(
    tmp_path: Path,
) -> None:
    records = _run_records([(100, 300)])
    path = _write(tmp_path / "fixed.tfrecord", records)
    _corrupt(path, _frame_offset(records, 250) + 12 + 50)
    reader = FrameReader(str(path), None, True, 0)
    one_by_one: list[int] = []
    parse_frames = reader._parse_frames

    def spy() -> Block:
        block = parse_frames()
        one_by_one.append(len(block.records))
        return block

    with mock.patch.object(reader, "_parse_frames", spy):
        blocks = [reader.read_block() for _ in range(6)]
    reader.close()
    # The run path takes every intact record; the loop only reports the damaged one.
    assert sum(one_by_one) == 0 and one_by_one
    assert [r for block in blocks for r in block.records] == records[:250]
    assert blocks[-1].error is not None and blocks[-1].error.reason == "data CRC"
    unchecked = list(TFRecordIterDataset(path, verify_crc=False))
    assert unchecked[:250] == records[:250] and unchecked[251:] == records[251:]
    assert unchecked[250] != records[250]


def _record_by_record(x: bytes) -> bytes:
    return x


@pytest.mark.parametrize("cycle_length", [1, 2])
def test_files_read_in_blocks_keep_the_order_and_states_of_record_by_record_reading(
    tmp_path: Path, cycle_length: int
) -> None:
    contents = [_run_records([(30, 50), (7, 3), (30, 40)], k) for k in range(3)]
    paths = [_write(tmp_path / f"run.tfrecord-{k:05d}-of-00003", r) for k, r in enumerate(contents)]
    with mock.patch.object(grain_tfrecord._stream, "_BLOCK_BYTES", 1024):
        ds = TFRecordIterDataset(paths, cycle_length=cycle_length)
        # The same interleave over inputs read one record per `next` (a map has no next_block).
        reference = InterleaveIterDataset(
            [TFRecordIterDataset(p).map(_record_by_record) for p in paths],
            cycle_length=cycle_length,
            iter_buffer_size=0,
        )
        expected = list(reference)
        assert len(expected) == sum(map(len, contents))
        out = check_iterator_conformance(ds, positions=range(0, len(expected) + 1, 11))
        assert out == expected
        assert_equal_output_after_checkpoint(ds)
        it, ref = iter(ds), iter(reference)
        for k in range(len(expected) + 1):
            assert it.get_state() == ref.get_state(), f"after {k} records"
            if k < len(expected):
                assert next(it) == next(ref) == expected[k]
        with pytest.raises(StopIteration):
            next(it)
        # A state of either restores in the other, also while a block is part taken.
        ref = iter(reference)
        for _ in range(60):
            next(ref)
        it = iter(ds)
        next(it)
        it.set_state(ref.get_state())
        assert list(it) == expected[60:]
        it.set_state(ref.get_state())
        assert next(it) == expected[60]
        ref.set_state(it.get_state())
        assert next(ref) == expected[61]
        it.close()
        with pytest.raises(ValueError, match="closed iterator"):
            next(it)


def test_file_iterator_blocks_match_next_record_for_record(tmp_path: Path) -> None:
    records = _run_records([(30, 50), (7, 3), (300, 20), (30, 40)])
    path = _write(tmp_path / "blocks.tfrecord", records)
    with mock.patch.object(grain_tfrecord._stream, "_BLOCK_BYTES", 1024):
        blocks = TFRecordFileIterator(str(path), None, True)
        single = TFRecordFileIterator(str(path), None, True)
        assert isinstance(blocks, SupportsNextBlock)
        taken: list[bytes] = []
        for max_size in itertools.cycle([1, 7, 1000]):
            block = blocks.next_block(max_size)
            assert 0 < len(block) <= max_size or not block.elements
            for k in range(len(block)):
                assert block.state_after(k) == single.get_state()
                assert next(single) == block.elements[k]
            assert block.state_after(len(block)) == single.get_state() == blocks.get_state()
            taken.extend(block.elements)
            if not block.elements:
                break
        assert taken == records
        with pytest.raises(StopIteration):
            next(single)
        # A state inside a taken block restores the iterator that handed the block out.
        assert block.state_after(0) == blocks.get_state()  # the end
        blocks.set_state({"reader_offset": 0})
        first = blocks.next_block(5)
        blocks.next_block(5)
        blocks.set_state(first.state_after(2))
        assert next(blocks) == records[2]


def test_damage_is_raised_by_the_block_after_the_intact_records(tmp_path: Path) -> None:
    records = _records(0, 9)
    path = _write(tmp_path / "bad.tfrecord", records)
    _corrupt(path, _frame_offset(records, 5) + 12 + 3)  # a payload byte of record 5
    it = TFRecordFileIterator(str(path), None, True)
    block = it.next_block(100)
    assert list(block.elements) == records[:5]
    with pytest.raises(CorruptRecordError, match="data CRC"):
        it.next_block(100)


def test_gzip_reader_restores_offsets_in_the_decompressed_stream(tmp_path: Path) -> None:
    records = [bytes([i % 251]) * (i * 37 % 3000) for i in range(400)]
    path = _write(tmp_path / "big.tfrecord.gz", records)
    ds = TFRecordIterDataset(path)
    assert check_iterator_conformance(ds, positions=[0, 1, 150, 399, 400]) == records


def test_large_records_span_many_reads(tmp_path: Path) -> None:
    records = [os.urandom(3 << 20), b"x", os.urandom(1 << 20)]
    path = _write(tmp_path / "large.tfrecord", records)
    assert list(TFRecordIterDataset(path)) == records
    assert TFRecordDataSource(path).__getitems__([2, 0]) == [records[2], records[0]]


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.tfrecord"
    empty.write_bytes(b"")
    assert list(TFRecordIterDataset(empty)) == []
    assert len(TFRecordDataSource(empty)) == 0
    # Empty shards among others (x@N output often has some) add nothing.
    full = tmp_path / "full.tfrecord"
    with TFRecordWriter(full) as writer:
        writer.write(b"hello")
        writer.write(b"world")
    source = TFRecordDataSource([empty, full, empty, full])
    expected = [b"hello", b"world"] * 2
    assert [source[i] for i in range(len(source))] == source.__getitems__(range(4)) == expected
    with pytest.raises(FileNotFoundError):
        iter(TFRecordIterDataset(tmp_path / "missing.tfrecord"))
    with pytest.raises(FileNotFoundError):
        TFRecordDataSource(tmp_path / "missing.tfrecord")
    with pytest.raises(ValueError, match="Unknown TFRecord compression 'BZIP2'"):
        TFRecordIterDataset(empty, compression="BZIP2")


def test_closed_iterator_refuses_to_advance(shards: tuple[list[Path], list[list[bytes]]]) -> None:
    it = iter(TFRecordIterDataset(shards[0][0]))
    next(it)
    it.close()
    it.close()
    with pytest.raises(ValueError, match="closed iterator"):
        next(it)


# --------------------------------------------------------------------------- bad input
def _corrupt(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _frame_offset(records: list[bytes], index: int) -> int:
    return sum(len(r) + 16 for r in records[:index])


def test_flipped_payload_byte_is_detected_and_nothing_is_returned_for_it(tmp_path: Path) -> None:
    records = _records(0, 9)
    path = _write(tmp_path / "bad.tfrecord", records)
    offset = _frame_offset(records, 6)
    _corrupt(path, offset + 12 + 3)
    it = iter(TFRecordIterDataset(path))
    assert [next(it) for _ in range(6)] == records[:6]
    with pytest.raises(CorruptRecordError) as caught:
        next(it)
    err = caught.value
    assert isinstance(err, ValueError)
    assert (err.path, err.offset, err.reason) == (str(path), offset, "data CRC")
    assert str(path) in str(err) and f"byte offset {offset}" in str(err) and "data CRC" in str(err)
    assert it.get_state() == {"reader_offset": offset}
    with pytest.raises(CorruptRecordError):  # still refuses, never skips silently
        next(it)
    restored = pickle.loads(pickle.dumps(err))
    assert (restored.path, restored.offset, restored.reason) == (err.path, offset, "data CRC")
    # verify_crc=False is the documented unsafe escape hatch: the damaged payload as is.
    unsafe = list(TFRecordIterDataset(path, verify_crc=False))
    assert unsafe[6] != records[6] and len(unsafe[6]) == len(records[6])
    assert unsafe[:6] == records[:6] and unsafe[7:] == records[7:]
    source = TFRecordDataSource(path)
    assert source[5] == records[5]
    with pytest.raises(CorruptRecordError, match="data CRC"):
        source[6]
    with pytest.raises(CorruptRecordError, match=f"byte offset {offset}"):
        source.__getitems__([0, 6, 8])
    assert TFRecordDataSource(path, verify_crc=False)[6] == unsafe[6]


def test_flipped_length_byte_fails_the_length_crc(tmp_path: Path) -> None:
    records = _records(0, 5)
    path = _write(tmp_path / "bad.tfrecord", records)
    offset = _frame_offset(records, 3)
    _corrupt(path, offset + 1)
    with pytest.raises(CorruptRecordError, match=f"length CRC mismatch .* byte offset {offset}"):
        list(TFRecordIterDataset(path))
    with pytest.raises(CorruptRecordError, match="length CRC"):
        TFRecordDataSource(path)


@pytest.mark.parametrize("cut", [3, 12 + 2, 16 + 40 + 12 + 1])
def test_truncated_header_or_payload_names_file_and_offset(tmp_path: Path, cut: int) -> None:
    records = [b"a" * 40, b"b" * 40]
    path = _write(tmp_path / "cut.tfrecord", records)
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) - cut])
    frame = 56 if cut < 56 else 0
    with pytest.raises(CorruptRecordError, match="Not a valid TFRecord. Fewer than") as caught:
        list(TFRecordIterDataset(path))
    assert str(path) in str(caught.value)
    assert caught.value.offset == frame
    with pytest.raises(CorruptRecordError, match=f"record at byte offset {frame}"):
        TFRecordDataSource(path)


def test_truncated_header_and_payload_reasons(tmp_path: Path) -> None:
    path = _write(tmp_path / "cut.tfrecord", [b"a" * 40, b"b" * 40])
    whole = path.read_bytes()
    path.write_bytes(whole[: 56 + 5])
    with pytest.raises(CorruptRecordError, match="Fewer than 12 bytes") as caught:
        list(TFRecordIterDataset(path))
    assert (caught.value.offset, caught.value.reason) == (56, "truncated header")
    path.write_bytes(whole[:-1])
    with pytest.raises(CorruptRecordError, match="Fewer than 56 bytes") as caught:
        list(TFRecordIterDataset(path))
    assert (caught.value.offset, caught.value.reason) == (56, "truncated payload")


def test_a_file_that_is_not_tfrecord(tmp_path: Path) -> None:
    path = tmp_path / "notes.tfrecord"
    path.write_text("these are my notes, not a TFRecord file\n" * 20)
    with pytest.raises(CorruptRecordError, match="not a TFRecord file") as caught:
        list(TFRecordIterDataset(path))
    assert caught.value.offset == 0
    with pytest.raises(CorruptRecordError, match="not a TFRecord file"):
        TFRecordDataSource(path)
    # Without the checks the garbage length reads as a truncated file, never as data.
    with pytest.raises(CorruptRecordError, match="Not a valid TFRecord"):
        list(TFRecordIterDataset(path, verify_crc=False))


def test_compressed_file_without_compression_gets_a_hint(tmp_path: Path) -> None:
    path = _write(tmp_path / "data.tfrecord", _records(0, 20), compression="GZIP")
    with pytest.raises(CorruptRecordError, match="looks GZIP-compressed: pass compression='GZIP'"):
        list(TFRecordIterDataset(path))
    zpath = _write(tmp_path / "zdata.tfrecord", _records(0, 20), compression="ZLIB")
    with pytest.raises(CorruptRecordError, match="looks ZLIB-compressed"):
        list(TFRecordIterDataset(zpath))


def test_damaged_or_cut_compressed_stream(tmp_path: Path) -> None:
    path = _write(tmp_path / "data.tfrecord.gz", [os.urandom(2000) for _ in range(50)])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptRecordError, match="GZIP data is damaged"):
        list(TFRecordIterDataset(path))
    broken = bytearray(data)
    broken[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(broken))
    with pytest.raises(CorruptRecordError):
        list(TFRecordIterDataset(path))


# -------------------------------------------------------------------------- data source
def test_source_conforms_and_reads_every_record(
    shards: tuple[list[Path], list[list[bytes]]],
) -> None:
    paths, contents = shards
    source = TFRecordDataSource(paths)
    everything = [r for records in contents for r in records]
    assert len(source) == len(everything)
    assert [source[i] for i in range(len(source))] == everything
    check_random_access_source(source)
    order = [18, 0, 7, 7, 3, 18, 10, 1]
    assert source.__getitems__(order) == [everything[i] for i in order]
    assert source.__getitems__(np.array([], dtype=np.int64)) == []
    with pytest.raises(IndexError, match="Record index 19 out of range for 19"):
        source[19]
    with pytest.raises(IndexError, match="-1"):
        source.__getitems__([0, -1])
    with pytest.raises(TypeError, match="Record keys must be integers"):
        source.__getitems__([1.9])  # not record 1
    assert repr(pickle.loads(pickle.dumps(source))) == repr(source)


def test_sidecar_index_is_written_reused_and_rebuilt_when_stale_or_corrupt(
    tmp_path: Path,
) -> None:
    records = _records(0, 30)
    path = _write(tmp_path / "data.tfrecord", records)
    sidecar = Path(index_path_for(str(path)))
    TFRecordDataSource(path)
    assert sidecar.name == ".data.tfrecord.tfrindex" and sidecar.exists()
    written = sidecar.read_bytes()
    TFRecordDataSource(path)
    assert sidecar.read_bytes() == written  # reused as is

    # Corrupt sidecar: a flipped offset fails its checksum; it is rebuilt, not trusted.
    damaged = bytearray(written)
    damaged[-3] ^= 0xFF
    sidecar.write_bytes(bytes(damaged))
    assert [TFRecordDataSource(path)[i] for i in range(30)] == records
    assert sidecar.read_bytes() == written
    sidecar.write_bytes(written[:20])  # truncated sidecar
    assert TFRecordDataSource(path)[29] == records[29]
    sidecar.write_bytes(b"garbage")
    assert TFRecordDataSource(path)[0] == records[0]

    # Stale sidecar: the data file was rewritten with other records.
    new_records = [b"new" * i for i in range(12)]
    _write(path, new_records)
    os.utime(path, ns=(1, 1))
    source = TFRecordDataSource(path)
    assert len(source) == 12 and source[11] == new_records[11]
    assert sidecar.read_bytes() != written


def test_sidecar_that_cannot_be_written_falls_back_to_memory(tmp_path: Path) -> None:
    path = _write(tmp_path / "data.tfrecord", _records(0, 4))
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="Could not save the TFRecord index"):
        source = TFRecordDataSource(path, index_dir=blocker)
    assert source[3] == _records(0, 4)[3]
    index_dir = tmp_path / "indexes"
    TFRecordDataSource(path, index_dir=index_dir)
    assert [p.suffix for p in index_dir.iterdir()] == [".tfrindex"]


def test_data_whose_directory_cannot_take_the_index_uses_the_cache_without_warning(
    tmp_path: Path,
) -> None:
    import warnings

    from grain_core import storage

    path = _write(tmp_path / "data.tfrecord", _records(0, 4))
    # The sidecar's place is taken (as in a read-only directory, which root could still write).
    (tmp_path / ".data.tfrecord.tfrindex").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TFRecordDataSource(path)[3] == _records(0, 4)[3]
        cached = Path(_cached_index_path(str(path), None))
        assert cached.parent == Path(storage.cache_dir("tfrecord-index"))
        stamp = cached.stat().st_mtime_ns
        assert TFRecordDataSource(path)[0] == _records(0, 4)[0]  # loads the cached index
    assert cached.stat().st_mtime_ns == stamp


def test_source_rejects_compressed_files(tmp_path: Path) -> None:
    path = _write(tmp_path / "data.tfrecord.gz", _records(0, 3))
    with pytest.raises(ValueError, match="needs uncompressed files .* GZIP-compressed"):
        TFRecordDataSource(path)


def test_source_notices_a_file_changed_after_indexing(tmp_path: Path) -> None:
    path = _write(tmp_path / "data.tfrecord", [b"a" * 10, b"b" * 10])
    source = TFRecordDataSource(path)
    _write(path, [b"a" * 12, b"b" * 8])
    with pytest.raises(CorruptRecordError, match="changed since it was indexed"):
        source[0]


def test_examples_shuffle_decode_batch_in_workers_and_checkpoint(tmp_path: Path) -> None:
    spec = {"label": FeatureSpec(np.int64, ()), "x": FeatureSpec(np.float32, (2,))}
    rows = [{"label": i, "x": [float(i), -float(i)]} for i in range(40)]
    paths = [tmp_path / f"ex.tfrecord-{k:05d}-of-00002" for k in range(2)]
    for k, path in enumerate(paths):
        with TFRecordWriter(path) as writer:
            for row in rows[k::2]:
                writer.write(row)

    def build() -> grain_core.IterDataset:
        return (
            grain_core.MapDataset.source(TFRecordDataSource(paths))
            .shuffle(seed=7)
            .map(functools.partial(decode_example, features=spec))
            .batch(4)
            .to_iter_dataset()
        )

    batches = check_iterator_conformance(build, positions=[0, 3, 10])
    labels = np.concatenate([b["label"] for b in batches])
    assert sorted(labels.tolist()) == list(range(40)) and labels.tolist() != sorted(labels.tolist())
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches])[:, 1], -labels)
    with iter(build().mp_prefetch(MultiprocessingOptions(num_workers=2))) as it:
        in_workers = list(it)
    assert [b["label"].tolist() for b in in_workers] == [b["label"].tolist() for b in batches]


# --------------------------------------------------------------------------- registration
def test_format_is_registered_for_its_suffixes_and_shards(tmp_path: Path) -> None:
    for name in (
        "a.tfrecord",
        "a.tfrecords",
        "a.tfrecord.gz",
        "train.tfrecord-00003-of-00016",
        "train.tfrecord@16",
    ):
        assert plugins.format_for_path(str(tmp_path / name)).name == "tfrecord"
    fmt = plugins.get_format("tfrecord")
    assert fmt.provides == ("source", "iter_dataset", "writer", "inspector")
    assert grain_core.experimental.TFRecordIterDataset is TFRecordIterDataset
    assert grain_core.sources.TFRecordDataSource is TFRecordDataSource
    path = tmp_path / "via_registry.tfrecord"
    with fmt.get("writer")(path) as writer:
        writer.write(b"one")
    assert list(fmt.get("iter_dataset")(str(path))) == [b"one"]
    assert fmt.get("source")(str(path))[0] == b"one"


def test_inspector_reports_count_sizes_and_the_first_example(tmp_path: Path) -> None:
    path = tmp_path / "ex.tfrecord"
    with TFRecordWriter(path) as writer:
        for i in range(6):
            writer.write({"image": b"\x00" * (10 + i), "label": i, "box": [0.5, 1.5, 2.5, 3.5]})
    info = plugins.get_format("tfrecord").get("inspector")(str(path), 2)
    assert info.num_records == 6
    assert info.schema == {
        "box": {"dtype": "float32", "shape": [4]},
        "image": {"dtype": "bytes", "shape": [1]},
        "label": {"dtype": "int64", "shape": [1]},
    }
    assert len(info.sample) == 2 and info.sample[1]["label"].tolist() == [1]
    assert info.details["record_bytes"]["min"] < info.details["record_bytes"]["max"]
    raw = _write(tmp_path / "raw.tfrecord.gz", [b"\x01\x02", b"\x03"])
    raw_info = plugins.get_format("tfrecord").get("inspector")(str(raw), 5)
    assert (raw_info.num_records, raw_info.schema, raw_info.sample) == (
        2,
        "bytes",
        (b"\x01\x02", b"\x03"),
    )
    assert raw_info.details["compression"] == "GZIP"


# ------------------------------------------------------------------------- any fsspec URL
def test_write_stream_and_random_access_through_an_fsspec_url() -> None:
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://tfrecord-{os.getpid()}"
    contents = [_records(k, 12) for k in range(2)]
    for k, records in enumerate(contents):
        with TFRecordWriter(f"{root}/part-{k}.tfrecord") as writer:
            for record in records:
                writer.write(record)
    everything = [r for records in contents for r in records]
    assert list(TFRecordIterDataset(f"{root}/part-*.tfrecord")) == everything
    source = TFRecordDataSource(f"{root}/part-*.tfrecord")
    assert source.__getitems__([20, 3, 11]) == [everything[20], everything[3], everything[11]]
    # Only the data lies in the store: the index is in the local cache directory.
    assert sorted(fsspec.filesystem("memory").ls(root, detail=False)) == [
        f"/tfrecord-{os.getpid()}/part-{k}.tfrecord" for k in range(2)
    ]
    fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.mark.parametrize("bad", [16.5, True, -16])
def test_a_byte_offset_that_is_not_an_integer_is_refused(
    shards: tuple[list[Path], list[list[bytes]]], bad: object
) -> None:
    it = iter(TFRecordIterDataset(path=shards[0][0]))
    with pytest.raises((TypeError, ValueError), match="checkpoint `reader_offset`"):
        it.set_state({"reader_offset": bad})

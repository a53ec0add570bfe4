"""Object storage end to end, against a real S3-compatible server (moto) on 127.0.0.1.

Formats, checkpoints and the CLI through ``s3://`` URLs, and the bad cases: unknown scheme,
missing bucket or key, permission denied, a glob matching nothing, the server going away.
Runs where moto[server] and s3fs are installed (``nox -s tests-remote``, ``tests-all``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
grain_tfrecord = pytest.importorskip("grain_tfrecord")

import killed_saves  # noqa: E402
from grain_tfrecord import TFRecordDataSource, TFRecordIterDataset, TFRecordWriter  # noqa: E402
from s3_server import running_s3_server, running_s3_server_with_user  # noqa: E402

import grain_core as grain  # noqa: E402
from grain_core import cli, storage  # noqa: E402
from grain_core.checkpoint import CheckpointHandler  # noqa: E402
from grain_core.samplers import IndexSampler  # noqa: E402
from grain_core.testing import check_iterator_conformance  # noqa: E402


def _records(shard: int, count: int = 40) -> list[bytes]:
    return [f"shard{shard}-record{i}-".encode() * (1 + i % 7) for i in range(count)]


def _write_shards(base: str, options: dict[str, Any], shards: int = 3) -> list[list[bytes]]:
    contents = []
    for k in range(shards):
        records = _records(k)
        name = f"{base}/train.tfrecord-{k:05d}-of-{shards:05d}"
        with TFRecordWriter(name, storage_options=options) as writer:
            for record in records:
                writer.write(record)
        contents.append(records)
    return contents


def _objects(s3: Any) -> list[str]:
    return sorted(storage.glob(f"{s3.url}/**", s3.options, allow_empty=True))


# -------------------------------------------------------------------------------- TFRecord
def test_tfrecord_stream_glob_and_checkpoint(s3: Any) -> None:
    contents = _write_shards(f"{s3.url}/data", s3.options)
    everything = [r for records in contents for r in records]
    pattern = f"{s3.url}/data/train.tfrecord-*-of-00003"
    ds = TFRecordIterDataset(pattern, storage_options=s3.options)
    assert ds.paths == tuple(f"{s3.url}/data/train.tfrecord-{k:05d}-of-00003" for k in range(3))
    assert list(ds) == everything
    it = iter(ds)
    for _ in range(50):
        next(it)
    state = it.get_state()
    resumed = iter(TFRecordIterDataset(pattern, storage_options=s3.options))
    resumed.set_state(state)
    assert list(resumed) == everything[50:]
    # x@N names the shards as well; a compressed file streams from the bucket too.
    assert (
        list(TFRecordIterDataset(f"{s3.url}/data/train.tfrecord@3", storage_options=s3.options))
        == everything
    )
    with TFRecordWriter(f"{s3.url}/data/packed.tfrecord.gz", storage_options=s3.options) as w:
        for record in everything:
            w.write(record)
    packed = TFRecordIterDataset(f"{s3.url}/data/packed.tfrecord.gz", storage_options=s3.options)
    assert list(packed) == everything


def test_tfrecord_next_file_downloads_while_one_is_read_and_restores_anywhere(s3: Any) -> None:
    contents = _write_shards(f"{s3.url}/ahead", s3.options)
    everything = [r for records in contents for r in records]
    pattern = f"{s3.url}/ahead/train.tfrecord-*-of-00003"
    it = iter(TFRecordIterDataset(pattern, storage_options=s3.options))
    assert next(it) == everything[0]
    # The interleave creates the next file's iterator on a thread as the first file opens;
    # creating it reads the file's first bytes (here the whole small file), before its turn.
    made_ahead = it._made_ahead[1].result()
    size = storage.size(f"{s3.url}/ahead/train.tfrecord-00001-of-00003", s3.options)
    assert len(made_ahead._reader._buf) == size
    assert list(it) == everything[1:]
    positions = [0, 1, 39, 40, 41, 79, 80, 81, 119, 120]
    assert (
        check_iterator_conformance(
            lambda: TFRecordIterDataset(pattern, storage_options=s3.options), positions=positions
        )
        == everything
    )


def test_a_tfrecord_pass_streams_each_file_with_one_get(s3: Any, s3_requests: Any) -> None:
    contents = _write_shards(f"{s3.url}/one-get", s3.options)
    ds = TFRecordIterDataset(f"{s3.url}/one-get/train.tfrecord-*", storage_options=s3.options)
    s3_requests.clear()
    everything = [r for records in contents for r in records]
    assert list(ds) == everything
    assert s3_requests == {("get_object", False): 3}
    # Building the random-access index scans the file through one streamed GET too, also where
    # a header straddles the scan's 1 MiB reads (frames of 1021 bytes: one starts 9 bytes
    # before 1 MiB) and the scan steps back to it.
    big = f"{s3.url}/one-get/big.tfrecord"
    records = [bytes([i % 256]) * 1005 for i in range(1100)]
    with TFRecordWriter(big, storage_options=s3.options) as writer:
        for record in records:
            writer.write(record)
    s3_requests.clear()
    source = TFRecordDataSource(big, storage_options=s3.options)
    assert s3_requests[("get_object", False)] == 1 and not s3_requests[("get_object", True)]
    assert source[1027] == records[1027]


def test_tfrecord_random_access_keeps_its_index_in_the_local_cache(s3: Any) -> None:
    contents = _write_shards(f"{s3.url}/data", s3.options)
    everything = [r for records in contents for r in records]
    before = _objects(s3)
    source = TFRecordDataSource(f"{s3.url}/data/*", storage_options=s3.options)
    assert len(source) == len(everything)
    keys = list(range(len(everything)))
    random.Random(0).shuffle(keys)
    assert source.__getitems__(keys) == [everything[k] for k in keys]
    assert [source[k] for k in keys[:5]] == [everything[k] for k in keys[:5]]
    assert _objects(s3) == before  # nothing written beside the data
    cache = Path(storage.cache_dir("tfrecord-index"))
    indexes = sorted(p for p in cache.iterdir() if p.name.startswith("train.tfrecord-"))
    assert len(indexes) >= 3
    stamps = [p.stat().st_mtime_ns for p in indexes]
    TFRecordDataSource(f"{s3.url}/data/*", storage_options=s3.options)
    assert [p.stat().st_mtime_ns for p in indexes] == stamps  # loaded, not rebuilt
    # A file that changes in the bucket gets a new index.
    with TFRecordWriter(
        f"{s3.url}/data/train.tfrecord-00000-of-00003", storage_options=s3.options
    ) as w:
        w.write(b"replaced")
    changed = TFRecordDataSource(f"{s3.url}/data/*", storage_options=s3.options)
    assert changed[0] == b"replaced" and len(changed) == 1 + len(everything) - 40


def test_data_loader_with_two_workers_reads_the_bucket(s3: Any) -> None:
    contents = _write_shards(f"{s3.url}/data", s3.options)
    everything = [r for records in contents for r in records]
    # The workers get the source with its URLs and storage options, not fsspec's config.
    source = TFRecordDataSource(f"{s3.url}/data/*", storage_options=s3.options)
    loader = grain.DataLoader(
        data_source=source,
        sampler=IndexSampler(len(source), shuffle=True, seed=3, num_epochs=1),
        worker_count=2,
    )
    with iter(loader) as it:
        out = list(it)
    assert sorted(out) == sorted(everything)
    local = grain.DataLoader(
        data_source=everything,
        sampler=IndexSampler(len(source), shuffle=True, seed=3, num_epochs=1),
        worker_count=0,
    )
    assert out == list(local)


# ----------------------------------------------------------------------------- ArrayRecord
def test_arrayrecord_reads_the_bucket_through_the_shard_cache(s3: Any, tmp_path: Path) -> None:
    grain_arrayrecord = pytest.importorskip("grain_arrayrecord")
    from grain_core.shard_cache import ShardCache

    contents = []
    for k in range(3):
        local = tmp_path / f"part-{k}.array_record"
        with grain_arrayrecord.ArrayRecordWriter(local) as writer:
            for record in _records(k):
                writer.write(record)
        storage.write_bytes(f"{s3.url}/ar/part-{k}.array_record", local.read_bytes(), s3.options)
        contents.append(_records(k))
    everything = [r for records in contents for r in records]
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    source = grain_arrayrecord.ArrayRecordDataSource(
        f"{s3.url}/ar/*", shard_cache=cache, storage_options=s3.options
    )
    assert source.paths[0] == f"{s3.url}/ar/part-0.array_record"
    keys = random.Random(0).sample(range(len(everything)), len(everything))
    assert source.__getitems__(keys) == [everything[k] for k in keys]
    assert len(list((tmp_path / "cache").glob("*.shard"))) == 3
    loader = grain.DataLoader(
        data_source=source,
        sampler=IndexSampler(len(source), shuffle=True, seed=3, num_epochs=1),
        worker_count=2,
    )
    with iter(loader) as it:
        assert sorted(it) == sorted(everything)
    with pytest.raises(FileNotFoundError, match=r"s3://.*/ar/missing"):
        grain_arrayrecord.ArrayRecordDataSource(
            f"{s3.url}/ar/missing", shard_cache=cache, storage_options=s3.options
        )


def test_arrayrecord_url_without_a_shard_cache_uses_the_default_one(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grain_arrayrecord = pytest.importorskip("grain_arrayrecord")
    local = tmp_path / "one.array_record"
    with grain_arrayrecord.ArrayRecordWriter(local) as writer:
        for record in _records(0):
            writer.write(record)
    storage.write_bytes(f"{s3.url}/one.array_record", local.read_bytes(), s3.options)
    monkeypatch.setenv("GRAIN_CORE_CACHE_DIR", str(tmp_path / "user-cache"))
    # The same call as for the local file: the URL goes through the default cache.
    for path, options in ((str(local), None), (f"{s3.url}/one.array_record", s3.options)):
        source = grain_arrayrecord.ArrayRecordDataSource(path, storage_options=options)
        assert source.__getitems__(range(len(source))) == _records(0)
    assert len(list((tmp_path / "user-cache" / "shards").glob("*.shard"))) == 1


# ----------------------------------------------------------------------------- checkpoints
def _loader(workers: int = 0) -> Any:
    return grain.DataLoader(
        data_source=list(range(20)), sampler=IndexSampler(20, num_epochs=1), worker_count=workers
    )


def test_checkpoint_save_restore_overwrite_in_the_bucket(s3: Any, tmp_path: Path) -> None:
    handler = CheckpointHandler()
    directory = f"{s3.url}/ckpt/step_4"
    with iter(_loader()) as it:
        for _ in range(4):
            next(it)
        handler.save(directory, it)
        next(it)
        handler.save(directory, it)  # overwrite: the newer state wins
    assert _objects(s3) == [f"{directory}/process_0-of-1.json"]
    assert not list(tmp_path.iterdir()) and not Path("s3:").exists()
    with iter(_loader()) as fresh:
        handler.restore(directory, fresh)
        assert list(fresh) == list(range(5, 20))


def test_a_killed_save_leaves_the_old_checkpoint(s3: Any) -> None:
    directory = f"{s3.url}/ckpt"
    with iter(_loader()) as it:
        next(it)
        CheckpointHandler().save(directory, it)
    # The child dies in the middle of its upload.
    code = textwrap.dedent(
        f"""
        import os, signal, s3fs, grain_core as grain
        from grain_core.checkpoint import CheckpointHandler
        from grain_core.samplers import IndexSampler
        async def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        s3fs.S3FileSystem._pipe_file = die
        loader = grain.DataLoader(data_source=list(range(20)), sampler=IndexSampler(20, num_epochs=1))
        it = iter(loader)
        for _ in range(7):
            next(it)
        CheckpointHandler().save({directory!r} + "", it)
        """
    )
    env = {**os.environ, "FSSPEC_S3": json.dumps(s3.options)}
    child = subprocess.run([sys.executable, "-c", code], env=env, check=False)
    assert child.returncode == -9
    with iter(_loader()) as fresh:
        CheckpointHandler().restore(directory, fresh)
        assert list(fresh) == list(range(1, 20))


def test_restoring_a_missing_or_damaged_checkpoint_names_the_url(s3: Any) -> None:
    missing = f"{s3.url}/ckpt/never_saved"
    with pytest.raises(ValueError, match=f"{missing}/process_0-of-1.json does not exist"):
        CheckpointHandler().restore(missing, iter(_loader()))
    damaged = f"{s3.url}/ckpt/damaged"
    storage.write_bytes(f"{damaged}/process_0-of-1.json", b'{"version": 2, "last_', s3.options)
    with pytest.raises(ValueError, match=f"{damaged}/process_0-of-1.json is not valid JSON"):
        CheckpointHandler().restore(damaged, iter(_loader()))


def test_orbax_checkpoint_manager_on_s3(s3: Any) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    from grain_core.checkpoint import CheckpointRestore, CheckpointSave

    # Object stores cannot rename directories: Orbax commits with a marker file there (its
    # default only on GCS), and the grain_core files inside are whole-object uploads.
    options = ocp.CheckpointManagerOptions(
        temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath
    )
    manager = ocp.CheckpointManager(
        f"{s3.url}/orbax", item_handlers={"ds": CheckpointHandler()}, options=options
    )
    with iter(_loader()) as it:
        for _ in range(3):
            next(it)
        manager.save(3, args=ocp.args.Composite(ds=CheckpointSave(it)))
        manager.wait_until_finished()
    assert any(name.endswith("/3/ds/process_0-of-1.json") for name in _objects(s3))
    with iter(_loader()) as fresh:
        manager.restore(3, args=ocp.args.Composite(ds=CheckpointRestore(fresh)))
        assert list(fresh) == list(range(3, 20))
    manager.close()


def test_elastic_shard_state_files_in_the_bucket(s3: Any) -> None:
    from grain_core.dataset.ops.interleave import InterleaveIterDataset
    from grain_core.experimental import ElasticIterator
    from grain_core.sharding import ShardOptions

    files = [list(range(10 * k, 10 * k + 10)) for k in range(4)]

    def make() -> Any:
        per_file = [grain.MapDataset.source(f) for f in files]
        return ElasticIterator(
            InterleaveIterDataset(per_file, cycle_length=2), 2, ShardOptions(0, 1)
        )

    it = make()
    before = [x for _ in range(3) for x in next(it).ravel().tolist()]
    CheckpointHandler().save(f"{s3.url}/elastic", it)
    # The shard's whole state (restored under the same shard count), and each input's progress.
    assert _objects(s3) == [f"{s3.url}/elastic/process_0-of-1.json"] + [
        f"{s3.url}/elastic/shard_state_{k}.json" for k in range(4)
    ]
    fresh = make()
    CheckpointHandler().restore(f"{s3.url}/elastic", fresh)
    after = [x for batch in fresh for x in batch.ravel().tolist()]
    assert sorted(before + after) == list(range(40))


def test_a_save_killed_at_each_file_boundary_in_the_bucket_restores_old_new_or_refused(
    s3: Any,
) -> None:
    # One process overwriting its checkpoint, and two saving into a fresh directory, die
    # before each of their uploads (each upload is whole or absent).
    for kill_at in range(8):
        directory = f"{s3.url}/overwritten_{kill_at}"
        old = killed_saves.save_killed_at(directory, 1, 1, kill_at=99)
        try:
            new = killed_saves.save_killed_at(directory, 1, 3, kill_at)
        except killed_saves.Killed:
            new = old
        for count in (1, 2):
            killed_saves.check_old_new_or_refused(directory, count, old, new, directory)
    for kill_at in range(9):
        directory = f"{s3.url}/fresh_{kill_at}"
        try:
            new = killed_saves.save_killed_at(directory, 2, 2, kill_at)
        except killed_saves.Killed:
            assert isinstance(killed_saves.restore_all(directory, 3), ValueError)
            continue
        killed_saves.check_old_new_or_refused(directory, 3, None, new, directory)


# ------------------------------------------------------------------------------------- CLI
def test_convert_to_and_from_the_bucket_and_inspect(s3: Any, tmp_path: Path, capsys: Any) -> None:
    local = tmp_path / "in.tfrecord"
    with TFRecordWriter(local) as writer:
        for record in _records(0):
            writer.write(record)
    url = f"{s3.url}/converted/out.tfrecord.gz"
    assert cli.main(["convert", str(local), url]) == 0
    assert list(TFRecordIterDataset(url, storage_options=s3.options)) == _records(0)
    back = tmp_path / "back.tfrecord"
    assert cli.main(["convert", url, str(back)]) == 0
    assert list(TFRecordIterDataset(back)) == _records(0)
    capsys.readouterr()
    assert cli.main(["inspect", f"{s3.url}/converted/out.tfrecord.gz", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_records"] == 40
    assert _objects(s3) == [url]


# ------------------------------------------------------------------------------- bad cases
def test_missing_bucket_key_and_empty_glob_name_the_url(s3: Any) -> None:
    with pytest.raises(FileNotFoundError, match="s3://no-such-bucket-x/a.tfrecord does not exist"):
        TFRecordDataSource("s3://no-such-bucket-x/a.tfrecord", storage_options=s3.options)
    with pytest.raises(FileNotFoundError, match=f"{s3.url}/absent.tfrecord does not exist"):
        list(TFRecordIterDataset(f"{s3.url}/absent.tfrecord", storage_options=s3.options))
    with pytest.raises(FileNotFoundError, match=f"pattern '{s3.url}/none-\\*' matches no file"):
        TFRecordIterDataset(f"{s3.url}/none-*", storage_options=s3.options)
    with pytest.raises(ValueError, match="no file system is known for the scheme nosuch://"):
        list(TFRecordIterDataset("nosuch://bucket/a.tfrecord"))


def test_permission_denied_names_the_url() -> None:
    # A user who may read but not write.
    frame = b"".join(_frames([b"secret"]))
    with running_s3_server_with_user(
        "locked", {"data.tfrecord": frame}, ["s3:Get*", "s3:Head*", "s3:List*"]
    ) as (server, reader):
        assert list(TFRecordIterDataset("s3://locked/data.tfrecord", storage_options=reader)) == [
            b"secret"
        ]
        with pytest.raises(PermissionError, match="Access to s3://locked/out.tfrecord was denied"):
            with TFRecordWriter("s3://locked/out.tfrecord", storage_options=reader) as writer:
                writer.write(b"x")
        with pytest.raises(PermissionError, match="Access to s3://locked/data.tfrecord was denied"):
            TFRecordDataSource(
                "s3://locked/data.tfrecord", storage_options=server.storage_options()
            )


def _frames(records: list[bytes]) -> list[bytes]:
    from grain_tfrecord._framing import U32, U64, masked_crc

    out = []
    for record in records:
        length = U64.pack(len(record))
        out += [length, U32.pack(masked_crc(length)), record, U32.pack(masked_crc(record))]
    return out


def test_the_server_going_away_mid_read_names_the_url_and_range() -> None:
    with running_s3_server() as server:
        options = server.storage_options(config_kwargs={"retries": {"max_attempts": 2}})
        bucket = server.make_bucket()
        url = f"{bucket}/data.tfrecord"
        with TFRecordWriter(url, storage_options=options) as writer:
            for record in _records(0):
                writer.write(record)
        source = TFRecordDataSource(url, storage_options=options)
        assert source[0] == _records(0)[0]
        # Opened mid-file, the file is read by ranged requests, which retry and then fail.
        # (A download from the start has the whole small file once the request is answered.)
        stream = storage.open_read(url, options, read_ahead=64, offset=16)
        server.process.kill()
        server.process.wait()
        with pytest.raises(
            storage.StorageError, match=f"Reading bytes \\d+-\\d+ of {url} failed"
        ) as info:
            source[5]
        assert info.value.url == url and info.value.byte_range is not None
        with pytest.raises(storage.StorageError, match=f"Reading bytes 16-1016 of {url} failed"):
            stream.read(1000)

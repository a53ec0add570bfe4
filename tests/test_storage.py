"""The file-system seam: paths and URLs, reads, globs and atomic writes, local and fsspec."""

from __future__ import annotations

import errno
import fcntl
import importlib
import os
import pathlib
import pickle
import random
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from grain_core import storage

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def memory_dir() -> Iterator[str]:
    """A fresh directory on fsspec's in-memory file system, removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/grain-core-test-{os.getpid()}-{id(fs)}"
    fs.mkdir(root)
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


class _URLPath:
    """Like ``etils.epath.Path`` for a bucket: its ``str()`` is the URL."""

    def __init__(self, url: str) -> None:
        self._url = url

    def __str__(self) -> str:
        return self._url

    def __fspath__(self) -> str:
        return self._url


def test_path_forms(tmp_path: pathlib.Path) -> None:
    assert storage.path_string(tmp_path) == str(tmp_path)
    assert storage.path_string(f"file://{tmp_path}") == str(tmp_path)
    assert storage.path_string(_URLPath("s3://bucket/x")) == "s3://bucket/x"
    assert storage.is_url("s3://bucket/x") and storage.is_url(_URLPath("gs://b/x"))
    assert not storage.is_url(tmp_path) and not storage.is_url("s3:/bucket/x")
    assert storage.join("s3://bucket/dir/", "a.json") == "s3://bucket/dir/a.json"
    assert storage.join(tmp_path, "a.json") == str(tmp_path / "a.json")
    with pytest.raises(TypeError, match="Expected a path"):
        storage.path_string(3)


def test_unknown_scheme_is_an_error_and_never_a_local_folder(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"nosuch://bucket/x.*no file system is known"):
        storage.write_bytes("nosuch://bucket/x", b"data")
    assert list(tmp_path.iterdir()) == []


def test_missing_fsspec_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=r"s3://b/x needs fsspec and s3fs: pip install "):
        storage.exists("s3://b/x")


def test_missing_implementation_names_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = importlib.import_module("fsspec.registry")
    monkeypatch.setitem(
        registry.known_implementations,
        "gs",
        {"class": "no_such_gcs_package.FileSystem", "err": "Please install gcsfs"},
    )
    monkeypatch.delitem(registry._registry, "gs", raising=False)
    with pytest.raises(ImportError, match=r"gs://b/x needs .*: pip install gcsfs"):
        storage.read_bytes("gs://b/x")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_write_read_size_and_ranges(where: str, tmp_path: pathlib.Path, memory_dir: str) -> None:
    root = str(tmp_path) if where == "local" else memory_dir
    path = storage.join(root, "sub", "data.bin")
    data = bytes(range(256)) * 40
    storage.write_bytes(path, data)
    assert storage.exists(path) and not storage.exists(storage.join(root, "other"))
    assert storage.read_bytes(path) == data
    assert storage.size(path) == len(data)
    size, version = storage.version(path)
    assert size == len(data) and version
    with storage.open_read(path) as file:
        assert file.read(10) == data[:10]
        assert file.read() == data[10:]
    reader = pickle.loads(pickle.dumps(storage.RangeReader(path)))
    assert reader.read(5, 9) == data[5:9]
    assert reader.read_many([0, 300, 1000], [3, 310, 1001]) == [
        data[0:3],
        data[300:310],
        data[1000:1001],
    ]
    reader.close()
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        storage.read_bytes(storage.join(root, "missing.bin"))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_glob_is_sorted_and_an_empty_match_names_the_pattern(
    where: str, tmp_path: pathlib.Path, memory_dir: str
) -> None:
    root = str(tmp_path) if where == "local" else memory_dir
    for name in ["b-1", "a-2", "a-1", "c"]:
        storage.write_bytes(storage.join(root, name), name.encode())
    found = storage.glob(storage.join(root, "?-*"))
    assert found == [storage.join(root, n) for n in ["a-1", "a-2", "b-1"]]
    assert storage.glob(storage.join(root, "z*"), allow_empty=True) == []
    pattern = storage.join(root, "z*")
    with pytest.raises(FileNotFoundError, match=re.escape(f"pattern {pattern!r} matches no file")):
        storage.glob(pattern)


def test_atomic_writer_keeps_the_old_file_until_commit(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), storage.AtomicWriter(target) as writer:
        writer.file.write(b"new, but never finished")
        raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    writer = storage.AtomicWriter(target)
    writer.file.close()  # a library writes the temporary file by name
    pathlib.Path(writer.temp_path).write_bytes(b"new")
    writer.commit()
    assert target.read_bytes() == b"new"
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_planted_symlinks_are_never_followed(tmp_path: pathlib.Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "out.bin"
    # Links at the names older writers used, and at this writer's name pattern.
    for name in [
        f"out.bin.tmp-{os.getpid()}",
        f".tmp.{os.getpid()}.x.out.bin",
        ".tmp.1.abcdefgh.out.bin",
    ]:
        (tmp_path / name).symlink_to(victim)
    storage.write_bytes(target, b"new")
    assert victim.read_bytes() == b"precious"
    assert target.read_bytes() == b"new" and not target.is_symlink()


def _victim(directory: pathlib.Path) -> tuple[pathlib.Path, tuple[bytes, int, int]]:
    """A file another user's link points at, and what must stay as it is: bytes, mode, mtime."""
    victim = directory / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    info = victim.stat()
    return victim, (victim.read_bytes(), info.st_mode, info.st_mtime_ns)


def _untouched(victim: pathlib.Path) -> tuple[bytes, int, int]:
    info = victim.stat()
    return victim.read_bytes(), info.st_mode, info.st_mtime_ns


@pytest.mark.parametrize("remote", [False, True])
def test_a_symlink_planted_at_the_next_temporary_name_is_left_alone(
    remote: bool, tmp_path: pathlib.Path, memory_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The names a writer will try are known here (a seeded generator): a link planted at the
    # first one, locally or in the spool directory of a remote write, is skipped, not opened.
    victim, before = _victim(tmp_path)
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    target = storage.join(memory_dir, "out.bin") if remote else str(tmp_path / "out.bin")
    first = "".join(random.Random(7).choices(storage._TEMP_CHARACTERS, k=8))
    planted = (spool if remote else tmp_path) / f".tmp.{os.getpid()}.{first}.out.bin"
    planted.symlink_to(victim)
    monkeypatch.setattr(storage, "_TEMP_RANDOM", random.Random(7))
    with storage.AtomicWriter(target) as writer:
        assert writer.temp_path != str(planted)
        writer.file.write(b"new")
    assert _untouched(victim) == before
    assert planted.is_symlink()
    assert storage.read_bytes(target) == b"new"


@pytest.mark.parametrize("by_name", [False, True])
def test_a_temporary_file_replaced_by_a_symlink_is_refused(
    by_name: bool, tmp_path: pathlib.Path
) -> None:
    victim, before = _victim(tmp_path)
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    writer = storage.AtomicWriter(target)
    assert oct(os.stat(writer.temp_path).st_mode & 0o777) == oct(0o600)  # owner-only meanwhile
    if by_name:  # a library writes the temporary file by name
        writer.file.close()
        pathlib.Path(writer.temp_path).write_bytes(b"new")
    else:
        writer.file.write(b"new")
    # Another user of the directory puts a link at the temporary file's name.
    os.unlink(writer.temp_path)
    os.symlink(victim, writer.temp_path)
    with pytest.raises(OSError, match=re.escape(f"{writer.temp_path} of {target} was replaced")):
        writer.commit()
    assert _untouched(victim) == before
    assert target.read_bytes() == b"old" and not target.is_symlink()


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path: pathlib.Path) -> None:
    victim, before = _victim(tmp_path)
    target = tmp_path / "out.bin"
    target.symlink_to(victim)
    storage.write_bytes(target, b"new")
    assert _untouched(victim) == before
    assert target.read_bytes() == b"new" and not target.is_symlink()
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_a_directory_replaced_by_a_link_while_writing_is_not_followed(
    tmp_path: pathlib.Path,
) -> None:
    mine, elsewhere = tmp_path / "mine", tmp_path / "elsewhere"
    mine.mkdir()
    elsewhere.mkdir()
    victim, before = _victim(elsewhere)
    writer = storage.AtomicWriter(mine / "victim")
    writer.file.write(b"new")
    # The directory is moved away and a link to another directory takes its name, holding a
    # file of the temporary file's name that a rename by name would put over the victim.
    mine.rename(tmp_path / "moved")
    mine.symlink_to(elsewhere)
    planted = elsewhere / os.path.basename(writer.temp_path)
    planted.write_bytes(b"planted")
    writer.commit()
    assert _untouched(victim) == before
    assert planted.read_bytes() == b"planted"
    assert (tmp_path / "moved" / "victim").read_bytes() == b"new"


def test_a_killed_writers_temp_file_is_removed_by_the_next_write(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "state.json"
    code = textwrap.dedent(
        f"""
        import sys
        from grain_core import storage
        writer = storage.AtomicWriter({str(target)!r})
        writer.file.write(b"half")
        writer.file.flush()
        print(writer.temp_path, flush=True)
        sys.stdin.read()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    temp = pathlib.Path(child.stdout.readline().strip())
    assert temp.exists() and temp.parent == tmp_path
    child.kill()
    child.wait()
    # A temporary file still being written by a writer on another host that shares the
    # directory (its pid means nothing here; its lock is held).
    busy = tmp_path / f".tmp.{child.pid}.busy0000.state.json"
    busy.write_bytes(b"")
    holder = os.open(busy, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    assert temp.exists()
    storage.write_bytes(target, b"{}")
    assert not temp.exists()
    assert busy.exists()
    os.close(holder)
    assert sorted(p.name for p in tmp_path.iterdir()) == [busy.name, "state.json"]


def test_a_writer_written_by_name_keeps_its_temp_file_locked(tmp_path: pathlib.Path) -> None:
    # A library that writes temp_path by name (ArrayRecord) has the caller close ``file``; the
    # lock that tells a cleaning writer on another host that the file is live stays held.
    writer = storage.AtomicWriter(tmp_path / "data.array_record")
    writer.file.close()
    probe = os.open(writer.temp_path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        writer.commit()
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the rename
    finally:
        os.close(probe)


def test_a_killed_remote_writers_spool_file_is_removed_by_the_next_write(
    tmp_path: pathlib.Path, memory_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    url = storage.join(memory_dir, "state.json")
    code = textwrap.dedent(
        f"""
        import sys
        from grain_core import storage
        writer = storage.AtomicWriter({url!r})
        writer.file.write(b"half")
        writer.file.flush()
        print(writer.temp_path, flush=True)
        sys.stdin.read()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(spool)},
    )
    assert child.stdout is not None
    temp = pathlib.Path(child.stdout.readline().strip())
    assert temp.exists() and temp.parent == spool
    child.kill()
    child.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    with storage.AtomicWriter(storage.join(memory_dir, "other.json")) as other:
        other.file.write(b"{}")
    assert temp.exists()  # a spool file of another name is left alone
    with storage.AtomicWriter(url) as writer:
        writer.file.write(b"{}")
    assert storage.read_bytes(url) == b"{}"
    assert list(spool.iterdir()) == []


def test_a_failed_write_names_the_directory(tmp_path: pathlib.Path) -> None:
    # A file size limit makes the write fail like a full disk does, with a real OS error.
    code = textwrap.dedent(
        f"""
        import resource, signal
        from grain_core import storage
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        try:
            storage.write_bytes({str(tmp_path / "ckpt" / "state.json")!r}, b"x" * 5000)
        except OSError as e:
            print(e.errno, e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith(f"{errno.EFBIG} ")
    assert f"directory {tmp_path / 'ckpt'}" in out.stdout
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == []


def test_atomic_writer_to_memory(memory_dir: str) -> None:
    url = storage.join(memory_dir, "out.bin")
    with storage.AtomicWriter(url) as writer:
        writer.file.write(b"payload")
        assert not storage.exists(url)
    assert storage.read_bytes(url) == b"payload"
    assert not os.path.exists(writer.temp_path)


# --------------------------------------------------------- streamed remote reads (s3fs)
def test_a_remote_file_read_from_its_start_is_one_streamed_get(s3: Any, s3_requests: Any) -> None:
    data = bytes(range(256)) * 4096
    url = f"{s3.url}/streamed.bin"
    storage.write_bytes(url, data, s3.options)
    s3_requests.clear()
    # A budget of a few chunks: the download waits for the reads, which cross its chunks.
    with storage.open_read(url, s3.options, read_ahead=64 << 10) as file:
        assert file.size == len(data)
        assert file.read(10) == data[:10]
        assert file.read(70_000) == data[10:70_010]
        assert file.read(1) == data[70_010:70_011]
        file.seek(100_000)  # near ahead: skipped within the download
        assert file.tell() == 100_000
        assert file.read(200_000) == data[100_000:300_000]
        file.seek(299_990)  # a step back within the chunk read last
        assert file.read(20) == data[299_990:300_010]
        file.seek(300_000)
        assert file.read() == data[300_000:]
        assert file.read(5) == b""
    assert s3_requests == {("get_object", False): 1}  # no HEAD, no ranged GET


def test_a_seek_away_from_the_download_reads_ranges(s3: Any, s3_requests: Any) -> None:
    data = bytes(range(256)) * 4096
    url = f"{s3.url}/ranged.bin"
    storage.write_bytes(url, data, s3.options)
    with storage.open_read(url, s3.options, read_ahead=64 << 10) as file:
        assert file.read(100) == data[:100]
        file.seek(10)  # backwards
        assert file.read(20) == data[10:30]
        file.seek(900_000)  # far ahead
        assert file.read(100) == data[900_000:900_100]
    with storage.open_read(url, s3.options, offset=500_000) as file:
        assert file.tell() == 500_000 and file.read(10) == data[500_000:500_010]
    assert s3_requests[("get_object", True)] >= 2


def test_a_broken_download_goes_on_with_ranged_requests(
    s3: Any, s3_requests: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    data = bytes(range(256)) * 4096
    url = f"{s3.url}/broken.bin"
    storage.write_bytes(url, data, s3.options)
    read = s3fs.core.S3AsyncStreamedFile.read

    async def breaking(self: Any, length: int = -1) -> bytes:
        if self.loc >= 300_000:
            raise ConnectionResetError("the connection was reset")
        return await read(self, length)

    monkeypatch.setattr(s3fs.core.S3AsyncStreamedFile, "read", breaking)
    with storage.open_read(url, s3.options, read_ahead=64 << 10) as file:
        assert b"".join(iter(lambda: file.read(100_000), b"")) == data
    assert s3_requests[("get_object", False)] == 1 and s3_requests[("get_object", True)] >= 1


def test_a_url_naming_a_version_reads_that_version(s3: Any) -> None:
    import s3fs

    options = {**s3.options, "version_aware": True}
    fs = s3fs.S3FileSystem(**options)
    bucket = s3.url.removeprefix("s3://")
    fs.make_bucket_versioned(bucket)
    url = f"{s3.url}/versioned.bin"
    storage.write_bytes(url, b"old" * 1000, options)
    version = fs.info(f"{bucket}/versioned.bin")["VersionId"]
    storage.write_bytes(url, b"new" * 1000, options)
    with storage.open_read(f"{url}?versionId={version}", options) as file:
        assert file.read() == b"old" * 1000
    with storage.open_read(url, options) as file:
        assert file.read() == b"new" * 1000


def test_missing_credentials_are_reported_as_credentials(
    s3_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """A store that cannot sign a request for lack of credentials says so, as a
    PermissionError naming the URL and where credentials go, not as retries and reachability."""
    for variable in list(os.environ):
        if variable.startswith("AWS_"):
            monkeypatch.delenv(variable)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {"endpoint_url": s3_server.endpoint, "client_kwargs": {"region_name": "eu-west-1"}}
    with pytest.raises(
        PermissionError, match=r"No usable credentials to access s3://b1/x\.bin"
    ) as e:
        storage.read_bytes("s3://b1/x.bin", storage_options=options)
    assert "AWS_ACCESS_KEY_ID" in str(e.value) and "reachable" not in str(e.value)
    assert type(e.value.__cause__).__name__ == "NoCredentialsError"

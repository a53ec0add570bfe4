"""grain_core.shard_cache: downloads on first use, validity, LRU eviction, sharing between
real processes, and the errors for a full or unwritable directory.

Remote files are local files behind a URL scheme array_record cannot open
(``countinglocal://``: fsspec's local file system, counting the downloads in a file beside
each shard), so several processes see the same "remote" files.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

fsspec = pytest.importorskip("fsspec")

from fsspec.implementations.local import LocalFileSystem  # noqa: E402

from grain_core import shard_cache as sc  # noqa: E402

PROTOCOL = "countinglocal"


class _CountingLocalFS(LocalFileSystem):  # type: ignore[misc]
    """The local file system under ``countinglocal://``; each open for reading appends a line
    to ``<file>.opens``."""

    protocol = PROTOCOL

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3 :]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            with open(self._strip_protocol(path) + ".opens", "a") as log:
                log.write("open\n")
        return super()._open(path, mode, **kwargs)


def _register() -> None:
    fsspec.register_implementation(PROTOCOL, _CountingLocalFS, clobber=True)


@pytest.fixture(autouse=True)
def _counting_protocol() -> None:
    _register()


def _remote(tmp_path: Path, name: str, data: bytes) -> str:
    remote = tmp_path / "remote"
    remote.mkdir(exist_ok=True)
    (remote / name).write_bytes(data)
    return f"{PROTOCOL}://{remote / name}"


def _downloads(url: str) -> int:
    log = Path(url[len(PROTOCOL) + 3 :] + ".opens")
    return len(log.read_text().splitlines()) if log.exists() else 0


def _entries(cache: sc.ShardCache) -> list[str]:
    return sorted(n for n in os.listdir(cache.directory) if n.endswith(".shard"))


def test_downloaded_once_and_reused_by_other_instances(tmp_path: Path) -> None:
    url = _remote(tmp_path, "a.bin", b"0123456789" * 100)
    cache = sc.ShardCache(tmp_path / "cache", max_bytes=10_000)
    path = cache.local_path(url)
    assert Path(path).read_bytes() == b"0123456789" * 100
    assert cache.local_path(url) == path
    # Another process's view of the directory (a fresh instance) adopts the copy.
    again = sc.ShardCache(tmp_path / "cache", max_bytes=10_000)
    assert again.local_path(url) == path
    assert _downloads(url) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "remote_changed"])
def test_an_invalid_copy_is_downloaded_again(tmp_path: Path, damage: str) -> None:
    url = _remote(tmp_path, "a.bin", bytes(range(256)) * 8)
    path = sc.ShardCache(tmp_path / "cache").local_path(url)
    if damage == "flip":  # same size: only the checksum tells
        data = bytearray(Path(path).read_bytes())
        data[100] ^= 0xFF
        Path(path).write_bytes(bytes(data))
    elif damage == "truncate":
        Path(path).write_bytes(Path(path).read_bytes()[:-1])
    else:
        Path(url[len(PROTOCOL) + 3 :]).write_bytes(b"new content")
    expected = Path(url[len(PROTOCOL) + 3 :]).read_bytes()
    fresh = sc.ShardCache(tmp_path / "cache")
    assert Path(fresh.local_path(url)).read_bytes() == expected
    assert _downloads(url) == 2


def test_without_verify_a_same_size_change_goes_unnoticed(tmp_path: Path) -> None:
    url = _remote(tmp_path, "a.bin", b"x" * 64)
    path = sc.ShardCache(tmp_path / "cache").local_path(url)
    Path(path).write_bytes(b"y" * 64)
    assert Path(sc.ShardCache(tmp_path / "cache", verify=False).local_path(url)).read_bytes() == (
        b"y" * 64
    )
    assert _downloads(url) == 1


def test_least_recently_used_shards_are_evicted_to_fit(tmp_path: Path) -> None:
    urls = [_remote(tmp_path, f"{n}.bin", n.encode() * 400) for n in "abc"]
    cache = sc.ShardCache(tmp_path / "cache", max_bytes=1000)  # two of the three
    path_a = cache.local_path(urls[0])
    path_b = cache.local_path(urls[1])
    os.utime(path_b, ns=(1, 1))  # b used longest ago
    os.utime(path_a, ns=(2, 2))
    cache.local_path(urls[2])
    assert not os.path.exists(path_b)
    assert os.path.exists(path_a)
    assert len(_entries(cache)) == 2
    assert Path(cache.local_path(urls[1])).read_bytes() == b"b" * 400  # downloaded again
    assert _downloads(urls[1]) == 2
    assert _downloads(urls[0]) == 1


def test_a_shard_larger_than_the_cache_is_refused(tmp_path: Path) -> None:
    url = _remote(tmp_path, "big.bin", b"z" * 2000)
    directory = tmp_path / "cache"
    with pytest.raises(sc.ShardCacheError, match=rf"{directory}.* more than max_bytes=1000"):
        sc.ShardCache(directory, max_bytes=1000).local_path(url)


def test_a_cache_full_of_downloads_in_progress_names_the_directory(tmp_path: Path) -> None:
    import fcntl

    directory = tmp_path / "cache"
    directory.mkdir()
    # Another process is downloading an 800-byte shard: its lock is held, its file reserved.
    key = "f" * 40
    (directory / f"{key}.800.xyz.tmp").write_bytes(b"")
    held = os.open(directory / f"{key}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        url = _remote(tmp_path, "a.bin", b"a" * 400)
        with pytest.raises(sc.ShardCacheError, match=rf"Shard cache {directory} is full"):
            sc.ShardCache(directory, max_bytes=1000).local_path(url)
    finally:
        os.close(held)
    # Once that process is gone, its temporary file is stale: removed, and the shard fits.
    assert Path(sc.ShardCache(directory, max_bytes=1000).local_path(url)).read_bytes() == (
        b"a" * 400
    )
    assert not list(directory.glob("*.tmp"))


def test_an_unwritable_directory_is_named(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses everyone
        directory = Path("/sys/grain-core-test-cache")
    else:
        directory = tmp_path / "read-only"
        directory.mkdir()
        directory.chmod(0o500)
    url = _remote(tmp_path, "a.bin", b"a")
    with pytest.raises(sc.ShardCacheError, match=rf"Shard cache {directory} is not writable"):
        sc.ShardCache(directory).local_path(url)


def test_a_full_disk_names_the_directory_and_leaves_nothing(tmp_path: Path) -> None:
    import subprocess
    import sys
    import textwrap

    (tmp_path / "big.bin").write_bytes(b"b" * 5000)
    url = f"local://{tmp_path / 'big.bin'}"  # fsspec's local file system under a URL
    directory = tmp_path / "cache"
    # A file size limit makes the write fail as a full disk does, with a real OS error.
    code = textwrap.dedent(
        f"""
        import resource, signal
        from grain_core.shard_cache import ShardCache, ShardCacheError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        try:
            ShardCache({str(directory)!r}).local_path({url!r})
        except ShardCacheError as e:
            print(e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith(f"Shard cache {directory}: no space for {url}"), out.stderr
    assert sorted(p.suffix for p in directory.iterdir()) == [".lock", ".lock"]


def test_prefetch_downloads_in_the_background(tmp_path: Path) -> None:
    urls = [_remote(tmp_path, f"{n}.bin", n.encode() * 10) for n in "abc"]
    cache = sc.ShardCache(tmp_path / "cache", read_ahead=2)
    cache.prefetch(urls[1:])
    for url, name in zip(urls, "abc", strict=True):
        assert Path(cache.local_path(url)).read_bytes() == name.encode() * 10
    assert [_downloads(u) for u in urls] == [1, 1, 1]


def _fetch_in_child(directory: str, url: str, barrier: Any, out: Any) -> None:
    _register()
    cache = sc.ShardCache(directory)
    barrier.wait()
    out.put(cache.local_path(url))


def test_processes_sharing_a_directory_download_a_shard_once(tmp_path: Path) -> None:
    url = _remote(tmp_path, "shared.bin", os.urandom(8 << 20))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    out = ctx.Queue()
    children = [
        ctx.Process(target=_fetch_in_child, args=(str(tmp_path / "cache"), url, barrier, out))
        for _ in range(3)
    ]
    for child in children:
        child.start()
    paths = {out.get() for _ in children}
    for child in children:
        child.join()
        assert child.exitcode == 0
    assert len(paths) == 1
    assert Path(paths.pop()).read_bytes() == Path(url[len(PROTOCOL) + 3 :]).read_bytes()
    assert _downloads(url) == 1


def test_pickles_without_threads(tmp_path: Path) -> None:
    import pickle

    cache = sc.ShardCache(tmp_path / "cache", max_bytes=123, read_ahead=3, verify=False)
    cache.prefetch([_remote(tmp_path, "a.bin", b"a")])
    clone = pickle.loads(pickle.dumps(cache))
    assert (clone.directory, clone.max_bytes, clone.read_ahead) == (cache.directory, 123, 3)
    assert repr(clone) == repr(cache)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        sc.ShardCache(tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match="read_ahead"):
        sc.ShardCache(tmp_path, read_ahead=-1)
    with pytest.raises(ValueError, match="must be local"):
        sc.ShardCache("s3://bucket/cache")

"""grain_core.shard_cache: downloads on first use, validity, LRU eviction, pins, sharing
between real processes, forks during downloads, planted symbolic links, and the errors for a
full or unwritable directory.

Remote files are local files behind a URL scheme array_record cannot open
(``countinglocal://``: fsspec's local file system, counting the downloads in a file beside
each shard), so several processes see the same "remote" files. ``gatedlocal://`` is the same
with a gate: a download reports on a pipe that it started (holding the entry's lock) and waits
until the test lets it go, so forks and other processes act during a download without sleeps.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import pytest

fsspec = pytest.importorskip("fsspec")

from conftest import fails_after  # noqa: E402
from fsspec.implementations.local import LocalFileSystem  # noqa: E402

from grain_core import shard_cache as sc  # noqa: E402

PROTOCOL = "countinglocal"
GATED = "gatedlocal"


class _CountingLocalFS(LocalFileSystem):  # type: ignore[misc]
    """The local file system under ``countinglocal://``; each open for reading appends a line
    to ``<file>.opens``."""

    protocol = PROTOCOL

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith(f"{cls.protocol}://"):
            path = path[len(cls.protocol) + 3 :]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            with open(self._strip_protocol(path) + ".opens", "a") as log:
                log.write("open\n")
        return super()._open(path, mode, **kwargs)


class _Gate:
    """Pipes between a gated download and the test: ``started`` (the download writes a byte
    once it holds the entry's lock) and ``go`` (it waits for a byte there)."""

    def __init__(self) -> None:
        self.started_r, self.started_w = os.pipe()
        self.go_r, self.go_w = os.pipe()


class _GatedLocalFS(_CountingLocalFS):
    """``countinglocal://`` whose downloads wait at the class's gate (when one is set)."""

    protocol = GATED
    gate: ClassVar[_Gate | None] = None

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        gate = type(self).gate
        if "r" in mode and gate is not None:
            os.write(gate.started_w, b"s")
            os.read(gate.go_r, 1)
        return super()._open(path, mode, **kwargs)


def _register() -> None:
    fsspec.register_implementation(PROTOCOL, _CountingLocalFS, clobber=True)
    fsspec.register_implementation(GATED, _GatedLocalFS, clobber=True)


@pytest.fixture(autouse=True)
def _counting_protocol() -> None:
    _register()


def _remote(tmp_path: Path, name: str, data: bytes, protocol: str = PROTOCOL) -> str:
    remote = tmp_path / "remote"
    remote.mkdir(exist_ok=True)
    (remote / name).write_bytes(data)
    return f"{protocol}://{remote / name}"


def _downloads(url: str) -> int:
    log = Path(url.split("://", 1)[1] + ".opens")
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


def test_a_download_in_progress_is_waited_for_not_an_error(tmp_path: Path) -> None:
    import fcntl
    import threading

    directory = tmp_path / "cache"
    directory.mkdir()
    # Another process is downloading an 800-byte shard: its temporary file reserves the bytes
    # and is locked by its downloader.
    temp = directory / f"{'f' * 40}.800.abc.tmp"
    temp.write_bytes(b"")
    held = os.open(temp, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    url = _remote(tmp_path, "a.bin", b"a" * 400)
    cache = sc.ShardCache(directory, max_bytes=1000)
    cache.prefetch([url])  # gives way while the download holds the room
    paths: list[str] = []
    reader = threading.Thread(target=lambda: paths.append(cache.local_path(url)))
    with fails_after(60):
        reader.start()
        os.close(held)  # that process is gone: its file is stale, removed, and the shard fits
        reader.join()
    assert Path(paths[0]).read_bytes() == b"a" * 400
    assert not list(directory.glob("*.tmp"))
    assert _downloads(url) == 1


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
    locks = ["cache.lock", "download.lock", "lock"]  # the directory's and the entry's two
    assert sorted(p.name.split(".", 1)[1] for p in directory.iterdir()) == locks


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


# ----------------------------------------------------------------------------- pins
def test_a_pinned_shard_is_not_evicted_and_a_full_cache_names_the_limit_and_holders(
    tmp_path: Path,
) -> None:
    urls = [_remote(tmp_path, f"{n}.bin", n.encode() * 400) for n in "abc"]
    cache = sc.ShardCache(tmp_path / "cache", max_bytes=1000)  # two of the three
    with cache.pin(urls[0]) as pinned_a, cache.pin(urls[1]):
        assert Path(pinned_a.path).read_bytes() == b"a" * 400
        with pytest.raises(
            sc.ShardCacheFullError,
            match=r"max_bytes=1000 leaves no room for .*c\.bin \(400 bytes\); held: 800 bytes "
            r"by 2 shards .*a\.bin, .*b\.bin",
        ):
            cache.pin(urls[2])
    # Unpinned, the least recently used one makes room.
    with cache.pin(urls[2]):
        assert len(_entries(cache)) == 2
    assert [_downloads(u) for u in urls] == [1, 1, 1]


def test_a_download_ahead_never_evicts_one_fetched_ahead_and_not_yet_used(tmp_path: Path) -> None:
    urls = [_remote(tmp_path, f"{n}.bin", n.encode() * 400) for n in "abc"]
    cache = sc.ShardCache(tmp_path / "cache", max_bytes=1000, read_ahead=1)
    cache.prefetch(urls[:1])
    cache.prefetch(urls[1:])  # does not fit beside a.bin without evicting it: left for pin
    cache.pin(urls[1]).close()
    with cache.pin(urls[0]) as pinned:
        assert Path(pinned.path).read_bytes() == b"a" * 400
    assert [_downloads(u) for u in urls] == [1, 1, 0]


def test_readers_that_find_an_entry_missing_together_never_wait_for_each_others_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes check a missing entry at the same moment (a hook makes each wait there
    for the other); one downloads it and keeps it pinned until the other has its pin too.
    Before, the other waited for the entry's exclusive lock, which the first one's pin keeps:
    a DataLoader worker holding a pin while it waits for the parent, which waits for the
    worker stuck on that lock, hung for ever."""
    url = _remote(tmp_path, "a.bin", b"a" * 1000)
    cache = sc.ShardCache(tmp_path / "cache")
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    ends = {"to_other": to_child_w, "from_other": to_parent_r}
    checked: list[bool] = []
    real_valid = sc.ShardCache._valid

    def valid_then_meet(self: sc.ShardCache, *args: Any) -> bool:
        found = real_valid(self, *args)
        if not checked:  # this process's first check: both have found the entry missing
            checked.append(found)
            os.write(ends["to_other"], b"c")
            os.read(ends["from_other"], 1)
        return found

    monkeypatch.setattr(sc.ShardCache, "_valid", valid_then_meet)

    def child() -> bool:
        ends.update(to_other=to_parent_w, from_other=to_child_r)
        with cache.pin(url) as pinned:
            os.write(to_parent_w, b"p")
            os.read(to_child_r, 1)  # the parent has its pin too (or gave up)
            return Path(pinned.path).read_bytes() == b"a" * 1000

    pid = _child(child)
    try:
        with fails_after(60), cache.pin(url) as pinned:
            assert os.read(to_parent_r, 1) == b"p"  # both hold a pin of the shard now
            assert Path(pinned.path).read_bytes() == b"a" * 1000
    finally:
        os.write(to_child_w, b"d")
        status = _exit_status(pid)
    assert checked == [False]
    assert status == 0
    assert _downloads(url) == 1


def test_a_read_takes_the_room_of_a_download_ahead_which_stops_at_its_next_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download ahead holds the room a read needs, and its transfer stalls after its first
    block (a hook: its next read waits until another thread removes a download's temporary
    file). The read takes the room: the download ahead stops at its next block and leaves
    nothing behind. Before, the read waited for the whole download ahead (here for ever)."""
    import threading

    from grain_core import storage

    monkeypatch.setattr(sc, "_BLOCK", 100)
    pinned_url = _remote(tmp_path, "p.bin", b"p" * 500)
    ahead_url = _remote(tmp_path, "a.bin", b"a" * 400)
    url = _remote(tmp_path, "c.bin", b"c" * 400)
    cache = sc.ShardCache(tmp_path / "cache", max_bytes=1000, read_ahead=1)
    stalled, go = threading.Event(), threading.Event()
    real_open_read, real_unlink = storage.open_read, os.unlink

    class Stalling:
        """The download ahead's source: its second read waits for ``go``."""

        def __init__(self, file: Any) -> None:
            self._file = file
            self._reads = 0

        def read(self, size: int = -1) -> bytes:
            self._reads += 1
            if self._reads == 2:
                stalled.set()
                go.wait()
            return self._file.read(size)  # type: ignore[no-any-return]

        def __enter__(self) -> Stalling:
            return self

        def __exit__(self, *exc_info: object) -> None:
            self._file.close()

    def open_read(path: Any, *args: Any, **kwargs: Any) -> Any:
        file = real_open_read(path, *args, **kwargs)
        return Stalling(file) if path == ahead_url else file

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        real_unlink(path, *args, **kwargs)
        if str(path).endswith(".tmp") and threading.current_thread() is threading.main_thread():
            go.set()  # the reader removed a download's file: the stalled transfer goes on

    monkeypatch.setattr(storage, "open_read", open_read)
    monkeypatch.setattr(os, "unlink", unlink)
    try:
        with cache.pin(pinned_url), fails_after(60):
            cache.prefetch([ahead_url])
            stalled.wait()  # 500 bytes pinned + 400 downloading ahead + 400 > 1000
            with cache.pin(url) as pinned:
                assert Path(pinned.path).read_bytes() == b"c" * 400
    finally:
        go.set()
    assert not list((tmp_path / "cache").glob("*.tmp"))
    # The download ahead gave way; a read of its shard downloads it.
    assert Path(cache.local_path(ahead_url)).read_bytes() == b"a" * 400


# ---------------------------------------------------------------------------- forks
_LOCK_PROBE = textwrap.dedent(
    """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("free")
    except BlockingIOError:
        print("held")
    """
)
_THIRD_PROCESS = textwrap.dedent(
    """
    import sys
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    from grain_core.shard_cache import ShardCache

    class Local(LocalFileSystem):
        protocol = sys.argv[3]

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.split("://", 1)[-1])

    fsspec.register_implementation(sys.argv[3], Local, clobber=True)
    print(open(ShardCache(sys.argv[1]).local_path(sys.argv[2]), "rb").read().decode())
    """
)


def _third_process(script: str, *args: str) -> str:
    """What a third process sharing the directory prints (``script`` run with ``args``)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def _entry_key(cache: sc.ShardCache, url: str) -> str:
    """The name of ``url``'s entry in the directory (from its metadata)."""
    for meta in Path(cache.directory).glob("*.json"):
        if json.loads(meta.read_text())["url"] == url:
            return meta.stem
    raise AssertionError(f"no entry of {url}")


def _lock_file(cache: sc.ShardCache, url: str) -> str:
    return os.path.join(cache.directory, _entry_key(cache, url) + ".lock")


def _child(body: Any) -> int:
    """Forks; the child runs ``body()`` (exit status 0 if it returns True) under a hang
    guard, the parent gets the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(60)  # a hang in the child ends it (and fails the test)
            code = 0 if body() else 2
        finally:
            os._exit(code)
    return pid


def _exit_status(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_child_forked_during_a_download_blocks_nobody_and_fetches_for_itself(
    tmp_path: Path,
) -> None:
    gate = _Gate()
    url = _remote(tmp_path, "a.bin", b"a" * 1000, protocol=GATED)
    other = _remote(tmp_path, "b.bin", b"b" * 1000)
    cache = sc.ShardCache(tmp_path / "cache")
    to_child_r, to_child_w = os.pipe()
    _GatedLocalFS.gate = gate
    try:
        with fails_after(60):
            cache.prefetch([url])
            os.read(gate.started_r, 1)  # the parent's download holds the entry now

            def child() -> bool:
                _GatedLocalFS.gate = None
                os.read(to_child_r, 1)  # the parent's download has ended
                # The parent's download thread is not in this process: the cache looks
                # for itself, and downloads what nobody has.
                same = Path(cache.local_path(url)).read_bytes() == b"a" * 1000
                own = Path(cache.local_path(other)).read_bytes() == b"b" * 1000
                os.read(to_child_r, 1)  # alive until the parent has checked
                return same and own

            pid = _child(child)
            os.write(gate.go_w, b"g")
            # Before: the child's copy of the download's lock descriptor kept the entry
            # locked for the child's whole life, and this waited for it.
            assert Path(cache.local_path(url)).read_bytes() == b"a" * 1000
            assert _third_process(_LOCK_PROBE, _lock_file(cache, url)) == "free"
            assert _third_process(_THIRD_PROCESS, cache.directory, url, GATED) == "a" * 1000
            os.write(to_child_w, b"1")
            os.write(to_child_w, b"2")
            assert _exit_status(pid) == 0
    finally:
        _GatedLocalFS.gate = None
    assert (_downloads(url), _downloads(other)) == (1, 1)


def test_a_forked_child_downloading_is_waited_for_and_holds_no_pin_of_its_parent(
    tmp_path: Path,
) -> None:
    gate = _Gate()
    pinned_url = _remote(tmp_path, "a.bin", b"a" * 1000)
    url = _remote(tmp_path, "c.bin", b"c" * 1000, protocol=GATED)
    cache = sc.ShardCache(tmp_path / "cache")
    pinned = cache.pin(pinned_url)
    _GatedLocalFS.gate = gate
    try:
        with fails_after(60):
            pid = _child(lambda: Path(cache.local_path(url)).read_bytes() == b"c" * 1000)
            os.read(gate.started_r, 1)  # the child's download holds its entry now
            _GatedLocalFS.gate = None
            pinned.close()  # the child has no copy of the parent's pin
            assert _third_process(_LOCK_PROBE, _lock_file(cache, pinned_url)) == "free"
            os.write(gate.go_w, b"g")
            # The parent waits for the child's download and takes its copy.
            assert Path(cache.local_path(url)).read_bytes() == b"c" * 1000
            assert _exit_status(pid) == 0
    finally:
        _GatedLocalFS.gate = None
    assert _downloads(url) == 1


# -------------------------------------------------------------- shared directories
def _planted(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not yours")
    os.utime(victim, ns=(1_000_000_000, 1_000_000_000))
    return victim


def _untouched(victim: Path) -> bool:
    info = victim.stat()
    return victim.read_bytes() == b"not yours" and info.st_mtime_ns == 1_000_000_000


@pytest.mark.parametrize("name", ["lock", "download.lock", "cache.lock", "json", "shard", "tmp"])
def test_a_planted_symlink_is_replaced_never_followed(tmp_path: Path, name: str) -> None:
    url = _remote(tmp_path, "a.bin", b"not yours")  # the victim's size and bytes: a link
    directory = tmp_path / "cache"  # to it passes every check that follows links
    cache = sc.ShardCache(directory, verify=False)
    cache.local_path(url)  # a valid entry, whose files the other user replaces by links
    victim = _planted(tmp_path)
    key = _entry_key(cache, url)
    planted = {
        "lock": f"{key}.lock",
        "download.lock": f"{key}.download.lock",
        "cache.lock": ".cache.lock",
        "json": f"{key}.json",
        "shard": f"{key}.shard",
        "tmp": f"{key}.9.0123456789ab.tmp",
    }[name]
    link = directory / planted
    link.unlink(missing_ok=True)
    link.symlink_to(victim)
    if name in ("json", "shard"):  # an entry whose file is a link is invalid: downloaded
        fresh = sc.ShardCache(directory, verify=False)
    else:
        fresh = sc.ShardCache(directory, verify=False, max_bytes=100)
        fresh.local_path(_remote(tmp_path, "b.bin", b"b" * 95))  # a reservation (evicts a)
    assert Path(fresh.local_path(url)).read_bytes() == b"not yours"
    assert _untouched(victim)
    assert not link.is_symlink()
    assert all(not p.is_symlink() for p in directory.iterdir())


def test_files_are_created_owner_only(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    sc.ShardCache(directory).local_path(_remote(tmp_path, "a.bin", b"a" * 10))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()} == {0o600}


_KILLED_DOWNLOAD = textwrap.dedent(
    """
    import sys
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    from grain_core.shard_cache import ShardCache

    class Stuck(LocalFileSystem):
        protocol = "countinglocal"

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.split("://", 1)[-1])

        def _open(self, path, mode="rb", **kwargs):
            file = super()._open(path, mode, **kwargs)
            real_read = file.read

            def read(size=-1):  # half the shard, then the process is killed
                data = real_read(500)
                print("half", flush=True)
                sys.stdin.read()
                return data

            file.read = read
            return file

    fsspec.register_implementation("countinglocal", Stuck, clobber=True)
    ShardCache(sys.argv[1], max_bytes=int(sys.argv[3])).local_path(sys.argv[2])
    """
)


@pytest.mark.parametrize("next_use", ["same shard", "another shard"])
def test_a_killed_download_is_counted_then_removed_by_the_next_operation(
    tmp_path: Path, next_use: str
) -> None:
    url = _remote(tmp_path, "a.bin", b"a" * 1000)
    directory = tmp_path / "cache"
    cache = sc.ShardCache(directory, max_bytes=2000)
    pinned = cache.pin(_remote(tmp_path, "c.bin", b"c" * 600))
    killed = subprocess.Popen(
        [sys.executable, "-c", _KILLED_DOWNLOAD, str(directory), url, "2000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert killed.stdout is not None and killed.stdout.readline() == "half\n"
    # While it runs, its reservation counts; the error comes because the pinned shard and
    # the new one alone exceed the bound.
    with pytest.raises(
        sc.ShardCacheFullError,
        match=r"max_bytes=2000 leaves no room for .*b\.bin \(1500 bytes\); held: 600 bytes by 1 "
        r"shards .*c\.bin\); 1000 bytes by downloads in progress",
    ):
        cache.local_path(_remote(tmp_path, "b.bin", b"b" * 1500))
    killed.kill()
    killed.wait()
    pinned.close()
    assert [p.name for p in directory.glob("*.tmp")]  # the partial file stays behind
    cache = sc.ShardCache(directory, max_bytes=2000)
    if next_use == "same shard":
        assert Path(cache.local_path(url)).read_bytes() == b"a" * 1000
    else:
        cache.local_path(_remote(tmp_path, "b.bin", b"b" * 1500))
    assert not list(directory.glob("*.tmp"))

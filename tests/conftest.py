"""Shared pytest configuration."""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import signal
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import grain_core as grain
from grain_core.dataset.mp import positions as mp_positions
from grain_core.observe import stages

settings.register_profile(
    "grain_core", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# CI runs the same examples every time (a property failure there is reproducible from the
# log, never a coin toss that blocks a merge); local runs keep exploring new examples.
settings.register_profile("ci", parent=settings.get_profile("grain_core"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "grain_core")

#: Set to 1 to run the tests marked ``slow`` under CI too (a two-node Ray cluster, ...).
SLOW_TESTS_ENV = "GRAIN_CORE_SLOW_TESTS"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"slow: minutes of set-up; skipped under CI unless {SLOW_TESTS_ENV}=1"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("CI") or os.environ.get(SLOW_TESTS_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"slow: CI runs it with {SLOW_TESTS_ENV}=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Worker processes receive this module's helpers by value (they cannot import conftest).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LogProduced:
    """A map that appends each element it passes to a file: what a worker has produced so far
    (the pipeline reaches a worker as a copy, so a list would stay empty here)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, x: int) -> int:
        with open(self.path, "a") as f:
            f.write(f"{x}\n")
        return x


@contextlib.contextmanager
def fails_after(seconds: int) -> Iterator[None]:
    """Turns a hang (a worker and the parent each waiting for the other) into a failure (an
    ``AssertionError``: a ``TimeoutError`` is an ``OSError``, which code around a pipe may
    take for a closed one)."""

    def fail(*_: object) -> None:
        raise AssertionError(
            f"no progress in {seconds} s: the worker and the parent wait on each other"
        )

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Indexes and downloads that grain_core caches go to a directory of this run, never to
    the user's ``~/.cache`` (set before any worker process starts, so workers inherit it)."""
    previous = os.environ.get("GRAIN_CORE_CACHE_DIR")
    os.environ["GRAIN_CORE_CACHE_DIR"] = str(tmp_path_factory.mktemp("grain-core-cache"))
    yield
    if previous is None:
        del os.environ["GRAIN_CORE_CACHE_DIR"]
    else:
        os.environ["GRAIN_CORE_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """moto's S3 server on 127.0.0.1 (a free port), started once and stopped at the end."""
    pytest.importorskip("moto.server", reason="needs moto[server] (nox -s tests-remote)")
    pytest.importorskip("s3fs", reason="needs s3fs (nox -s tests-remote)")
    from s3_server import running_s3_server

    with running_s3_server() as server:
        yield server


@pytest.fixture
def s3(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh bucket on the S3 server: ``s3.url`` (``s3://<bucket>``), ``s3.options`` (the
    storage_options reaching it). fsspec's configuration points ``s3://`` at the server too,
    for code that takes URLs without options (the CLI, Orbax)."""
    import fsspec

    options = s3_server.storage_options()
    monkeypatch.setitem(fsspec.config.conf, "s3", options)
    return types.SimpleNamespace(url=s3_server.make_bucket(), options=options, server=s3_server)


@pytest.fixture
def s3_requests(s3: Any, monkeypatch: pytest.MonkeyPatch) -> collections.Counter[tuple[str, bool]]:
    """Counts the requests s3fs sends from here on: ``(operation, ranged)`` -> how many."""
    import s3fs

    requests: collections.Counter[tuple[str, bool]] = collections.Counter()
    call = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        requests[(method, "Range" in kwargs)] += 1
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    return requests


# --------------------------------------------------------- mp_prefetch's worker processes
def mp_options(n: int, buffer: int = 1) -> grain.MultiprocessingOptions:
    """``MultiprocessingOptions`` with ``n`` workers and ``per_worker_buffer_size`` ``buffer``."""
    return grain.MultiprocessingOptions(num_workers=n, per_worker_buffer_size=buffer)


def shm_names() -> set[str]:
    """Blocks created by this process or its workers (all names carry our pid)."""
    prefix = f"gc{os.getpid():x}"
    return {e for e in os.listdir("/dev/shm") if e.startswith(prefix)}


@pytest.fixture
def no_shm_leak() -> Iterator[None]:
    """Fails a test whose worker processes leave shared-memory blocks behind once closed (the
    parent unlinks a worker's blocks when its pool stops: this waits for that, at most 5 s)."""
    before = shm_names()
    yield
    gc.collect()
    deadline = time.monotonic() + 5
    while shm_names() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shm_names() - before == set()


@pytest.fixture
def strict_rotation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mp_prefetch`` runs every pipeline by strict rotation (no dispatching)."""
    monkeypatch.setattr(mp_positions, "dispatchable", lambda *_: False)


def big_element(x: int) -> dict[str, Any]:
    """An element whose array goes through shared memory, with a number and a string."""
    return {"z": np.full((128, 256), x, np.float32), "a": x, "s": np.array(["x" * (x + 1)])}


# ------------------------------------------------------- the pipeline debugging tools watch
def normalize(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) / 255


def image_pipeline(n: int = 64, read: grain.ReadOptions | None = None) -> grain.IterDataset:
    """The pipeline of docs/debugging.md on ``n`` one-pixel images: seed, shuffle, read (by
    default in the consumer's thread), normalize, batches of 8."""
    source = np.arange(n, dtype=np.uint8).reshape(n, 1)
    return (
        grain.MapDataset.source(source)
        .seed(42)
        .shuffle()
        .to_iter_dataset(read or grain.ReadOptions(num_threads=0))
        .map(normalize)
        .batch(8)
    )


# ------------------------------------------------------------------ protobuf wire bytes
def varint_size(value: int) -> int:
    """Bytes of ``value``'s canonical varint (as a 64-bit two's complement number)."""
    return max(1, -(-(value & (1 << 64) - 1).bit_length() // 7))


def encode_varint(value: int, extra: int = 0) -> bytes:
    """``value`` (as a 64-bit two's complement number) as a protobuf varint, over-long by
    ``extra`` zero groups (decoders must take them, up to 10 bytes in all)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    if extra:
        out[-1] |= 0x80
        out += b"\x80" * (extra - 1) + b"\x00"
    return bytes(out)


class StageClock:
    """Replaces the stage-timing clock; transforms ``advance`` it to cost a known amount of time."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


@pytest.fixture
def stage_clock(monkeypatch: pytest.MonkeyPatch) -> StageClock:
    """The clock of stage timing (``grain_core.observe.stages``), replaced by a StageClock."""
    fake = StageClock()
    monkeypatch.setattr(stages, "_now", fake)
    return fake


def stage_pipeline(clock: StageClock | None = None) -> Any:
    """Six stages whose transforms cost 1000, 10 and 100 ns of ``clock`` per element."""

    def costly(x: int) -> int:
        if clock is not None:
            clock.advance(1000)
        return x + 1

    def keep_even(x: int) -> bool:
        if clock is not None:
            clock.advance(10)
        return x % 2 == 0

    def cheap(x: int) -> int:
        if clock is not None:
            clock.advance(100)
        return x * 2

    return (
        grain.MapDataset.range(100)
        .map(costly)
        .to_iter_dataset(grain.ReadOptions(num_threads=0))
        .filter(keep_even)
        .map(cheap)
        .batch(5)
    )

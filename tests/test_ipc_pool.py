"""Tests of grain_core._ipc.pool: how worker processes start."""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import logging
import multiprocessing.connection
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import fails_after

import grain_core
import grain_core as grain
from grain_core._ipc import pool as ipc_pool
from grain_core._ipc import watchdog
from grain_core.multiprocessing import WorkerStalledError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver")

_SCRIPT = """
import grain_core as grain


def where(_):
    import grain_core

    return grain_core.__file__


if __name__ == "__main__":
    ds = grain.MapDataset.range(2).map(where).to_iter_dataset()
    options = grain.MultiprocessingOptions(num_workers=2)
    print(grain.__file__)
    for path in sorted(set(ds.mp_prefetch(options))):
        print(path)
"""


def test_workers_import_the_grain_core_the_parent_imported(tmp_path: Path) -> None:
    # Run from a source checkout whose grain_core is not the one the parent imports (the
    # script's directory comes first on its path, not the working directory): the workers'
    # forkserver must not import the checkout's from its working directory. The checkout's
    # package runs the real modules, so a worker that imported it still works and says where
    # its grain_core came from.
    checkout = tmp_path / "checkout" / "grain_core"
    checkout.mkdir(parents=True)
    real = Path(grain_core.__file__).parent
    (checkout / "__init__.py").write_text(f"__path__.append({str(real)!r})\n")
    script = tmp_path / "script" / "run.py"
    script.parent.mkdir()
    script.write_text(_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=checkout.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    parent, *workers = out.stdout.split()
    assert parent == grain_core.__file__
    assert workers == [parent]


_FORK_SCRIPT = """
import os
import sys
import threading

import numpy as np

import grain_core as grain


def big(i):
    return np.full(40_000, i, np.int32)  # 160 KB: travels in shared memory


def loader(n):
    ds = grain.MapDataset.range(n).map(big).to_iter_dataset()
    return iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))


def first_values(it, count):
    return [int(next(it)[0]) for _ in range(count)]


if __name__ == "__main__":
    grain.config.update("py_mp_prefetch_dispatch", sys.argv[1] == "dispatch")
    it = loader(40)
    print("parent", first_values(it, 3), flush=True)
    pid = os.fork()
    if pid == 0:
        if sys.argv[2] == "own-workers":
            try:
                next(it)
            except RuntimeError as e:
                print("child-uses-parents", type(e).__name__, e, flush=True)
            print("child", first_values(loader(6), 6), flush=True)
        sys.exit(0)  # the interpreter's whole exit: atexit hooks, finalizers
    _, status = os.waitpid(pid, 0)
    print("child-exit", os.waitstatus_to_exitcode(status), flush=True)
    print("parent", first_values(it, 37), flush=True)
"""


@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
@pytest.mark.parametrize("child", ["exits", "own-workers"])
def test_a_forked_child_leaves_the_parents_workers_alone(
    tmp_path: Path, engine: str, child: str
) -> None:
    # The child exits normally (or first starts workers of its own) while the parent's
    # workers hold elements in shared memory: the parent's iterator reads on, every element.
    script = tmp_path / "fork.py"
    script.write_text(_FORK_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), engine, child],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"parent {list(range(3))}"
    assert lines[-2:] == ["child-exit 0", f"parent {list(range(3, 40))}"]
    if child == "own-workers":
        assert lines[1].startswith("child-uses-parents WorkerDiedError Worker process")
        assert "a forked process cannot use its parent's iterator" in lines[1]
        assert lines[2] == f"child {list(range(6))}"
    else:
        assert len(lines) == 3


def _read_variable(name: str) -> str:
    import os

    return os.environ.get(name, "unset")  # a None element would be dropped


def test_workers_see_variables_the_parent_set_after_the_forkserver_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first pool starts the forkserver; the variable is set after that, as a credential
    # or a storage emulator's endpoint may be.
    options = grain_core.MultiprocessingOptions(num_workers=1)
    first = grain_core.MapDataset.range(1).map(lambda _: _read_variable("GRAIN_TEST_LATE"))
    assert list(first.to_iter_dataset().mp_prefetch(options)) == ["unset"]
    monkeypatch.setenv("GRAIN_TEST_LATE", "set later")
    monkeypatch.delenv("HOME", raising=False)
    late = grain_core.MapDataset.range(2).map(
        lambda _: (_read_variable("GRAIN_TEST_LATE"), _read_variable("HOME"))
    )
    assert list(late.to_iter_dataset().mp_prefetch(options)) == [("set later", "unset")] * 2


class _BlockedAt:
    """Element ``x`` itself, but element ``stuck`` first waits until something opens the FIFO
    ``fifo`` for writing (a worker stuck in user code, released by the test)."""

    def __init__(self, stuck: int, fifo: str) -> None:
        self.stuck, self.fifo = stuck, fifo

    def __call__(self, x: int) -> int:
        if x == self.stuck:
            _wait_for_release(self.fifo)
        return x


def _wait_for_release(fifo: str) -> None:
    with open(fifo):  # blocks until the test opens it for writing
        pass


def _release(fifo: str) -> None:
    with open(fifo, "w"):  # the worker is waiting in open() for a writer: no wait here
        pass


class _StallRecords(logging.Handler):
    """Keeps the watchdog's warnings; releases the stuck worker at the first whose stacks show
    it waiting in ``_wait_for_release`` (earlier ones may be about a worker still starting)."""

    def __init__(self, fifo: str) -> None:
        super().__init__(logging.WARNING)
        self.fifo = fifo
        self.stuck: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "_wait_for_release" in message and not self.stuck:
            self.stuck.append(message)
            _release(self.fifo)


def _stuck_pipeline(tmp_path: Path, engine: str, **options: Any) -> tuple[Any, str]:
    grain.config.update("py_mp_prefetch_dispatch", engine == "dispatch")
    fifo = str(tmp_path / "release")
    os.mkfifo(fifo)
    ds = grain.MapDataset.range(8).map(_BlockedAt(5, fifo)).to_iter_dataset()
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2, **options)), fifo


@pytest.fixture
def restore_dispatch() -> Iterator[None]:
    yield
    grain.config.update("py_mp_prefetch_dispatch", True)


@pytest.mark.usefixtures("restore_dispatch")
@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
def test_the_watchdog_warns_with_the_stuck_workers_stack(tmp_path: Path, engine: str) -> None:
    ds, fifo = _stuck_pipeline(tmp_path, engine, stall_warning_s=0.05)
    records = _StallRecords(fifo)
    logger = logging.getLogger("grain_core")
    logger.addHandler(records)
    try:
        assert list(ds) == list(range(8))  # the handler released the worker
    finally:
        logger.removeHandler(records)
    (message,) = records.stuck
    # Element 5 is worker 1's element 2 under rotation; dispatch names the position. A worker
    # reads a few positions at once, so the consumer may wait for an earlier one of them.
    what = "position [1-5] of" if engine == "dispatch" else "element [0-2] of its share"
    assert re.search(rf"waited \d+\.\d s for {what}.* from worker process \d of 2 \(pid", message)
    assert "stall_timeout_s makes it an error" in message
    assert re.search(r"line \d+ in _wait_for_release\n.*line \d+ in __call__", message)


@pytest.mark.usefixtures("restore_dispatch")
@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
def test_past_the_deadline_a_stuck_worker_is_an_error(tmp_path: Path, engine: str) -> None:
    ds, fifo = _stuck_pipeline(tmp_path, engine, stall_warning_s=None, stall_timeout_s=0.05)
    it = iter(ds)
    seen: list[int] = []
    while True:
        try:
            seen.append(next(it))
        except WorkerStalledError as e:
            if "_wait_for_release" in str(e):  # not a worker still starting
                error = e
                break
            # Past the deadline for a worker still starting: the next call waits again.
    # Element 5 holds back those a worker reads with it (as in the previous test).
    assert 1 <= len(seen) <= 5 and seen == list(range(len(seen)))
    assert re.search(r"giving up \(MultiprocessingOptions.stall_timeout_s=0.05\)", str(error))
    # The worker was left running: released, it sends the element, and the stream goes on
    # (a call after the error waits again; the deadline may pass again on a loaded machine).
    _release(fifo)
    rest: list[int] = []
    while True:
        try:
            rest.append(next(it))
        except StopIteration:
            break
        except WorkerStalledError:
            continue
    assert rest == list(range(len(seen), 8))


def _holds_the_gil_at_two(x: int) -> int:
    """Element 2 never ends, in native code that holds the GIL (the regular expression engine
    backtracking exponentially): the worker's stack thread cannot answer."""
    if x == 2:
        re.fullmatch(r"(a|aa)+b", "a" * 200)
    return x


@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
def test_the_stack_request_does_not_delay_the_watchdog(
    monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    # A stack thread that would get an hour to answer: the warning and the error still come
    # at their deadlines (with the stacks asked for ahead of them, faulthandler writing them
    # to stderr when the worker cannot answer). Before, each report waited for the answer.
    monkeypatch.setattr(watchdog, "STACK_ANSWER_S", 3600.0)
    monkeypatch.setattr(ipc_pool, "STOP_TIMEOUT_S", 1.0)  # the stuck worker is killed sooner
    grain.config.update("py_mp_prefetch_dispatch", engine == "dispatch")
    options = grain.MultiprocessingOptions(num_workers=1, stall_warning_s=0.2, stall_timeout_s=0.6)
    ds = grain.MapDataset.range(4).map(_holds_the_gil_at_two).to_iter_dataset()
    try:
        with iter(ds.mp_prefetch(options)) as it, fails_after(120):
            while True:
                try:
                    next(it)  # elements 0 and 1 may come, or wait with element 2
                except WorkerStalledError as e:
                    if "native code may hold the worker's GIL" in str(e):
                        error = e
                        break  # else about the worker still starting
    finally:
        grain.config.update("py_mp_prefetch_dispatch", True)
    assert "stall_timeout_s=0.6" in str(error)


class _Blocked(logging.Handler):
    """Sets ``event`` at the watchdog's first warning whose stacks show the worker waiting in
    ``_wait_for_release``: the consumer's thread is then inside its wait for the worker."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "_wait_for_release" in record.getMessage():
            self.event.set()


@pytest.mark.usefixtures("restore_dispatch")
@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
def test_an_iterator_used_by_two_threads_at_once_says_it_is_not_thread_safe(
    tmp_path: Path, engine: str
) -> None:
    grain.config.update("py_mp_prefetch_dispatch", engine == "dispatch")
    fifo = str(tmp_path / "release")
    os.mkfifo(fifo)
    ds = grain.MapDataset.range(4).map(_BlockedAt(0, fifo)).to_iter_dataset()
    it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2, stall_warning_s=0.05)))
    blocked = _Blocked()
    logger = logging.getLogger("grain_core")
    logger.addHandler(blocked)
    first: list[int] = []
    reader = threading.Thread(target=lambda: first.append(next(it)), daemon=True)
    try:
        reader.start()
        assert blocked.event.wait(timeout=120)  # the reader waits for element 0
        with pytest.raises(RuntimeError, match="grain_core iterators are not thread-safe"):
            next(it)
    finally:
        logger.removeHandler(blocked)
        if blocked.event.is_set():  # else nobody waits on the FIFO: opening it would block
            _release(fifo)
            reader.join()
    assert first == [0]


@dataclasses.dataclass(frozen=True)
class _StuckSpec:
    """A worker stuck reading the FIFO ``release`` until the test writes to it, in native code
    that holds the GIL (``holds_gil``: its stack thread cannot answer) or in a read that
    lets it go; faulthandler's signal writes its stacks into the FIFO ``dumps``."""

    index: int
    count: int
    shm_prefix: str
    holds_gil: bool
    release: str
    dumps: str


def _stuck_worker(spec: _StuckSpec, control: Any, output: Any) -> None:
    dumps = os.open(spec.dumps, os.O_RDWR)  # a FIFO opened so does not wait for a reader
    faulthandler.register(signal.SIGUSR1, file=dumps, all_threads=True)
    release = os.open(spec.release, os.O_RDWR)
    # This thread keeps the GIL until it blocks below: a stack request that comes right after
    # "stuck" finds a worker already stuck, never one still on its way.
    sys.setswitchinterval(3600.0)
    output.send_bytes(pickle.dumps(("stuck",)))
    if spec.holds_gil:
        # libc's read() called through PyDLL keeps the GIL while it blocks.
        ctypes.PyDLL(None).read(release, ctypes.create_string_buffer(1), 1)
    else:
        os.read(release, 1)
    sys.setswitchinterval(0.005)
    try:
        control.recv_bytes()
    except EOFError:
        return  # the pool stops


def test_faulthandler_is_signalled_once_for_a_stack_request_unanswered_for_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two workers stuck in user code; the parent's watchdog asks both for their stacks at 0 s
    # (on a clock the test advances). Worker 1 answers and is never signalled. Worker 0 holds
    # the GIL and cannot answer: SIGUSR1 (faulthandler writes its stacks) comes only once its
    # request has gone unanswered for _STACK_ANSWER_S, and once for that request, whatever
    # the reports after it. Released, it answers, and a new request is answered too.
    signalled: list[int] = []
    kill = os.kill

    def recording_kill(pid: int, signum: int) -> None:
        if signum == signal.SIGUSR1:
            signalled.append(pid)
        kill(pid, signum)

    monkeypatch.setattr(os, "kill", recording_kill)
    now = [0.0]
    specs = []
    for i in range(2):
        release, dumps = str(tmp_path / f"release{i}"), str(tmp_path / f"dumps{i}")
        os.mkfifo(release)
        os.mkfifo(dumps)
        prefix = ipc_pool.WorkerPool.new_prefix(i)
        specs.append(_StuckSpec(i, 2, prefix, holds_gil=i == 0, release=release, dumps=dumps))
    pool = ipc_pool.WorkerPool(specs, _stuck_worker, stall_warning_s=30.0, clock=lambda: now[0])
    watches = [watchdog.StallWatch(0.0, lambda i=i: (i, f"element {i}")) for i in range(2)]
    stuck, answering = pool._procs[0].pid, 1
    try:
        with fails_after(120):
            assert [pool.recv(i) for i in range(2)] == [("stuck",)] * 2
            for watch in watches:
                pool._watchdog.ask_for_stacks(watch)
            multiprocessing.connection.wait([pool._watchdog.workers[answering].answers])
            now[0] = watchdog.STACK_ANSWER_S - 0.01
            assert "no answer yet" in pool._watchdog.report(watches[0], 29.0, None)
            assert "in _stuck_worker" in pool._watchdog.report(watches[1], 29.0, None)
            assert signalled == []
            now[0] = watchdog.STACK_ANSWER_S
            assert "no answer yet" in pool._watchdog.report(watches[0], 30.0, None)
            assert signalled == [stuck]
            with open(specs[0].dumps, "rb", buffering=0) as f:  # the worker holds it open
                written = b""
                while b"in _stuck_worker" not in written:
                    written += f.read(65536)
            for t in (1.5, 2.0, 31.0, 60.0):
                now[0] = t
                for watch in watches:
                    pool._watchdog.ask_for_stacks(watch)
                multiprocessing.connection.wait([pool._watchdog.workers[answering].answers])
                assert "no answer yet" in pool._watchdog.report(watches[0], t, None)
                assert "in _stuck_worker" in pool._watchdog.report(watches[1], t, None)
            assert signalled == [stuck]
            _write_byte(specs[0].release)
            multiprocessing.connection.wait([pool._watchdog.workers[0].answers])
            assert "in _stuck_worker" in pool._watchdog.report(watches[0], 90.0, None)
            now[0] = 90.0
            pool._watchdog.ask_for_stacks(watches[0])
            multiprocessing.connection.wait([pool._watchdog.workers[0].answers])
            now[0] = 120.0
            assert "in _stuck_worker" in pool._watchdog.report(watches[0], 120.0, None)
            assert signalled == [stuck]
            _write_byte(specs[1].release)
    finally:
        pool.shutdown()


def _write_byte(fifo: str) -> None:
    with open(fifo, "wb") as f:  # the worker holds it open for reading: no wait here
        f.write(b"x")

"""grain_core.dataset.mp (``mp_prefetch``) with real worker processes, whichever engine runs
them: order, checkpoints, failures, shared memory, statistics. Engine specifics:
test_mp_rotation.py and test_mp_dispatch.py."""

from __future__ import annotations

import collections
import functools
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import pytest
from conftest import big_element, fails_after, mp_options, shm_names

import grain_core as grain
from grain_core._ipc import errors as ipc_errors
from grain_core._ipc import pool as ipc_pool
from grain_core._ipc import shm as _shm
from grain_core.dataset.mp import MultiprocessPrefetchIterDataset, protocol, rotation
from grain_core.dataset.mp import dispatch as mp_dispatch
from grain_core.dataset.mp.pickling import pickle_pipeline
from grain_core.dataset.worker_slicing import slice_for_worker
from grain_core.experimental import DatasetOptions, ExecutionTrackingMode, WithOptionsIterDataset
from grain_core.observe import Observer
from grain_core.observe.summary import get_execution_summary
from grain_core.testing import assert_trees_equal, check_iterator_conformance

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX shm + /dev/shm")

# Workers receive this module's functions by value, so they never import pytest.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _times_ten(x: int) -> int:
    return x * 10


def _pid(_: Any) -> int:
    return os.getpid()


# ------------------------------------------------------------------------------- order
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_output_equals_single_process(workers: int, no_shm_leak: None) -> None:
    ds = grain.MapDataset.range(23).map(_times_ten).to_iter_dataset()
    with iter(ds.mp_prefetch(mp_options(workers))) as it:
        assert list(it) == list(ds)


def test_batched_random_pipeline_same_for_any_worker_count(no_shm_leak: None) -> None:
    def rand(x: int, rng: np.random.Generator) -> float:
        return x + rng.random()

    base = grain.MapDataset.range(40).seed(7).shuffle().random_map(rand).batch(4)
    ds = base.to_iter_dataset()
    expected = list(ds)
    for workers in (1, 2, 3):
        out = list(ds.mp_prefetch(mp_options(workers, buffer=2)))
        assert len(out) == len(expected)
        for a, e in zip(out, expected, strict=True):
            assert_trees_equal(a, e)


def test_large_arrays_travel_through_shared_memory(no_shm_leak: None) -> None:
    ds = grain.MapDataset.range(9).map(big_element).to_iter_dataset()
    out = list(ds.mp_prefetch(mp_options(2)))
    for a, e in zip(out, list(ds), strict=True):
        assert_trees_equal(a, e)
        assert list(a) == ["z", "a", "s"]  # dict order survives the transport


def test_final_batch_is_stacked_into_shared_memory(no_shm_leak: None) -> None:
    ds = grain.MapDataset.range(10).map(big_element).to_iter_dataset().batch(3)
    out = list(ds.mp_prefetch(mp_options(2)))
    # Batches form inside each worker: worker w batches elements w, w + 2, ...
    per_worker = [list(slice_for_worker(ds, w, 2)) for w in range(2)]
    expected = [b for pair in zip(*per_worker, strict=True) for b in pair]
    for a, e in zip(out, expected, strict=True):
        assert_trees_equal(a, e)
    assert out[0]["s"].dtype == np.dtype("<U5")  # strings are not truncated


def test_sequential_slice_goldens() -> None:
    ds = grain.MapDataset.source(list(range(15))).to_iter_dataset()
    assert list(ds.mp_prefetch(mp_options(4), sequential_slice=True)) == [
        0,
        4,
        8,
        12,
        1,
        5,
        9,
        13,
        2,
        6,
        10,
        14,
        3,
        7,
        11,
    ]
    ds = grain.MapDataset.range(10).to_iter_dataset()
    assert list(ds.mp_prefetch(mp_options(3), sequential_slice=True)) == [
        0,
        4,
        7,
        1,
        5,
        8,
        2,
        6,
        9,
        3,
    ]


def test_sequential_slice_rejects_reordering_pipelines() -> None:
    ds = grain.MapDataset.range(10).shuffle(seed=1).to_iter_dataset()
    with pytest.raises(ValueError, match="sequential_slice"):
        slice_for_worker(ds, 0, 2, sequential=True)


def test_worker_slices_are_rebuilt_not_mutated() -> None:
    source = grain.MapDataset.range(12)
    ds = source.map(_times_ten).to_iter_dataset().map(_times_ten)
    sliced = slice_for_worker(ds, 1, 3)
    assert list(sliced) == [100, 400, 700, 1000]
    assert len(source) == 12
    assert list(ds) == [x * 100 for x in range(12)]


def test_zero_workers_returns_the_dataset() -> None:
    ds = grain.MapDataset.range(3).to_iter_dataset()
    assert ds.mp_prefetch(mp_options(0)) is ds


_SCALARS = [
    np.bool_(True), np.int8(-3), np.uint16(7), np.int32(-9), np.int64(2**62 + 1), np.uint64(2**63 + 5),
    np.float16(0.1), np.float32(1 / 3), np.float64(1e300), np.complex64(1 + 2j),
    np.complex128(-1 - 1e-300j), np.longdouble(1) / 3, np.datetime64("2026-12-03"),
    # NaNs keep their bits: a signalling one, and payloads
    np.uint32(0x7F800001).view(np.float32), np.uint16(0x7C01).view(np.float16),
    np.uint64(0x7FF0000000000123).view(np.float64), np.complex64(complex(0, np.nan)),
]  # fmt: skip


def _scalar_and_its_pickle_size(i: int) -> tuple[Any, int]:
    value = _SCALARS[i % len(_SCALARS)]
    return value, len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


@pytest.mark.parametrize("dispatch", [True, False])
def test_numpy_scalars_travel_exactly_and_without_their_dtype(dispatch: bool) -> None:
    ds = grain.MapDataset.range(len(_SCALARS)).map(_scalar_and_its_pickle_size).to_iter_dataset()
    grain.config.update("py_mp_prefetch_dispatch", dispatch)
    try:
        out = list(ds.mp_prefetch(mp_options(2)))
    finally:
        grain.config.update("py_mp_prefetch_dispatch", True)
    for (value, size_in_worker), expected in zip(out, _SCALARS, strict=True):
        assert type(value) is type(expected) and value.tobytes() == expected.tobytes()
        size_here = len(pickle.dumps(expected, protocol=pickle.HIGHEST_PROTOCOL))
        # Numbers go as type and value (no dtype); longdouble and datetime64 as NumPy does.
        if expected.dtype.kind in "biufc" and not isinstance(expected, np.longdouble):
            assert size_in_worker < size_here
        else:
            assert size_in_worker == size_here


def _reading_process_and_thread(x: int) -> tuple[int, str]:
    sum(range(300))  # a few microseconds of work holding the GIL
    return os.getpid(), threading.current_thread().name


@pytest.mark.parametrize("dispatch", [True, False])
def test_workers_read_cpu_bound_elements_in_their_main_thread(dispatch: bool) -> None:
    # Read threads would give such reads no parallelism in a process per core, only hand-offs.
    # A worker's reads reach a thread only through a probe, after its first five blocks at the
    # earliest (whether one stays is ReadConcurrency's, tested in test_prefetch).
    ds = grain.MapDataset.range(2000).map(_reading_process_and_thread).to_iter_dataset()
    grain.config.update("py_mp_prefetch_dispatch", dispatch)
    try:
        read = list(ds.mp_prefetch(mp_options(2)))
    finally:
        grain.config.update("py_mp_prefetch_dispatch", True)
    in_main_thread = collections.Counter(pid for pid, name in read if name == "MainThread")
    assert len(in_main_thread) == 2 and min(in_main_thread.values()) >= 5


# -------------------------------------------------------------------------- checkpoints
def test_checkpoint_conformance_with_workers(no_shm_leak: None) -> None:
    ds = grain.MapDataset.range(11).map(_times_ten).to_iter_dataset().batch(2)
    check_iterator_conformance(lambda: ds.mp_prefetch(mp_options(2)), positions=[0, 3, 6])


def test_set_state_restores_workers_in_place() -> None:
    ds = grain.MapDataset.range(12).map(_pid).to_iter_dataset()
    with iter(ds.mp_prefetch(mp_options(2))) as it:
        start = it.get_state()
        first = [next(it) for _ in range(5)]
        workers = {p.pid for p in multiprocessing.active_children()}
        it.set_state(start)
        again = list(it)
        assert len(again) == 12
        # Which worker computes a position is dynamic; the processes are the same ones.
        assert set(first) | set(again) <= workers
        assert workers <= {p.pid for p in multiprocessing.active_children()}


def test_get_state_before_iteration_starts_no_process() -> None:
    before = {p.pid for p in multiprocessing.active_children()}
    ds = grain.MapDataset.range(6).to_iter_dataset().mp_prefetch(mp_options(2))
    it = iter(ds)
    state = it.get_state()
    assert state["iterators_in_use_states"] == [{"next_index": 0}, {"next_index": 0}]
    assert {p.pid for p in multiprocessing.active_children()} == before
    it.close()


def test_restore_on_a_fresh_iterator_before_start() -> None:
    ds = grain.MapDataset.range(10).to_iter_dataset().mp_prefetch(mp_options(2))
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = it.get_state()
    it.close()
    with iter(ds) as fresh:
        fresh.set_state(state)
        assert list(fresh) == list(range(3, 10))


def test_state_with_other_worker_count_is_rejected() -> None:
    state = iter(grain.MapDataset.range(4).to_iter_dataset().mp_prefetch(mp_options(2))).get_state()
    with iter(grain.MapDataset.range(4).to_iter_dataset().mp_prefetch(mp_options(3))) as it:
        with pytest.raises(ValueError, match="slots"):
            it.set_state(state)


def test_rewinding_after_exhaustion_keeps_workers() -> None:
    ds = grain.MapDataset.range(4).map(_pid).to_iter_dataset().mp_prefetch(mp_options(2))
    with iter(ds) as it:
        start = it.get_state()
        out = []
        for _ in range(3):  # what an epoch-repeating consumer does
            out += list(it)
            it.set_state(start)
    assert len(out) == 12 and len(set(out)) == 2


# ------------------------------------------------------------------------------ failures
class CustomError(Exception):
    pass


def _fail_on_five(x: int) -> int:
    if x == 5:
        raise CustomError(f"bad element {x}")
    return x


def _unpicklable_at_13(x: int) -> Any:
    return threading.Lock() if x == 13 else x


@pytest.mark.parametrize(
    ("fn", "error", "before"),
    [(_unpicklable_at_13, "cannot be pickled", 13), (_fail_on_five, "bad element 5", 5)],
    ids=["unpicklable", "raised"],
)
def test_rotation_error_ends_the_stream_after_the_elements_before_it(
    fn: Any, error: str, before: int, strict_rotation: None, no_shm_leak: None
) -> None:
    # The elements before it may share its message: they arrive, then the error, again on
    # every request.
    ds = grain.MapDataset.range(40).to_iter_dataset().map(fn)
    with iter(ds.mp_prefetch(mp_options(1, buffer=2))) as it:
        got = []
        with pytest.raises((TypeError, CustomError), match=error):
            for x in it:
                got.append(x)
        assert got == list(range(before))
        with pytest.raises((TypeError, CustomError), match=error):
            next(it)


def test_worker_exception_keeps_type_and_traceback(no_shm_leak: None) -> None:
    ds = grain.MapDataset.range(10).map(_fail_on_five).to_iter_dataset().mp_prefetch(mp_options(2))
    it = iter(ds)
    got = []
    with pytest.raises(CustomError, match="bad element 5") as info:
        for x in it:
            got.append(x)
    assert got == [0, 1, 2, 3, 4]
    notes = "\n".join(info.value.__notes__)
    # Which worker computed element 5 depends on timing: positions go to free workers.
    assert re.search("worker process [01] of 2", notes) and "_fail_on_five" in notes
    with pytest.raises(CustomError):  # asking again never hangs
        next(it)
    it.close()


class _TwoArgumentError(Exception):
    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"record {index}: {reason}")
        self.index = index


class _KeywordOnlyError(ValueError):
    def __init__(self, *, code: int) -> None:
        super().__init__(f"code={code}")
        self.code = code
        self.lock = threading.Lock()  # cannot be pickled: the error travels without it


def _raise_at_two(error: type[Exception], x: int) -> int:
    if x == 2:
        raise _TwoArgumentError(2, "corrupt") if error is _TwoArgumentError else error(code=7)
    return x


@pytest.mark.parametrize(
    "error, match, attribute",
    [
        (_TwoArgumentError, "record 2: corrupt", ("index", 2)),
        (_KeywordOnlyError, "code=7", None),
    ],
    ids=["two_arguments", "keyword_only_and_unpicklable"],
)
def test_worker_exceptions_that_pickle_cannot_rebuild_keep_their_type(
    error: type[Exception], match: str, attribute: tuple[str, int] | None
) -> None:
    # Pickle rebuilds an exception by calling its class with its args: these classes take
    # other parameters. The parent gets the same class, args and (picklable) attributes.
    fn = functools.partial(_raise_at_two, error)
    ds = grain.MapDataset.range(4).map(fn).to_iter_dataset().mp_prefetch(mp_options(2))
    with iter(ds) as it, pytest.raises(error, match=match) as info:
        list(it)
    if attribute is not None:
        assert getattr(info.value, attribute[0]) == attribute[1]
    assert "Worker traceback" in "\n".join(info.value.__notes__)


def _stop_at_three(x: int) -> int:
    if x == 3:
        raise StopIteration
    return x


@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatch", "rotation"])
@pytest.mark.parametrize("after_reading", [False, True], ids=["map_dataset", "iter_dataset"])
def test_stop_iteration_in_a_worker_function_is_an_error(
    dispatch: bool, after_reading: bool
) -> None:
    source = grain.MapDataset.range(8)
    if after_reading:
        ds = source.to_iter_dataset().map(_stop_at_three)
    else:
        ds = source.map(_stop_at_three).to_iter_dataset()
    grain.config.update("py_mp_prefetch_dispatch", dispatch)
    try:
        with iter(ds) as single, pytest.raises(RuntimeError, match="raised StopIteration"):
            list(single)
        with iter(ds.mp_prefetch(mp_options(2))) as it:
            with pytest.raises(RuntimeError, match="raised StopIteration"):
                list(it)  # before: one worker's share ended there, and the other went on
    finally:
        grain.config.update("py_mp_prefetch_dispatch", True)


def _exit_at_one(x: int) -> np.ndarray:
    if x == 1:
        sys.exit(3)
    return np.full(1 << 16, x, np.float32)


@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatch", "rotation"])
def test_a_worker_exiting_in_user_code_delivers_what_it_sent_first(
    dispatch: bool, no_shm_leak: None
) -> None:
    # Its element 0 is in shared memory when the worker exits at element 1: the block stays
    # for the parent to read, then the exit is reported (the block was unlinked with the
    # worker's pool: FileNotFoundError).
    ds = grain.MapDataset.range(4).map(_exit_at_one).to_iter_dataset()
    grain.config.update("py_mp_prefetch_dispatch", dispatch)
    try:
        with iter(ds.mp_prefetch(mp_options(1, buffer=2))) as it, fails_after(60):
            it.start_prefetch()
            # The worker has sent element 0 and exited before the parent reads anything.
            multiprocessing.connection.wait([p.sentinel for p in _worker_processes(it)])
            assert float(next(it)[0]) == 0.0
            with pytest.raises(ipc_errors.WorkerDiedError, match="exit code 3"):
                next(it)
    finally:
        grain.config.update("py_mp_prefetch_dispatch", True)


def _worker_processes(it: Any) -> list[Any]:
    """The processes of a started mp_prefetch iterator's workers."""
    pools = []
    for merge_input in it._iters:
        if isinstance(merge_input, rotation.RotationIterator):
            pools.append(merge_input._pool)
        else:
            pools.append(merge_input._consumer._producer._pool)
    return [proc for pool in {id(p): p for p in pools}.values() for proc in pool._procs]


class _SignalSelfOnThree:
    """A map that kills its own process with ``signum`` at element 3."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __call__(self, x: int) -> int:
        if x == 3:
            os.kill(os.getpid(), self.signum)
        return x


def test_killed_worker_is_reported_quickly(no_shm_leak: None) -> None:
    ds = grain.MapDataset.range(8).map(_SignalSelfOnThree(signal.SIGKILL)).to_iter_dataset()
    it = iter(ds.mp_prefetch(mp_options(2)))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Worker process [01] of 2 .* exit code -9 \(SIGKILL\)"):
        list(it)
    assert time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match="terminated unexpectedly"):
        next(it)
    it.close()


class _ForkThenKillSelfOnThree:
    """At element 3: forks a child that keeps every descriptor of the worker open (the end of
    its output pipe included, as a helper process started by a map would), writes the child's
    pid to ``pid_file``, then kills its own process."""

    def __init__(self, pid_file: str) -> None:
        self.pid_file = pid_file

    def __call__(self, x: int) -> int:
        if x == 3:
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            with open(self.pid_file, "w") as f:
                f.write(str(pid))
            os.kill(os.getpid(), signal.SIGKILL)
        return x


@pytest.mark.parametrize("dispatch", [True, False])
def test_killed_worker_is_reported_while_its_pipe_stays_open(
    no_shm_leak: None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, dispatch: bool
) -> None:
    # No end of file ever comes on the dead worker's pipe: the parent must watch the process.
    if not dispatch:
        monkeypatch.setattr(mp_dispatch, "dispatchable", lambda *_: False)
    pid_file = tmp_path / "child"
    ds = grain.MapDataset.range(8).map(_ForkThenKillSelfOnThree(str(pid_file))).to_iter_dataset()
    it = iter(ds.mp_prefetch(mp_options(2)))
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"Worker process [01] of 2 .* \(SIGKILL\)"):
            list(it)
        assert time.monotonic() - start < 5
    finally:
        it.close()
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_bus_error_in_a_worker_points_at_shared_memory(no_shm_leak: None) -> None:
    ds = grain.MapDataset.range(8).map(_SignalSelfOnThree(signal.SIGBUS)).to_iter_dataset()
    with iter(ds.mp_prefetch(mp_options(2))) as it:
        with pytest.raises(RuntimeError, match=r"\(SIGBUS\)\. .*/dev/shm is full.*--shm-size"):
            list(it)


_SMALL_DEV_SHM_SCRIPT = """
import numpy as np, warnings, grain_core as grain
warnings.simplefilter("ignore", RuntimeWarning)
def batch(i):
    return np.full((1024, 1024), i, np.float32)
ds = grain.MapDataset.range(40).map(batch).to_iter_dataset()
options = grain.MultiprocessingOptions(num_workers=2, per_worker_buffer_size=2)
print(sum(float(x[0, 0]) for x in ds.mp_prefetch(options)))
"""


def test_a_real_full_dev_shm_slows_down_but_loses_nothing(tmp_path: Any) -> None:
    # 4 MiB batches from 2 workers with 2 ahead each need ~24 MiB; /dev/shm gets 12 MiB in a
    # private mount namespace (root only), as in a container with a small --shm-size.
    script = tmp_path / "small_dev_shm.py"
    script.write_text(_SMALL_DEV_SHM_SCRIPT)
    mount = "mount -t tmpfs -o size=12m tmpfs /dev/shm"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", mount], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("needs unshare and mount (root) to give /dev/shm a small size")
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{mount} && exec "{sys.executable}" "{script}"'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(float(sum(range(40))))]


_SEGFAULT_SCRIPT = """
import ctypes, grain_core as grain
def crash_in_native_code(x):
    if x == 3:
        ctypes.string_at(0)
    return x
ds = grain.MapDataset.range(8).map(crash_in_native_code).to_iter_dataset()
list(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
"""


def test_a_crash_in_native_code_names_the_signal_and_the_python_stack(tmp_path: Any) -> None:
    script = tmp_path / "segfault.py"
    script.write_text(_SEGFAULT_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert result.returncode == 1
    assert "exit code -11 (SIGSEGV). The worker crashed in native code" in result.stderr
    # The worker's own stack, from faulthandler, points at the function that crashed.
    assert "Segmentation fault" in result.stderr and "crash_in_native_code" in result.stderr


def _no_room_in_dev_shm(worker_index: int, worker_count: int) -> None:
    import errno

    def fallocate(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    os.posix_fallocate = fallocate


def test_arrays_travel_pickled_when_dev_shm_is_full(no_shm_leak: None) -> None:
    # Both ways into shared memory: a map output copied into a block, a batch stacked into one.
    ds = grain.MapDataset.range(12).map(big_element).to_iter_dataset()
    for pipeline in (ds, ds.batch(3)):
        expected = list(pipeline.mp_prefetch(mp_options(2)))
        # Each worker warns once, in the parent (where filters and pytest see it).
        with pytest.warns(RuntimeWarning, match="travel pickled") as record:
            got = list(pipeline.mp_prefetch(mp_options(2), worker_init_fn=_no_room_in_dev_shm))
        assert_trees_equal(got, expected)
        assert len([w for w in record if "travel pickled" in str(w.message)]) == 2


def _warns_on_odd(x: int, where: str = "map") -> int:
    if x % 2:
        warnings.warn(f"{where}: element {x} is odd", UserWarning, stacklevel=1)
    return x


@pytest.mark.parametrize("dispatch", [True, False])
def test_warnings_in_workers_are_issued_in_the_parent(
    dispatch: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    # A MapDataset map runs in the workers' read threads, an IterDataset map in their main
    # thread: both reach the parent, each once.
    ds = grain.MapDataset.range(8).map(functools.partial(_warns_on_odd, where="read"))
    ds = ds.to_iter_dataset().map(functools.partial(_warns_on_odd, where="main"))
    grain.config.update("py_mp_prefetch_dispatch", dispatch)
    try:
        with pytest.warns(UserWarning, match="is odd") as record:
            assert list(ds.mp_prefetch(mp_options(2))) == list(range(8))
    finally:
        grain.config.update("py_mp_prefetch_dispatch", True)
    messages = sorted(str(w.message) for w in record)
    assert messages == sorted(
        f"{w}: element {x} is odd" for x in (1, 3, 5, 7) for w in ("read", "main")
    )
    assert "is odd" not in capfd.readouterr().err  # not printed by the workers as well


def _warns_with_a_category_that_cannot_travel(x: int) -> int:
    lock = threading.Lock()

    class LockedWarning(UserWarning):
        held = lock  # the class cannot be pickled

    warnings.warn(f"element {x}", LockedWarning, stacklevel=1)
    return x


def test_a_warning_whose_category_cannot_travel_arrives_by_name() -> None:
    ds = grain.MapDataset.range(2).map(_warns_with_a_category_that_cannot_travel)
    with pytest.warns(RuntimeWarning, match=r"LockedWarning: element \d") as record:
        assert list(ds.to_iter_dataset().mp_prefetch(mp_options(2))) == [0, 1]
    assert len(record) == 2


def test_a_warning_filter_in_the_parent_applies_to_workers() -> None:
    ds = grain.MapDataset.range(4).map(_warns_on_odd).to_iter_dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(UserWarning, match="map: element 1 is odd"):
            list(ds.mp_prefetch(mp_options(2)))


def _unpicklable_element(x: int) -> Any:
    return threading.Lock()


def test_unpicklable_element_is_an_error(no_shm_leak: None) -> None:
    ds = grain.MapDataset.range(4).map(_unpicklable_element).to_iter_dataset()
    with iter(ds.mp_prefetch(mp_options(2))) as it:
        with pytest.raises(TypeError, match="cannot be pickled"):
            next(it)


def test_unpicklable_pipeline_names_the_node() -> None:
    lock = threading.Lock()
    ds = grain.MapDataset.range(4).map(lambda x: (x, lock)).to_iter_dataset().map(_times_ten)
    with pytest.raises(TypeError) as info:
        next(iter(ds.mp_prefetch(mp_options(2))))
    assert "MapMapDataset" in "\n".join(info.value.__notes__)


def test_unpicklable_worker_init_fn_says_so() -> None:
    lock = threading.Lock()
    ds = grain.MapDataset.range(4).to_iter_dataset()
    with pytest.raises(TypeError) as info:
        next(iter(ds.mp_prefetch(mp_options(2), worker_init_fn=lambda i, n: lock.acquire())))
    assert "worker_init_fn <function" in "\n".join(info.value.__notes__)


def test_mp_prefetch_inside_a_worker_is_a_clear_error(no_shm_leak: None) -> None:
    ds = grain.MapDataset.range(4).to_iter_dataset().mp_prefetch(mp_options(2))
    with iter(ds.mp_prefetch(mp_options(2))) as it:
        with pytest.raises(ValueError, match="cannot start worker processes inside a worker"):
            next(it)


class _ListIterDataset(grain.IterDataset):
    def __init__(self, values: list[int]) -> None:
        super().__init__()
        self._values = values

    def __iter__(self) -> Any:
        return iter(grain.MapDataset.source(self._values).to_iter_dataset())

    def __repr__(self) -> str:
        return "_ListIterDataset()"


def test_unsliceable_source_fails_with_several_workers_only() -> None:
    ds = _ListIterDataset([1, 2, 3])
    assert list(ds.mp_prefetch(mp_options(1))) == [1, 2, 3]
    with pytest.raises(ValueError, match="Cannot slice `IterDataset` source"):
        list(ds.mp_prefetch(mp_options(2)))


def _init_env(index: int, count: int) -> None:
    os.environ["TEST_WORKER_ID"] = f"{index}/{count}"


def _read_env(_: Any) -> tuple[str | None, str | None]:
    return os.environ.get("TEST_WORKER_ID"), os.environ.get("JAX_PLATFORMS")


def test_worker_init_fn_and_cpu_only_jax() -> None:
    # Each worker computes its strided share (a worker_init_fn turns dispatch off).
    ds = grain.MapDataset.range(8).map(_read_env).to_iter_dataset()
    out = list(ds.mp_prefetch(mp_options(2), worker_init_fn=_init_env))
    assert out == [("0/2", "cpu"), ("1/2", "cpu")] * 4


def _glibc_tunables(_: Any) -> str | None:
    return os.environ.get("GLIBC_TUNABLES")


def test_workers_copy_large_arrays_with_streaming_stores() -> None:
    from grain_core._ipc.pool import worker_glibc_tunables

    if "x86_non_temporal_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        pytest.skip("the environment sets the threshold itself")
    ds = grain.MapDataset.range(2).map(_glibc_tunables).to_iter_dataset().mp_prefetch(mp_options(2))
    threshold = f"glibc.cpu.x86_non_temporal_threshold={2 * 1024 * 1024:#x}"
    assert all(threshold in (tunables or "") for tunables in ds)
    assert threshold not in os.environ.get("GLIBC_TUNABLES", "")  # the parent's is unchanged
    # The user's own tunables are kept, their thresholds win, 0 leaves glibc's choice.
    malloc = "glibc.malloc.mmap_threshold=0x2000000:glibc.malloc.trim_threshold=0x4000000"
    streaming = "glibc.cpu.x86_non_temporal_threshold=0x4040"
    assert worker_glibc_tunables(None, 0x4040) == f"{malloc}:{streaming}"
    assert worker_glibc_tunables("glibc.malloc.arena_max=2", 0x4040) == (
        f"glibc.malloc.arena_max=2:{malloc}:{streaming}"
    )
    own = "glibc.cpu.x86_non_temporal_threshold=0x10000"
    assert worker_glibc_tunables(own, 0x4040) == f"{own}:{malloc}"
    assert worker_glibc_tunables(None, 0) == malloc
    # Either malloc threshold of the user's keeps glibc's other one.
    own = "glibc.malloc.trim_threshold=0x1000"
    assert worker_glibc_tunables(own, 0) == own
    assert worker_glibc_tunables(own, 0x4040) == f"{own}:{streaming}"


def _page_faults(_: Any) -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _fresh_array(i: int) -> np.ndarray:
    return np.full((128, 28, 28), i, np.float32) / 255.0


def test_workers_reuse_freed_heap_memory() -> None:
    # A worker makes each 400 KB result afresh and frees it once it is in shared memory:
    # with glibc's dynamic thresholds it gave those pages back and faulted them in again
    # for every result, with the workers' thresholds the heap keeps them.
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        pytest.skip("the environment sets malloc's thresholds itself")
    ds = grain.MapDataset.range(400).map(_fresh_array).map(_page_faults).to_iter_dataset()
    faults = list(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=1)))
    # 200 results: about 88 faults each before, 8 with the workers' thresholds.
    assert faults[-1] - faults[200] < 200 * 30


def test_the_streaming_threshold_is_read_when_the_forkserver_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from grain_core._ipc.pool import _WorkerForkServer

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    grain.config.update("py_mp_worker_streaming_copy_bytes", 0x300000)
    server = _WorkerForkServer()

    def server_environ() -> list[bytes]:
        pid = server._forkserver_pid  # type: ignore[attr-defined]
        # The file reads empty until the new program's environment is set up in exec.
        deadline = time.monotonic() + 10
        environ = [b""]
        while environ == [b""] and time.monotonic() < deadline:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            time.sleep(0.01)
        return environ

    def streams_from_3_mib(environ: list[bytes]) -> bool:
        # glibc parses GLIBC_TUNABLES in place: the file shows its tunables apart.
        return any(v.endswith(b"glibc.cpu.x86_non_temporal_threshold=0x300000") for v in environ)

    try:
        server.ensure_running()
        first = server._forkserver_pid  # type: ignore[attr-defined]
        assert streams_from_3_mib(server_environ())
        assert "GLIBC_TUNABLES" not in os.environ
        server.ensure_running()
        assert server._forkserver_pid == first  # type: ignore[attr-defined]
        # A server that died restarts with the threshold too.
        os.kill(first, signal.SIGKILL)
        os.waitid(os.P_PID, first, os.WEXITED | os.WNOWAIT)
        server.ensure_running()
        assert server._forkserver_pid != first  # type: ignore[attr-defined]
        assert streams_from_3_mib(server_environ())
        assert "GLIBC_TUNABLES" not in os.environ
    finally:
        grain.config.update("py_mp_worker_streaming_copy_bytes", 2 * 1024 * 1024)
        server._stop()  # type: ignore[attr-defined]


def test_closed_iterator_and_gc_release_everything(no_shm_leak: None) -> None:
    ds = (
        grain.MapDataset.range(50)
        .map(big_element)
        .to_iter_dataset()
        .mp_prefetch(mp_options(2, buffer=3))
    )
    earlier = {p.pid for p in multiprocessing.active_children()}  # other tests' workers
    it = iter(ds)
    next(it)
    pids = {p.pid for p in multiprocessing.active_children()} - earlier
    assert pids
    it.close()
    it.close()
    with pytest.raises(ValueError, match="closed iterator"):
        next(it)
    unclosed = iter(ds)
    next(unclosed)
    del unclosed
    gc.collect()
    alive = {p.pid for p in multiprocessing.active_children()}
    assert not alive & pids


def test_restoring_again_and_again_without_reading_keeps_shared_memory_bounded(
    no_shm_leak: None,
) -> None:
    # Each set_state drops what the worker sent for the old position; its blocks go back to
    # the worker with the set_state instead of piling up unread in the pipe.
    ds = grain.MapDataset.range(100).map(big_element).to_iter_dataset().filter(_keep)
    blocks: set[str] = set()
    with iter(ds.mp_prefetch(mp_options(1, buffer=2))) as it:
        next(it)
        start = it.get_state()
        for _ in range(30):
            it.set_state(start)
            time.sleep(0.02)  # the worker sends a buffer's worth for the new position
            blocks |= shm_names()
        assert next(it)["a"] == 1
    assert 0 < len(blocks) <= 8


def _rebuilt_in_workers_only(value: int) -> int:
    if multiprocessing.parent_process() is None:
        raise ValueError(f"cannot rebuild {value} in the main process")
    return value


class _OnlyWorkersRebuild:
    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        return (_rebuilt_in_workers_only, (self.value,))


def _unreadable_at_three(x: int) -> Any:
    if x != 3:
        return x
    return {"odd": _OnlyWorkersRebuild(x), "big": np.zeros(1 << 17)}


def _unreadable_small_at_three(x: int) -> Any:
    return _OnlyWorkersRebuild(x) if x == 3 else x


@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatch", "rotation"])
@pytest.mark.parametrize(
    "make", [_unreadable_at_three, _unreadable_small_at_three], ids=["with_shm", "pickled"]
)
def test_an_element_the_parent_cannot_unpickle_stops_the_stream_until_set_state(
    no_shm_leak: None, dispatch: bool, make: Callable[[int], Any]
) -> None:
    ds = grain.MapDataset.range(10).map(make).to_iter_dataset()
    grain.config.update("py_mp_prefetch_dispatch", dispatch)
    try:
        with iter(ds.mp_prefetch(mp_options(2))) as it:
            start = it.get_state()
            assert [next(it) for _ in range(3)] == [0, 1, 2]
            for _ in range(3):  # the same error every time: never a hang, nothing skipped
                with pytest.raises(ipc_errors.UnreadableElementError, match="process 1 of 2 sent"):
                    next(it)
            it.set_state(start)
            assert [next(it) for _ in range(3)] == [0, 1, 2]
    finally:
        grain.config.update("py_mp_prefetch_dispatch", True)


def _stuck_after_three(x: int) -> int:
    if x >= 3:
        time.sleep(60)
    return x


def test_close_gives_busy_workers_one_timeout_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three workers inside a long user function cannot take the stop message: they are killed
    # after one stop timeout together, not one each in turn.
    monkeypatch.setattr(ipc_pool, "STOP_TIMEOUT_S", 1.0)
    ds = (
        grain.MapDataset.range(100)
        .map(_stuck_after_three)
        .to_iter_dataset(read_options=grain.ReadOptions(num_threads=1, prefetch_buffer_size=1))
    )
    it = iter(ds.mp_prefetch(mp_options(3)))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    time.sleep(0.5)  # every worker is now in the function
    began = time.monotonic()
    it.close()
    assert time.monotonic() - began < 2.5


def test_workers_exit_when_the_parent_dies(tmp_path: Any) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import multiprocessing, sys, time
            import grain_core as grain
            from grain_core.options import MultiprocessingOptions

            def slow(x):
                time.sleep(0.01)
                return x

            if __name__ == "__main__":
                ds = grain.MapDataset.range(10**6).map(slow).to_iter_dataset()
                it = iter(ds.mp_prefetch(MultiprocessingOptions(num_workers=2)))
                next(it)
                print(" ".join(str(p.pid) for p in multiprocessing.active_children()
                               if p.name.startswith("grain_core-worker")), flush=True)
                time.sleep(60)
            """
        )
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or during the read
        return False


def test_large_arrays_reach_the_workers_in_shared_memory(no_shm_leak: None) -> None:
    # An in-memory source's data is copied once into a block that every worker maps
    # read-only, not pickled into the pipeline sent to each worker.
    rows = np.arange(1 << 20, dtype=np.int32).reshape(1024, 1024)  # 4 MiB
    dataset, blocks = pickle_pipeline(grain.MapDataset.source(rows).to_iter_dataset())
    assert len(blocks) == 1 and len(dataset) < 64 * 1024
    in_worker = pickle.loads(dataset).map_parent  # what a worker unpickles
    np.testing.assert_array_equal(in_worker[5], rows[5])
    assert rows[5].flags.writeable and not in_worker[5].flags.writeable
    del in_worker
    _shm.unlink_shm(blocks)
    small = grain.MapDataset.source(rows[:8].copy()).to_iter_dataset()
    assert pickle_pipeline(small)[1] == []  # small arrays travel pickled
    # Workers on other hosts (a worker backend) get the arrays in the pickle.
    remote, none = pickle_pipeline(grain.MapDataset.source(rows).to_iter_dataset(), False)
    assert none == [] and len(remote) > rows.nbytes
    shared = grain.MapDataset.source(rows).to_iter_dataset().mp_prefetch(mp_options(2))
    with iter(shared) as it:
        for i, row in enumerate(it):
            np.testing.assert_array_equal(row, rows[i])
    del shared, it  # its blocks go with the dataset (no_shm_leak)


def test_building_a_pipeline_with_workers_starts_their_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The server imports the workers' modules while the caller goes on building, so the first
    # workers fork from a ready server.
    server = ipc_pool._WorkerForkServer()
    monkeypatch.setattr(ipc_pool, "_FORKSERVER", server)
    try:
        grain.MapDataset.range(3).to_iter_dataset().mp_prefetch(mp_options(0))
        grain.DataLoader(data_source=[0, 1, 2], sampler=_sampler(3), worker_count=0)
        assert getattr(server, "_forkserver_pid", None) is None
        grain.DataLoader(data_source=[0, 1, 2], sampler=_sampler(3), worker_count=2)
        pid = server._forkserver_pid  # type: ignore[attr-defined]
        assert pid is not None
        ds = grain.MapDataset.range(3).to_iter_dataset().mp_prefetch(mp_options(2))
        assert server._forkserver_pid == pid  # type: ignore[attr-defined]
        with iter(ds) as it:
            assert list(it) == [0, 1, 2]
    finally:
        server._stop()  # type: ignore[attr-defined]


def _sampler(n: int) -> grain.samplers.IndexSampler:
    return grain.samplers.IndexSampler(n, num_epochs=1)


def test_dataset_is_picklable_and_shm_module_leaves_nothing() -> None:
    import pickle

    ds = grain.MapDataset.range(3).to_iter_dataset().mp_prefetch(mp_options(2))
    ds.engine.payload()  # type: ignore[attr-defined]
    assert list(pickle.loads(pickle.dumps(ds))) == [0, 1, 2]
    assert _shm.unlink_prefix(f"gc{os.getpid():x}") == []


_MIB_BATCHES_SCRIPT = """
import gc
import os

import numpy as np
import grain_core as grain

class Row(grain.transforms.Map):
    def map(self, x):
        return np.full(1024, x, np.float32)

def loader(**options):
    return grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 256 * 24, 1),
        sampler=grain.samplers.SequentialSampler(256 * 24),
        operations=[Row(), grain.transforms.Batch(256)],
        worker_count=2,
        **options,
    )

assert sum(1 for _ in loader()) == 24
ds = grain.MapDataset.range(256 * 24).map(lambda x: np.full(1024, x, np.float32)).batch(256)
options = grain.MultiprocessingOptions(num_workers=2)
assert sum(1 for _ in ds.to_iter_dataset().mp_prefetch(options)) == 24
gc.collect()
# Before exit: every block the batches went through is gone (not only at exit).
print(sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"gc{os.getpid():x}")))
# Left to the interpreter's exit: an epoch broken off with batches in flight, and persistent
# workers never closed, one of their iterators open.
broken = iter(loader())
first = next(broken)
kept = loader(persistent_workers=True)
assert sum(1 for _ in kept) == 24
in_flight = iter(kept)
second = next(in_flight)
"""


@pytest.mark.parametrize("in_process", [None, "auto", "always"])
def test_runs_with_mib_batches_leave_no_shared_memory_and_no_tracker_warning(
    in_process: str | None,
) -> None:
    # A training script's DataLoader and mp_prefetch with 1 MiB batches through 2 workers:
    # at its exit, multiprocessing's resource tracker finds nothing registered and left
    # (it warns "There appear to be N leaked shared_memory objects" otherwise), and no block
    # of the script or its workers stays in /dev/shm, during the run or after it. Under the
    # opt-in in-process mode (the default when the issue was filed) the parent itself stacks
    # the DataLoader's batches into shared memory: each block must go when its batch does.
    env = {k: v for k, v in os.environ.items() if k != "GRAIN_PY_MP_PREFETCH_IN_PROCESS"}
    if in_process is not None:
        env["GRAIN_PY_MP_PREFETCH_IN_PROCESS"] = in_process
    with subprocess.Popen(
        [sys.executable, "-c", _MIB_BATCHES_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        out, err = proc.communicate(timeout=600)
    assert (proc.returncode, out.strip()) == (0, "[]"), (out, err)
    assert "resource_tracker" not in err and "leaked" not in err, err
    assert [e for e in os.listdir("/dev/shm") if e.startswith(f"gc{proc.pid:x}")] == []


def _keep(x: Any) -> bool:
    return True


@pytest.mark.parametrize("buffer", [1, 2])
@pytest.mark.parametrize("rotation", [False, True], ids=["dispatch", "rotation"])
def test_workers_recycle_shared_memory_blocks(
    no_shm_leak: None, rotation: bool, buffer: int
) -> None:
    ds = grain.MapDataset.range(40).map(big_element).to_iter_dataset()
    if rotation:
        ds = ds.filter(_keep)  # an IterDataset step: workers stream their shares
    blocks: set[str] = set()
    with iter(ds.mp_prefetch(mp_options(1, buffer=buffer))) as it:
        for x in it:
            blocks |= shm_names()
            del x  # the block goes back to the worker with the next request
    # 40 elements used the blocks of the elements buffered, the one the consumer holds and the
    # next one, copied while it waits for a credit (so that it goes as soon as one comes).
    # A dispatching worker may send as many small results ahead as SHARED_AHEAD_BYTES holds.
    ahead = (
        buffer if rotation else max(buffer, protocol.shared_ahead_room(big_element(0)["z"].nbytes))
    )
    assert 0 < len(blocks) <= ahead + 2


def _big_rows(x: int) -> np.ndarray:
    return np.full(64 * 1024, x, np.float32)


def test_set_state_returns_the_block_of_a_batch_waiting_for_a_credit(no_shm_leak: None) -> None:
    # The batch waits for a credit in its block when set_state drops it: the block goes back
    # to the worker's pool instead of staying taken.
    ds = grain.MapDataset.range(64).map(_big_rows).to_iter_dataset().filter(_keep).batch(2)
    with iter(ds.mp_prefetch(mp_options(1, buffer=1))) as it:
        start = it.get_state()
        blocks: set[str] = set()
        for _ in range(12):
            it.set_state(start)
            x = next(it)
            assert float(x[0, 0]) == 0.0
            del x
            time.sleep(0.02)  # the worker makes the next batches, which wait for credits
            blocks |= shm_names()
    assert 0 < len(blocks) <= 4


# ----------------------------------------------------------------- execution statistics
TIMING = DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING)


def _slow(x: int) -> int:
    time.sleep(0.04)  # sleeping: the stage's self time does not depend on CPU contention
    return x


def _slow_map_pipeline() -> grain.IterDataset:
    return grain.MapDataset.range(24).map(_slow).to_iter_dataset(grain.ReadOptions(num_threads=0))


def test_worker_stages_reach_the_parent_summary(
    no_shm_leak: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Strict rotation (dispatching workers: test_mp_dispatch).
    monkeypatch.setattr(mp_dispatch, "dispatchable", lambda *_: False)
    ds = WithOptionsIterDataset(_slow_map_pipeline().map(_times_ten), TIMING)
    with iter(ds.mp_prefetch(mp_options(2))) as it:
        it.start_prefetch()  # worker start-up is not part of any next()
        assert list(it) == [x * 10 for x in range(24)]
        summary = get_execution_summary(it)
    names = [s.name for s in summary.stages]
    assert names[0] == "MultiprocessPrefetch(num_workers=2)"
    assert names[1] == "ProcessPrefetch" and not summary.stages[1].in_workers
    assert summary.stages[1].instances == 2
    workers = [s for s in summary.stages if s.in_workers]
    assert workers and all(s.depth >= 2 and s.instances == 2 for s in workers)
    # The slow map ran 12 times in each worker, each sleeping 40 ms (a lower bound of its self
    # time whatever the load); the workers' last statistics came before their END.
    slow = next(s for s in workers if "transform=_slow" in s.name)
    assert slow.num_produced_elements == 24
    assert slow.self_time_ns >= 24 * 40_000_000
    by_kind = {s.name.split("(")[0]: s for s in workers}
    assert by_kind["Map"].num_produced_elements == 24
    text = str(summary)
    assert "[worker] MapMapDataset(transform=_slow" in text
    assert "SliceMapDataset (differs per worker) x2" in text
    print(text)


@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatch", "rotation"])
def test_every_summary_has_what_the_workers_did_when_it_was_taken(
    dispatch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A summary asks the workers and waits for their answers: after each element, the
    # workers' stages have read at least every element handed out (more: they read ahead),
    # and asking, with elements in flight, changes neither the output nor its order.
    if not dispatch:
        monkeypatch.setattr(mp_dispatch, "dispatchable", lambda *_: False)
    ds = grain.MapDataset.range(40).map(_times_ten).to_iter_dataset()
    ds = WithOptionsIterDataset(ds, TIMING).mp_prefetch(mp_options(2))
    seen: list[int] = []
    counts = [0]
    with iter(ds) as it:
        for x in it:
            seen.append(x)
            summary = get_execution_summary(it)
            (mapped,) = [s for s in summary.stages if s.in_workers and "_times_ten" in s.name]
            assert len(seen) <= mapped.num_produced_elements <= 40
            assert mapped.num_produced_elements >= counts[-1]
            counts.append(mapped.num_produced_elements)
    assert seen == [x * 10 for x in range(40)]
    assert counts[-1] == 40


def test_options_downstream_of_mp_prefetch_reach_the_workers() -> None:
    ds = _slow_map_pipeline().mp_prefetch(mp_options(2))
    with iter(WithOptionsIterDataset(ds, TIMING)) as it:
        assert len(list(it)) == 24
        summary = get_execution_summary(it)
    assert any(s.in_workers for s in summary.stages)


def test_untracked_workers_send_no_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(Observer, "receive_worker_snapshot", lambda *a: calls.append(a))
    ds = grain.MapDataset.range(10).to_iter_dataset().mp_prefetch(mp_options(2))
    with iter(ds) as it:
        assert list(it) == list(range(10))
        with pytest.raises(ValueError, match="STAGE_TIMING"):
            get_execution_summary(it)
    assert calls == []


def test_tracked_output_and_checkpoints_match_untracked() -> None:
    ds = grain.MapDataset.range(9).map(_times_ten).to_iter_dataset()
    assert list(WithOptionsIterDataset(ds, TIMING).mp_prefetch(mp_options(2))) == list(ds)
    check_iterator_conformance(
        lambda: WithOptionsIterDataset(ds, TIMING).mp_prefetch(mp_options(2)), positions=[0, 4]
    )


# ------------------------------------------------------------ free-threaded CPython
@pytest.fixture
def gil_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)


def _shared_counter() -> Any:
    class Counter:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def __call__(self, x: int) -> int:
            self.seen.append(x)
            return x

    return Counter()


def test_free_threaded_python_uses_threads_with_a_copy_per_thread(gil_disabled: None) -> None:
    counter = _shared_counter()
    ds = grain.MapDataset.range(10).map(counter).to_iter_dataset().map(_pid)
    before = {p.pid for p in multiprocessing.active_children()}
    prefetched = ds.mp_prefetch(mp_options(3))
    assert not isinstance(prefetched, MultiprocessPrefetchIterDataset)
    assert list(prefetched) == [os.getpid()] * 10  # threads of this process
    assert {p.pid for p in multiprocessing.active_children()} == before
    assert counter.seen == []  # each thread transformed with its own deep copy
    values = grain.MapDataset.range(10).map(_times_ten).to_iter_dataset()
    assert list(values.mp_prefetch(mp_options(3))) == [x * 10 for x in range(10)]
    check_iterator_conformance(lambda: values.mp_prefetch(mp_options(3)), positions=[0, 4, 9])


def test_free_threaded_python_ignores_worker_init_fn(gil_disabled: None) -> None:
    ds = grain.MapDataset.range(4).to_iter_dataset()
    with pytest.warns(RuntimeWarning, match="worker_init_fn is ignored"):
        prefetched = ds.mp_prefetch(mp_options(2), worker_init_fn=_init_env)
    assert list(prefetched) == [0, 1, 2, 3]
    assert "TEST_WORKER_ID" not in os.environ

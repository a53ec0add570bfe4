"""Worker processes and the DataLoader (issue 4), each against Google Grain in the same run.

* ``mp_cpu_heavy``: ~1 ms of GIL-bound NumPy work per element, 20,000 elements, batch 64, with
  2 workers (positions dispatched to free workers, which compute every result); baselines:
  grain_core with 0 and 1 workers, with 2 workers and the opt-in
  ``py_mp_prefetch_in_process="auto"`` (the first results computed in this process decide
  whether workers pay off), with 2 workers in strict rotation (an IterDataset step after ``to_iter_dataset``), Grain
  with 0 and 2 workers, and the same batches from a bare ``multiprocessing.Pool(2)`` (how two
  processes scale here now); passes alternate between the implementations.
* ``mp_cpu_heavy_slow_core``: the same with each worker pinned to its own core and a busy
  process sharing core 1 (a noisy neighbour on one virtual CPU), against the batch made after
  ``to_iter_dataset`` (each worker batches its share; dispatched as well), strict rotation and
  a pool pinned alike.
* ``mp_shm_transport``: 4 MiB float32 batches from 2 running workers to the parent, which
  touches every page of each; baselines: a plain NumPy copy of the same bytes in the parent into
  one reused buffer (the physical limit, cache-resident) and into as many rotating buffers as the
  transport keeps in flight (memory-bound), the bare mechanism (two processes copying into
  shared-memory blocks mapped once, block names over a pipe, no pipeline) with glibc's usual
  copies and with the streaming stores grain_core's workers use (the ceiling of a
  cross-process transport here), and Grain with 2 workers. The workers hand out a
  ready 4 MiB array, so only the transport is measured (copy into shared memory, message,
  mapping in the parent). batches/s × 4 MiB = GB/s.
* ``mp_shm_transport_copied_out``: the same batches, each copied out by the parent into one
  reused buffer, as a transfer to a device does (the page touch above leaves the bytes where
  the worker wrote them); baselines: the same copy of a batch already in the parent (the
  limit), Grain with 2 workers. grain_core's workers write with streaming stores, which this
  consumer reads at memory speed (glibc's ordinary stores, ``GRAIN_PY_MP_WORKER_STREAMING_COPY_BYTES=0``,
  leave them in the worker's core: 1.2-1.7x fewer batches here).
* ``mp_batch_transport``: the usual end of a pipeline, ``.batch(256).to_iter_dataset()``, with
  256 ready 16 KiB rows per 4 MiB batch, batched inside 2 workers (the batch is written
  straight into shared memory); baselines: the same pipeline in one process, Grain 2 workers.
* ``mp_small_elements``: Python ints through 2 running workers, one element per ``next`` (no
  batch before ``mp_prefetch``; workers send the elements they have read already several to
  a message), steady state: the per-element cost of the transport; baselines: the same
  pipeline in one process, and Grain with 2 workers.
* ``mp_small_elements_rotation``: the same ints through a ``filter`` after ``to_iter_dataset``
  (workers stream their shares in strict rotation), default ``per_worker_buffer_size``: small
  elements run ahead of the buffer instead of waiting for the parent after each.
* ``first_batch_mp_prefetch`` / ``first_batch_dataloader``: seconds from ``iter()`` to the first
  batch with 2 workers, cold (grain_core's forkserver is stopped after every pass, so each pass
  pays for starting it). elements/s = 1 / seconds.
* ``dataloader_restore``: restoring a DataLoader iterator at 20 positions over 10,000 records and
  reading the first element; the state size is printed in the description.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from _harness import import_google_grain, steady_pass, with_config, workload

HEAVY_ELEMENTS = 20_000
HEAVY_BATCH = 64
TRANSPORT_BATCHES = 200
SMALL_ELEMENTS = 20_000
TRANSPORT_SHAPE = (1024, 1024)  # float32: 4 MiB
RESTORE_RECORDS = 10_000
RESTORE_POSITIONS = list(range(0, RESTORE_RECORDS, RESTORE_RECORDS // 20))


def heavy(x: int) -> np.ndarray:
    """About 1 ms of NumPy work on small arrays (the GIL is held throughout)."""
    a = np.full(64, float(x))
    for _ in range(150):
        a = np.sin(a) * 0.5 + 1.0
    return a


_READY_BATCH: list[np.ndarray] = []


def ready_batch(i: int) -> np.ndarray:
    """The same 4 MiB batch every time: producing it is not what is measured."""
    if not _READY_BATCH:
        _READY_BATCH.append(np.ones(TRANSPORT_SHAPE, np.float32))
    return _READY_BATCH[0]


def _touch_pages(batch: np.ndarray) -> float:
    # One value per 4 KiB page: the consumer maps every page, as a device transfer would.
    return float(batch.reshape(-1)[::1024].sum())


_STAGING: list[np.ndarray] = []


def _copy_out(batch: np.ndarray) -> float:
    # The consumer copies the whole batch into one reused buffer, as a transfer to a device does.
    if not _STAGING:
        _STAGING.append(np.empty(TRANSPORT_SHAPE, np.float32))
    np.copyto(_STAGING[0], batch)
    return _touch_pages(_STAGING[0])


def _drain(ds: Any, expected: int) -> Callable[[], None]:
    def run() -> None:
        it = iter(ds)
        count = sum(1 for _ in it)
        close = getattr(it, "close", None)
        if close is not None:
            close()
        if count != expected:
            raise AssertionError(f"{count} elements, expected {expected}")

    return run


def same(x: Any) -> Any:
    return x


def _heavy_ds(
    grain: Any, workers: int, rotation: bool = False, batch_after: bool = False, **mp_kwargs: Any
) -> Any:
    ds = grain.MapDataset.range(HEAVY_ELEMENTS).map(heavy)
    if batch_after:
        # Each worker batches its strided share (as Grain's workers do): dispatched too.
        ds = ds.to_iter_dataset().batch(HEAVY_BATCH)
    else:
        ds = ds.batch(HEAVY_BATCH).to_iter_dataset()
    if rotation:
        # An IterDataset step after the slice point: workers run strided shares in rotation.
        ds = ds.map(same)
    if workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers), **mp_kwargs)
    return ds


HEAVY_OUT = -(-HEAVY_ELEMENTS // HEAVY_BATCH)
# Batched after to_iter_dataset by 2 workers: each worker's share ends in a partial batch.
HEAVY_OUT_BATCH_AFTER = sum(-(-len(range(w, HEAVY_ELEMENTS, 2)) // HEAVY_BATCH) for w in range(2))


@workload(
    "mp_cpu_heavy",
    elements=HEAVY_ELEMENTS,
    description="1 ms NumPy map, 20k elements, batch 64, mp_prefetch 2 workers",
    # The 2-worker / 0-worker ratio is the figure: alternated passes see the same host load
    # (a neighbour taking a core for a minute would otherwise fall on one implementation).
    alternate=True,
)
def mp_cpu_heavy() -> Callable[[], None]:
    import grain_core as grain

    return _drain(_heavy_ds(grain, 2), HEAVY_OUT)


@mp_cpu_heavy.baseline("grain_core 0 workers")
def _() -> Callable[[], None]:
    import grain_core as grain

    return _drain(_heavy_ds(grain, 0), HEAVY_OUT)


@mp_cpu_heavy.baseline("grain_core 2 workers, py_mp_prefetch_in_process=auto")
def _() -> Callable[[], object]:
    import grain_core as grain

    # Results computed in this process first show whether workers pay off.
    return with_config("py_mp_prefetch_in_process", "auto", _drain(_heavy_ds(grain, 2), HEAVY_OUT))


@mp_cpu_heavy.baseline("grain_core 1 worker")
def _() -> Callable[[], None]:
    import grain_core as grain

    return _drain(_heavy_ds(grain, 1), HEAVY_OUT)


@mp_cpu_heavy.baseline("grain_core 2 workers, strict rotation")
def _() -> Callable[[], None]:
    import grain_core as grain

    return _drain(_heavy_ds(grain, 2, rotation=True), HEAVY_OUT)


@mp_cpu_heavy.baseline("grain 2 workers", requires="grain")
def _() -> Callable[[], None]:
    return _drain(_heavy_ds(import_google_grain(), 2), HEAVY_OUT)


@mp_cpu_heavy.baseline("grain 0 workers", requires="grain")
def _() -> Callable[[], None]:
    return _drain(_heavy_ds(import_google_grain(), 0), HEAVY_OUT)


def heavy_batch(start: int) -> np.ndarray:
    """One batch of the same work, for the plain process pool."""
    stop = min(start + HEAVY_BATCH, HEAVY_ELEMENTS)
    return np.stack([heavy(x) for x in range(start, stop)])


def _pool_pass(
    initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()
) -> Any:
    """The heavy batches from a bare ``multiprocessing.Pool(2)`` (dynamic task dispatch)."""
    import multiprocessing

    pool = multiprocessing.get_context("forkserver").Pool(2, initializer, initargs)
    starts = range(0, HEAVY_ELEMENTS, HEAVY_BATCH)

    def run() -> None:
        count = sum(1 for _ in pool.imap(heavy_batch, starts))
        if count != HEAVY_OUT:
            raise AssertionError(f"{count} batches, expected {HEAVY_OUT}")

    def close() -> None:
        pool.terminate()
        pool.join()

    run.close = close  # type: ignore[attr-defined]
    return run


@mp_cpu_heavy.baseline("multiprocessing.Pool(2), no pipeline")
def _() -> Callable[[], None]:
    # What this machine gives two processes right now (shared hosts vary): the same batches
    # computed by a bare process pool, so the 2-worker figure can be read against it.
    return _pool_pass()


def pin_worker_to_core(index: int, count: int) -> None:
    """``worker_init_fn``: worker ``i`` runs on core ``i % 2`` only."""
    os.sched_setaffinity(0, {index % 2})


def pin_pool_process_to_core(counter: Any) -> None:
    """Pool initializer: the ``i``-th process started runs on core ``i % 2`` only."""
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    os.sched_setaffinity(0, {index % 2})


def keep_core_1_busy() -> None:
    os.sched_setaffinity(0, {1})
    while True:
        pass


def _with_core_1_busy(run: Any) -> Callable[[], None]:
    # A busy process on core 1 leaves the worker pinned there half of that core, as a noisy
    # neighbour on a shared host does to one virtual CPU.
    import multiprocessing

    busy = multiprocessing.get_context("forkserver").Process(target=keep_core_1_busy, daemon=True)
    busy.start()
    close_run = getattr(run, "close", None)

    def close() -> None:
        busy.kill()
        busy.join()
        if close_run is not None:
            close_run()

    run.close = close
    return run  # type: ignore[no-any-return]


if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:

    @workload(
        "mp_cpu_heavy_slow_core",
        elements=HEAVY_ELEMENTS,
        description="mp_cpu_heavy with one worker per core and core 1 shared with a busy process",
    )  # Not alternated: each implementation's busy process runs only while it is timed.
    def mp_cpu_heavy_slow_core() -> Callable[[], None]:
        # Positions go to the worker that is free, as a pool's tasks do.
        import grain_core as grain

        ds = _heavy_ds(grain, 2, worker_init_fn=pin_worker_to_core)
        return _with_core_1_busy(_drain(ds, HEAVY_OUT))

    @mp_cpu_heavy_slow_core.baseline("grain_core 2 workers, batch after to_iter_dataset")
    def _() -> Callable[[], None]:
        import grain_core as grain

        ds = _heavy_ds(grain, 2, batch_after=True, worker_init_fn=pin_worker_to_core)
        return _with_core_1_busy(_drain(ds, HEAVY_OUT_BATCH_AFTER))

    @mp_cpu_heavy_slow_core.baseline("grain_core 2 workers, strict rotation")
    def _() -> Callable[[], None]:
        # Each worker computes its strided share: both run at the slower core's pace.
        import grain_core as grain

        ds = _heavy_ds(grain, 2, rotation=True, worker_init_fn=pin_worker_to_core)
        return _with_core_1_busy(_drain(ds, HEAVY_OUT))

    @mp_cpu_heavy_slow_core.baseline("multiprocessing.Pool(2), no pipeline")
    def _() -> Callable[[], None]:
        import multiprocessing

        counter = multiprocessing.get_context("forkserver").Value("i", 0)
        return _with_core_1_busy(_pool_pass(pin_pool_process_to_core, (counter,)))


def _batches_pass(
    ds: Any, consume: Callable[[np.ndarray], float] = _touch_pages
) -> Callable[[], None]:
    """Takes ``TRANSPORT_BATCHES`` 4 MiB batches of ones from one long-lived iterator, touching
    every page of each, or as ``consume`` does (steady state: the workers run before the first
    timed pass; start-up is what first_batch_mp_prefetch measures)."""
    it = iter(ds)
    consume(next(it))

    def run() -> None:
        total = sum(consume(next(it)) for _ in range(TRANSPORT_BATCHES))
        if total != TRANSPORT_BATCHES * 1024:
            raise AssertionError(f"checksum {total}")

    run.close = getattr(it, "close", lambda: None)  # type: ignore[attr-defined]
    return run


def _transport_pass(
    grain: Any, consume: Callable[[np.ndarray], float] = _touch_pages
) -> Callable[[], None]:
    ds = grain.MapDataset.range(TRANSPORT_BATCHES).repeat().map(ready_batch).to_iter_dataset()
    options = grain.MultiprocessingOptions(num_workers=2, per_worker_buffer_size=2)
    return _batches_pass(ds.mp_prefetch(options), consume)


def _workers_workload(
    name: str, elements: int, description: str, make_pass: Callable[[Any, int], Any]
) -> None:
    """Registers ``name``: ``make_pass(grain, workers)`` for grain_core with 2 workers, against
    grain_core with 0 workers (the same pipeline in one process) and Grain with 2 workers."""

    def grain_core_setup(workers: int) -> Callable[[], Callable[[], None]]:
        def setup() -> Callable[[], None]:
            import grain_core as grain

            return make_pass(grain, workers)  # type: ignore[no-any-return]

        return setup

    bench = workload(name, elements=elements, description=description)(grain_core_setup(2))
    bench.baseline("grain_core 0 workers")(grain_core_setup(0))
    bench.baseline("grain 2 workers", requires="grain")(lambda: make_pass(import_google_grain(), 2))


@workload(
    "mp_shm_transport",
    elements=TRANSPORT_BATCHES,
    description="4 MiB float32 batches from 2 workers, steady state (x 4 MiB = GB/s)",
)
def mp_shm_transport() -> Callable[[], None]:
    import grain_core as grain

    return _transport_pass(grain)


def _copy_pass(destinations: int) -> Callable[[], None]:
    batch = np.ones(TRANSPORT_SHAPE, np.float32)
    outs = [np.empty_like(batch) for _ in range(destinations)]

    def run() -> None:
        for i in range(TRANSPORT_BATCHES):
            out = outs[i % destinations]
            np.copyto(out, batch)
            _touch_pages(out)

    return run


@mp_shm_transport.baseline("numpy copy in parent")
def _() -> Callable[[], None]:
    # One destination: source and destination stay in the CPU cache (the upper limit).
    return _copy_pass(1)


@mp_shm_transport.baseline("numpy copy, 6 rotating buffers")
def _() -> Callable[[], None]:
    # As many destinations as the transport keeps in flight (2 workers x 3 blocks), so the
    # copy streams through memory as the transport's does.
    return _copy_pass(6)


def bare_transport_worker(conn: Any, names: list[str]) -> None:
    """Copies the ready batch into whichever of its blocks the parent handed back, and sends
    the block's name; ``None`` stops it."""
    from multiprocessing import shared_memory

    blocks = {name: shared_memory.SharedMemory(name) for name in names}
    free = list(names)
    try:
        while True:
            while not free or conn.poll():
                name = conn.recv()
                if name is None:
                    return
                free.append(name)
            name = free.pop()  # the block handed back last: the likeliest still in cache
            np.ndarray(TRANSPORT_SHAPE, np.float32, buffer=blocks[name].buf)[...] = ready_batch(0)
            conn.send(name)
    finally:
        for block in blocks.values():
            block.close()


def _bare_transport_pass(glibc_tunables: str | None = None) -> Callable[[], None]:
    """The mechanism alone: 2 processes copy the batch into shared-memory blocks mapped once,
    a pipe carries block names both ways, the parent reads in rotation and hands each block
    back once read. Each worker has ``per_worker_buffer_size + 1`` blocks, what grain_core
    keeps in flight (the buffered results and the one the consumer holds). The processes are
    spawned with ``GLIBC_TUNABLES=glibc_tunables`` when given."""
    import multiprocessing
    from multiprocessing import shared_memory

    context = multiprocessing.get_context("spawn")
    nbytes = int(np.prod(TRANSPORT_SHAPE)) * 4
    blocks: dict[str, shared_memory.SharedMemory] = {}
    conns, workers = [], []
    for _ in range(2):
        names = []
        for _ in range(3):
            block = shared_memory.SharedMemory(create=True, size=nbytes)
            blocks[block.name] = block
            names.append(block.name)
        parent_end, child_end = context.Pipe()
        worker = context.Process(target=bare_transport_worker, args=(child_end, names))
        inherited = os.environ.get("GLIBC_TUNABLES")
        if glibc_tunables is not None:
            os.environ["GLIBC_TUNABLES"] = glibc_tunables
        try:
            worker.start()
        finally:
            if inherited is None:
                os.environ.pop("GLIBC_TUNABLES", None)
            else:
                os.environ["GLIBC_TUNABLES"] = inherited
        conns.append(parent_end)
        workers.append(worker)

    def take(i: int) -> float:
        conn = conns[i % 2]
        name = conn.recv()
        value = _touch_pages(np.ndarray(TRANSPORT_SHAPE, np.float32, buffer=blocks[name].buf))
        conn.send(name)
        return value

    take(0)
    take(1)

    def run() -> None:
        total = sum(take(i) for i in range(TRANSPORT_BATCHES))
        if total != TRANSPORT_BATCHES * 1024:
            raise AssertionError(f"checksum {total}")

    def close() -> None:
        for conn in conns:
            conn.send(None)
        for worker in workers:
            worker.join()
        for block in blocks.values():
            block.close()
            block.unlink()

    run.close = close  # type: ignore[attr-defined]
    return run


@mp_shm_transport.baseline("bare pipe + shared memory, 2 processes")
def _() -> Callable[[], None]:
    # The mechanism with glibc's copies as they come.
    return _bare_transport_pass()


@mp_shm_transport.baseline("bare pipe + shared memory, streaming stores")
def _() -> Callable[[], None]:
    # The same copies as grain_core's workers make (streaming stores from 2 MiB): the ceiling
    # of a cross-process transport here; what is left between it and the cache-resident numpy
    # copy is the hardware's, not the library's.
    from grain_core._ipc.pool import worker_glibc_tunables
    from grain_core.config import config

    inherited = os.environ.get("GLIBC_TUNABLES")
    return _bare_transport_pass(
        worker_glibc_tunables(inherited, config.py_mp_worker_streaming_copy_bytes)
    )


@mp_shm_transport.baseline("grain 2 workers", requires="grain")
def _() -> Callable[[], None]:
    return _transport_pass(import_google_grain())


@workload(
    "mp_shm_transport_copied_out",
    elements=TRANSPORT_BATCHES,
    description="the same, each batch copied out by the parent (as a device transfer does)",
)
def mp_shm_transport_copied_out() -> Callable[[], None]:
    import grain_core as grain

    return _transport_pass(grain, _copy_out)


@mp_shm_transport_copied_out.baseline("copy of a batch already in the parent")
def _() -> Callable[[], None]:
    batch = np.ones(TRANSPORT_SHAPE, np.float32)

    def run() -> None:
        total = sum(_copy_out(batch) for _ in range(TRANSPORT_BATCHES))
        if total != TRANSPORT_BATCHES * 1024:
            raise AssertionError(f"checksum {total}")

    return run


@mp_shm_transport_copied_out.baseline("grain 2 workers", requires="grain")
def _() -> Callable[[], None]:
    return _transport_pass(import_google_grain(), _copy_out)


_READY_ROW: list[np.ndarray] = []


def ready_row(i: int) -> np.ndarray:
    """The same 16 KiB row every time: 256 of them make a 4 MiB batch."""
    if not _READY_ROW:
        _READY_ROW.append(np.ones(TRANSPORT_SHAPE[1] * 4, np.float32))
    return _READY_ROW[0]


def _batch_transport_pass(grain: Any, workers: int) -> Callable[[], None]:
    ds = grain.MapDataset.range(10**9).map(ready_row).batch(256).to_iter_dataset()
    if workers:
        options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=2)
        ds = ds.mp_prefetch(options)
    return _batches_pass(ds)


_workers_workload(
    "mp_batch_transport",
    TRANSPORT_BATCHES,
    "4 MiB batches of 256 rows batched in 2 workers, steady state (x 4 MiB = GB/s)",
    _batch_transport_pass,
)


def plus_one(x: int) -> int:
    return x + 1


def _small_elements_pass(grain: Any, workers: int) -> Callable[[], None]:
    # Steady state over a long stream: start-up is what first_batch_mp_prefetch measures.
    ds = grain.MapDataset.range(10**9).map(plus_one).to_iter_dataset()
    if workers:
        options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=16)
        ds = ds.mp_prefetch(options)
    return steady_pass(lambda: iter(ds), SMALL_ELEMENTS)


_workers_workload(
    "mp_small_elements",
    SMALL_ELEMENTS,
    "ints, no batch, mp_prefetch 2 workers, buffer 16, steady state",
    _small_elements_pass,
)


def keep(x: int) -> bool:
    return True


def _rotation_small_elements_pass(grain: Any, workers: int) -> Callable[[], None]:
    # A filter after to_iter_dataset: no positions to hand out, so each worker streams its
    # share in strict rotation; the default per_worker_buffer_size (1).
    ds = grain.MapDataset.range(10**9).to_iter_dataset().filter(keep).map(plus_one)
    if workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return steady_pass(lambda: iter(ds), SMALL_ELEMENTS)


_workers_workload(
    "mp_small_elements_rotation",
    SMALL_ELEMENTS,
    "ints through a filter (strict rotation), 2 workers, default buffer, steady state",
    _rotation_small_elements_pass,
)


def _first_batch(make_iterator: Callable[[], Any], cold: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        it = make_iterator()
        batch = next(it)
        it.close()
        cold()
        if batch is None:
            raise AssertionError("no batch")

    return run


def _stop_grain_core_forkserver() -> None:
    import multiprocessing

    from grain_core._ipc import pool

    # A forkserver exits only once every process it started has exited (each holds the
    # server's "alive" pipe): with a worker still running, stopping it would wait forever.
    for process in multiprocessing.active_children():
        process.join(timeout=10)
    alive = multiprocessing.active_children()
    if alive:
        raise RuntimeError(
            f"Cannot measure a cold start: worker processes {alive} of an earlier workload are "
            "still running (an iterator that was not closed or collected)."
        )
    pool._FORKSERVER._stop()


def small_record(i: int) -> np.ndarray:
    return np.full(256, i, np.float32)


def _small_ds(grain: Any) -> Any:
    # A cheap map: what is measured is starting the workers, not computing elements.
    ds = grain.MapDataset.range(1000).map(small_record).to_iter_dataset().batch(32)
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))


@workload(
    "first_batch_mp_prefetch",
    elements=1,
    description="iter() to first batch, mp_prefetch 2 workers, cold (1/s = seconds)",
)
def first_batch_mp_prefetch() -> Callable[[], None]:
    import grain_core as grain

    ds = _small_ds(grain)
    return _first_batch(lambda: iter(ds), _stop_grain_core_forkserver)


@first_batch_mp_prefetch.baseline("grain", requires="grain")
def _() -> Callable[[], None]:
    ds = _small_ds(import_google_grain())
    return _first_batch(lambda: iter(ds), lambda: None)


def _loader(grain: Any, workers: int, records: int = 1000) -> Any:
    return grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, records, 1),
        sampler=grain.samplers.IndexSampler(records, num_epochs=1, shuffle=True, seed=1),
        operations=[grain.transforms.Batch(32)],
        worker_count=workers,
    )


@workload(
    "first_batch_dataloader",
    elements=1,
    description="iter() to first batch, DataLoader 2 workers, cold (1/s = seconds)",
)
def first_batch_dataloader() -> Callable[[], None]:
    import grain_core as grain

    loader = _loader(grain, 2)
    return _first_batch(lambda: iter(loader), _stop_grain_core_forkserver)


@first_batch_dataloader.baseline("grain", requires="grain")
def _() -> Callable[[], None]:
    loader = _loader(import_google_grain(), 2)

    def make() -> Any:
        it = iter(loader)
        it.close = lambda: None  # Grain's DataLoader iterator has no close
        return it

    return _first_batch(make, lambda: None)


def _restore_run(grain: Any) -> Callable[[], None]:
    loader = grain.DataLoader(
        data_source=list(range(RESTORE_RECORDS)),
        sampler=grain.samplers.IndexSampler(RESTORE_RECORDS, num_epochs=1, shuffle=True, seed=1),
        worker_count=0,
    )
    states = []
    it = iter(loader)
    for pos in range(RESTORE_RECORDS):
        if pos in RESTORE_POSITIONS:
            states.append(it.get_state())
        next(it)

    def run() -> None:
        for state in states:
            fresh = iter(loader)
            fresh.set_state(state)
            next(fresh)

    return run


def _state_size() -> int:
    import grain_core as grain

    loader = grain.DataLoader(
        data_source=list(range(RESTORE_RECORDS)),
        sampler=grain.samplers.IndexSampler(RESTORE_RECORDS, num_epochs=1),
        worker_count=0,
    )
    it = iter(loader)
    for _ in range(RESTORE_RECORDS):
        next(it)
    state = it.get_state()
    json.loads(state)
    return len(state)


@workload(
    "dataloader_restore",
    elements=len(RESTORE_POSITIONS),
    description=f"restore + first element at 20 positions; state after 10k records: "
    f"{_state_size()} bytes",
)
def dataloader_restore() -> Callable[[], None]:
    import grain_core as grain

    return _restore_run(grain)


@dataloader_restore.baseline("grain", requires="grain")
def _() -> Callable[[], None]:
    return _restore_run(import_google_grain())

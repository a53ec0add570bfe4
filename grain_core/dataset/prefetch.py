"""From MapDataset to IterDataset (``to_iter_dataset``) and background-thread prefetching."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import functools
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from grain_core._checks import as_int
from grain_core.dataset.base import IterDataset, MapDataset, stop_iteration_error
from grain_core.dataset.element_spec import parent_spec
from grain_core.dataset.iterator import DatasetIterator, ElementBlock, pipeline_observer
from grain_core.dataset.options import FilterRatioChecker
from grain_core.dataset.read_concurrency import (
    MAX_BLOCK,
    READ_THREAD_PREFIX,
    BlockReader,
    FirstReadWatch,
    ReadConcurrency,
    overlaps_consumer,
)
from grain_core.options import ReadOptions

__all__ = [
    "PrefetchDatasetIterator",
    "PrefetchIterDataset",
    "ThreadPrefetchDatasetIterator",
    "ThreadPrefetchIterDataset",
    "read_index",
]


def read_index(ds: MapDataset[Any], index: int) -> Any:
    """``ds[index]``. An error raised notes which index of ``ds`` raised it, unless a reader
    nearer the user's data already named its index (a worker reading its assigned positions
    names the pipeline's index, not its own)."""
    try:
        return ds[index]
    except StopIteration as e:
        raise stop_iteration_error(f"Reading index {index} of {ds!r}") from e
    except Exception as e:
        if getattr(e, "_grain_core_read_index", None) is None:
            setattr(e, "_grain_core_read_index", index)  # noqa: B010 - exceptions take attributes
            e.add_note(f"Raised while reading index {index} of {ds!r}.")
        raise


class PrefetchIterDataset(IterDataset[Any]):
    """Iterates one epoch of a MapDataset in index order (``MapDataset.to_iter_dataset``)."""

    element_spec_rule = parent_spec

    def __init__(
        self,
        parent: MapDataset[Any],
        *,
        read_options: ReadOptions | None = None,
        allow_nones: bool = False,
    ) -> None:
        super().__init__(parent)
        self.read_options = read_options or ReadOptions()
        self.allow_nones = allow_nones

    @property
    def map_parent(self) -> MapDataset[Any]:
        return self._parents[0]

    def with_parent(self, parent: MapDataset[Any]) -> PrefetchIterDataset:
        """Returns the same reader over another MapDataset (used to slice for workers)."""
        return PrefetchIterDataset(
            parent, read_options=self.read_options, allow_nones=self.allow_nones
        )

    def __iter__(self) -> PrefetchDatasetIterator:
        return PrefetchDatasetIterator(self)

    def holes_checker(self) -> FilterRatioChecker:
        """The filter-ratio check of this reader's holes (elements filtered out upstream)."""
        return FilterRatioChecker(
            f"PrefetchDatasetIterator(read_options={self.read_options}, "
            f"allow_nones={self.allow_nones})",
            where=f"reading {self.map_parent!r}",
        )

    def __repr__(self) -> str:
        return (
            f"PrefetchIterDataset(read_options={self.read_options}, allow_nones={self.allow_nones})"
        )


class PrefetchDatasetIterator(DatasetIterator[Any]):
    """Reads blocks of indices (on a thread pool when configured); state ``{"next_index"}``."""

    def __init__(self, ds: PrefetchIterDataset) -> None:
        super().__init__()
        self._map_ds = ds.map_parent
        self._len = len(self._map_ds)
        self._allow_nones = ds.allow_nones
        opts = ds.read_options
        self._threaded = opts.num_threads > 0 and opts.prefetch_buffer_size > 0
        self._num_threads = opts.num_threads
        self._buffer_size = opts.prefetch_buffer_size
        self._chunk_cap = max(1, min(MAX_BLOCK, opts.prefetch_buffer_size))
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._checker = ds.holes_checker()
        # Kept across set_state: what was learnt about the reads still holds.
        self._concurrency = ReadConcurrency(
            self._num_threads, overlaps_consumer=overlaps_consumer()
        )
        self._reader = BlockReader(self._threaded, self._concurrency, self._chunk_cap)
        # Guards the read-ahead (pending blocks, positions, reads running), which a read
        # thread extends when its block is done; reentrant: a read already done when its
        # callback is added calls it in the thread that added it.
        self._read_ahead_lock = threading.RLock()
        # A finished read starts the next ones, so the read-ahead fills while the consumer is
        # away (after an early break), as Grain's read threads do. The callback holds the
        # iterator weakly: a dropped iterator is still collected with its reads in flight.
        self._on_read_done = functools.partial(_read_done, weakref.ref(self))
        self._reset(0)

    def _reset(self, next_index: int) -> None:
        with self._read_ahead_lock:
            self._reset_positions(next_index)

    def _reset_positions(self, next_index: int) -> None:
        self._next_index = next_index  # parent indices consumed, holes included
        self._chunk: Sequence[Any] = []
        self._chunk_pos = 0
        self._chunk_holes = 0
        self._read_index = next_index  # first index not yet requested
        self._reader.chunk_size = 1
        self._pending: collections.deque[tuple[int, int, concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        self._in_flight = 0
        self._running: set[concurrent.futures.Future[Any]] = set()  # reads not done yet
        self._reader.cpu_share = 1.0

    def _next_chunk_range(self, limit: int) -> tuple[int, int]:
        start = self._read_index
        count = min(self._reader.chunk_size, self._len - start, limit)
        if self._threaded:
            # The read-ahead is shared by the blocks that may be in flight: one block alone
            # may take all of it (large batched reads amortise a source's per-call cost).
            count = min(count, max(1, self._buffer_size // max(1, self._concurrency.value)))
        self._read_index += count
        return start, count

    def _fill(self) -> None:
        """Starts reads on the read threads until ``concurrency.value`` run at once or the
        read-ahead holds ``prefetch_buffer_size`` elements."""
        with self._read_ahead_lock:
            while (
                not self._closed
                and self._read_index < self._len
                and self._in_flight < self._buffer_size
                and len(self._running) < self._concurrency.value
            ):
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        self._num_threads, thread_name_prefix=READ_THREAD_PREFIX
                    )
                start, count = self._next_chunk_range(self._buffer_size - self._in_flight)
                block = self._executor.submit(self._reader.read, self._map_ds, start, count)
                self._pending.append((start, count, block))
                self._in_flight += count
                self._running.add(block)
                block.add_done_callback(self._on_read_done)

    def _read_finished(self, block: concurrent.futures.Future[Any]) -> None:
        """A read thread's block is done: the next reads start (see ``_on_read_done``)."""
        with self._read_ahead_lock:
            self._running.discard(block)
            if not block.cancelled():
                self._fill()

    def _load_chunk(self) -> None:
        if self._threaded:
            self._fill()
        if not self._pending:  # no read threads, or none in use now: read here
            self._read_here(self._chunk_cap)
        with self._read_ahead_lock:
            start, count, block = self._pending.popleft()
            self._in_flight -= count
        try:
            chunk = block.result()
        except Exception:
            chunk = self._read_one_by_one(start, count)
        if self._threaded:
            self._concurrency.block_done(len(chunk), self._reader.cpu_share, time.perf_counter())
            self._fill()
        holes = 0
        if not self._allow_nones:
            holes = sum(x is None for x in chunk)
            self._checker.record(len(chunk), holes, self._ctx.dataset_options)
        self._chunk = chunk
        self._chunk_pos = 0
        self._chunk_holes = holes

    def _read_one_by_one(self, start: int, count: int) -> list[Any]:
        """Re-reads a failed block element by element so the good elements before the bad one
        are delivered and the error surfaces at the index that caused it."""
        out: list[Any] = []
        for i in range(start, start + count):
            try:
                out.append(read_index(self._map_ds, i))
            except Exception as e:  # noqa: BLE001 - delivered in order, then raised
                out.append(_Raise(e))
                break
        return out

    def __next__(self) -> Any:
        if self._closed:
            self._check_open()
        while True:
            if self._chunk_pos < len(self._chunk):
                x = self._chunk[self._chunk_pos]
                self._chunk_pos += 1
                if type(x) is _Raise:
                    self._raise(x)
                self._next_index += 1
                if x is None and not self._allow_nones:
                    continue
                return x
            if self._next_index >= self._len:
                raise StopIteration
            self._load_chunk()

    def next_block(self, max_size: int) -> ElementBlock[Any]:
        """Takes up to ``max_size`` next elements of the block read last (see
        ``grain_core.experimental.SupportsNextBlock``).

        Raises:
          Exception: What reading an index raised, once the elements before it are taken.
        """
        if self._closed:
            self._check_open()
        while True:
            while self._chunk_pos >= len(self._chunk):
                if self._next_index >= self._len:
                    return _indexed_block([], self._next_index, None)
                self._load_chunk()
            chunk, pos, first = self._chunk, self._chunk_pos, self._next_index
            stop = min(pos + max_size, len(chunk))
            if type(chunk[stop - 1]) is _Raise:  # only a block's last element is an error
                stop -= 1
                if stop == pos:
                    self._raise(chunk[pos])
            if not self._chunk_holes:
                self._chunk_pos = stop
                self._next_index = first + stop - pos
                return _indexed_block(chunk[pos:stop], first, None)
            # Holes are skipped: the state after an element is the index after it.
            ends = [k + 1 for k in range(stop - pos) if chunk[pos + k] is not None]
            used = ends[-1] if ends else stop - pos
            self._chunk_pos = pos + used
            self._next_index = first + used
            if ends:
                return _indexed_block([chunk[pos + k - 1] for k in ends], first, ends)

    def _raise(self, failed: _Raise) -> NoReturn:
        """Raises a read's error in its turn; the next read starts again at its index."""
        self._reset(self._next_index)
        raise failed.error

    def read_ahead(self) -> bool:
        """Reads the next block in the calling thread, unless read threads are in use or the
        read-ahead is full; returns whether it did. (An ``mp_prefetch`` worker reading inline
        calls it while it waits for the parent, as a read thread would read on.)"""
        if self._closed or (self._threaded and self._concurrency.value > 0):
            return False
        room = self._buffer_size - self._in_flight
        if self._read_index >= self._len or room <= 0:
            return False
        self._read_here(min(self._chunk_cap, room))
        return True

    def _first_read_waits_on_io(self) -> None:
        """The first read was seen waiting on I/O: every block goes in flight at once."""
        self._concurrency.waits_on_io()
        self._fill()

    def _read_here(self, limit: int) -> None:
        """Reads the next block (at most ``limit`` elements) in this thread and queues it as
        the threads' blocks are: an error is raised when its turn comes."""
        # Queued before it is read: the reads that the first read's watcher starts come after.
        block: concurrent.futures.Future[Sequence[Any]] = concurrent.futures.Future()
        with self._read_ahead_lock:
            start, count = self._next_chunk_range(limit)
            self._in_flight += count
            self._pending.append((start, count, block))
        watch = None
        if self._threaded and not self._concurrency.measured:
            watch = FirstReadWatch(self._first_read_waits_on_io)
        try:
            block.set_result(self._reader.read(self._map_ds, start, count))
        except BaseException as e:  # noqa: BLE001 - re-read one by one when its turn comes
            # A read thread's SystemExit waits for its turn too: a worker reading ahead while
            # it waits for credits sends what it computed before user code exits.
            block.set_exception(e)
        if watch is not None:
            watch.stop()

    def buffered(self) -> bool:
        """Whether ``next`` has an element read already (a hole skipped counts as one)."""
        if self._chunk_pos < len(self._chunk):
            return True
        return bool(self._pending) and self._pending[0][2].done()

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._next_index}

    def set_state(self, state: dict[str, Any]) -> None:
        # Out of range is an IndexError, as in Grain; only the type is checked first.
        next_index = as_int(self._state_name("next_index"), state["next_index"])
        if not 0 <= next_index <= self._len:
            raise IndexError(
                f"Checkpoint `next_index` {next_index} is out of range for dataset of length "
                f"{self._len} ({self._map_ds!r}): the checkpoint belongs to a different pipeline."
            )
        self._cancel_pending()
        self._reset(next_index)
        self._start_when_restored()

    def source_extended(self) -> None:
        """Reads on into indices appended to a growing MapDataset (the positions assigned to an
        ``mp_prefetch`` worker); the read-ahead never passes the last one."""
        self._len = len(self._map_ds)
        self.start_prefetch()

    def _get_next_index(self) -> int:
        return self._next_index

    def _set_next_index(self, index: int) -> None:
        self.set_state({"next_index": index})

    def _cancel_pending(self) -> None:
        with self._read_ahead_lock:
            for _, _, future in self._pending:
                future.cancel()

    def start_prefetch(self) -> None:
        if self._threaded and not self._closed:
            self._fill()

    def close(self) -> None:
        if self._closed:
            return
        with self._read_ahead_lock:  # no read starts after this
            self._closed = True
        self._cancel_pending()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _read_done(
    iterator: weakref.ref[PrefetchDatasetIterator], block: concurrent.futures.Future[Any]
) -> None:
    """A read thread's block is done: its iterator, unless collected, starts the next reads."""
    it = iterator()
    if it is not None:
        it._read_finished(block)


def _indexed_block(
    elements: Sequence[Any], first: int, ends: Sequence[int] | None
) -> ElementBlock[Any]:
    """A block of a ``to_iter_dataset`` reader: its elements start at index ``first``, and
    the ``k``-th is followed by index ``first + ends[k - 1]`` (``first + k`` without holes)."""
    if ends is None:
        return ElementBlock(elements, lambda k: {"next_index": first + k})
    return ElementBlock(elements, lambda k: {"next_index": first + (ends[k - 1] if k else 0)})


class _Raise:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


# ------------------------------------------------------------------------ thread prefetch
class ThreadPrefetchIterDataset(IterDataset[Any]):
    """Runs the parent iterator on a background thread, ``prefetch_buffer_size`` ahead.

    Raises:
      ValueError: if ``prefetch_buffer_size`` is negative.
    """

    element_spec_rule = parent_spec

    def __init__(self, parent: IterDataset[Any], *, prefetch_buffer_size: int) -> None:
        super().__init__(parent)
        if prefetch_buffer_size < 0:
            raise ValueError(
                "`prefetch_buffer_size` must be greater than or equal to 0, got "
                f"{prefetch_buffer_size}."
            )
        self._buffer_size = prefetch_buffer_size

    def __iter__(self) -> DatasetIterator[Any]:
        parent = iter(self._parents[0])
        if self._buffer_size == 0:
            return parent
        return ThreadPrefetchDatasetIterator(parent, self._buffer_size)

    def __repr__(self) -> str:
        return f"ThreadPrefetchIterDataset(prefetch_buffer_size={self._buffer_size})"


_END = object()
# Producer threads alive now, with their stop events. They are daemon threads, so that a
# forgotten iterator never keeps the interpreter alive; but one still inside a C++ extension
# when the interpreter finalizes (a JAX device copy) is cut off there, and that aborts the
# process. So they are stopped and joined before the interpreter exits, as concurrent.futures
# does with its workers (threading's own exit hook, which runs before any atexit handler).
_PRODUCERS: dict[threading.Thread, threading.Event] = {}
_EXIT_JOIN_S = 5.0


def _stop_producers_at_exit() -> None:
    for stop in list(_PRODUCERS.values()):
        stop.set()
    deadline = time.monotonic() + _EXIT_JOIN_S
    for thread in list(_PRODUCERS):
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


threading._register_atexit(_stop_producers_at_exit)  # type: ignore[attr-defined]  # private, as used by concurrent.futures


def _snapshot(source: Any, owns_state_copies: bool) -> Any:
    state = source.get_state()
    # grain_core iterators return fresh state dicts; foreign iterators may not.
    return copy.deepcopy(state) if owns_state_copies else state


class _Carried:
    """What one producer thread leaves to the next, after a pause (``inputs_paused``): the
    item it read but had no room for when it was stopped, and whether it put the end."""

    __slots__ = ("ended", "item")

    def __init__(self) -> None:
        self.item: tuple[Any, Any, BaseException | None] | None = None
        self.ended = False


def _produce(
    source: Any,
    owns_state_copies: bool,
    stop: threading.Event,
    q: queue.Queue[Any],
    carried: _Carried,
) -> None:
    """The producer thread of a ThreadPrefetchDatasetIterator: ``(element, state, error)``,
    starting with the item ``carried`` holds and leaving there the one it holds when
    stopped."""
    try:
        item, carried.item = carried.item, None
        while not stop.is_set():
            if item is None:
                try:
                    item = (next(source), _snapshot(source, owns_state_copies), None)
                except StopIteration:
                    item = (_END, None, None)
                except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                    item = (_END, None, e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            else:
                carried.item = item
                return
            if item[0] is _END:
                carried.ended = True
                return
            item = None
    finally:
        _PRODUCERS.pop(threading.current_thread(), None)


class ThreadPrefetchDatasetIterator(DatasetIterator[Any]):
    """Prefetches ``(element, state)`` pairs from any iterator with get_state/set_state.

    The state reported is the parent's state right after producing the last element handed out,
    captured by the producer thread, so restoring it never skips or repeats an element.
    """

    def __init__(self, parent: Any, prefetch_buffer_size: int) -> None:
        super().__init__([parent] if isinstance(parent, DatasetIterator) else [])
        self._source = parent
        self._owns_state_copies = not isinstance(parent, DatasetIterator)
        self._buffer_size = prefetch_buffer_size
        self._state = self._snapshot()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[Any, Any, BaseException | None]] = queue.Queue(
            maxsize=prefetch_buffer_size
        )
        self._exhausted = False
        self._carried = _Carried()
        pipeline_observer().reads_inputs_on_own_thread(self, self.inputs_paused)

    def _snapshot(self) -> Any:
        return _snapshot(self._source, self._owns_state_copies)

    @contextlib.contextmanager
    def inputs_paused(self) -> Iterator[None]:
        """While entered, the producer thread is stopped (it finishes the read in progress
        first and keeps what it read), so the caller's thread may use the source; afterwards
        a new thread goes on from where it stopped. The producer thread itself passes."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            yield
            return
        self._stop.set()
        thread.join()
        self._thread = None
        try:
            yield
        finally:
            if not self._closed:
                self._start()

    def _start(self) -> None:
        if self._thread is None and not self._exhausted and not self._carried.ended:
            self._stop = threading.Event()
            # The thread gets the source, never this iterator: an iterator the user drops
            # without close() is then collected, and collecting it stops the thread and
            # closes the source (worker processes included).
            self._thread = threading.Thread(
                target=_produce,
                args=(
                    self._source,
                    self._owns_state_copies,
                    self._stop,
                    self._queue,
                    self._carried,
                ),
                name="grain_core-thread-prefetch",
                daemon=True,
            )
            _PRODUCERS[self._thread] = self._stop
            self._thread.start()

    def start_prefetch(self) -> None:
        if not self._closed:
            self._start()

    def __next__(self) -> Any:
        self._check_open()
        if self._exhausted:
            raise StopIteration
        self._start()
        element, state, error = self._queue.get()
        if element is _END:
            self._exhausted = True
            self._thread = None
            if error is not None:
                raise error
            raise StopIteration
        self._state = state
        return element

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=5)
            self._thread = None
        # Fresh: a thread that outlived the join writes only into the old ones.
        self._queue = queue.Queue(maxsize=self._buffer_size)
        self._carried = _Carried()

    def get_state(self) -> dict[str, Any]:
        return copy.deepcopy(self._state) if self._owns_state_copies else dict(self._state)

    def set_state(self, state: dict[str, Any]) -> None:
        self._stop_thread()
        self._source.set_state(state)
        self._state = self._snapshot()
        self._exhausted = False
        self._start_when_restored()

    def _progress_held(self) -> None:
        # The state is the source's as of the last element handed out: read-ahead is not in it.
        return None

    def _get_next_index(self) -> int:
        # The producer may have run ahead: rewind the source to what was handed out.
        self._stop_thread()
        self._source.set_state(self._state)
        self._exhausted = False
        return self._source._get_next_index()

    def _set_next_index(self, index: int) -> None:
        self._stop_thread()
        self._source._set_next_index(index)
        self._state = self._snapshot()
        self._exhausted = False

    def close(self) -> None:
        if self._closed:
            return
        self._stop_thread()
        super().close()
        if self._owns_state_copies:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

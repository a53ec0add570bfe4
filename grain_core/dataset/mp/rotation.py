"""Strict rotation: worker ``w`` of ``N`` runs its share of the pipeline and streams it; the
parent takes one element from each worker in turn.

Worker ``w`` runs a copy of the pipeline in which, on every path from the output to the
sources, the first sliceable node reads only its share (``worker_slicing``). The parent takes
one element from each worker in turn (``0, 1, …, N-1, 0, …``), blocking on a slow worker
rather than skipping it, and skips workers that are exhausted, so the output never depends on
timing (the merge is the parent's interleave, ``grain_core.dataset.mp``).

Parent side, ``RotationIterator``: one per worker, the input of the merge. Its state is the
worker pipeline's state after the last element handed out: every element arrives with its
worker's state right after producing it, so ``get_state`` never talks to the worker, and
``set_state`` restores the worker in place (``SET_STATE``, a new generation), without
restarting it. It grants ``per_worker_buffer_size`` credits and returns them as elements are
handed out, in batches while the worker's elements may overdraw (``protocol``).

Worker side, ``RotationWorkerLoop``: runs its share and sends each element with its state.
Elements that need no shared memory go as ``PICKLED_ELEMENTS``, a list of ``(element,
state)`` pairs pickled one by one (so each one's size is known), several to a message while
the next is expected within ``worker.GROUP_S``. A worker about to wait for a credit says so,
once, with its credits then (``WANTS_CREDIT``), as credits go back in batches. The stream
ends with ``END`` (and the final state) or stops at its ``ERROR``.
"""

from __future__ import annotations

import collections
import copy
import pickle
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from grain_core._ipc import shm
from grain_core._ipc.errors import (
    UnreadableElementError,
    WorkerDiedError,
    remote_error,
    unreadable_element_error,
)
from grain_core._ipc.pool import STOP_TIMEOUT_S, WorkerPool
from grain_core.dataset.iterator import DatasetIterator, MultiprocessingContext, pipeline_observer
from grain_core.dataset.mp.pickling import EngineInput, dumps, dumps_message
from grain_core.dataset.mp.protocol import (
    CREDIT,
    ELEMENT,
    END,
    PICKLED_ELEMENTS,
    SET_STATE,
    STATS_GENERATION,
    WANTS_CREDIT,
    credit_batch,
    receive_side_message,
    stats_request_message,
)
from grain_core.dataset.mp.share_index import share_next_index, share_state_at
from grain_core.dataset.mp.worker import (
    GROUP_S,
    WorkerLoop,
    WorkerSpec,
    lease_workers,
    release_workers,
    run_worker,
)
from grain_core.dataset.options import DatasetOptions
from grain_core.dataset.transfer_cost import overdraft_room
from grain_core.plugins import loaded_plugin_names

if TYPE_CHECKING:
    from grain_core.dataset.base import IterDataset

__all__ = [
    "RotationIterator",
    "RotationWorkerLoop",
    "build_worker_iterator",
    "credit_message",
    "set_state_message",
    "worker_main",
]


# ----------------------------------------------------------------------------- messages
def credit_message(credits: int, names: list[str]) -> tuple[Any, ...]:
    """Control: ``credits`` more elements may be sent; blocks ``names`` are free again."""
    return (CREDIT, credits, names)


def set_state_message(
    generation: int, state: Any, credits: int, names: list[str]
) -> tuple[Any, ...]:
    """Control: restore the worker pipeline to ``state`` as generation ``generation``, with
    ``credits`` and blocks ``names`` back (those of the elements the parent dropped)."""
    return (SET_STATE, generation, state, credits, names)


def end_message(generation: int, state: Any) -> tuple[Any, ...]:
    """Output: the share is exhausted; ``state`` is the pipeline's at its end."""
    return (generation, END, None, state, (), ())


def pickled_elements_message(
    generation: int, blobs: list[bytes], dropped: Sequence[str]
) -> tuple[Any, ...]:
    """Output: ``(element, state)`` pairs, each pickled alone, none in shared memory."""
    return (generation, PICKLED_ELEMENTS, blobs, None, [], dropped)


def wants_credit_message(generation: int, credits: int) -> tuple[Any, ...]:
    """Output, before waiting: only a credit lets the worker go on; ``credits`` it has."""
    return (generation, WANTS_CREDIT, credits, None, (), ())


# ---------------------------------------------------------------------------- worker side
def build_worker_iterator(
    share: IterDataset[Any],
    index: int,
    count: int,
    options: DatasetOptions | None,
) -> DatasetIterator[Any]:
    """Builds worker ``index``'s iterator over its ``share`` of the pipeline
    (``PipelineNodes.worker_share``) with its multiprocessing context and options.

    ``options`` are the parent's: they already hold the options set in this pipeline, merged
    with those set downstream of ``mp_prefetch``, so they win.
    """
    it = iter(share)
    it._ctx.mp_context = MultiprocessingContext(index, count)
    if options is not None:
        it._merge_dataset_options(options)
    return it


class RotationWorkerLoop(WorkerLoop):
    """A worker of strict rotation: streams its share of the pipeline, each element with the
    pipeline's state right after it."""

    def _build_pipeline(self, ds: Any) -> None:
        spec = self._spec
        share = spec.nodes.worker_share(ds, spec.index, spec.count, spec.sequential_slice, True)
        self._it = build_worker_iterator(share, spec.index, spec.count, spec.options)
        if spec.state is not None:
            self._it.set_state(spec.state)

    def _ask_for_credit(self) -> None:
        """Before waiting: tells the parent, once, that only a credit lets the worker go on
        (an element too big for the overdraft, or the overdraft full), as the parent grants
        credits in batches."""
        if (
            self._credits <= 0
            and not self._asked
            and self._has_work()
            and self._spec.buffer_size > 0
        ):
            self._send(wants_credit_message(self._generation, self._credits))
            self._asked = True

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == CREDIT:
            self._add_credits(message[1])
            shm.release_blocks(message[2])
        elif kind == SET_STATE:
            _, self._generation, state, credits, names = message
            shm.release_blocks(names)
            self._reset_credits(credits)
            self._finished = False
            if self._it is not None:
                try:
                    self._it.set_state(state)
                except Exception as e:  # noqa: BLE001 - reported on the next request
                    self._send_error(e)
                    self._finish_with_error()

    def _finish_with_error(self) -> None:
        # The stream stops at its error; the parent re-raises it until the next set_state.
        self._finished = True
        self._credits = max(self._credits - 1, 0)

    def _produce(self) -> None:
        if self._build_error is not None:
            self._send_error(self._build_error)
            self._finish_with_error()
            return
        it = self._it
        # Elements that need no shared memory go several to a message while the next one is
        # expected within GROUP_S of the first (the last one's time foretells it): a message
        # costs both sides a system call, and often a wake-up, per element. Each is pickled
        # alone, so its size is known for the overdraft.
        blobs: list[bytes] = []
        deadline = time.perf_counter() + GROUP_S
        while True:
            began = time.perf_counter()
            if self._waiting is not None:  # _can_produce found it may go now
                pending, self._waiting = self._waiting, None
            else:
                try:
                    element = next(it)
                except StopIteration:
                    self._send_blobs(blobs)
                    self._send_stats()
                    self._send(end_message(self._generation, it.get_state()))
                    self._finished = True
                    self._credits -= 1
                    return
                except Exception as e:  # noqa: BLE001 - re-raised in the parent
                    self._send_blobs(blobs)
                    self._send_error(e)
                    self._finish_with_error()
                    return
                state = it.get_state()
                tree, names = shm.copy_to_shm(element, self._min_shm_size)
                if names:
                    pending = ((tree, state), names, None)
                else:
                    try:
                        blob = dumps_message((tree, state))
                    except Exception as failure:  # noqa: BLE001 - sent as its error, in its place
                        self._send_blobs(blobs)
                        self._send_unpicklable(failure)
                        self._finish_with_error()
                        return
                    pending = (blob, [], len(blob))
            payload, names, size = pending
            if names:
                self._send_blobs(blobs)
                if self._take_credit(None):
                    tree, state = payload
                    self._send_in_shm(tree, state, names)
                else:
                    self._waiting = pending
                return
            if not self._take_credit(size):
                self._send_blobs(blobs)
                self._waiting = pending
                return
            blobs.append(cast(bytes, payload))  # without shared memory: the pickled element
            now = time.perf_counter()
            if not (self._credits > 0 or self._may_overdraw()) or 2 * now - began >= deadline:
                self._send_blobs(blobs)
                return

    def _send_in_shm(self, tree: Any, state: Any, names: list[str]) -> None:
        """Sends an element whose arrays are in blocks ``names`` (encoded only now, so the
        blocks freed meanwhile go with it); the stream ends at one that cannot be pickled."""
        if self._send_element(tree, state, names) is None:
            self._finish_with_error()

    def _send_blobs(self, blobs: list[bytes]) -> None:
        """Sends pickled ``(element, state)`` pairs in one message, and the blocks this worker
        freed."""
        if blobs:
            message = pickled_elements_message(self._generation, blobs, shm.take_dropped())
            self._write(dumps(message))


def worker_main(spec: WorkerSpec, control: Any, output: Any) -> None:
    """Entry point of a strict-rotation worker process."""
    run_worker(RotationWorkerLoop, spec, control, output)


# ---------------------------------------------------------------------------- parent side
class RotationIterator(DatasetIterator[Any]):
    """Reads one worker's output; its state is the worker pipeline's state after the last
    element handed out. The process starts on the first ``next``/``start_prefetch``.

    Args:
      engine: The pipeline, its options and payload.
      index: The worker.
    """

    def __init__(self, engine: EngineInput, index: int) -> None:
        super().__init__()
        self._stage_label = "ProcessPrefetch"  # the execution summary's name for this stage
        self._engine = engine
        self._index = index
        self._count = engine.num_workers
        # Credits: the buffer, returned as elements are handed out (a buffer of 0 asks for no
        # read-ahead at all: one credit per request). Small elements also go beyond them, on
        # the worker's overdraft (``protocol``), and while they do, credits go back in
        # batches (``credit_batch``).
        self._buffer = engine.options.per_worker_buffer_size
        self._grant_batch = credit_batch(self._buffer)
        self._pool: WorkerPool | None = None
        self._finalizer: weakref.finalize | None = None
        self._state: Any = None
        self._exhausted = False
        self._generation = 0
        self._outstanding = 0
        # Elements handed out since the start or the last set_state: what the watchdog names.
        self._handed_out_count = 0
        self._restored = False
        self._error: BaseException | None = None
        # Blocks of elements the consumer has dropped go back with the next credit.
        self._recycled = shm.RecycledBlocks()
        self._warning_registry: dict[Any, Any] = {}
        # Elements received, not handed out yet, each pickled with its state.
        self._received: collections.deque[bytes] = collections.deque()
        # Messages read while waiting for the answer to a statistics request, for __next__ in
        # order; an error that reading raised stands in the place of its message.
        self._early: collections.deque[tuple[Any, ...] | BaseException] = collections.deque()
        self._stats_requests = 0  # requests sent
        self._stats_answered = 0  # the last request answered
        pipeline_observer().receives_worker_stages(
            self, self.request_worker_stages, self.receive_worker_stages
        )

    def _start(self) -> None:
        """Starts the worker (or takes the one the last iterator left running for this
        index, and restores it to this iterator's state)."""
        engine = self._engine
        plugins = loaded_plugin_names()
        options = self._ctx.dataset_options

        def make_specs() -> list[WorkerSpec]:
            spec = WorkerSpec.for_engine(
                engine,
                self._index,
                self._count,
                options=options,
                plugins=plugins,
                results_in_flight=self._buffer,
                buffer_size=self._buffer,
                sequential_slice=engine.sequential_slice,
                state=self._state,
            )
            return [spec]

        warm = engine.warm_workers
        key = (worker_main, self._index, options, plugins)
        lease = lease_workers(warm, key, make_specs, worker_main, engine.options)
        self._pool = lease.pool
        self._recycled = lease.recycled[0]
        self._finalizer = weakref.finalize(self, release_workers, warm, lease)
        self._generation = lease.first_generation
        if lease.reused:
            credits = 0 if self._exhausted else self._buffer
            state = self.get_state()
            released = self._recycled.take_released()
            self._pool.send(0, set_state_message(self._generation, state, credits, released))
            self._outstanding = credits
        elif not self._exhausted:
            self._grant(self._buffer)

    def _grant(self, credits: int) -> None:
        if credits > 0:
            assert self._pool is not None
            self._pool.send(0, credit_message(credits, self._recycled.take_released()))
            self._outstanding += credits

    def start_prefetch(self) -> None:
        if self._pool is None and not self._closed:
            self._start()

    def __next__(self) -> Any:
        self._check_open()
        if self._error is not None:
            raise self._error
        if self._exhausted:
            raise StopIteration
        if self._received:
            return self._hand_out_pickled()
        if self._pool is None:
            self._start()
        pool = self._pool
        assert pool is not None
        if self._outstanding == 0 and not self._buffer:
            self._grant(1)  # on request only
        while True:
            try:
                generation, kind, element, state, names, dropped = self._recv(pool)
            except (WorkerDiedError, UnreadableElementError) as e:
                self._error = e
                raise
            self._recycled.forget(dropped)
            if generation == self._generation:
                if kind != WANTS_CREDIT:
                    break
                # Everything it sent before was handed out, so what is outstanding here is
                # its credits now; more than it had then: credits were on their way, which
                # let it go on (or it asks again).
                if self._outstanding <= element:
                    self._grant(self._buffer - self._outstanding)
                continue
            if generation == STATS_GENERATION:
                self._take_side_message(kind, element, state)
                continue
            self._recycled.released.extend(names)  # produced before the last set_state
        if kind == PICKLED_ELEMENTS:
            self._received.extend(element)
            if self._buffer:
                room = overdraft_room(max(map(len, element)))
                self._grant_batch = credit_batch(self._buffer, room)
            return self._hand_out_pickled()
        if kind == ELEMENT:  # in shared memory
            self._grant_batch = credit_batch(self._buffer)
            self._handed_out(state)
            return shm.open_from_shm(element, self._recycled) if names else element
        self._outstanding -= 1
        if kind == END:
            self._state = state
            self._exhausted = True
            raise StopIteration
        self._error = remote_error(element, self._index, self._count)
        raise self._error

    def _recv(self, pool: WorkerPool) -> tuple[Any, ...]:
        """The worker's next message: first those read while waiting for statistics."""
        if not self._early:
            return pool.recv(0, waiting_for=self._waiting_for)
        message = self._early.popleft()
        if isinstance(message, BaseException):
            raise message
        return message

    def _waiting_for(self) -> tuple[int, str]:
        """For the watchdog: the element the consumer waits for."""
        where = "was restored" if self._restored else "started"
        return 0, (
            f"element {self._handed_out_count} of its share (counted from where this "
            f"iterator {where})"
        )

    def _take_side_message(self, kind: int, value: Any, extra: Any) -> None:
        answers = receive_side_message(kind, value, extra, self, self._warning_registry)
        if answers is not None:
            self._stats_answered = answers

    def request_worker_stages(self) -> None:
        """Asks the worker for its stage statistics (``observe.stages.refresh_worker_stages``)."""
        if self._pool is not None and not self._closed and self._error is None:
            self._stats_requests += 1
            self._pool.send(0, stats_request_message(self._stats_requests))

    def receive_worker_stages(self, deadline: float | None = None) -> None:
        """Reads the worker's messages until it has answered the last request (or until
        ``time.monotonic()`` reaches ``deadline``); elements read meanwhile wait in order for
        ``__next__``."""
        pool = self._pool
        while pool is not None and self._stats_answered < self._stats_requests:
            if self._early and isinstance(self._early[-1], BaseException):
                return  # the worker has ended, or its stream cannot be read further
            try:
                if deadline is not None and not pool.ready_workers(
                    max(0.0, deadline - time.monotonic())
                ):
                    return
                message = pool.recv(0)
            except (WorkerDiedError, UnreadableElementError) as e:
                self._early.append(e)  # raised by __next__ after what came before it
                continue
            generation, kind, value, extra, _, _ = message
            if generation == STATS_GENERATION:
                self._take_side_message(kind, value, extra)
            else:
                self._early.append(message)

    def _hand_out_pickled(self) -> Any:
        blob = self._received.popleft()
        try:
            element, state = pickle.loads(blob)
        except Exception as e:
            self._received.clear()  # the stream stops at this element
            self._error = unreadable_element_error(f"{self._index} of {self._count}", e)
            raise self._error from e
        self._handed_out(state)
        return element

    def _handed_out(self, state: Any) -> None:
        """An element goes to the consumer; ``state`` is the worker's after it."""
        self._state = state
        self._outstanding -= 1
        self._handed_out_count += 1
        owed = self._buffer - self._outstanding
        if owed >= self._grant_batch:
            self._grant(owed)

    def get_state(self) -> dict[str, Any]:
        if self._state is None:
            # Before the first element: build this worker's pipeline here only to read its
            # initial state; no process starts.
            engine = self._engine
            worker_ds = engine.nodes.worker_share(
                engine.pipeline, self._index, self._count, engine.sequential_slice, False
            )
            it = iter(worker_ds)
            self._state = it.get_state()
            it.close()
        return copy.deepcopy(self._state)

    def _get_next_index(self) -> int:
        return share_next_index(self._engine, self._index, self._count, self.get_state())

    def _set_next_index(self, index: int) -> None:
        self.set_state(share_state_at(self._engine, self._index, self._count, index))

    def set_state(self, state: dict[str, Any]) -> None:
        if isinstance(self._error, WorkerDiedError):
            raise self._error
        self._state = copy.deepcopy(state)
        self._handed_out_count = 0
        self._restored = True
        self._exhausted = False
        self._error = None
        self._received.clear()
        if self._pool is None:
            self._start_when_restored()
            return
        released = self._drop_messages_in_flight()
        self._generation += 1
        message = set_state_message(self._generation, self._state, self._buffer, released)
        self._pool.send(0, message)
        self._outstanding = self._buffer

    def _drop_messages_in_flight(self) -> list[str]:
        """Reads what the worker has sent and the consumer will now never see, and returns the
        blocks to hand back with ``set_state``: restoring again and again without reading
        would otherwise leave a buffer's worth of blocks in the pipe each time.

        Raises:
          WorkerDiedError: The worker process ended.
        """
        pool = self._pool
        assert pool is not None
        try:
            while self._early or pool.ready_workers():
                try:
                    message = self._recv(pool) if self._early else pool.recv(0, ready=True)
                except UnreadableElementError:
                    continue  # dropped anyway
                generation, kind, element, extra, names, dropped = message
                self._recycled.forget(dropped)
                if generation == STATS_GENERATION:
                    self._take_side_message(kind, element, extra)
                else:
                    self._recycled.released.extend(names)
        except WorkerDiedError as e:
            self._error = e
            raise
        return self._recycled.take_released()

    def close(self) -> None:
        if self._closed:
            return
        if self._pool is not None and pipeline_observer().tracks(self):
            # Tracked: the worker's last statistics and trace spans reach the parent (its wait
            # since END included). A worker busy in a long function gets the time shutting it
            # down would give it.
            self.request_worker_stages()
            self.receive_worker_stages(time.monotonic() + STOP_TIMEOUT_S)
        if self._finalizer is not None:
            self._finalizer()
        super().close()

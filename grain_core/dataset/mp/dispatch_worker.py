"""The worker side of dispatch (``dispatch.py``): a worker computes the runs of positions the
parent assigns, in assignment order (``positions.PositionReader``), and sends each result with
its CPU seconds so far, results already read several to a message
(``protocol.elements_message``). An error is sent for its position and the worker goes on
with the next one.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from typing import Any

from grain_core._ipc import shm
from grain_core.dataset.mp.pickling import FIXED_SIZE_TYPES, dumps_message
from grain_core.dataset.mp.protocol import elements_message
from grain_core.dataset.mp.worker import GROUP_S, WorkerLoop, WorkerSpec, run_worker
from grain_core.dataset.transfer_cost import OVERDRAFT_BYTES

__all__ = ["DispatchWorkerLoop", "worker_main"]


class DispatchWorkerLoop(WorkerLoop):
    """A worker of the dispatching engine.

    It computes the runs of positions the parent assigns, in assignment order, and sends each
    element with the CPU seconds the worker has used in this generation so far instead of a
    state (the parent knows every position). An
    error is sent for its position and the worker goes on with the next one: another class's
    positions queued behind it are still needed.

    It computes the positions assigned ahead (``PositionReader``: in its main thread while
    reads are CPU-bound, also while it waits for credits; on read threads while they wait on
    I/O); results are sent while it has credits, so the shared memory in flight stays bounded
    however long the runs, and small ones also on overdraft (``per_worker_buffer_size`` 0:
    never).

    Control: ``assign_message(generation, runs, credits, names)`` adds runs ``(class, first slice
    index, count)`` and credits and hands back blocks; a new generation first drops the runs
    not yet computed and the credits left.
    """

    def __init__(self, spec: WorkerSpec, control: Any, output: Any) -> None:
        super().__init__(spec, control, output)
        self._reader: Any = None
        self._pending = 0
        self._cpu_start = time.process_time()
        self._result_bytes = 0  # pickled, per result of the last message without blocks

    def _build_pipeline(self, ds: Any) -> None:
        spec = self._spec
        self._reader = self._it = spec.nodes.position_reader(
            ds, spec.index, spec.count, spec.options
        )
        self._cpu_start = time.process_time()  # start-up is not the cost of an element

    def _pipeline(self) -> Any:
        return None if self._reader is None else self._reader.pipeline

    def _has_work(self) -> bool:
        return self._pending > 0

    def _ask_for_credit(self) -> None:
        """The parent sends credits through the positions it waits for (``_unblock``)."""

    def _read_ahead(self) -> bool:
        # Positions assigned, no credit to send them: compute them now, as read threads would.
        return self._pending > 0 and self._reader is not None and self._reader.read_ahead()

    def _handle(self, message: tuple[Any, ...]) -> None:
        _, generation, runs, credits, names = message  # assign_message, the only kind
        shm.release_blocks(names)
        if generation != self._generation:
            self._generation = generation
            # CPU seconds count per generation: the parent that sizes runs by them (a new
            # iterator on kept workers, or a restore) starts counting at zero.
            self._cpu_start = time.process_time()
            self._pending = 0
            self._reset_credits(0)
            if self._reader is not None:
                self._reader.reset()
        self._add_credits(credits)
        if runs:
            self._pending += sum(run[2] for run in runs)
            if self._reader is not None:
                self._reader.assign(runs)

    def _produce(self) -> None:
        if self._build_error is not None:
            self._pending -= 1
            self._take_credit(0)
            self._send_error(self._build_error)
            return
        # Elements read already (ahead, or in the block of the last one) go together (for
        # GROUP_S at most), those in shared memory too: each message costs the parent a
        # wake-up, and a worker that waited for credits has several ready when they come.
        group: list[Any] = []
        names_of: list[list[str]] = []  # per element of the group: its blocks
        deadline = time.perf_counter() + GROUP_S
        waiting, self._waiting = self._waiting, None
        while True:
            if waiting is None:
                self._pending -= 1
                try:
                    element = self._reader.next()
                except Exception as e:  # noqa: BLE001 - re-raised in the parent at its position
                    self._take_credit(0)
                    self._send_group(group, names_of)
                    self._send_error(e)
                    return
                tree, names = shm.copy_to_shm(element, self._min_shm_size)
                # Its size matters only for an overdraft.
                size = 0 if self._credits > 0 else self._size_for_overdraft(tree, names)
                if not self._take_credit(size):
                    self._waiting = (tree, names, size)
                    self._send_group(group, names_of)
                    return
            else:  # _can_produce found it may go now
                (tree, names, size), waiting = waiting, None
                self._take_credit(size)
            group.append(tree)
            names_of.append(names)
            if not (
                self._pending > 0
                and (self._credits > 0 or self._may_overdraw())
                and self._reader.ready()
                and time.perf_counter() < deadline
            ):
                self._send_group(group, names_of)
                return

    def _cpu_seconds(self) -> float:
        # The process's CPU time so far, read threads included: what the parent sizes this
        # worker's commitments by.
        return time.process_time() - self._cpu_start

    def _send_group(self, group: list[Any], names_of: list[list[str]]) -> None:
        """Sends the elements of ``group`` (element ``i``'s arrays in blocks ``names_of[i]``)
        in one message, or one message each when one of them cannot be pickled (that one is
        sent as its error)."""
        if not group:
            return
        cpu_seconds = self._cpu_seconds()
        dropped: Sequence[str] = shm.take_dropped()
        if len(group) > 1:
            shared = any(names_of)
            message = elements_message(
                self._generation, group, cpu_seconds, dropped, names_of if shared else None
            )
            try:
                data = dumps_message(message)
            except Exception:  # noqa: BLE001 - one of them cannot be pickled: each alone below
                pass
            else:
                self._write(data)
                if not shared:
                    self._result_bytes = len(data) // len(group)
                return
        for element, names in zip(group, names_of, strict=True):  # one, or one unpicklable
            self._send_result(element, cpu_seconds, names, dropped)
            dropped = ()

    def _send_result(
        self, tree: Any, cpu_seconds: float, names: list[str], dropped: Sequence[str] = ()
    ) -> None:
        """Sends one result (see ``_send_element``); one that cannot be pickled is sent as its
        error and the worker goes on with the next position."""
        size = self._send_element(tree, cpu_seconds, names, dropped)
        if size is not None and not names:
            self._result_bytes = size

    def _size_for_overdraft(self, tree: Any, names: list[str]) -> int | None:
        """The pickled size of result ``tree``; None (it waits for a credit) if its arrays
        are in blocks ``names``, it cannot be pickled, or the last results were too big to
        overdraw a few (such results are not pickled twice)."""
        if names or self._result_bytes > OVERDRAFT_BYTES // 4:
            return None
        if type(tree) in FIXED_SIZE_TYPES:
            return 0
        try:
            return len(pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001 - it is sent when a credit comes, and fails there
            return None


def worker_main(spec: WorkerSpec, control: Any, output: Any) -> None:
    """Entry point of a dispatching worker process."""
    run_worker(DispatchWorkerLoop, spec, control, output)

"""The messages between an ``mp_prefetch`` parent and its workers, shared by both engines.

One kind convention everywhere: a message is a plain tuple whose kind is a small int, pickled
once (``pickling.dumps_message``) and sent as bytes over the worker's pipes
(``grain_core._ipc.pool``).

* Control (parent → worker): ``(kind, ...)``: ``CREDIT`` and ``SET_STATE`` for strict
  rotation (``rotation.py``), ``ASSIGN`` for dispatch (``dispatch.py``), and
  ``STATS_REQUEST`` for both. No message stops a worker: the parent closes its control pipe
  (``WorkerPool.shutdown``).
* Output (worker → parent): ``(generation, kind, payload, extra, shm_names, dropped)``, six
  fields always, so one unpacking reads any of them. ``generation`` counts the parent's
  restores (a message of an older one is discarded, its blocks freed); ``extra`` is the
  worker's state after the element (rotation) or its CPU seconds in this generation (dispatch);
  ``shm_names`` are the blocks holding the element's arrays; ``dropped`` the blocks the
  worker freed (the parent forgets its mappings of them). Here: ``ELEMENT``, ``ERROR``, and
  the side messages ``STATS`` and ``WARNING`` (generation ``STATS_GENERATION``, which no
  restore has, so the element path never looks at them; ``receive_side_message`` reads
  them). A worker sends ``STATS`` before ``END`` and ``ERROR``, and in answer to
  ``STATS_REQUEST`` (``extra`` then is the request's number, the snapshot None if the worker
  does not track its stages): the parent asks whenever it reports (an execution summary, the
  dataset graph, a trace) and waits for the answers, so what it shows is what the workers had
  done when it asked, never an older snapshot. Rotation adds ``END``, ``PICKLED_ELEMENTS`` and ``WANTS_CREDIT``; dispatch adds
  ``ELEMENTS`` (several results in one message; ``shm_names`` then lists each one's blocks).

Kinds are numbered here for both engines so that no two mean the same.

Flow control, decided alike on both sides: a worker sends against credits (the parent grants
``per_worker_buffer_size`` and returns one for each element handed out). An element that
needs no shared memory may also go without a credit, while the worker's *overdraft*
(elements sent beyond its credits, which the next credits cover first) stays within
``SMALL_AHEAD`` elements and ``OVERDRAFT_BYTES`` pickled (``overdraft_room``, defined with
the transport's cost in ``dataset/transfer_cost.py``, which prices it); credits then
go back in batches (``credit_batch``). A dispatching parent also grants more credits than
``per_worker_buffer_size`` for results in shared memory while ``SHARED_AHEAD_BYTES`` holds
them (``shared_ahead_room``): cheap elements then travel several per wake-up of the worker,
not one.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from grain_core._ipc.errors import ErrorPayload
from grain_core.dataset.iterator import DatasetIterator, pipeline_observer
from grain_core.dataset.transfer_cost import SMALL_AHEAD

__all__ = [
    "ASSIGN",
    "CREDIT",
    "ELEMENT",
    "ELEMENTS",
    "END",
    "ERROR",
    "PICKLED_ELEMENTS",
    "SET_STATE",
    "SHARED_AHEAD_BYTES",
    "STATS",
    "STATS_GENERATION",
    "STATS_REQUEST",
    "WANTS_CREDIT",
    "WARNING",
    "assign_message",
    "credit_batch",
    "element_block_names",
    "element_message",
    "elements_message",
    "error_message",
    "receive_side_message",
    "shared_ahead_room",
    "stats_message",
    "stats_request_message",
    "warning_message",
]

# Control kinds (parent → worker). STATS_REQUEST: both engines.
CREDIT, SET_STATE, ASSIGN, STATS_REQUEST = range(4)
# Output kinds (worker → parent). END, PICKLED_ELEMENTS, WANTS_CREDIT: rotation only;
# ELEMENTS: dispatch only.
ELEMENT, END, ERROR, STATS, ELEMENTS, WARNING, PICKLED_ELEMENTS, WANTS_CREDIT = range(8)

#: Generation of side messages (statistics, warnings): no restore's (they count up from 0).
STATS_GENERATION = -1

#: Shared memory a dispatching worker's results may hold beyond those the consumer took, when
#: ``per_worker_buffer_size`` results hold less: with one 400 KB batch ahead per worker (the
#: default buffer), two workers waited on the parent's wake-up after every batch and
#: delivered MNIST-like batches at half the rate of one process; 4 MiB is 10 such batches.
SHARED_AHEAD_BYTES = 4 * 1024 * 1024


def shared_ahead_room(result_bytes: int) -> int:
    """How many results of ``result_bytes`` bytes in shared memory a dispatching worker may
    have sent beyond those consumed, by ``SHARED_AHEAD_BYTES`` (``SMALL_AHEAD`` at most)."""
    return min(SMALL_AHEAD, SHARED_AHEAD_BYTES // max(1, result_bytes))


def credit_batch(buffer_size: int, room: int = 0) -> int:
    """How many credits a parent returns in one message to a worker with
    ``per_worker_buffer_size`` ``buffer_size`` whose elements may overdraw by ``room``
    (``overdraft_room``; 0 for elements in shared memory): half the buffer, or half the
    overdraft, which carries the worker meanwhile, and at least one. (A message per element
    halved the parent's rate of small elements; a quarter of the overdraft at a time cost
    both engines 15-20%.)"""
    return max(1, buffer_size // 2, room // 2)


# ---------------------------------------------------------------------------- builders
def stats_request_message(number: int) -> tuple[Any, ...]:
    """Control: send the stage statistics now, answering request ``number``."""
    return (STATS_REQUEST, number)


def assign_message(
    generation: int, runs: list[tuple[int, int, int]], credits: int, names: list[str]
) -> tuple[Any, ...]:
    """Control: runs ``(class, first slice index, count)`` to compute after those assigned
    before, ``credits`` more results to send, blocks ``names`` free again. A new
    ``generation`` first drops the runs not yet computed and the credits left."""
    return (ASSIGN, generation, runs, credits, names)


def elements_message(
    generation: int,
    values: list[Any],
    cpu_seconds: float,
    dropped: Sequence[str],
    names: list[list[str]] | None = None,
) -> tuple[Any, ...]:
    """Output: results of consecutive assigned positions; ``names``, where some are in shared
    memory, the blocks of each (``[]`` where none is: no list per value)."""
    return (generation, ELEMENTS, values, cpu_seconds, names or [], dropped)


def element_block_names(kind: int, count: int, names: list[Any]) -> list[list[str]]:
    """The blocks of each of the ``count`` results of an output message of ``kind``
    (``ELEMENT`` or ``ELEMENTS``) whose ``shm_names`` field is ``names``."""
    if kind != ELEMENTS:
        return [names]
    return names or [[] for _ in range(count)]


def element_message(
    generation: int, value: Any, extra: Any, names: list[str], dropped: Sequence[str]
) -> tuple[Any, ...]:
    """Output: one element (its arrays in blocks ``names``), with the engine's ``extra``."""
    return (generation, ELEMENT, value, extra, names, dropped)


def error_message(
    generation: int, error: ErrorPayload, dropped: Sequence[str] = ()
) -> tuple[Any, ...]:
    """Output: what producing the next element raised (``_ipc.errors.error_payload``)."""
    return (generation, ERROR, error, None, (), dropped)


def stats_message(snapshot: Any, answers: int | None = None) -> tuple[Any, ...]:
    """Output, side: the worker pipeline's stage statistics (None: it does not track them),
    answering request number ``answers`` (None: sent unasked)."""
    return (STATS_GENERATION, STATS, snapshot, answers, (), ())


def warning_message(
    category: type[Warning], text: str, filename: str, lineno: int
) -> tuple[Any, ...]:
    """Output, side: a warning the worker's filters let through, issued again in the parent."""
    return (STATS_GENERATION, WARNING, (category, text, filename, lineno), None, (), ())


# ----------------------------------------------------------------------------- readers
def receive_side_message(
    kind: int,
    value: Any,
    extra: Any,
    iterator: DatasetIterator[Any] | None,
    registry: dict[Any, Any],
) -> int | None:
    """Takes a side message (generation ``STATS_GENERATION``): statistics go to ``iterator``
    (if it is still there), a warning is issued again in this process under its filters
    (``pytest.warns``, ``-W error``, ``logging.captureWarnings`` see it), ``registry`` (one per
    iterator) showing a warning at one place once across all workers.

    Returns:
      The number of the ``STATS_REQUEST`` the message answers, or None.
    """
    if kind == STATS:
        if iterator is not None and value is not None:
            pipeline_observer().receive_worker_snapshot(iterator, value)
        return extra  # type: ignore[no-any-return]
    if kind == WARNING:
        category, text, filename, lineno = value
        warnings.warn_explicit(text, category, filename, lineno, registry=registry)
    return None

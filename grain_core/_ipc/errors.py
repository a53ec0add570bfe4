"""Errors across the process boundary: a worker's exception sent as bytes and rebuilt in the
parent with its type and traceback, and the parent's own errors about its workers."""

from __future__ import annotations

import pickle
import traceback
from typing import Any

__all__ = [
    "ErrorPayload",
    "UnreadableElementError",
    "WorkerDiedError",
    "WorkerStalledError",
    "error_payload",
    "remote_error",
    "unreadable_element_error",
]

#: A worker's exception on the wire: pickled (None if its type cannot travel), its type's
#: qualified name, its message and its formatted traceback.
ErrorPayload = tuple[bytes | None, str, str, str]


class WorkerDiedError(RuntimeError):
    """A worker process ended without being asked to."""


class WorkerStalledError(RuntimeError):
    """A worker sent nothing the parent waits for within the stall deadline
    (``MultiprocessingOptions.stall_timeout_s``); it is left running."""


class UnreadableElementError(RuntimeError):
    """A worker sent an element that cannot be unpickled in the parent: the message, and any
    elements with it, are lost, so the iterator stops at it until ``set_state``."""


def unreadable_element_error(worker: str, error: Exception) -> UnreadableElementError:
    """The error for worker ``worker``'s message that unpickling failed on with ``error``."""
    return UnreadableElementError(
        f"Worker process {worker} sent an element that cannot be unpickled in the main "
        f"process: {type(error).__name__}: {error}. The iterator stops here (restore a "
        "checkpoint with set_state to go on). Elements must be rebuilt in the main process "
        "from their pickle: NumPy arrays and plain Python values always can be."
    )


def error_payload(error: BaseException) -> ErrorPayload:
    """``error`` as a worker sends it (``remote_error`` rebuilds it in the parent)."""
    tb = "".join(traceback.format_exception(error))
    name = f"{type(error).__module__}.{type(error).__qualname__}"
    return _pickled_error(error), name, str(error), tb


def remote_error(
    payload: ErrorPayload, index: int, count: int, where: str | None = None
) -> BaseException:
    """The exception worker ``index`` of ``count`` sent (``error_payload``), with its type
    when it can be unpickled here (else a ``RuntimeError`` naming it), noted with the worker's
    traceback and ``where`` it ran (default: a local worker process)."""
    exc_bytes, type_name, message, tb = payload
    error: BaseException | None = None
    if exc_bytes is not None:
        try:
            error = pickle.loads(exc_bytes)
        except Exception:  # noqa: BLE001 - fall back to a text description
            error = None
    if error is None:
        error = RuntimeError(f"{type_name}: {message}")
    if where is None:
        where = f"mp_prefetch worker process {index} of {count}"
    error.add_note(f"Raised in {where}. Worker traceback:\n{tb}")
    return error


def _pickled_error(error: BaseException) -> bytes | None:
    """``error`` pickled so that the parent gets its type back: as it is; else rebuilt without
    its ``__init__`` (one whose parameters are not its ``args``), with its attributes, then
    without them; None if even its type cannot travel (it goes as text)."""
    import cloudpickle  # import cost: only a worker that fails needs it

    for candidate in (error, _Uninitialised(error, True), _Uninitialised(error, False)):
        try:
            data: bytes = cloudpickle.dumps(candidate)
            pickle.loads(data)
        except Exception:  # noqa: BLE001 - the next, plainer form
            continue
        return data
    return None


class _Uninitialised:
    """Pickles as its exception rebuilt from its type and ``args`` without calling ``__init__``
    (and its attributes, with ``attributes``)."""

    def __init__(self, error: BaseException, attributes: bool) -> None:
        self.error = error
        self.attributes = attributes

    def __reduce__(self) -> tuple[Any, ...]:
        error = self.error
        state = dict(vars(error)) if self.attributes else {}
        return (_uninitialised_error, (type(error), error.args, state))


def _uninitialised_error(
    cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]
) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error

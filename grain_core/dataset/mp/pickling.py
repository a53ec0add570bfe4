"""Pickling for ``mp_prefetch``: the pipeline and ``worker_init_fn`` sent to the workers, and
the messages on the element path.

Large NumPy arrays of the pipeline (an in-memory source's data) go to the workers in shared
memory: copied once into a block that every worker maps read-only, instead of pickled into
the pipeline, written through the worker server's pipe and unpickled once per worker (the
47 MB of an MNIST-like source took 0.2 s per worker that way).

Messages are pickled with the standard pickler (cloudpickle only for what it cannot do:
lambdas and local classes in an element), and NumPy number scalars, often an element's label
or id, as their type and Python value in workers.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import marshal
import pickle
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np

from grain_core._ipc import shm
from grain_core.options import MultiprocessingOptions

if TYPE_CHECKING:
    from grain_core.dataset.base import IterDataset
    from grain_core.dataset.mp.positions import DispatchView, PositionReader

__all__ = [
    "FIXED_SIZE_TYPES",
    "EngineInput",
    "PipelineNodes",
    "dumps",
    "dumps_message",
    "pickle_init_fn",
    "pickle_pipeline",
    "register_numpy_scalar_reducers",
]

#: Types whose values pickle to a few bytes: no pickle is needed to know they are small.
FIXED_SIZE_TYPES = frozenset({int, float, bool, complex, type(None)})

#: Arrays in a pipeline at least this large travel to the workers in shared memory, read-only.
SHARED_ARRAY_MIN_BYTES = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class PipelineNodes:
    """The dataset nodes the engines build from their pipeline: built by the dataset side
    (``positions.PIPELINE_NODES``) and handed to the engines in ``EngineInput.nodes``, so no
    engine imports an operator. Module-level functions and classes: a worker gets them
    pickled by reference.

    Attributes:
      worker_share: ``(pipeline, index, count, sequential_slice, shared_memory)``: worker
        ``index`` of ``count``'s share of the pipeline; with ``shared_memory``, its final
        batch is written into shared memory.
      dispatch_view: ``(pipeline, count)``: how dispatching workers compute the pipeline by
        position (a ``positions.DispatchView``), or None when they cannot.
      position_reader: ``(pipeline, index, count, options, shared_memory=True)``: a
        dispatching worker's reader of its assigned positions.
    """

    worker_share: Callable[[IterDataset[Any], int, int, bool, bool], IterDataset[Any]]
    dispatch_view: Callable[[IterDataset[Any], int], DispatchView | None]
    position_reader: Callable[..., PositionReader]


@dataclasses.dataclass(eq=False)
class EngineInput:
    """What an ``mp_prefetch`` engine runs, built once by ``mp_prefetch``'s dataset.

    Attributes:
      pipeline: The pipeline the workers run.
      options: Worker count, buffer, backend and watchdog thresholds.
      nodes: What builds the nodes the engines run from ``pipeline`` (worker shares, the
        dispatch view, the position reader).
      sequential_slice: Workers take contiguous blocks instead of strided shares.
      worker_init_fn: Called in each worker before the pipeline is unpickled.
      share_arrays: Large arrays of the pipeline go to the workers in shared memory (workers
        on this host).
      warm_workers: Where iterators leave their local workers for the next one
        (``MultiprocessingOptions.persistent_workers``, a ``worker.WarmWorkers``); None: each
        iterator stops its own.
    """

    pipeline: IterDataset[Any]
    options: MultiprocessingOptions
    nodes: PipelineNodes
    sequential_slice: bool = False
    worker_init_fn: Callable[[int, int], None] | None = None
    share_arrays: bool = True
    warm_workers: Any = dataclasses.field(default=None, repr=False)
    _payload: tuple[bytes, bytes | None] | None = dataclasses.field(
        default=None, init=False, repr=False
    )

    @property
    def num_workers(self) -> int:
        return self.options.num_workers

    def payload(self) -> tuple[bytes, bytes | None]:
        """The cloudpickled pipeline and ``worker_init_fn``, computed once.

        Raises:
          Exception: The pickling error, with a note naming the first node that cannot be
            pickled.
        """
        if self._payload is None:
            dataset, blocks = pickle_pipeline(self.pipeline, share_arrays=self.share_arrays)
            if blocks:
                # Workers started from this payload map these blocks; every engine holds this
                # input, so the blocks outlive every worker that may start from them.
                weakref.finalize(self, shm.unlink_shm, blocks)
            init = None if self.worker_init_fn is None else pickle_init_fn(self.worker_init_fn)
            self._payload = (dataset, init)
        return self._payload

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_payload": None, "warm_workers": None}


def dumps(message: tuple[Any, ...]) -> bytes:
    """``message`` pickled by the standard pickler (control messages, plain values)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def dumps_message(message: tuple[Any, ...]) -> bytes:
    """``message`` pickled; with cloudpickle when it holds what the standard pickler refuses.

    Raises:
      Exception: What cloudpickle raised (something in it cannot be pickled at all).
    """
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - lambdas and local classes need cloudpickle
        return cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[no-any-return]


def register_numpy_scalar_reducers() -> None:
    """Pickles NumPy number scalars as their type and Python value in this process.

    NumPy's own reduction pickles the scalar's dtype object with it: 5.8 us to pickle and 3.3
    to unpickle an ``np.int64`` in a message, against 2.0 and 2.2 this way (elements are often
    scalars, a label or an id). The value round-trips exactly: ``item()`` is lossless for these
    types but for the bits of a NaN, which go as bytes (``longdouble`` is left out, it has no
    lossless Python value).
    """
    for cls in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
    ):  # fmt: skip
        copyreg.pickle(cls, _reduce_numpy_scalar)


def _reduce_numpy_scalar(value: Any) -> tuple[Any, tuple[Any, ...]]:
    item = value.item()
    if item != item:  # a NaN: a Python float would make a signalling one quiet
        return _numpy_scalar_from_bytes, (value.dtype.str, value.tobytes())
    return type(value), (item,)


def _numpy_scalar_from_bytes(dtype: str, data: bytes) -> Any:
    return np.frombuffer(data, dtype)[0]


class _PipelinePickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, keeping the file name of the code of functions it pickles by value (those
    of ``__main__`` or of a file run by path), which cloudpickle replaces by
    ``<dynamic-code>``: worker tracebacks and stage names then show the user's file and line.
    The workers run the parent's interpreter, so the code goes as ``marshal`` writes it."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)


class _SharingPickler(_PipelinePickler):
    """The pipeline pickler, with large plain NumPy arrays copied into shared-memory blocks
    (named in ``blocks``) and pickled as the block's name: a worker maps the block read-only."""

    def __init__(self, file: io.BytesIO, blocks: list[str]) -> None:
        super().__init__(file)
        self._blocks = blocks

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is np.ndarray  # not a subclass (a memmap, a SharedMemoryArray)
            and obj.nbytes >= SHARED_ARRAY_MIN_BYTES
            and not obj.dtype.hasobject
            and shm.AVAILABLE
        ):
            try:
                name = shm.copy_into_block(obj)
            except shm.SharedMemoryFullError as e:
                shm.warn_full(e)
            else:
                self._blocks.append(name)
                return shm.attach_read_only, (name, obj.shape, obj.dtype)
        return super().reducer_override(obj)


def pickle_pipeline(ds: IterDataset[Any], share_arrays: bool = True) -> tuple[bytes, list[str]]:
    """``ds`` pickled for the workers, and the shared-memory blocks holding its large arrays
    (the caller unlinks them when no worker will start from these bytes any more).

    Args:
      ds: The pipeline.
      share_arrays: Large arrays go in shared-memory blocks (workers on this host); False:
        pickled with the pipeline (workers elsewhere).

    Raises:
      Exception: The pickling error, with a note naming the first node that cannot be
        pickled.
    """
    blocks: list[str] = []
    buffer = io.BytesIO()
    try:
        if share_arrays:
            _SharingPickler(buffer, blocks).dump(ds)
        else:
            _PipelinePickler(buffer).dump(ds)
        return buffer.getvalue(), blocks
    except Exception as e:
        shm.unlink_shm(blocks)
        node = _first_unpicklable_node(ds)
        if node is not None:
            e.add_note(
                f"Dataset: {node!r} cannot be pickled! Everything in an mp_prefetch pipeline "
                "is sent to worker processes: make its transformations picklable (module-level "
                "functions or classes, no open files, locks or generators)."
            )
        raise


def pickle_init_fn(init_fn: Callable[[int, int], None]) -> bytes:
    buffer = io.BytesIO()
    try:
        _PipelinePickler(buffer).dump(init_fn)
        return buffer.getvalue()
    except Exception as e:
        e.add_note(
            f"worker_init_fn {init_fn!r} cannot be pickled! It is sent to every worker "
            "process: make it a module-level function (or a picklable callable) that opens "
            "what it needs (files, locks, connections) inside the worker."
        )
        raise


def _first_unpicklable_node(root: Any) -> Any:
    """The most upstream node that fails to pickle on its own (other nodes stubbed out)."""
    order: list[Any] = []
    seen: set[int] = set()

    def visit(node: Any) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        for parent in getattr(node, "_parents", ()):
            visit(parent)
        order.append(node)

    visit(root)

    class _OneNodePickler(cloudpickle.Pickler):  # type: ignore[misc]
        def __init__(self, target: Any) -> None:
            super().__init__(io.BytesIO())
            self._target = target

        def persistent_id(self, obj: Any) -> Any:
            if obj is not self._target and id(obj) in seen:
                return id(obj)
            return None

    for node in order:
        try:
            _OneNodePickler(node).dump(node)
        except Exception:  # noqa: BLE001 - this is the search for the failure
            return node
    return None

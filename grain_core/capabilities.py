"""Optional capabilities: what a dataset, batch function, source or sampler may offer beyond
its base protocol, each a named ``Protocol``.

grain_core checks them with ``isinstance`` when a graph is built or an object is taken in
(never per element), and uses the capability when it is there. Plugins and users implement
them by defining the methods; no base class is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from grain_core.dataset.iterator import ElementBlock

T = TypeVar("T")

__all__ = [
    "BatchFunctionOutputSpec",
    "BatchedReadSource",
    "BatchMapping",
    "BatchedTransform",
    "Batching",
    "BytesState",
    "CheckpointAliases",
    "ColumnBlockReading",
    "ColumnBlockStacking",
    "ColumnReadSource",
    "FanOutBounded",
    "FunctionBatching",
    "GrainBatchedReadSource",
    "HoleMaking",
    "InPlaceSliceable",
    "MetadataBlockSampler",
    "RecordKeysSampler",
    "RecordRngDeclaring",
    "SameStateEverywhere",
    "ShardStateCheckpointing",
    "ShardStateOwner",
    "SharedMemoryBatchFn",
    "SupportsNextBlock",
    "TransformApplying",
    "TransformOutputSpec",
    "WorkerSliceable",
]


@runtime_checkable
class WorkerSliceable(Protocol):
    """An ``IterDataset`` source that makes a copy of itself reading only a slice of its inputs
    (files, datasets): how worker processes, threads and elastic shards split it."""

    def with_slice(self, sl: slice) -> Any:
        """A copy reading the inputs ``sl`` selects (``slice(index, None, count)``)."""
        ...


@runtime_checkable
class InPlaceSliceable(Protocol):
    """Grain's spelling of ``WorkerSliceable``: slices its inputs in place (grain_core calls it
    on a copy)."""

    def set_slice(self, sl: slice) -> None:
        """Reads only the inputs ``sl`` selects from now on."""
        ...


@runtime_checkable
class SharedMemoryBatchFn(Protocol):
    """A batch function that can write its output straight into shared memory, used when the
    batch is the last step inside a worker process."""

    def __call__(self, values: Sequence[Any]) -> Any: ...

    def enable_shared_memory_output(self) -> None:
        """Makes this (a copy, in the worker) write its batches into shared memory."""
        ...


@runtime_checkable
class ColumnReadSource(Protocol):
    """A random-access source that reads records column-wise, as one dict of columns per
    batch of keys (the DataLoader and ``to_iter_dataset`` batch them without stacking)."""

    def read_columns(self, record_keys: Sequence[int]) -> Any:
        """The records ``record_keys`` as columns."""
        ...


@runtime_checkable
class BatchedReadSource(Protocol):
    """A random-access source that reads many records in one call (array_record's and
    PyTorch's spelling): blocks of keys are read with it instead of one ``[key]`` each."""

    def __getitems__(self, record_keys: Sequence[int]) -> Sequence[Any]:
        """The records ``record_keys``, in order."""
        ...


@runtime_checkable
class GrainBatchedReadSource(Protocol):
    """Google Grain's spelling of ``BatchedReadSource`` (used where ``__getitems__`` is
    missing)."""

    def _getitems(self, record_keys: Sequence[int]) -> Sequence[Any]:
        """The records ``record_keys``, in order."""
        ...


@runtime_checkable
class TransformOutputSpec(Protocol):
    """A map transform that says what it makes of an element spec, so ``get_element_spec``
    answers without reading data."""

    def output_spec(self, input_spec: Any) -> Any:
        """The PyTree of ``ShapeDtypeStruct`` the transform produces from ``input_spec``."""
        ...


@runtime_checkable
class BatchFunctionOutputSpec(Protocol):
    """A custom ``batch_fn`` that says what spec its batches have."""

    def output_spec(self, input_spec: Any, batch_size: int, drop_remainder: bool) -> Any:
        """The spec of a batch of ``batch_size`` elements of ``input_spec``."""
        ...


@runtime_checkable
class TransformApplying(Protocol):
    """A node that applies one user transform to each element (``map``, ``random_map``,
    ``map_with_index``): its element spec is the transform's ``output_spec``."""

    @property
    def transform(self) -> Any:
        """The transform as given."""
        ...


@runtime_checkable
class Batching(Protocol):
    """A node whose elements are batches of ``batch_size`` of its parent's (the last one
    smaller unless ``drop_remainder``): its element spec has that leading dimension."""

    @property
    def batch_size(self) -> int: ...

    @property
    def drop_remainder(self) -> bool: ...


@runtime_checkable
class FunctionBatching(Batching, Protocol):
    """A batching node that may take a user's ``batch_fn``: its element spec is that
    function's (``BatchFunctionOutputSpec``), wherever its batches are written."""

    @property
    def custom_batch_fn(self) -> Any:
        """The batch function as given; None for the default stacking."""
        ...


@runtime_checkable
class FanOutBounded(Protocol):
    """A ``flat_map`` transform that bounds how many elements one input becomes (a
    ``MapDataset.flat_map`` needs it: ``len`` is the bound times the parent's)."""

    max_fan_out: int


@runtime_checkable
class RecordRngDeclaring(Protocol):
    """A DataLoader operation of another library that says whether it reads a record's
    ``rng`` (one that does not say so gets one built per record, which costs tens of
    microseconds)."""

    uses_record_rng: bool


@runtime_checkable
class ShardStateCheckpointing(Protocol):
    """An iterator that ``CheckpointHandler`` saves as per-dataset shard-state files (an
    elastic iterator over an ``IterDataset``) when ``checkpoints_shard_states`` is true: it
    writes and reads its own files."""

    @property
    def checkpoints_shard_states(self) -> bool: ...

    def save_shard_checkpoint(self, directory: Any) -> None:
        """Writes the shard-state files and this shard's process file into ``directory``."""
        ...

    def restore_shard_checkpoint(self, directory: Any) -> None:
        """Restores from the files of a save of any shard count in ``directory``."""
        ...


@runtime_checkable
class SameStateEverywhere(Protocol):
    """An iterator whose state is the same on every process after the same steps (an
    ``ElasticIterator`` over a ``MapDataset``) when ``state_same_on_every_process`` is true:
    any process's checkpoint file restores it, and the files of one save must agree."""

    @property
    def state_same_on_every_process(self) -> bool: ...


@runtime_checkable
class BytesState(Protocol):
    """An iterator whose ``get_state`` gives, and ``set_state`` takes, its checkpoint file's
    text as UTF-8 bytes (a ``DataLoaderIterator``) when ``state_is_bytes`` is true; other
    iterators' states are JSON-serialisable dicts."""

    @property
    def state_is_bytes(self) -> bool: ...


@runtime_checkable
class ColumnBlockReading(Protocol):
    """A ``MapDataset`` that can read a block of elements as whole columns (a ``ColumnBlock``
    or ``StackedBlock``) under ``columns_wanted()``, when ``reads_columns`` is true."""

    @property
    def reads_columns(self) -> bool: ...


@runtime_checkable
class ColumnBlockStacking(Protocol):
    """A batch function that takes a ``ColumnBlock`` as well as a list of elements (when
    ``stacks_column_blocks`` is true): a batch over a columnar source then reads whole
    columns."""

    stacks_column_blocks: bool

    def __call__(self, values: Any) -> Any: ...


@runtime_checkable
class HoleMaking(Protocol):
    """A ``MapDataset`` that leaves holes (``None``) in its index space when
    ``creates_holes`` is true (``filter``, ``flat_map``): ``MapDataset.batch`` cannot follow
    it, and its refusal names the node by ``display_name`` (the words Google Grain uses where
    it has them, e.g. ``MapDataset.filter``)."""

    creates_holes: bool
    display_name: str


@runtime_checkable
class BatchMapping(Protocol):
    """A ``MapDataset`` whose reads of a batch's indices give that batch's values already
    mapped as one (a batched ``map``) when ``maps_batches`` is true."""

    maps_batches: bool


@runtime_checkable
class BatchedTransform(Protocol):
    """A map transform that takes a whole batch of elements at once when ``batched`` is true
    (``MapDataset.map`` then runs it once per block read)."""

    batched: bool


@runtime_checkable
class CheckpointAliases(Protocol):
    """An object named in DataLoader checkpoints that other spellings name too (e.g. Google
    Grain's ``repr`` of the same source), so their checkpoints restore."""

    def checkpoint_reprs(self) -> list[str]:
        """The other names a checkpoint may give this object."""
        ...


@runtime_checkable
class RecordKeysSampler(Protocol):
    """A sampler that gives the record keys of many indices at once, without metadata."""

    def record_keys(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``[self[i].record_key for i in indices]`` as an int64 array."""
        ...


@runtime_checkable
class MetadataBlockSampler(Protocol):
    """A sampler that gives the metadata of many indices at once."""

    def metadata_block(
        self, indices: Sequence[int] | np.ndarray, *, with_rng: bool = True
    ) -> list[Any]:
        """``[self[i] for i in indices]``; ``with_rng=False`` leaves each ``rng`` None."""
        ...


@runtime_checkable
class ShardStateOwner(Protocol):
    """An iterator that keeps its progress per input dataset, which ``ElasticIterator``
    redistributes when the number of shards changes."""

    def get_shard_states(self) -> Any:
        """The progress of each input dataset."""
        ...

    def set_shard_states(self, states: Any) -> None:
        """Restores the progress of each input dataset."""
        ...


@runtime_checkable
class SupportsNextBlock(Protocol[T]):
    """An iterator that can hand out a block of its next elements in one call.

    ``next_block`` is a faster ``next``: the elements, their order, the errors and the states
    are exactly those of calling ``next`` as many times. Consumers that move many elements at
    a time (``InterleaveIterDataset``, ``mix``, ``concatenate`` over streams) use it when
    an input's iterator has it; an iterator without it is read with ``next``.
    """

    def next_block(self, max_size: int) -> ElementBlock[T]:
        """Takes the next elements, at least one and at most ``max_size`` (>= 1).

        Afterwards the iterator stands after the block's last element. An empty block means
        the iterator is exhausted. An error that ``next`` would raise after some elements is
        raised by the call after the block that holds them.
        """
        ...

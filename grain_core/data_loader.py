"""``DataLoader``: a random-access source, a sampler and a list of transformations.

Built entirely on the Dataset API. Two layouts, chosen from the operations:

* **Index layout** (every operation is ``Map``, ``RandomMap``, ``TfRandomMap``, ``MapWithIndex``
  or ``Batch``): the whole pipeline is a ``MapDataset`` and workers take strided shares of its
  *output* elements (batches), so the output is the same for any ``worker_count`` and a
  checkpoint taken with ``N`` workers restores with ``M`` (Grain cannot; see docs/compatibility.md).
* **Stream layout** (a ``Filter``, ``FlatMap`` or legacy operation is present): records are strided across workers
  and the operations run as ``IterDataset`` steps inside each worker, as in Grain; the order and
  the checkpoint depend on ``worker_count``.

``DataLoaderIterator.get_state()`` returns Grain's version-2 JSON. Sources and samplers are
identified by a stable fingerprint (type, length and ``repr`` when the ``repr`` is stable and
short), never by a ``repr`` that embeds data or memory addresses.

Checkpoints written by Google Grain's DataLoader restore too: the source may be named as Grain
names it (``<class 'list'>``, its ``repr``, or what its ``checkpoint_reprs()`` lists), and
where Grain's workers batch their own records (several workers, a ``Batch``; their positions
then cannot be an index-layout state) the iterator continues in the stream layout, as Grain
would, with the checkpoint's worker count. With a ``FlatMap`` Grain writes the pipeline's own
state, which restores as it is (Grain gives nothing to validate it by).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_core import transforms
from grain_core._checkpoint_io import decode_state, encode_state, load_coroutine, save_coroutine
from grain_core._checks import as_int, non_negative_int
from grain_core.capabilities import (
    CheckpointAliases,
    ColumnReadSource,
    MetadataBlockSampler,
    RecordKeysSampler,
    RecordRngDeclaring,
)
from grain_core.dataset.base import DatasetIterator, Indices, IterDataset, MapDataset
from grain_core.dataset.mp import MultiprocessPrefetchIterDataset
from grain_core.dataset.ops.batch import make_batch
from grain_core.dataset.ops.flatmap import FlatMapIterDataset
from grain_core.dataset.ops.interleave import (
    interleave_input_states,
    interleave_next_input,
    interleave_state,
)
from grain_core.dataset.source import BatchedReader
from grain_core.options import MultiprocessingOptions, ReadOptions
from grain_core.record import Record, RecordMetadata
from grain_core.samplers import IndexSampler
from grain_core.sharding import NoSharding, ShardOptions

__all__ = ["DataLoader", "DataLoaderIterator", "load"]

_STATE_VERSION = 2
_ONE_TO_ONE = (
    transforms.Map,
    transforms.RandomMap,
    transforms.TfRandomMap,
    transforms.MapWithIndex,
)
_KNOWN_OPERATIONS = (*_ONE_TO_ONE, transforms.Batch, transforms.Filter, transforms.FlatMap)
_LONG_REPR = 256


def fingerprint(obj: Any) -> str:
    """A stable, short description of a source or sampler for checkpoint validation.

    Lists, tuples and arrays are described by type and length; objects whose ``repr`` is
    Python's default (it contains a memory address) by qualified type name and length; a long
    ``repr`` (which likely embeds data) by type, length and a SHA-1 of the ``repr``.
    """
    cls = type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    try:
        length: Any = len(obj)
    except TypeError:
        length = "?"
    if isinstance(obj, (list, tuple, np.ndarray)):
        return f"{cls.__qualname__}(len={length})"
    text = repr(obj)
    if cls.__repr__ is object.__repr__ or " at 0x" in text:
        return f"{name}(len={length})"
    if len(text) > _LONG_REPR:
        digest = hashlib.sha1(text.encode()).hexdigest()[:16]
        return f"{name}(len={length}, repr_sha1={digest})"
    return text


def checkpoint_names(obj: Any) -> set[str]:
    """The names a DataLoader checkpoint may give a source or sampler: its ``fingerprint``,
    the name Google Grain's DataLoader writes (``str(type(obj))`` for lists, tuples and
    arrays, else its ``repr`` unless that holds a memory address), and any the object lists
    in an optional ``checkpoint_reprs()`` (a format plugin's source gives Grain's ``repr``
    of its own source there)."""
    names = {fingerprint(obj)}
    if isinstance(obj, (list, tuple, np.ndarray)):
        names.add(str(type(obj)))
    else:
        text = repr(obj)
        if " at 0x" not in text:
            names.add(text)
    if isinstance(obj, CheckpointAliases):
        names.update(obj.checkpoint_reprs())
    return names


def _sampler_length(sampler: Any) -> int:
    try:
        return len(sampler)
    except TypeError:
        pass
    # First index where the sampler raises IndexError: exponential then binary search. One
    # that answers at sys.maxsize - 1 is infinite, as len() of an infinite dataset says.
    hi = 1
    while _has_index(sampler, hi - 1):
        if hi >= sys.maxsize:
            return sys.maxsize
        hi = min(2 * hi, sys.maxsize)
    lo = hi // 2
    while lo < hi:
        mid = (lo + hi) // 2
        if _has_index(sampler, mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _has_index(sampler: Any, index: int) -> bool:
    try:
        sampler[index]
    except IndexError:
        return False
    return True


class _SamplerMapDataset(MapDataset[Any]):
    """Local index ``i`` of shard ``s`` of ``S`` is ``Record(m, source[m.record_key])`` with
    ``m = sampler[i * S + s]``, or just ``source[m.record_key]`` without ``with_metadata``.

    Args:
      with_rng: Give each record's metadata its random generator.
      with_metadata: Produce Records; without it no metadata object is built per record (for
        pipelines whose operations never look at it).
    """

    def __init__(
        self,
        source: Any,
        sampler: Any,
        shard_options: ShardOptions,
        *,
        with_rng: bool = True,
        with_metadata: bool = True,
    ) -> None:
        super().__init__()
        self._source = source
        self._read_batch = BatchedReader(source)
        self._sampler = sampler
        self._with_rng = with_rng
        self._with_metadata = with_metadata
        # Batched forms of the sampler, when it has them (else one record at a time).
        self._record_keys = sampler.record_keys if isinstance(sampler, RecordKeysSampler) else None
        self._metadata_block = (
            sampler.metadata_block if isinstance(sampler, MetadataBlockSampler) else None
        )
        self._shard_index = shard_options.shard_index
        self._shard_count = shard_options.shard_count
        total = _sampler_length(sampler)
        count, index = self._shard_count, self._shard_index
        if shard_options.drop_remainder:
            self._len = total // count
        else:
            self._len = total // count + (1 if index < total % count else 0)

    def __len__(self) -> int:
        return self._len

    @property
    def reads_columns(self) -> bool:
        """Whether reads give the source's values alone, as a ``ColumnBlock`` when asked."""
        return not self._with_metadata and isinstance(self._source, ColumnReadSource)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        return self._getitems([index])[0]

    def _getitems(self, indices: Indices) -> Sequence[Any]:
        if self._len == 0:
            raise IndexError("The sampler yields no records for this shard.")
        local = np.asarray(indices, dtype=np.int64) % self._len
        global_indices = local * self._shard_count + self._shard_index
        record_keys = self._record_keys
        if not self._with_metadata and record_keys is not None:
            return self._read_batch(record_keys(global_indices).tolist())
        block = self._metadata_block
        if block is not None:
            metas = block(global_indices, with_rng=self._with_rng)
        else:
            metas = [self._sampler[i] for i in global_indices.tolist()]
        values = self._read_batch([m.record_key for m in metas])
        if not self._with_metadata:
            return values
        return [Record(m, v) for m, v in zip(metas, values, strict=True)]

    def __repr__(self) -> str:
        return f"_SamplerMapDataset(sampler={fingerprint(self._sampler)})"


# ------------------------------------------------------------------- record operations
class _RecordMap:
    """A 1:1 operation applied to ``Record.data``, keeping the metadata."""

    def __init__(self, op: Any) -> None:
        self._op = op
        # Chosen once: isinstance checks against the transform ABCs cost a microsecond each.
        if isinstance(op, transforms.Map):
            self._apply = self._map
        elif isinstance(op, transforms.MapWithIndex):
            self._apply = self._map_with_index
        elif isinstance(op, transforms.RandomMap):
            self._apply = self._random_map
        else:
            self._apply = self._np_random_map

    def __call__(self, record: Record[Any]) -> Record[Any]:
        return self._apply(record)

    def _map(self, record: Record[Any]) -> Record[Any]:
        return Record(record.metadata, self._op.map(record.data))

    def _map_with_index(self, record: Record[Any]) -> Record[Any]:
        meta = record.metadata
        return Record(meta, self._op.map_with_index(meta.index, record.data))

    def _random_map(self, record: Record[Any]) -> Record[Any]:
        return Record(record.metadata, self._op.random_map(record.data, self._rng(record)))

    def _np_random_map(self, record: Record[Any]) -> Record[Any]:
        return Record(record.metadata, self._op.np_random_map(record.data, self._rng(record)))

    def _rng(self, record: Record[Any]) -> np.random.Generator:
        rng = record.metadata.rng
        if rng is None:
            raise ValueError(
                f"{type(self._op).__name__} needs a random generator, but record "
                f"{record.metadata.index} has none: give the sampler a seed (e.g. "
                "IndexSampler(..., seed=42))."
            )
        return rng


class _RecordFilter:
    def __init__(self, op: transforms.Filter) -> None:
        self._op = op

    def __call__(self, record: Record[Any]) -> bool:
        return bool(self._op.filter(record.data))


class _RecordFlatMap:
    """Splits get fresh metadata ``index = parent_index * max_fan_out + k`` (no key, no rng)."""

    def __init__(self, op: transforms.FlatMap) -> None:
        self._op = op
        self.max_fan_out = op.max_fan_out

    def flat_map(self, record: Record[Any]) -> list[Record[Any]]:
        base = record.metadata.index * self.max_fan_out
        return [
            Record(RecordMetadata(index=base + k), split)
            for k, split in enumerate(self._op.flat_map(record.data))
        ]


def _batch_fn(batch_fn: Any, shared_memory: bool) -> Any:
    """The function a ``Batch`` operation stacks with: the user's or ``make_batch``, writing
    into shared memory when the batch is sent to the parent process."""
    # Shared memory (grain_core._ipc.shm) loads only for a DataLoader with workers.
    from grain_core.dataset.ops.shm_batch import shared_memory_batch_fn  # import cost

    fn = make_batch if batch_fn is None else batch_fn
    if shared_memory:
        return shared_memory_batch_fn(fn) or fn
    return fn


class _RecordBatch:
    """Batches ``data`` fields; keeps the last record's metadata without its key."""

    def __init__(self, batch_fn: Any) -> None:
        self._batch_fn = batch_fn

    def __call__(self, records: Sequence[Record[Any]]) -> Record[Any]:
        data = self._batch_fn([r.data for r in records])
        return Record(records[-1].metadata.remove_record_key(), data)


def _record_data(record: Record[Any]) -> Any:
    return record.data


def _records_per_element(operations: Sequence[Any]) -> int:
    n = 1
    for op in operations:
        if isinstance(op, transforms.Batch):
            n *= op.batch_size
    return n


def _check_operation(op: Any) -> None:
    if isinstance(op, _KNOWN_OPERATIONS) or callable(op):
        return
    raise TypeError(
        f"Unsupported DataLoader operation {op!r} ({type(op).__name__}). Use "
        "grain_core.transforms Map, RandomMap, MapWithIndex, Filter, FlatMap or Batch, or a "
        "legacy operation: a callable from an iterator of Records to an iterator of Records."
    )


class _LegacyOperationIterDataset(IterDataset[Record[Any]]):
    """Applies a legacy DataLoader operation (``Iterator[Record] -> Iterator[Record]``, such as
    ``PackAndBatchOperation``) to the records of its parent.

    The operation has no state of its own: the state is the parent's, and restoring it starts a
    new run of the operation there. Records the operation had taken but not yet emitted when
    the state was saved (a partly filled pack) are not replayed; use the Dataset API's
    packing datasets for exact checkpoints.
    """

    def __init__(self, parent: IterDataset[Record[Any]], operation: Any) -> None:
        super().__init__(parent)
        self._operation = operation

    def __iter__(self) -> _LegacyOperationIterator:
        return _LegacyOperationIterator(self._parents[0].__iter__(), self._operation)

    def __repr__(self) -> str:
        return f"LegacyOperation({self._operation!r})"


class _LegacyOperationIterator(DatasetIterator[Record[Any]]):
    def __init__(self, parent: DatasetIterator[Record[Any]], operation: Any) -> None:
        super().__init__(parent)
        self._operation = operation
        self._output: Any = None

    def __next__(self) -> Record[Any]:
        self._check_open()
        if self._output is None:
            self._output = self._start()
        return next(self._output)  # type: ignore[no-any-return]

    def _start(self) -> Any:
        usage = (
            f"A legacy DataLoader operation ({self._operation!r}) maps an iterator of Records "
            "to an iterator of Records; use transforms.Map for a function of one element."
        )
        try:
            output = self._operation(self._parents[0])
        except TypeError as e:
            e.add_note(usage)
            raise
        if not hasattr(output, "__next__"):
            raise TypeError(f"It returned {type(output).__name__}, not an iterator. {usage}")
        return output

    def get_state(self) -> dict[str, Any]:
        return self._parents[0].get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._parents[0].set_state(state)
        self._output = None


# -------------------------------------------------------------------------- DataLoader
class DataLoader:
    """Reads ``data_source`` in the order given by ``sampler`` through ``operations``.

    Args:
      data_source: Random-access source (``len`` and ``__getitem__``).
      sampler: Maps global indices to ``RecordMetadata``.
      operations: Transformations applied in order.
      worker_count: Worker processes (0: in this process; None: ``os.cpu_count()``).
      worker_buffer_size: Output elements each worker may produce ahead.
      shard_options: This process's shard; default: the sampler's.
      read_options: Threads and read-ahead for reading records.
      enable_profiling: Accepted for compatibility (no effect).
      worker_backend: Where the workers run: ``"local"`` processes, or a worker backend
        (``"ray"`` with ``grainpipe-ray``): see ``MultiprocessingOptions.backend``. The
        output and the checkpoints are the same.
      worker_stall_warning_s: Seconds the loader waits for a worker before it logs a warning
        with the worker's Python stacks, and again at each multiple (None: never); as
        ``MultiprocessingOptions.stall_warning_s``.
      worker_stall_timeout_s: Seconds after which the wait raises ``WorkerStalledError``
        (None: wait forever); as ``MultiprocessingOptions.stall_timeout_s``.
      persistent_workers: Keep the worker processes running between iterators (epochs) of
        this loader, until ``close()`` or the loader is collected; as
        ``MultiprocessingOptions.persistent_workers``.

    Raises:
      ValueError: For negative counts, missing shard options, a stall threshold that is not a
        positive number, or a random operation with a sampler that has no seed.
      TypeError: For an unsupported operation.
    """

    def __init__(
        self,
        *,
        data_source: Any,
        sampler: Any,
        operations: Sequence[Any] = (),
        worker_count: int | None = 0,
        worker_buffer_size: int = 1,
        shard_options: ShardOptions | None = None,
        read_options: ReadOptions | None = None,
        enable_profiling: bool = False,
        worker_backend: str | Any = "local",
        worker_stall_warning_s: float | None = 30.0,
        worker_stall_timeout_s: float | None = None,
        persistent_workers: bool = False,
    ) -> None:
        if worker_count is None:
            worker_count = os.cpu_count()
            if worker_count is None:
                raise ValueError("os.cpu_count() is unknown: pass worker_count explicitly.")
        non_negative_int("worker_count", worker_count)
        non_negative_int("worker_buffer_size", worker_buffer_size)
        if shard_options is None:
            shard_options = getattr(sampler, "_shard_options", None)
            if shard_options is None:
                raise ValueError(
                    "No shard options were provided to the DataLoader and the sampler has "
                    "none: pass shard_options=grain_core.sharding.NoSharding() (or a shard)."
                )
        operations = list(operations)
        for op in operations:
            _check_operation(op)
        _check_random_ops_have_rng(operations, sampler)
        self._data_source = data_source
        self._sampler = sampler
        self._operations = operations
        self._worker_count = int(worker_count)
        self._shard_options = shard_options
        self._read_options = read_options or ReadOptions()
        self._multiprocessing_options = MultiprocessingOptions(
            num_workers=self._worker_count,
            per_worker_buffer_size=worker_buffer_size,
            enable_profiling=enable_profiling,
            backend=worker_backend,
            stall_warning_s=worker_stall_warning_s,
            stall_timeout_s=worker_stall_timeout_s,
            persistent_workers=persistent_workers,
        )
        self._index_layout = all(
            isinstance(op, (*_ONE_TO_ONE, transforms.Batch)) for op in operations
        )
        self._records_per_element = _records_per_element(operations) if self._index_layout else 1
        self._has_flat_map = any(isinstance(op, transforms.FlatMap) for op in operations)
        self._dataset = self._build(self._index_layout)
        # The stream layout of an index-layout pipeline, built when a Grain checkpoint needs it.
        self._stream_dataset: IterDataset[Any] | None = None

    @property
    def multiprocessing_options(self) -> MultiprocessingOptions:
        return dataclasses.replace(self._multiprocessing_options)

    def _dataset_for(self, index_layout: bool) -> IterDataset[Any]:
        if index_layout == self._index_layout:
            return self._dataset
        if self._stream_dataset is None:
            self._stream_dataset = self._build(index_layout=False)
        return self._stream_dataset

    def _build(self, index_layout: bool) -> IterDataset[Any]:
        # Building a Philox generator per record costs tens of microseconds: only pipelines
        # with a random operation, or a legacy one that may read a record's rng (all but
        # those that say otherwise with `uses_record_rng = False`), get them.
        with_rng = any(
            isinstance(op, (transforms.RandomMap, transforms.TfRandomMap))
            or (
                not isinstance(op, _KNOWN_OPERATIONS)
                and (not isinstance(op, RecordRngDeclaring) or op.uses_record_rng)
            )
            for op in self._operations
        )
        # Only index and random operations look at a record's metadata; without them the
        # pipeline runs on the data alone, with no Record objects per record.
        with_metadata = not index_layout or any(
            isinstance(op, _ONE_TO_ONE) and not isinstance(op, transforms.Map)
            for op in self._operations
        )
        records = _SamplerMapDataset(
            self._data_source,
            self._sampler,
            self._shard_options,
            with_rng=with_rng,
            with_metadata=with_metadata,
        )
        #: Records in this shard: the last batch of the index layout may be partial.
        self._shard_records = len(records)
        # A batch sent to the parent through pipes is written into shared memory; a backend's
        # workers send theirs their own way.
        local_workers = self._worker_count and self._multiprocessing_options.backend == "local"
        shm_batch_at = _last_batch_position(self._operations) if local_workers else -1
        if index_layout:
            ds: Any = records
            for position, op in enumerate(self._operations):
                if isinstance(op, transforms.Batch):
                    batch_fn = _batch_fn(op.batch_fn, position == shm_batch_at)
                    ds = ds.batch(
                        op.batch_size,
                        drop_remainder=op.drop_remainder,
                        batch_fn=_RecordBatch(batch_fn) if with_metadata else batch_fn,
                    )
                else:
                    ds = ds.map(_RecordMap(op) if with_metadata else op.map)
            if with_metadata:
                ds = ds.map(_record_data)
            out = ds.to_iter_dataset(self._element_read_options())
        else:
            it_ds: Any = records.to_iter_dataset(self._read_options)
            for position, op in enumerate(self._operations):
                if isinstance(op, transforms.Batch):
                    it_ds = it_ds.batch(
                        op.batch_size,
                        drop_remainder=op.drop_remainder,
                        batch_fn=_RecordBatch(_batch_fn(op.batch_fn, position == shm_batch_at)),
                    )
                elif isinstance(op, transforms.Filter):
                    it_ds = it_ds.filter(_RecordFilter(op))
                elif isinstance(op, transforms.FlatMap):
                    it_ds = FlatMapIterDataset(it_ds, _RecordFlatMap(op))
                elif isinstance(op, _ONE_TO_ONE):
                    it_ds = it_ds.map(_RecordMap(op))
                else:
                    it_ds = _LegacyOperationIterDataset(it_ds, op)
            out = it_ds.map(_record_data)
        if self._worker_count:
            out = out.mp_prefetch(self.multiprocessing_options)
        return out  # type: ignore[no-any-return]

    def _last_record_of(self, element: int, per: int) -> int:
        """The last record (index in this shard) of ``element`` when each has ``per``
        records: the last one of the shard for a final, partial batch (as Grain writes it)."""
        return min((element + 1) * per, self._shard_records) - 1

    def _element_of(self, record: int, per: int) -> int:
        """The element whose last record is ``record`` (inverse of ``_last_record_of``)."""
        return -(-(record + 1) // per) - 1

    def _element_read_options(self) -> ReadOptions:
        # In the index layout an element read at the boundary is a whole batch: keep the
        # read-ahead in records as configured, not in batches.
        opts = self._read_options
        per = self._records_per_element
        if per == 1 or opts.prefetch_buffer_size == 0:
            return opts
        buffer = max(1, -(-opts.prefetch_buffer_size // per))
        return ReadOptions(num_threads=min(opts.num_threads, buffer), prefetch_buffer_size=buffer)

    def __iter__(self) -> DataLoaderIterator:
        return DataLoaderIterator(self)

    def close(self) -> None:
        """Stops the worker processes kept between iterators (``persistent_workers``); an
        open iterator's stop when it is closed. Idempotent."""
        for ds in (self._dataset, self._stream_dataset):
            if isinstance(ds, MultiprocessPrefetchIterDataset):
                ds.close()

    def __repr__(self) -> str:
        return (
            f"DataLoader(data_source={fingerprint(self._data_source)}, "
            f"sampler={fingerprint(self._sampler)}, worker_count={self._worker_count})"
        )


def _last_batch_position(operations: Sequence[Any]) -> int:
    """Position of a ``Batch`` that is the last operation, else -1."""
    if operations and isinstance(operations[-1], transforms.Batch):
        return len(operations) - 1
    return -1


def _check_random_ops_have_rng(operations: Sequence[Any], sampler: Any) -> None:
    after_flat_map = False
    for op in operations:
        if isinstance(op, transforms.FlatMap):
            after_flat_map = True
        if not isinstance(op, (transforms.RandomMap, transforms.TfRandomMap)):
            continue
        if after_flat_map:
            raise ValueError(
                f"{type(op).__name__} after a FlatMap has no per-record random generator (the "
                "splits have no sampler index). Move it before the FlatMap."
            )
        if hasattr(sampler, "_seed") and sampler._seed is None:
            raise ValueError(
                f"{type(op).__name__} needs a per-record random generator, but {sampler!r} "
                "has no seed. Pass seed=... to the sampler."
            )


# ---------------------------------------------------------------------- the iterator
class DataLoaderIterator:
    """Iterator over a :class:`DataLoader`; its state is Grain's version-2 JSON (bytes).

    A context manager: leaving the ``with`` block stops the workers.
    """

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._index_layout = loader._index_layout
        self._it: DatasetIterator[Any] = iter(loader._dataset)

    def __iter__(self) -> DataLoaderIterator:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def start_prefetch(self) -> None:
        """Starts workers and read-ahead without consuming elements."""
        self._it.start_prefetch()

    def close(self) -> None:
        """Stops workers and threads. Idempotent."""
        self._it.close()

    def __enter__(self) -> DataLoaderIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------- state
    def _shard(self) -> tuple[int, int]:
        opts = self._loader._shard_options
        return opts.shard_index, opts.shard_count

    @property
    def state_is_bytes(self) -> bool:
        """``get_state`` gives, and ``set_state`` takes, the checkpoint file's UTF-8 text
        (``BytesState``)."""
        return True

    def get_state_dict(self) -> dict[str, Any]:
        """The position as the dict that :meth:`get_state` encodes."""
        loader = self._loader
        inner = self._it.get_state()
        state: dict[str, Any] = {"version": _STATE_VERSION}
        if loader._has_flat_map:
            state["dataset_state"] = inner
        else:
            workers = loader._worker_count
            if workers == 0:
                consumed = [inner["next_index"]]
                last_worker = -1
            else:
                consumed = [s["next_index"] for s in interleave_input_states(inner)]
                last_worker = interleave_next_input(inner) - 1
            s, count = self._shard()
            slots = max(workers, 1)
            per = loader._records_per_element if self._index_layout else 1
            state["last_seen_indices"] = {
                str(w): s + count * loader._last_record_of(w + (n - 1) * slots, per)
                for w, n in enumerate(consumed)
            }
            state["last_worker_index"] = last_worker
        state["worker_count"] = loader._worker_count
        state["sampler"] = fingerprint(loader._sampler)
        state["data_source"] = fingerprint(loader._data_source)
        return state

    def get_state(self) -> bytes:
        """The position as UTF-8 JSON (version 2: last sampler index seen by each worker)."""
        return encode_state(self.get_state_dict()).encode()

    def set_state(self, state: bytes) -> None:
        """Restores a position from :meth:`get_state` of an equally defined DataLoader, or from
        the state of Google Grain's DataLoader over the same source, sampler and operations.

        Raises:
          ValueError: If the state is not valid JSON of version 2, belongs to another sampler
            or source, or to another worker count where the order depends on it (Filter or
            FlatMap operations; Grain's workers batching their own records).
        """
        self.set_state_dict(decode_state(state, "DataLoader state"))

    def set_state_dict(self, data: Any) -> None:
        """Restores a position from :meth:`get_state_dict` (see :meth:`set_state`).

        Raises:
          ValueError: As :meth:`set_state`.
        """
        loader = self._loader
        if loader._has_flat_map and isinstance(data, dict) and "version" not in data:
            # Google Grain's DataLoader writes the pipeline's own state for a FlatMap, with
            # nothing to validate it by.
            self._it.set_state(data)
            return
        if not isinstance(data, dict) or data.get("version") != _STATE_VERSION:
            raise ValueError(
                f"Unsupported DataLoader state (version {data.get('version') if isinstance(data, dict) else None}); "
                f"expected version {_STATE_VERSION}."
            )
        for key, obj in (("sampler", loader._sampler), ("data_source", loader._data_source)):
            if data.get(key) not in checkpoint_names(obj):
                raise ValueError(
                    f"The checkpoint was taken with {key} {data.get(key)!r} but this DataLoader "
                    f"has {fingerprint(obj)!r}. Restore with the same {key}; a custom one needs "
                    "a stable __repr__ that does not embed data."
                )
        try:
            if not loader._has_flat_map:
                _check_positions(data)
            index_layout = loader._index_layout and self._in_index_layout(data)
            same_workers = data.get("worker_count") == loader._worker_count
            inner = self._inner_state(data, index_layout) if index_layout or same_workers else None
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"DataLoader state is malformed ({type(e).__name__}: {e}); it is not one that "
                "get_state wrote (or Google Grain's DataLoader)."
            ) from e
        if inner is None:
            why = (
                "Google Grain's workers batched their own records"
                if loader._index_layout
                else "with Filter or FlatMap operations the order depends on the worker count"
            )
            raise ValueError(
                f"The checkpoint was taken with worker_count={data.get('worker_count')} but this "
                f"DataLoader has worker_count={loader._worker_count}: {why}. Restore with the "
                "same worker_count."
            )
        if index_layout != self._index_layout:
            self._it.close()
            self._index_layout = index_layout
            self._it = iter(loader._dataset_for(index_layout))
        self._it.set_state(inner)

    def _inner_state(self, data: dict[str, Any], index_layout: bool) -> dict[str, Any]:
        """The pipeline's state for ``data`` in the layout chosen."""
        if self._loader._has_flat_map:
            return data["dataset_state"]  # type: ignore[no-any-return]
        if index_layout:
            return self._index_layout_state(data)
        return self._stream_layout_state(data)

    def _in_index_layout(self, data: dict[str, Any]) -> bool:
        """Whether ``data`` holds positions of the index layout (any worker count), rather
        than those of workers that batch their own records, as Google Grain's do. The two
        agree without a ``Batch`` or with one worker at most; otherwise worker 0's last record
        tells them apart (in the index layout it ends element ``k * worker_count``)."""
        per = self._loader._records_per_element
        workers = int(data.get("worker_count", 0))
        if per == 1 or workers <= 1:
            return True
        s, count = self._shard()
        loader = self._loader
        for key, value in data["last_seen_indices"].items():
            seen = int(value)
            element = loader._element_of((seen - s) // count, per)
            # A final, partial batch ends at the shard's last record (earlier versions wrote
            # where a whole batch would have ended).
            ends = {loader._last_record_of(element, per), (element + 1) * per - 1}
            if seen not in {s + count * end for end in ends} or (element - int(key)) % workers:
                return False
        return True

    def _index_layout_state(self, data: dict[str, Any]) -> dict[str, Any]:
        s, count = self._shard()
        loader = self._loader
        per = loader._records_per_element
        last_elements = [
            loader._element_of((int(v) - s) // count, per)
            for v in data["last_seen_indices"].values()
        ]
        consumed = max(last_elements, default=-1) + 1
        workers = self._loader._worker_count
        if workers == 0:
            return {"next_index": consumed}
        per_worker = [max(0, -(-(consumed - w) // workers)) for w in range(workers)]
        return interleave_state([{"next_index": n} for n in per_worker], consumed % workers)

    def _stream_layout_state(self, data: dict[str, Any]) -> dict[str, Any]:
        s, count = self._shard()
        workers = self._loader._worker_count
        seen = data["last_seen_indices"]
        if workers == 0:
            return {"next_index": (int(seen["0"]) + count - s) // count}
        group = workers * count
        consumed = [(int(seen[str(w)]) + group - s - w * count) // group for w in range(workers)]
        next_worker = (int(data["last_worker_index"]) + 1) % workers
        return interleave_state([{"next_index": n} for n in consumed], next_worker)

    # ------------------------------------------------------------- Orbax v1 protocol
    async def save(self, directory: Any) -> Any:
        return save_coroutine(directory, self)

    async def load(self, directory: Any) -> Any:
        return load_coroutine(directory, self)

    def __str__(self) -> str:
        return f"PyGrainDatasetIterator(state={self.get_state().decode()})"


def _check_positions(data: dict[str, Any]) -> None:
    """Refuses positions that are not integers (``2.7`` would be truncated). A last-seen index
    may be negative: it is the one before a worker's first record.

    Raises:
      TypeError: naming the entry.
    """
    non_negative_int("DataLoader state `worker_count`", data.get("worker_count", 0))
    for key, value in data["last_seen_indices"].items():
        as_int(f"DataLoader state `last_seen_indices[{key}]`", value)
    if "last_worker_index" in data:
        as_int("DataLoader state `last_worker_index`", data["last_worker_index"])


def load(
    source: Any,
    *,
    num_epochs: int | None = None,
    shuffle: bool = False,
    seed: int | None = None,
    shard_options: ShardOptions | None = None,
    transformations: Sequence[Any] = (),
    batch_size: int | None = None,
    drop_remainder: bool = False,
    worker_count: int | None = 0,
    read_options: ReadOptions | None = None,
) -> DataLoader:
    """A DataLoader over ``source`` with an ``IndexSampler`` (``num_epochs=None``: forever).

    Raises:
      ValueError / TypeError: As ``IndexSampler`` and ``DataLoader``.
    """
    sampler = IndexSampler(
        num_records=len(source),
        shard_options=shard_options if shard_options is not None else NoSharding(),
        shuffle=shuffle,
        num_epochs=num_epochs,
        seed=seed,
    )
    operations = list(transformations)
    if batch_size is not None:
        operations.append(transforms.Batch(batch_size, drop_remainder=drop_remainder))
    return DataLoader(
        data_source=source,
        sampler=sampler,
        operations=operations,
        worker_count=worker_count,
        read_options=read_options,
    )

"""Feeding JAX: device prefetch and global arrays built from each process's batch.

``device_put(ds, target)`` moves every element of a pipeline (or a ``DataLoader``) to a JAX
device or sharding on background threads, so that the copies overlap the training step:

* a CPU-side thread keeps ``cpu_buffer_size`` host elements ready;
* a second thread copies them to the device(s) and keeps ``device_buffer_size`` on device.

With a ``jax.sharding.Sharding`` the elements become **global** arrays
(:func:`make_global_batch`): each process passes the batch it read from its own shard, and JAX
stitches them into one array whose leading dimension is the sum over processes. Checkpoints
of the returned iterator are the pipeline's own state as of the last element handed out, so a
restored run repeats or skips nothing that was prefetched.

JAX is imported only when these functions run: the core does not depend on it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from grain_core.dataset.base import IterDataset
from grain_core.dataset.iterator import DatasetIterator
from grain_core.dataset.prefetch import ThreadPrefetchIterDataset
from grain_core.sharding import JAX_INSTALL_HINT

__all__ = ["device_put", "make_global_batch"]


def _import_jax(what: str) -> Any:
    try:
        import jax  # optional dependency
    except ImportError as err:
        raise ImportError(f"{what} needs JAX, which is not installed: {JAX_INSTALL_HINT}") from err
    return jax


def device_put(
    ds: Any,
    device: Any,
    *,
    cpu_buffer_size: int = 4,
    device_buffer_size: int = 2,
) -> IterDataset[Any]:
    """Prefetches the elements of ``ds`` to a JAX device or sharding on background threads.

    Args:
      ds: An ``IterDataset``, or a ``grain_core.DataLoader`` (the iterator's state is then the
        loader's version-2 JSON as a dict; ``CheckpointHandler`` writes the same text).
      device: A ``jax.Device`` (each element is ``jax.device_put`` there), or a
        ``jax.sharding.Sharding`` (each element becomes a global array from this process's
        part, see :func:`make_global_batch`). Named as in Grain.
      cpu_buffer_size: Host elements read ahead of the device copy.
      device_buffer_size: Elements kept on device ahead of the consumer.

    Returns:
      An ``IterDataset`` of device arrays (same tree structure as the input elements).

    Raises:
      ImportError: If JAX is not installed (the message says what to install).
      TypeError: If ``ds`` is neither an ``IterDataset`` nor a ``DataLoader``, or the target is
        neither a device nor a sharding.
      ValueError: If a buffer size is negative.
    """
    jax = _import_jax("device_put")
    put = _placer(jax, device)
    if cpu_buffer_size < 0 or device_buffer_size < 0:
        raise ValueError(
            f"Buffer sizes must be >= 0, got cpu_buffer_size={cpu_buffer_size}, "
            f"device_buffer_size={device_buffer_size}."
        )
    source = _as_iter_dataset(ds)
    host = ThreadPrefetchIterDataset(source, prefetch_buffer_size=cpu_buffer_size)
    return ThreadPrefetchIterDataset(host.map(put), prefetch_buffer_size=device_buffer_size)


def _placer(jax: Any, target: Any) -> _Place:
    if isinstance(target, jax.sharding.Sharding):
        return _Place("make_global_batch", make_global_batch, target)
    if isinstance(target, jax.Device):
        return _Place("device_put", jax.device_put, target)
    raise TypeError(
        f"device_put needs a jax.Device or a jax.sharding.Sharding, got {type(target).__name__} "
        f"({target!r})."
    )


class _Place:
    """``put(element, target)`` as a transform, named after both in the execution summary."""

    def __init__(self, name: str, put: Any, target: Any) -> None:
        self._name = name
        self._put = put
        self._target = target

    def __call__(self, element: Any) -> Any:
        return self._put(element, self._target)

    def __repr__(self) -> str:
        return f"{self._name}({self._target})"


def make_global_batch(local_batch: Any, sharding: Any) -> Any:
    """Turns this process's batch into global ``jax.Array``s laid out by ``sharding``.

    Every process calls this with the batch it read from its own shard (same shapes on every
    process); the global leading dimension is the sum over processes, and each device holds
    the rows that ``sharding`` assigns to it. In a single process the global batch is the local
    one. Uses ``jax.make_array_from_process_local_data`` leaf by leaf.

    Args:
      local_batch: A tree (dicts, lists, tuples) of arrays with a leading batch dimension.
      sharding: A ``jax.sharding.Sharding``, typically ``NamedSharding(mesh, P("data"))``.

    Raises:
      ImportError: If JAX is not installed.
      ValueError: If a leaf's leading dimension does not divide over the devices of this
        process that split it (the message names the leaf, its shape and the mesh axes).
    """
    jax = _import_jax("make_global_batch")

    def to_global(path: Any, leaf: Any) -> Any:
        array = np.asarray(leaf)
        name = jax.tree_util.keystr(path) or "<root>"
        parts = _local_parts_of_leading_dim(sharding, array.ndim)
        if array.ndim and parts > 1 and array.shape[0] % parts:
            raise ValueError(
                f"Batch leaf {name} has shape {array.shape}: its leading dimension "
                f"{array.shape[0]} does not divide over the {parts} devices of this process "
                f"that split it ({sharding}). Use a per-process batch size that is a multiple "
                f"of {parts} (and batch with drop_remainder=True so the last batch is full)."
            )
        try:
            return jax.make_array_from_process_local_data(sharding, array)
        except ValueError as err:
            raise ValueError(
                f"Cannot build a global array for batch leaf {name} of shape {array.shape} "
                f"with {sharding}: {err}"
            ) from err

    return jax.tree_util.tree_map_with_path(to_global, local_batch)


@functools.lru_cache(maxsize=64)
def _local_parts_of_leading_dim(sharding: Any, ndim: int) -> int:
    """How many pieces this process's devices cut dimension 0 into (1 if not a NamedSharding).

    For other shardings JAX's own check (re-raised with the leaf's name) applies.
    """
    import jax  # optional dependency

    if not isinstance(sharding, jax.sharding.NamedSharding) or ndim == 0 or not sharding.spec:
        return 1
    axes = sharding.spec[0]
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    mesh = sharding.mesh
    positions = [mesh.axis_names.index(a) for a in axes]
    here = jax.process_index()
    coords = {
        tuple(index[p] for p in positions)
        for index, device in np.ndenumerate(mesh.devices)
        if device.process_index == here
    }
    return max(1, len(coords))


def _as_iter_dataset(ds: Any) -> IterDataset[Any]:
    if isinstance(ds, IterDataset):
        return ds
    from grain_core.data_loader import DataLoader  # import cost

    if isinstance(ds, DataLoader):
        return _DataLoaderIterDataset(ds)
    raise TypeError(
        f"device_put needs an IterDataset or a DataLoader, got {type(ds).__name__}. For a "
        "MapDataset, call .to_iter_dataset() first."
    )


class _DataLoaderIterDataset(IterDataset[Any]):
    """A ``DataLoader`` seen as an ``IterDataset``, so that dataset stages can follow it."""

    def __init__(self, loader: Any) -> None:
        super().__init__()
        self._loader = loader

    def __iter__(self) -> DatasetIterator[Any]:
        return _DataLoaderDatasetIterator(iter(self._loader))

    def __repr__(self) -> str:
        return f"_DataLoaderIterDataset({self._loader!r})"


class _DataLoaderDatasetIterator(DatasetIterator[Any]):
    """State: the ``DataLoaderIterator``'s version-2 JSON as a dict (same file when saved)."""

    def __init__(self, loader_iterator: Any) -> None:
        # The loader's own pipeline iterator joins this pipeline's context, so options set
        # downstream (e.g. execution tracking) reach the loader's stages too.
        super().__init__([loader_iterator._it])
        self._loader_iterator = loader_iterator

    def __next__(self) -> Any:
        return next(self._loader_iterator)

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self._loader_iterator.get_state_dict()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self._loader_iterator.set_state_dict(state)

    def start_prefetch(self) -> None:
        self._loader_iterator.start_prefetch()

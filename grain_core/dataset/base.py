"""The two dataset types: ``MapDataset`` and ``IterDataset`` (their iterators' base class,
``DatasetIterator``, is the runtime's, in ``iterator.py``).

Every transformation is a node whose ``parents`` are its inputs. The base classes own the
protocol (factories, chaining methods, seeds, state, closing); each node module implements only
its own index arithmetic (``MapDataset``) or ``__next__``/state (``DatasetIterator``).

Hot path: ``MapDataset._getitems(indices)`` reads a whole block of indices with one call per node,
so a batch over a source is one call into the source. Nodes never add per-element bookkeeping.
"""

from __future__ import annotations

import abc
import collections
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, overload

import numpy as np

from grain_core import random as _random
from grain_core.capabilities import BatchedTransform
from grain_core.dataset.iterator import DatasetIterator, _FirstParent

if TYPE_CHECKING:
    from grain_core import transforms
    from grain_core.options import MultiprocessingOptions, ReadOptions

__all__ = [
    "IterDataset",
    "MapDataset",
]

T = TypeVar("T")
S = TypeVar("S")

#: Indices handed to ``_getitems``: any integer sequence, usually a NumPy array.
Indices = Sequence[int] | np.ndarray

#: Length of an infinite MapDataset (one epoch never ends).
INFINITE = sys.maxsize


def _parents_tuple(parents: Any) -> tuple[Any, ...]:
    if isinstance(parents, (MapDataset, IterDataset)):
        return (parents,)
    return tuple(parents)


class _Node:
    """Shared DAG behaviour of MapDataset and IterDataset: parents and default seeds."""

    _parents: tuple[Any, ...]
    _seed_value: int | None = None
    #: How ``get_element_spec`` derives this node's element spec from its parents': a rule of
    #: ``dataset/element_spec.py`` (None: not without reading data).
    element_spec_rule: ClassVar[Callable[[Any], Any] | None] = None

    @property
    def parents(self) -> tuple[Any, ...]:
        return self._parents

    _parent = _FirstParent()

    @functools.cached_property
    def _default_seed(self) -> int | None:
        """Seed derived from the nearest ``.seed()`` calls upstream, bit-exact with Grain."""
        found: list[tuple[int, int]] = []
        queue: collections.deque[tuple[Any, int]] = collections.deque([(self, 0)])
        while queue:
            node, depth = queue.popleft()
            seed = getattr(node, "_seed_value", None)
            if seed is not None:
                found.append((seed, depth))
                continue
            for parent in getattr(node, "_parents", ()):
                queue.append((parent, depth + 1))
        return _random.derive_seed(found)

    def _resolve_seed(self, seed: int | None, op: str, *, below_2_32: bool = True) -> int:
        if seed is None:
            seed = self._default_seed
        if seed is None:
            raise ValueError(
                f"`{op}` requires a seed. Please provide it with `ds.seed(seed)` upstream or "
                f"pass `seed=` to `{op}`."
            )
        return _random.validate_seed(seed, f"`{op}`", below_2_32=below_2_32)

    def pipe(self, func: Callable[..., S], /, *args: Any, **kwargs: Any) -> S:
        """Returns ``func(self, *args, **kwargs)`` to chain user-defined steps."""
        return func(self, *args, **kwargs)


def stop_iteration_error(where: str) -> RuntimeError:
    """The error for ``StopIteration`` raised by a user function (``where``: the function, or
    the read that called it): passed on, it would end the stream there without a word; it is
    an error instead, as in a generator (PEP 479)."""
    return RuntimeError(
        f"{where} raised StopIteration, which would end the stream here silently (an error, "
        "as it is in a generator: PEP 479). Catch it inside the function that raised it."
    )


def _transform_fn(transform: Any, method: str) -> Callable[..., Any]:
    fn = getattr(transform, method, None)
    if fn is not None and not isinstance(transform, type):
        return fn
    if callable(transform):
        return transform
    raise TypeError(f"Expected a callable or an object with `{method}`, got {transform!r}.")


def transform_name(transform: Any) -> str:
    """Display name of a user transform: class name, custom str/repr, or function and place."""
    if isinstance(transform, functools.partial):
        return f"functools.partial({transform_name(transform.func)})"
    code = getattr(transform, "__code__", None)
    if code is not None:
        parts = code.co_filename.split(os.sep)[-3:]
        return (
            f"{getattr(transform, '__name__', 'fn')} @ .../{'/'.join(parts)}:{code.co_firstlineno}"
        )
    cls = type(transform)
    if cls.__str__ is not object.__str__ or cls.__repr__ is not object.__repr__:
        return str(transform)
    return cls.__name__


class MapDataset(_Node, Generic[T], abc.ABC):
    """A lazily computed, random-access dataset (an infinite ``Sequence``).

    ``len(ds)`` is one epoch; ``ds[i]`` with ``i >= len(ds)`` reads epoch ``i // len(ds)``.
    ``None`` at an index means "no element here" (a hole made by ``filter``).
    """

    #: ``_getitems`` returns its one parent's values (for other indices) unchanged: a batch
    #: above a chain of such nodes may have the source read whole columns.
    passes_values: bool = False

    def __init__(self, parents: MapDataset[Any] | Sequence[MapDataset[Any]] = ()) -> None:
        self._parents = _parents_tuple(parents)

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> MapDataset[T]: ...

    @overload
    def __getitem__(self, index: int) -> T | None: ...

    @abc.abstractmethod
    def __getitem__(self, index: Any) -> Any: ...

    def _getitems(self, indices: Indices) -> Sequence[Any]:
        """Reads many indices at once. Nodes override this to pass the block down in one call.

        A list, or what a pass-through node's parent returned (a ``ColumnBlock`` under
        ``columns_wanted()``)."""
        return [self[int(i)] for i in indices]

    def __iter__(self) -> Iterator[T]:
        return iter(self.to_iter_dataset())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(len={len(self)})"

    # ----------------------------------------------------------------- factories
    @staticmethod
    def source(source: Any) -> MapDataset[Any]:
        """Wraps anything with ``__len__`` and ``__getitem__`` (a data source, list, array...)."""
        from grain_core.dataset.source import SourceMapDataset  # fluent API cycle

        return SourceMapDataset(source)

    @staticmethod
    def range(start: int, stop: int | None = None, step: int = 1) -> MapDataset[int]:
        """Integers with Python ``range`` argument rules."""
        from grain_core.dataset.source import RangeMapDataset  # fluent API cycle

        return RangeMapDataset(start, stop, step)

    @staticmethod
    def mix(
        datasets: Sequence[MapDataset[Any]], weights: Sequence[float] | None = None
    ) -> MapDataset[Any]:
        """Deterministic proportional interleave of ``datasets`` (exact at every prefix)."""
        from grain_core.dataset.ops.mix import MixedMapDataset  # fluent API cycle

        return MixedMapDataset(datasets, proportions=weights)

    @staticmethod
    def select_from_datasets(
        datasets: Sequence[MapDataset[Any]], selection_map: transforms.DatasetSelectionMap
    ) -> MapDataset[Any]:
        """Element ``i`` is ``datasets[d][j]`` where ``(d, j) = selection_map[i]``."""
        from grain_core.dataset.ops.mix import MixedMapDataset  # fluent API cycle

        return MixedMapDataset(datasets, selection_map=selection_map)

    @staticmethod
    def concatenate(datasets: Sequence[MapDataset[Any]]) -> MapDataset[Any]:
        """Epoch ``e`` of the result is epoch ``e`` of every component, in order."""
        from grain_core.dataset.ops.mix import ConcatenateMapDataset  # fluent API cycle

        return ConcatenateMapDataset(datasets)

    # --------------------------------------------------------------- transforms
    # Without batch_fn a batch is the elements' structure with stacked leaves, which no type
    # expresses: Any, so that a checker infers a pipeline ending in batch() without help.
    @overload
    def batch(
        self, batch_size: int, *, drop_remainder: bool = False, batch_fn: None = None
    ) -> MapDataset[Any]: ...

    @overload
    def batch(
        self,
        batch_size: int,
        *,
        drop_remainder: bool = False,
        batch_fn: Callable[[Sequence[T]], S],
    ) -> MapDataset[S]: ...

    def batch(
        self,
        batch_size: int,
        *,
        drop_remainder: bool = False,
        batch_fn: Callable[[Sequence[T]], S] | None = None,
    ) -> MapDataset[Any]:
        """Groups consecutive elements; leaves are stacked into NumPy arrays."""
        from grain_core.dataset.ops.batch import BatchMapDataset  # fluent API cycle

        return BatchMapDataset(self, batch_size, drop_remainder=drop_remainder, batch_fn=batch_fn)

    def filter(self, transform: Any) -> MapDataset[T]:
        """Keeps elements for which the predicate is true; others become holes (``None``)."""
        from grain_core.dataset.ops.map import FilterMapDataset  # fluent API cycle

        return FilterMapDataset(self, transform)

    def map(self, transform: Any, *, batched: bool = False) -> MapDataset[Any]:
        """Applies ``transform`` (a callable or ``transforms.Map``) to every element.

        Args:
          transform: The function, or an object with a ``map`` method.
          batched: ``transform`` takes a batch of elements (``make_batch`` of them: the
            leaves stacked) and returns a batch of as many results, leaf ``[i]`` being
            element ``i``'s. It then runs once per block of elements read together (a whole
            batch under ``.batch``) instead of once per element; the elements are the same.
            Also set by ``batched = True`` on a ``transforms.Map`` subclass.

        Raises:
          ValueError: If ``batched`` and a node below leaves holes (``filter``).
        """
        from grain_core.dataset.ops.map import (  # fluent API cycle
            BatchedMapMapDataset,
            MapMapDataset,
        )

        if batched or (isinstance(transform, BatchedTransform) and transform.batched is True):
            return BatchedMapMapDataset(self, transform)
        return MapMapDataset(self, transform)

    def map_with_index(self, transform: Any) -> MapDataset[Any]:
        """Applies ``transform(index, element)`` with the raw index (may exceed ``len``)."""
        from grain_core.dataset.ops.map import MapWithIndexMapDataset  # fluent API cycle

        return MapWithIndexMapDataset(self, transform)

    def random_map(self, transform: Any, *, seed: int | None = None) -> MapDataset[Any]:
        """Applies ``transform(element, rng)`` with a per-index Philox generator."""
        from grain_core.dataset.ops.map import RandomMapMapDataset  # fluent API cycle

        return RandomMapMapDataset(self, transform, seed=seed)

    def seed(self, seed: int) -> MapDataset[T]:
        """Sets the root seed from which downstream random transforms derive theirs."""
        from grain_core.dataset.ops.seed import _WithSeedMapDataset  # fluent API cycle

        return _WithSeedMapDataset(self, seed)

    def shuffle(self, seed: int | None = None) -> MapDataset[T]:
        """Global per-epoch permutation with O(1) memory and random access."""
        from grain_core.dataset.ops.shuffle import ShuffleMapDataset  # fluent API cycle

        return ShuffleMapDataset(self, seed=seed)

    def slice(self, sl: slice | Sequence[int] | MapDataset[int]) -> MapDataset[T]:
        """Selects ``ds[sl]`` for a slice, or re-indexes by a sequence of indices."""
        from grain_core.dataset.ops.slice import (  # fluent API cycle
            ReindexMapDataset,
            SliceMapDataset,
        )

        if isinstance(sl, slice):
            return SliceMapDataset(self, sl)
        if isinstance(sl, (MapDataset, Sequence, np.ndarray)) and not isinstance(sl, (str, bytes)):
            return ReindexMapDataset(self, sl)
        raise ValueError(f"`slice` takes a slice or a sequence of indices, got {sl!r}.")

    def repeat(
        self, num_epochs: int | None = None, *, reseed_each_epoch: bool = True
    ) -> MapDataset[T]:
        """Repeats ``num_epochs`` times (``None``: forever); random nodes vary per epoch."""
        from grain_core.dataset.ops.repeat import RepeatMapDataset  # fluent API cycle

        return RepeatMapDataset(self, num_epochs, reseed_each_epoch=reseed_each_epoch)

    def to_iter_dataset(
        self, read_options: ReadOptions | None = None, *, allow_nones: bool = False
    ) -> IterDataset[T]:
        """Iterates one epoch in index order, reading ahead on a thread pool."""
        from grain_core.dataset.prefetch import PrefetchIterDataset  # fluent API cycle

        return PrefetchIterDataset(self, read_options=read_options, allow_nones=allow_nones)

    def apply(self, transformations: Any) -> MapDataset[Any]:
        """Applies one transformation object or a sequence of them, in order."""
        from grain_core.dataset.ops.apply import apply_transformations  # fluent API cycle

        return apply_transformations(self, transformations)


class IterDataset(_Node, Iterable[T], Generic[T], abc.ABC):
    """A dataset that can only be iterated; ``iter()`` builds a fresh ``DatasetIterator``."""

    def __init__(self, parents: Any = ()) -> None:
        self._parents = _parents_tuple(parents)

    @abc.abstractmethod
    def __iter__(self) -> DatasetIterator[T]: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @staticmethod
    def mix(
        datasets: Sequence[IterDataset[Any]] | Mapping[str, IterDataset[Any]],
        weights: Sequence[float] | Mapping[str, float] | None = None,
    ) -> IterDataset[Any]:
        """Proportional interleave; stops when a draw hits an exhausted component."""
        from grain_core.dataset.ops.mix import MixedIterDataset  # fluent API cycle

        return MixedIterDataset(datasets, weights)

    @overload
    def batch(
        self, batch_size: int, *, drop_remainder: bool = False, batch_fn: None = None
    ) -> IterDataset[Any]: ...

    @overload
    def batch(
        self,
        batch_size: int,
        *,
        drop_remainder: bool = False,
        batch_fn: Callable[[Sequence[T]], S],
    ) -> IterDataset[S]: ...

    def batch(
        self,
        batch_size: int,
        *,
        drop_remainder: bool = False,
        batch_fn: Callable[[Sequence[T]], S] | None = None,
    ) -> IterDataset[Any]:
        """Groups consecutive elements; leaves are stacked into NumPy arrays (see
        ``MapDataset.batch``)."""
        from grain_core.dataset.ops.batch import BatchIterDataset  # fluent API cycle

        return BatchIterDataset(self, batch_size, drop_remainder=drop_remainder, batch_fn=batch_fn)

    def filter(self, transform: Any) -> IterDataset[T]:
        from grain_core.dataset.ops.map import FilterIterDataset  # fluent API cycle

        return FilterIterDataset(self, transform)

    def map(self, transform: Any) -> IterDataset[Any]:
        from grain_core.dataset.ops.map import MapIterDataset  # fluent API cycle

        return MapIterDataset(self, transform)

    def map_with_index(self, transform: Any) -> IterDataset[Any]:
        from grain_core.dataset.ops.map import MapWithIndexIterDataset  # fluent API cycle

        return MapWithIndexIterDataset(self, transform)

    def random_map(self, transform: Any, *, seed: int | None = None) -> IterDataset[Any]:
        from grain_core.dataset.ops.map import RandomMapIterDataset  # fluent API cycle

        return RandomMapIterDataset(self, transform, seed=seed)

    def seed(self, seed: int) -> IterDataset[T]:
        from grain_core.dataset.ops.seed import _WithSeedIterDataset  # fluent API cycle

        return _WithSeedIterDataset(self, seed)

    def prefetch(self, multiprocessing_options: MultiprocessingOptions) -> IterDataset[T]:
        """Deprecated alias of :meth:`mp_prefetch`."""
        warnings.warn(
            "IterDataset.prefetch is deprecated; use mp_prefetch.", DeprecationWarning, stacklevel=2
        )
        return self.mp_prefetch(multiprocessing_options)

    def mp_prefetch(
        self,
        options: MultiprocessingOptions | None = None,
        worker_init_fn: Callable[[int, int], None] | None = None,
        sequential_slice: bool = False,
    ) -> IterDataset[T]:
        """Runs the pipeline in worker processes, merged in strict round-robin order."""
        from grain_core.dataset.mp import mp_prefetch  # fluent API cycle

        return mp_prefetch(self, options, worker_init_fn, sequential_slice=sequential_slice)

    def apply(self, transformations: Any) -> IterDataset[Any]:
        from grain_core.dataset.ops.apply import apply_transformations  # fluent API cycle

        return apply_transformations(self, transformations)

"""The core's own shuffle strategies and sharding policies: grain_core's default plugin.

The plugin manager imports this module by name (``grain_core.plugins.DEFAULT_PLUGINS``) and
registers it through the same loader and hooks as a third-party plugin, so that lookup,
listing, conflict rules and the report of a failure are the same for everyone. It belongs to
the dataset layer (``docs/architecture.md``), whose operators it applies, and the manager
below never imports it; it sits outside ``dataset/`` so that loading the plugins, which
``grain-core plugins`` and every format lookup do, runs no ``dataset/__init__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from grain_core.plugins import ShardingPolicy, ShuffleStrategy, hookimpl
from grain_core.sharding import (
    ShardByJaxProcess,
    ShardOptions,
    even_split,
    jax_process_index_and_count,
)

if TYPE_CHECKING:
    from grain_core.dataset.base import MapDataset

__all__ = ["register_sharding_policies", "register_shuffle_strategies"]


class GlobalShuffle:
    """Global per-epoch permutation of all indices (``MapDataset.shuffle``)."""

    name = "global"
    description = "permutation of every index per epoch (MapDataset.shuffle)"

    def apply(self, ds: MapDataset, *, seed: int | None = None, **options: Any) -> MapDataset:
        """Returns ``ds.shuffle(seed=seed)``.

        Raises:
          TypeError: If any option is given; this strategy takes none.
        """
        _reject_unknown_options(self.name, options)
        return ds.shuffle(seed=seed)


class WindowShuffle:
    """Shuffle within consecutive windows of ``window_size`` elements."""

    name = "window"
    description = "permutation within consecutive windows (WindowShuffleMapDataset)"

    def apply(self, ds: MapDataset, *, seed: int | None = None, **options: Any) -> MapDataset:
        """Returns ``WindowShuffleMapDataset(ds, window_size=..., seed=seed)``.

        Raises:
          TypeError: If ``window_size`` is missing or another option is given.
        """
        if "window_size" not in options:
            raise TypeError("The 'window' shuffle strategy needs window_size=<int>.")
        window_size = options.pop("window_size")
        _reject_unknown_options(self.name, options)
        # Loading the plugins (`grain-core plugins`, a format lookup) loads no operator.
        from grain_core.dataset.ops.window_shuffle import WindowShuffleMapDataset  # import cost

        return WindowShuffleMapDataset(ds, window_size=window_size, seed=seed)


class NoShardingPolicy:
    """Every process reads everything."""

    name = "none"
    description = "no sharding: every process reads all elements"

    def apply(self, ds: MapDataset, options: ShardOptions | None = None) -> MapDataset:
        """Returns ``ds`` unchanged.

        Raises:
          ValueError: If ``options`` asks for more than one shard.
        """
        if options is not None and options.shard_count != 1:
            raise ValueError(
                f"The 'none' sharding policy cannot apply {options!r}; use 'even_split' or "
                "'strided' to split the data."
            )
        return ds


class EvenSplitPolicy:
    """Contiguous blocks, as ``IndexSampler`` shards (``even_split``)."""

    name = "even_split"
    description = "contiguous blocks: shard i reads ds[start:end] (even_split)"

    def apply(self, ds: MapDataset, options: ShardOptions | None = None) -> MapDataset:
        """Returns ``ds[start:end]`` with ``(start, end) = even_split(len(ds), options)``.

        Raises:
          ValueError: If ``options`` is None.
        """
        start, end = even_split(len(ds), _require_options(self.name, options))
        return ds[start:end]


class StridedPolicy:
    """Every ``shard_count``-th element: the Dataset-API idiom ``ds[i::n]``."""

    name = "strided"
    description = "interleaved: shard i reads ds[i::n]"

    def apply(self, ds: MapDataset, options: ShardOptions | None = None) -> MapDataset:
        """Returns ``ds[index::count]``; with ``drop_remainder`` all shards have equal length.

        Raises:
          ValueError: If ``options`` is None.
        """
        options = _require_options(self.name, options)
        count = options.shard_count
        stop = len(ds) - len(ds) % count if options.drop_remainder else len(ds)
        return ds[options.shard_index : stop : count]


class JaxProcessPolicy:
    """Contiguous blocks, one per JAX process."""

    name = "jax_process"
    description = "contiguous blocks, one per JAX process (needs jax)"

    def apply(self, ds: MapDataset, options: ShardOptions | None = None) -> MapDataset:
        """Returns this JAX process's contiguous block of ``ds``.

        Args:
          ds: The dataset to shard.
          options: None, or a ``ShardByJaxProcess`` to set ``drop_remainder``.

        Raises:
          ImportError: If JAX is not installed (the message names the extra to install).
          ValueError: If ``options`` is not a ``ShardByJaxProcess``.
        """
        if options is not None and not isinstance(options, ShardByJaxProcess):
            raise ValueError(
                f"The 'jax_process' policy takes its shard from JAX; got {options!r}. Pass "
                "ShardByJaxProcess(drop_remainder=...) or use 'even_split' for explicit shards."
            )
        index, count = jax_process_index_and_count(required=True)
        drop_remainder = options.drop_remainder if options is not None else False
        return EvenSplitPolicy().apply(ds, ShardOptions(index, count, drop_remainder))


def _require_options(policy: str, options: ShardOptions | None) -> ShardOptions:
    if options is None:
        raise ValueError(
            f"The {policy!r} sharding policy needs ShardOptions(shard_index, shard_count)."
        )
    return options


def _reject_unknown_options(strategy: str, options: dict[str, Any]) -> None:
    if options:
        raise TypeError(
            f"The {strategy!r} shuffle strategy got unknown options: {', '.join(sorted(options))}."
        )


@hookimpl
def register_shuffle_strategies(register: Callable[[ShuffleStrategy], None]) -> None:
    """Registers the core's shuffle strategies."""
    register(GlobalShuffle())
    register(WindowShuffle())


@hookimpl
def register_sharding_policies(register: Callable[[ShardingPolicy], None]) -> None:
    """Registers the core's sharding policies."""
    register(NoShardingPolicy())
    register(EvenSplitPolicy())
    register(StridedPolicy())
    register(JaxProcessPolicy())

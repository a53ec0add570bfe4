"""Shard options: which slice of the data this process reads.

A shard is described by ``(shard_index, shard_count, drop_remainder)``. Samplers and the
DataLoader split records into contiguous blocks with :func:`even_split`; Dataset-API users
shard by slicing (``ds[shard_index::shard_count]``) or through a sharding policy plugin
(``grain_core.plugins.get_sharding_policy("even_split").apply(ds, options)``).
"""

from __future__ import annotations

import dataclasses
import logging

from grain_core._checks import as_int, non_negative_int, positive_int

__all__ = ["NoSharding", "ShardByJaxProcess", "ShardOptions", "even_split"]

_LOG = logging.getLogger(__name__)

JAX_INSTALL_HINT = "pip install jax"


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """Which shard of the data this process reads.

    Args:
      shard_index: Index of this shard, in ``[0, shard_count - 1]``.
      shard_count: Number of shards; at least 1.
      drop_remainder: If True every shard gets ``n // shard_count`` elements and the
        remainder is dropped; if False the first ``n % shard_count`` shards get one extra.

    Raises:
      TypeError: If ``shard_index`` or ``shard_count`` is not an integer.
      ValueError: If ``shard_count <= 0`` or ``shard_index`` is out of range.
    """

    shard_index: int
    shard_count: int
    drop_remainder: bool = False

    def __post_init__(self) -> None:
        index = as_int("shard_index", self.shard_index)
        count = positive_int("shard_count", self.shard_count)
        if not 0 <= index < count:
            raise ValueError(
                f"shard_index must be in [0, shard_count - 1] = [0, {count - 1}], got {index}."
            )
        # Normalise numpy integers so that equality, hashing and JSON dumps behave.
        object.__setattr__(self, "shard_index", index)
        object.__setattr__(self, "shard_count", count)
        object.__setattr__(self, "drop_remainder", bool(self.drop_remainder))


class NoSharding(ShardOptions):
    """The whole data set in one shard: ``ShardOptions(0, 1, drop_remainder=False)``."""

    def __init__(self) -> None:
        super().__init__(shard_index=0, shard_count=1, drop_remainder=False)


class ShardByJaxProcess(ShardOptions):
    """One shard per JAX process, read from ``jax.process_index()`` / ``process_count()``.

    The index and count are evaluated once, at construction. Without JAX installed this is
    shard ``(0, 1)``, as in Grain; code that must not silently fall back to a single shard
    should use the ``"jax_process"`` sharding policy, which requires JAX.

    Args:
      drop_remainder: As for :class:`ShardOptions`.
    """

    def __init__(self, drop_remainder: bool = False) -> None:
        index, count = jax_process_index_and_count(required=False)
        super().__init__(shard_index=index, shard_count=count, drop_remainder=drop_remainder)


def jax_process_index_and_count(*, required: bool) -> tuple[int, int]:
    """Returns ``(jax.process_index(), jax.process_count())``.

    Args:
      required: If False and JAX is not importable, logs a warning naming the package to
        install and returns ``(0, 1)``.

    Raises:
      ImportError: If JAX is not importable and ``required`` is True; the message says
        which package to install.
    """
    try:
        import jax  # optional dependency
    except ImportError as err:
        if not required:
            # Grain's fallback, but a multi-host job without JAX would read all the data on
            # every host: say so.
            _LOG.warning(
                "JAX is not installed, so this process reads shard 0 of 1 (all the data). "
                "For one shard per JAX process: %s",
                JAX_INSTALL_HINT,
            )
            return 0, 1
        raise ImportError(
            f"Sharding by JAX process needs JAX, which is not installed: {JAX_INSTALL_HINT}"
        ) from err
    return int(jax.process_index()), int(jax.process_count())


def even_split(num_examples: int, options: ShardOptions) -> tuple[int, int]:
    """Returns the contiguous block ``[start, end)`` of ``num_examples`` owned by a shard.

    Blocks are ``num_examples // shard_count`` long; without ``drop_remainder`` the first
    ``num_examples % shard_count`` shards get one extra element, so every element belongs to
    exactly one shard.

    Args:
      num_examples: Number of elements to split; non-negative.
      options: The shard to compute the block for.

    Raises:
      ValueError: If ``num_examples`` is negative.
    """
    n = non_negative_int("num_examples", num_examples)
    index, count = options.shard_index, options.shard_count
    per_shard, remainder = divmod(n, count)
    start = per_shard * index
    end = per_shard * (index + 1)
    if remainder:
        if options.drop_remainder:
            _LOG.warning(
                "Dropping %d of %d examples so that all %d shards have %d examples.",
                remainder,
                n,
                count,
                per_shard,
            )
        else:
            start += min(index, remainder)
            end += min(index + 1, remainder)
    return start, end

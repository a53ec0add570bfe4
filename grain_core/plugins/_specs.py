"""The typed objects plugins hand to the ``register`` callbacks of the hooks."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from grain_core.plugins._errors import MissingCapabilityError

if TYPE_CHECKING:
    from grain_core import MapDataset
    from grain_core.sharding import ShardOptions

__all__ = [
    "CAPABILITIES",
    "PUBLIC_EXPORT_MODULES",
    "FormatInfo",
    "FormatSpec",
    "RecordWriter",
    "ShardingPolicy",
    "ShuffleStrategy",
    "WorkerBackend",
    "WorkerGroup",
    "WorkerJob",
    "WorkerLostError",
    "check_object_name",
    "path_for_matching",
]

CAPABILITIES = ("source", "iter_dataset", "writer", "inspector")

# Modules whose ``__getattr__`` asks the registry for plugin-provided names.
PUBLIC_EXPORT_MODULES = ("grain_core.sources", "grain_core.experimental")

_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
# Sharded and globbed file names: "x.tfrecord-00003-of-00016", "x.tfrecord-*-of-*",
# "x.array_record-?????-of-00004", "x.array_record@8", "x.array_record-*", "x.parquet*".
_SHARD_SUFFIX_RE = re.compile(r"(?:-(?:\d+|\*|\?+)-of-(?:\d+|\*|\?+)|@(?:\d+|\*)|-?\*)$")


def check_object_name(kind: str, name: object) -> str:
    """Returns ``name`` if it is a valid registry name.

    Raises:
      TypeError / ValueError: If it is not a lower-case identifier such as ``array_record``.
    """
    if not isinstance(name, str):
        raise TypeError(f"{kind} name must be a str, got {type(name).__name__}.")
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"{kind} name {name!r} is invalid: use lower-case letters, digits and '_', "
            "starting with a letter."
        )
    return name


def path_for_matching(path: str) -> str:
    """Returns the lower-cased file name of ``path`` without URL query or shard suffix."""
    if "://" in path:
        path = path.split("?", 1)[0].split("#", 1)[0]
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return _SHARD_SUFFIX_RE.sub("", name).lower()


@dataclasses.dataclass(frozen=True)
class FormatInfo:
    """What a format's inspector reports about one file or file set.

    Args:
      num_records: Number of records, or None when only a full read could tell.
      schema: JSON-serialisable description of a record (e.g. ``{"label": "int"}``).
      sample: The first few records, decoded.
      details: Further format-specific facts (row groups, compression, ...).
    """

    num_records: int | None
    schema: Any = None
    sample: tuple[Any, ...] = ()
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class RecordWriter(Protocol):
    """What a format's ``writer`` factory returns: a context manager that writes records."""

    def write(self, record: Any) -> None:
        """Appends one record."""

    def close(self) -> None:
        """Finishes the file; the records are readable only after this."""

    def __enter__(self) -> RecordWriter: ...

    def __exit__(self, *exc_info: object) -> None: ...


@dataclasses.dataclass(frozen=True, eq=False)
class FormatSpec:
    """A file format: what it is called, which paths it claims and what it can do.

    Every capability is optional, but a format must offer at least one.

    Args:
      name: Registry name, a lower-case identifier (``"jsonl"``).
      suffixes: File suffixes it claims (``(".jsonl",)``). Sharded names such as
        ``x.jsonl-00001-of-00004`` or ``x.jsonl@4`` match the plain suffix.
      url_patterns: Regular expressions searched in the full path; a match wins over any
        suffix (``(r"^hf://datasets/",)``).
      source: ``source(paths, **options)`` returns a random-access data source
        (``__len__`` and ``__getitem__``, ideally ``__getitems__``).
      iter_dataset: ``iter_dataset(paths, **options)`` returns an ``IterDataset``.
      writer: ``writer(path, **options)`` returns a :class:`RecordWriter`.
      inspector: ``inspector(path, sample_size)`` returns a :class:`FormatInfo`.
      record_decoder: ``record_decoder(record)`` turns one raw record of the format into a
        mapping of feature name to value (TFRecord: ``tf.train.Example`` bytes to arrays);
        ``grain-core convert`` uses it for an output format that stores rows, not bytes.
      exports: Public names the format provides, by module:
        ``{"grain_core.sources": {"JsonlDataSource": JsonlDataSource}}`` makes
        ``grain_core.sources.JsonlDataSource`` resolve to that object.
      description: One line for ``grain-core plugins``.

    Raises:
      TypeError / ValueError: On an invalid field; the message names the field.
    """

    name: str
    suffixes: tuple[str, ...] = ()
    url_patterns: tuple[str, ...] = ()
    source: Callable[..., Any] | None = None
    iter_dataset: Callable[..., Any] | None = None
    writer: Callable[..., RecordWriter] | None = None
    inspector: Callable[..., FormatInfo] | None = None
    record_decoder: Callable[[Any], Mapping[str, Any]] | None = None
    exports: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        check_object_name("format", self.name)
        suffixes = _str_tuple(self.name, "suffixes", self.suffixes)
        for suffix in suffixes:
            if not suffix.startswith(".") or len(suffix) < 2:
                raise ValueError(f"format {self.name!r}: suffix {suffix!r} must look like '.ext'.")
        patterns = _str_tuple(self.name, "url_patterns", self.url_patterns)
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(
                    f"format {self.name!r}: url pattern {pattern!r} is not a valid regular "
                    f"expression: {err}"
                ) from None
        if not suffixes and not patterns:
            raise ValueError(f"format {self.name!r} claims no suffixes and no URL patterns.")
        for capability in (*CAPABILITIES, "record_decoder"):
            value = getattr(self, capability)
            if value is not None and not callable(value):
                raise TypeError(f"format {self.name!r}: {capability} must be callable or None.")
        if not self.provides:
            raise ValueError(
                f"format {self.name!r} offers none of {', '.join(CAPABILITIES)}; "
                "give it at least one."
            )
        object.__setattr__(self, "suffixes", tuple(s.lower() for s in suffixes))
        object.__setattr__(self, "url_patterns", patterns)
        object.__setattr__(self, "exports", _frozen_exports(self.name, self.exports))

    @property
    def provides(self) -> tuple[str, ...]:
        """The capabilities this format offers, in :data:`CAPABILITIES` order."""
        return tuple(c for c in CAPABILITIES if getattr(self, c) is not None)

    def get(self, capability: str) -> Callable[..., Any]:
        """Returns the factory for ``capability`` (one of :data:`CAPABILITIES`).

        Raises:
          ValueError: If ``capability`` is not a known capability.
          MissingCapabilityError: If this format does not offer it.
        """
        if capability not in CAPABILITIES:
            raise ValueError(f"Unknown capability {capability!r}; expected one of {CAPABILITIES}.")
        factory = getattr(self, capability)
        if factory is None:
            raise MissingCapabilityError(
                f"Format {self.name!r} has no {capability}; it offers: {', '.join(self.provides)}."
            )
        return factory

    def match_strength(self, path: str) -> int:
        """How specifically this format claims ``path``: 0 for not at all.

        A URL pattern match beats any suffix; among suffixes the longest wins
        (``.tfrecord.gz`` over ``.gz``).
        """
        if any(re.search(pattern, path) for pattern in self.url_patterns):
            return 1 << 16
        name = path_for_matching(path)
        return max((len(s) for s in self.suffixes if name.endswith(s)), default=0)


@runtime_checkable
class ShuffleStrategy(Protocol):
    """A way to shuffle a MapDataset, applied in one call.

    ``strategy.apply(ds, seed=42, **options)`` returns the shuffled dataset; with
    ``seed=None`` the strategy uses the pipeline's default seed (``ds.seed(...)``).
    """

    name: str
    description: str

    def apply(self, ds: MapDataset, *, seed: int | None = None, **options: Any) -> MapDataset:
        """Returns ``ds`` shuffled.

        Raises:
          TypeError: On an option the strategy does not know.
        """
        ...


@runtime_checkable
class ShardingPolicy(Protocol):
    """A way to pick this process's shard of a MapDataset, applied in one call.

    ``policy.apply(ds, ShardOptions(i, n))`` returns the elements shard ``i`` of ``n`` reads.
    """

    name: str
    description: str

    def apply(self, ds: MapDataset, options: ShardOptions | None = None) -> MapDataset:
        """Returns the shard of ``ds`` described by ``options``.

        Raises:
          ValueError: If the policy needs options and got none, or they do not fit it.
        """
        ...


class WorkerLostError(RuntimeError):
    """A worker of a :class:`WorkerGroup` is gone (killed, its node lost); the message names
    it. A group returns it in place of the results of every task the worker had."""


@dataclasses.dataclass(frozen=True)
class WorkerJob:
    """What ``mp_prefetch`` asks a :class:`WorkerBackend` to run.

    Attributes:
      num_workers: The pipeline's ``num_workers``: how many workers to start unless the
        backend was told otherwise (the output does not depend on it).
      make_worker: Picklable, shipped once to each worker: ``make_worker(index, count)``
        called there returns ``compute``; ``compute(task)`` returns the task's result (a
        picklable value; NumPy arrays in it may arrive read-only). A worker computes its tasks
        one at a time, in the order they were submitted to it.
      environ: Variables to set in a worker's process before ``make_worker`` runs, before
        anything there imports JAX (``JAX_PLATFORMS``: workers claim no accelerator).
    """

    num_workers: int
    make_worker: Callable[[int, int], Callable[[Any], Any]]
    environ: Mapping[str, str]


@runtime_checkable
class WorkerGroup(Protocol):
    """Running workers of a backend, as the ``mp_prefetch`` parent drives them."""

    def workers(self) -> list[int]:
        """The indices of the workers that can take tasks (not lost), ascending."""
        ...

    def submit(self, worker: int, task: Any) -> int:
        """Queues ``task`` on ``worker``; returns a ticket that ``wait`` reports it under."""
        ...

    def wait(self, timeout: float | None) -> list[tuple[int, Any]]:
        """Finished tasks as ``(ticket, result)``, waiting up to ``timeout`` seconds (None:
        until one finishes) when none has. ``result`` is ``compute``'s return value, a
        :class:`WorkerLostError` when its worker is gone (that worker then leaves
        ``workers()``), or the exception with which the call failed otherwise."""
        ...

    def describe(self, worker: int) -> str:
        """``worker`` for messages: what it is and where it runs."""
        ...

    def close(self) -> None:
        """Stops every worker and releases what they hold. Idempotent."""
        ...


@runtime_checkable
class WorkerBackend(Protocol):
    """Where ``mp_prefetch`` runs its workers when they are not local processes
    (``MultiprocessingOptions(backend=...)``): a name registered by a plugin, or the object.

    The parent keeps the pipeline's state and hands workers tasks (blocks of positions), so
    the output and the checkpoints are those of local workers.
    """

    name: str
    description: str

    def start(self, job: WorkerJob) -> WorkerGroup:
        """Starts the workers of ``job``.

        Raises:
          RuntimeError: If the workers cannot be started (the message says why).
        """
        ...


def _str_tuple(fmt: str, field: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise TypeError(f"format {fmt!r}: {field} must be a tuple of str, got {value!r}.")
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"format {fmt!r}: every entry of {field} must be a str, got {value!r}.")
    return tuple(value)


def _frozen_exports(
    fmt: str, exports: Mapping[str, Mapping[str, object]]
) -> Mapping[str, Mapping[str, object]]:
    frozen: dict[str, Mapping[str, object]] = {}
    for module, names in exports.items():
        if module not in PUBLIC_EXPORT_MODULES:
            raise ValueError(
                f"format {fmt!r} exports names into {module!r}; only "
                f"{', '.join(PUBLIC_EXPORT_MODULES)} resolve plugin names."
            )
        for public_name in names:
            if not public_name.isidentifier() or public_name.startswith("_"):
                raise ValueError(
                    f"format {fmt!r}: exported name {public_name!r} must be a public identifier."
                )
        frozen[module] = dict(names)
    return frozen

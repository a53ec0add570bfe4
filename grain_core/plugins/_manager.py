"""Loads plugins from entry points, once per process, and answers lookups.

Loading is lazy: nothing is imported until the first lookup. Each plugin is imported,
registered with pluggy, checked (``check_pending`` catches misspelled hooks) and asked for
its objects on its own, so one broken plugin is recorded with its traceback and the core
and the other plugins keep working.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

from grain_core._version import __version__
from grain_core.plugins import hookspecs
from grain_core.plugins._errors import (
    AmbiguousFormatError,
    MissingPluginError,
    NoFormatForPathError,
    PluginConflictError,
    PluginError,
    PluginWarning,
    UnknownPluginObjectError,
)
from grain_core.plugins._specs import (
    PUBLIC_EXPORT_MODULES,
    FormatSpec,
    ShardingPolicy,
    ShuffleStrategy,
    WorkerBackend,
    check_object_name,
    path_for_matching,
)

if TYPE_CHECKING:
    import importlib.metadata

__all__ = [
    "BUILTIN_PLUGIN",
    "DEFAULT_PLUGINS",
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV",
    "PluginReport",
    "Registry",
    "format_for_path",
    "get_format",
    "get_sharding_policy",
    "get_shuffle_strategy",
    "get_worker_backend",
    "list_formats",
    "list_sharding_policies",
    "list_shuffle_strategies",
    "list_worker_backends",
    "loaded_plugin_names",
    "plugin_install_command",
    "registry",
    "reset",
    "resolve_public_name",
]

ENTRY_POINT_GROUP = "grain_core"
PLUGINS_ENV = "GRAIN_CORE_PLUGINS"
DISABLE_ENV = "GRAIN_CORE_DISABLE_PLUGINS"
BUILTIN_PLUGIN = "builtins"
#: grain_core's own plugins, name -> module: imported by name and registered through the same
#: loader as an entry point's, before any of those. The modules live in the layers whose
#: objects they register, so the manager imports none of them.
DEFAULT_PLUGINS: Mapping[str, str] = {BUILTIN_PLUGIN: "grain_core._builtin_plugin"}


@dataclasses.dataclass(frozen=True)
class _Kind:
    key: str
    label: str
    hook: str
    type: type


_FORMATS = _Kind("formats", "format", "register_formats", FormatSpec)
_SHUFFLES = _Kind(
    "shuffle_strategies", "shuffle strategy", "register_shuffle_strategies", ShuffleStrategy
)
_SHARDINGS = _Kind(
    "sharding_policies", "sharding policy", "register_sharding_policies", ShardingPolicy
)
_BACKENDS = _Kind("worker_backends", "worker backend", "register_worker_backends", WorkerBackend)
_KINDS = (_FORMATS, _SHUFFLES, _SHARDINGS, _BACKENDS)
# Public names from FormatSpec.exports, keyed "module.Name", share the conflict rules.
_EXPORTS = _Kind("exports", "public name", "", object)


def plugin_install_command(package: str) -> str:
    """The command that installs first-party plugin ``package`` (its directory under
    ``plugins/``): its ``grainpipe-*`` distribution is on no package index yet, and alone it
    fails on its ``grainpipe`` dependency, so the core is installed beside it."""
    return f"pip install . ./plugins/{package} (in a clone of grain_core)"


@dataclasses.dataclass(frozen=True)
class _FirstParty:
    distribution: str
    package: str  # import name, also its directory under plugins/ in a source checkout
    suffixes: tuple[str, ...]
    public_names: tuple[str, ...]

    @property
    def install_hint(self) -> str:
        return plugin_install_command(self.package)


# The project's own format plugins: what to tell a user who needs one that is missing.
_FIRST_PARTY = (
    _FirstParty(
        "grainpipe-arrayrecord",
        "grain_arrayrecord",
        (".array_record",),
        ("ArrayRecordDataSource",),
    ),
    _FirstParty(
        "grainpipe-parquet",
        "grain_parquet",
        (".parquet",),
        ("ParquetIterDataset", "ParquetDataSource"),
    ),
    _FirstParty(
        "grainpipe-tfrecord",
        "grain_tfrecord",
        (".tfrecord",),
        ("TFRecordIterDataset", "TFRecordDataSource", "TFRecordWriter"),
    ),
)


@dataclasses.dataclass
class PluginReport:
    """What happened to one plugin when the registry loaded.

    Attributes:
      name: Entry-point name (``"builtins"`` for the core's own plugin).
      distribution: The distribution declaring the entry point, if known.
      version: Its version, if known.
      module: What the entry point loads.
      status: ``"loaded"``, ``"failed"``, ``"disabled"`` (``GRAIN_CORE_DISABLE_PLUGINS``)
        or ``"not selected"`` (``GRAIN_CORE_PLUGINS``).
      error: One-line reason when failed.
      traceback: Full traceback when failed.
      hooks: Hooks the plugin implements.
      provides: Registered names by kind (``formats``, ``shuffle_strategies``,
        ``sharding_policies``, ``worker_backends``, ``exports``).
    """

    name: str
    distribution: str | None
    version: str | None
    module: str
    status: str = "loaded"
    error: str | None = None
    traceback: str | None = None
    hooks: tuple[str, ...] = ()
    provides: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        """``plugin 'jsonl' (grain-jsonl 0.1.0)``, for messages."""
        origin = " ".join(p for p in (self.distribution, self.version) if p)
        return f"plugin {self.name!r}" + (f" ({origin})" if origin else "")

    def to_json(self) -> dict[str, Any]:
        """Returns the report as a JSON-serialisable dict."""
        return {**dataclasses.asdict(self), "hooks": list(self.hooks)}


_Registration = tuple[Any, PluginReport]


class Registry:
    """Everything the installed plugins registered, and what went wrong loading them.

    Args:
      environ: Where to read ``GRAIN_CORE_PLUGINS`` / ``GRAIN_CORE_DISABLE_PLUGINS``.
      default_plugins: The core's own plugins, name -> module, loaded before the entry points.
    """

    def __init__(
        self, environ: Mapping[str, str], default_plugins: Mapping[str, str] = DEFAULT_PLUGINS
    ) -> None:
        self.reports: list[PluginReport] = []
        self.problems: list[str] = []
        self._objects: dict[str, dict[str, list[_Registration]]] = {
            kind.key: {} for kind in (*_KINDS, _EXPORTS)
        }
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._load_all(environ, default_plugins)
        self._find_conflicts()
        self._warn()

    # Loading.

    def _load_all(self, environ: Mapping[str, str], default_plugins: Mapping[str, str]) -> None:
        for name, module in default_plugins.items():
            default = PluginReport(name, "grainpipe", __version__, module)
            self.reports.append(default)
            self._load_one(default, functools.partial(importlib.import_module, module))
        selected = _parse_env_names(environ, PLUGINS_ENV)
        disabled = _parse_env_names(environ, DISABLE_ENV) or set()
        seen: dict[str, PluginReport] = {}
        for entry_point in _entry_points():
            dist = entry_point.dist
            report = PluginReport(
                name=entry_point.name,
                distribution=dist.name if dist else None,
                version=dist.version if dist else None,
                module=entry_point.value,
            )
            previous = seen.get(report.name)
            if previous is not None:
                if previous.distribution == report.distribution:
                    continue  # The same distribution found twice on sys.path.
                self.reports.append(report)
                self._fail(
                    report,
                    f"plugin name {report.name!r} is also declared by {previous.label}; "
                    "uninstall one of the two distributions.",
                )
                continue
            seen[report.name] = report
            self.reports.append(report)
            keys = _plugin_keys(report)
            if selected is not None and not keys & selected:
                report.status = "not selected"
            elif keys & disabled:
                report.status = "disabled"
            else:
                self._load_one(report, entry_point.load)
        known = set().union(*(_plugin_keys(r) for r in seen.values()))
        for env_name, names in ((PLUGINS_ENV, selected or set()), (DISABLE_ENV, disabled)):
            for unknown in sorted(names - known):
                self.problems.append(
                    f"{env_name} names {unknown!r}, which is not an installed plugin "
                    f"(installed: {', '.join(sorted(seen)) or 'none'})."
                )

    def _load_one(self, report: PluginReport, load: Callable[[], object]) -> None:
        try:
            module = load()
            self._pm.register(module, name=report.name)
        except Exception as err:
            self._fail(report, f"could not be loaded: {_one_line(err)}")
            return
        try:
            self._pm.check_pending()
            collected = self._call_hooks(report)
        except Exception as err:
            self._pm.unregister(name=report.name)
            self._fail(report, _one_line(err))
            return
        report.hooks = tuple(sorted(c.name for c in self._pm.get_hookcallers(module) or ()))
        for kind, obj in collected:
            self._add(kind, obj.name, obj, report)
            if isinstance(obj, FormatSpec):
                for module_name, names in obj.exports.items():
                    for public_name, value in names.items():
                        self._add(_EXPORTS, f"{module_name}.{public_name}", value, report)

    def _call_hooks(self, report: PluginReport) -> list[tuple[_Kind, Any]]:
        # Hooks are called plugin by plugin (not through pm.hook.X(...), which stops at the
        # first exception) so that a raising hook is pinned on its own plugin.
        collected: list[tuple[_Kind, Any]] = []
        for kind in _KINDS:
            for impl in getattr(self._pm.hook, kind.hook).get_hookimpls():
                if impl.plugin_name != report.name:
                    continue

                def register(obj: object, kind: _Kind = kind) -> None:
                    collected.append((kind, _validated(kind, obj)))

                impl.function(**dict.fromkeys(impl.argnames, register))
        return collected

    def _add(self, kind: _Kind, name: str, obj: Any, report: PluginReport) -> None:
        self._objects[kind.key].setdefault(name, []).append((obj, report))
        report.provides.setdefault(kind.key, []).append(name)

    def _fail(self, report: PluginReport, reason: str) -> None:
        report.status = "failed"
        report.error = reason
        if sys.exc_info()[0] is not None:
            report.traceback = traceback.format_exc()

    def _find_conflicts(self) -> None:
        for kind in (*_KINDS, _EXPORTS):
            for name, registrations in sorted(self._objects[kind.key].items()):
                if len(registrations) > 1:
                    self.problems.append(_conflict_message(kind, name, registrations))

    def _warn(self) -> None:
        failures = [f"{r.label} failed: {r.error}" for r in self.reports if r.status == "failed"]
        if failures or self.problems:
            warnings.warn(
                "grain_core plugins: "
                + " ".join(failures + self.problems)
                + " Run `grain-core plugins` for details.",
                PluginWarning,
                stacklevel=2,
            )

    # Lookups.

    def objects(self, kind_key: str) -> list[Any]:
        """Returns the objects of a kind whose name only one plugin registered, by name."""
        return [regs[0][0] for _, regs in sorted(self._objects[kind_key].items()) if len(regs) == 1]

    def get(self, kind_key: str, name: str) -> Any:
        """Returns the object of a kind registered under ``name``.

        Raises:
          UnknownPluginObjectError: If no plugin registered it; lists the known names.
          PluginConflictError: If several plugins registered it; names them.
        """
        kind = next(k for k in (*_KINDS, _EXPORTS) if k.key == kind_key)
        registrations = self._objects[kind_key].get(name)
        if not registrations:
            known = ", ".join(sorted(self._objects[kind_key])) or "none"
            raise UnknownPluginObjectError(
                f"No {kind.label} named {name!r} is installed. Installed: {known}. "
                "Run `grain-core plugins` to see what each plugin provides."
            )
        if len(registrations) > 1:
            raise PluginConflictError(_conflict_message(kind, name, registrations))
        return registrations[0][0]

    def format_for_path(self, path: str) -> FormatSpec:
        """Returns the format that claims ``path`` most specifically.

        Raises:
          NoFormatForPathError: If no installed format claims it; says what to install.
          AmbiguousFormatError: If two formats claim it equally.
          PluginConflictError: If the claiming format's name is registered twice.
        """
        scored = [
            (fmt.match_strength(path), fmt, report)
            for registrations in self._objects[_FORMATS.key].values()
            for fmt, report in registrations
        ]
        best = max((score for score, _, _ in scored), default=0)
        if best == 0:
            raise NoFormatForPathError(self._no_format_message(path))
        winners = [(fmt, report) for score, fmt, report in scored if score == best]
        names = sorted({fmt.name for fmt, _ in winners})
        if len(names) > 1:
            claimants = ", ".join(f"{fmt.name!r} of {report.label}" for fmt, report in winners)
            raise AmbiguousFormatError(
                f"{path!r} is claimed equally by formats {claimants}. Name the format "
                f"explicitly, or block one plugin with {DISABLE_ENV}."
            )
        return self.get(_FORMATS.key, names[0])

    def _no_format_message(self, path: str) -> str:
        installed = "; ".join(
            f"{fmt.name} ({', '.join(fmt.suffixes + fmt.url_patterns)}) of plugin {report.name}"
            for registrations in self._objects[_FORMATS.key].values()
            for fmt, report in registrations
        )
        message = f"No installed format claims {path!r}. Installed formats: {installed or 'none'}."
        file_name = path_for_matching(path)
        for first_party in _FIRST_PARTY:
            if any(file_name.endswith(s) for s in first_party.suffixes):
                return f"{message} {first_party.suffixes[0]} files need: {first_party.install_hint}"
        claimed = {suffix for fmt in self.objects(_FORMATS.key) for suffix in fmt.suffixes}
        missing = [fp for fp in _FIRST_PARTY if not claimed.issuperset(fp.suffixes)]
        if not missing:
            return f"{message} Name the format explicitly, or install a plugin for this format."
        return (
            f"{message} Install a plugin for this format (first-party, not installed: "
            + ", ".join(fp.install_hint for fp in missing)
            + ") or name the format explicitly."
        )

    def resolve_public_name(self, module: str, name: str) -> object:
        """Returns the object a plugin exports as ``module.name``.

        Raises:
          MissingPluginError: If ``name`` belongs to a first-party plugin that is not
            installed or not loaded; the message says what to install or fix.
          PluginConflictError: If two plugins export it.
          AttributeError: If nothing provides the name.
        """
        registrations = self._objects[_EXPORTS.key].get(f"{module}.{name}")
        if registrations:
            return self.get(_EXPORTS.key, f"{module}.{name}")
        owner = next((fp for fp in _FIRST_PARTY if name in fp.public_names), None)
        if owner is None or module not in PUBLIC_EXPORT_MODULES:
            raise AttributeError(f"module {module!r} has no attribute {name!r}", name=name)
        report = next(
            (r for r in self.reports if _normalise(r.distribution) == owner.distribution), None
        )
        if report is None:
            reason = f"which is not installed: {owner.install_hint}"
        elif report.status == "failed":
            reason = (
                f"which is installed but failed to load: {report.error} "
                "(`grain-core plugins` shows the traceback)"
            )
        elif report.status == "loaded":
            reason = (
                f"but the installed version does not export it: pip install -U {owner.distribution}"
            )
        else:
            reason = f"which is installed but {report.status} by {PLUGINS_ENV}/{DISABLE_ENV}"
        raise MissingPluginError(
            f"{module}.{name} is provided by the {owner.distribution} plugin, {reason}.",
            name=owner.package,
        )


def _validated(kind: _Kind, obj: object) -> Any:
    if not isinstance(obj, kind.type):
        raise TypeError(
            f"{kind.hook} expects {kind.type.__name__} objects, got {type(obj).__name__}: {obj!r}"
        )
    check_object_name(kind.label, getattr(obj, "name", None))
    return obj


def _conflict_message(kind: _Kind, name: str, registrations: list[_Registration]) -> str:
    owners = " and ".join(report.label for _, report in registrations)
    return (
        f"{kind.label} {name!r} is registered by both {owners}; uninstall one, or block it "
        f"with {DISABLE_ENV}=<plugin name>."
    )


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    import importlib.metadata  # import cost: ~20 ms a process loading no plugin skips

    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return sorted(found, key=lambda ep: (ep.name, ep.dist.name if ep.dist else ""))


def _parse_env_names(environ: Mapping[str, str], variable: str) -> set[str] | None:
    """Returns the comma-separated names in ``variable``, or None if it is unset."""
    value = environ.get(variable)
    if value is None:
        return None
    return {_normalise(part.strip()) for part in value.split(",") if part.strip()}


def _plugin_keys(report: PluginReport) -> set[str]:
    """Names a user may write in the environment variables: entry point or distribution."""
    return {_normalise(report.name)} | (
        {_normalise(report.distribution)} if report.distribution else set()
    )


def _normalise(name: str | None) -> str:
    return re.sub(r"[-_.]+", "-", name or "").lower()


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0]


_registry: Registry | None = None
_lock = threading.RLock()
_loading = False


def registry() -> Registry:
    """Returns the process-wide registry, loading the plugins on first use.

    Raises:
      PluginError: If a plugin looks objects up while it is being imported.
    """
    global _registry, _loading
    if _registry is not None:
        return _registry
    with _lock:
        if _registry is None:
            if _loading:
                raise PluginError(
                    "A plugin used the grain_core plugin registry while plugins were being "
                    "loaded; look plugin objects up when they are used, not at import time."
                )
            _loading = True
            try:
                _registry = Registry(os.environ)
            finally:
                _loading = False
        return _registry


def loaded_plugin_names() -> list[str] | None:
    """Names of the plugins this process has loaded (the core's default plugins left out), or
    None if it has not loaded plugins yet. Worker processes load the same set."""
    loaded = _registry
    if loaded is None:
        return None
    return [
        r.name for r in loaded.reports if r.status == "loaded" and r.name not in DEFAULT_PLUGINS
    ]


def reset() -> None:
    """Forgets the loaded registry; the next lookup loads plugins again.

    For tests and for programs that change ``GRAIN_CORE_PLUGINS`` at run time.
    """
    global _registry
    with _lock:
        _registry = None


def list_formats() -> list[FormatSpec]:
    """Returns the installed formats, by name (names registered twice are left out)."""
    return registry().objects(_FORMATS.key)


def list_shuffle_strategies() -> list[ShuffleStrategy]:
    """Returns the installed shuffle strategies, by name."""
    return registry().objects(_SHUFFLES.key)


def list_sharding_policies() -> list[ShardingPolicy]:
    """Returns the installed sharding policies, by name."""
    return registry().objects(_SHARDINGS.key)


def list_worker_backends() -> list[WorkerBackend]:
    """Returns the installed worker backends, by name."""
    return registry().objects(_BACKENDS.key)


#: The project's own worker backends: the distribution that provides each.
_FIRST_PARTY_BACKENDS = {"ray": _FirstParty("grainpipe-ray", "grain_ray", (), ("RayBackend",))}


def get_worker_backend(name: str) -> WorkerBackend:
    """Returns the worker backend called ``name`` (``"ray"``, ...).

    Raises:
      MissingPluginError: If it is a first-party backend whose plugin is not installed.
      UnknownPluginObjectError / PluginConflictError: See :meth:`Registry.get`.
    """
    reg = registry()
    owner = _FIRST_PARTY_BACKENDS.get(name)
    if owner is not None and name not in reg._objects[_BACKENDS.key]:
        raise MissingPluginError(
            f"Worker backend {name!r} is provided by the {owner.distribution} plugin, which "
            f"is not installed or not loaded: {owner.install_hint}.",
            name=owner.package,
        )
    return reg.get(_BACKENDS.key, name)  # type: ignore[no-any-return]


def get_format(name: str) -> FormatSpec:
    """Returns the format called ``name``.

    Raises:
      UnknownPluginObjectError / PluginConflictError: See :meth:`Registry.get`.
    """
    return registry().get(_FORMATS.key, name)


def get_shuffle_strategy(name: str) -> ShuffleStrategy:
    """Returns the shuffle strategy called ``name`` (``"global"``, ``"window"``, ...).

    Raises:
      UnknownPluginObjectError / PluginConflictError: See :meth:`Registry.get`.
    """
    return registry().get(_SHUFFLES.key, name)


def get_sharding_policy(name: str) -> ShardingPolicy:
    """Returns the sharding policy called ``name`` (``"even_split"``, ``"strided"``, ...).

    Raises:
      UnknownPluginObjectError / PluginConflictError: See :meth:`Registry.get`.
    """
    return registry().get(_SHARDINGS.key, name)


def format_for_path(path: str | os.PathLike[str]) -> FormatSpec:
    """Returns the installed format that claims ``path`` (by URL pattern, then suffix).

    Raises:
      NoFormatForPathError / AmbiguousFormatError / PluginConflictError: See
        :meth:`Registry.format_for_path`.
    """
    return registry().format_for_path(os.fspath(path))


def resolve_public_name(module: str, name: str) -> object:
    """Resolves a plugin-provided public name; for module-level ``__getattr__``.

    Usage in ``grain_core/sources.py``::

        def __getattr__(name: str) -> object:
            return resolve_public_name(__name__, name)

    Raises:
      MissingPluginError / PluginConflictError / AttributeError: See
        :meth:`Registry.resolve_public_name`.
    """
    if name.startswith("_"):
        # Dunder probes (``__path__`` on every ``from m import x``, ``__wrapped__``) must not
        # import every plugin; exported names are public, so nothing is lost.
        raise AttributeError(f"module {module!r} has no attribute {name!r}", name=name)
    return registry().resolve_public_name(module, name)

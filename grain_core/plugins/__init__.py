"""The plugin system: formats, shuffle strategies, sharding policies and worker backends from
entry points.

A plugin is a module named by an entry point in the ``grain_core`` group whose
:func:`hookimpl`-marked functions register typed objects (:class:`FormatSpec`,
:class:`ShuffleStrategy`, :class:`ShardingPolicy`, :class:`WorkerBackend`). See
``docs/writing-a-plugin.md``.

Environment:
  GRAIN_CORE_PLUGINS: comma-separated plugin names to load; empty loads none (the
    core's built-ins always load).
  GRAIN_CORE_DISABLE_PLUGINS: comma-separated plugin names not to load.
"""

from __future__ import annotations

from grain_core.plugins._errors import (
    AmbiguousFormatError,
    MissingCapabilityError,
    MissingPluginError,
    NoFormatForPathError,
    PluginConflictError,
    PluginError,
    PluginWarning,
    UnknownPluginObjectError,
)
from grain_core.plugins._manager import (
    BUILTIN_PLUGIN,
    DEFAULT_PLUGINS,
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    PLUGINS_ENV,
    PluginReport,
    Registry,
    format_for_path,
    get_format,
    get_sharding_policy,
    get_shuffle_strategy,
    get_worker_backend,
    list_formats,
    list_sharding_policies,
    list_shuffle_strategies,
    list_worker_backends,
    loaded_plugin_names,
    plugin_install_command,
    registry,
    reset,
    resolve_public_name,
)
from grain_core.plugins._specs import (
    CAPABILITIES,
    FormatInfo,
    FormatSpec,
    RecordWriter,
    ShardingPolicy,
    ShuffleStrategy,
    WorkerBackend,
    WorkerGroup,
    WorkerJob,
    WorkerLostError,
)
from grain_core.plugins.hookspecs import hookimpl

__all__ = [
    "BUILTIN_PLUGIN",
    "CAPABILITIES",
    "DEFAULT_PLUGINS",
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV",
    "AmbiguousFormatError",
    "FormatInfo",
    "FormatSpec",
    "MissingCapabilityError",
    "MissingPluginError",
    "NoFormatForPathError",
    "PluginConflictError",
    "PluginError",
    "PluginReport",
    "PluginWarning",
    "RecordWriter",
    "Registry",
    "ShardingPolicy",
    "ShuffleStrategy",
    "UnknownPluginObjectError",
    "WorkerBackend",
    "WorkerGroup",
    "WorkerJob",
    "WorkerLostError",
    "format_for_path",
    "get_format",
    "get_sharding_policy",
    "get_shuffle_strategy",
    "get_worker_backend",
    "hookimpl",
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

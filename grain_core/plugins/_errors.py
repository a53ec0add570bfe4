"""Exceptions and the warning category of the plugin system."""

from __future__ import annotations

__all__ = [
    "AmbiguousFormatError",
    "MissingCapabilityError",
    "MissingPluginError",
    "NoFormatForPathError",
    "PluginConflictError",
    "PluginError",
    "PluginWarning",
    "UnknownPluginObjectError",
]


class PluginError(Exception):
    """Base class of every error raised by the plugin system."""


class PluginConflictError(PluginError):
    """Two plugins registered the same name; the message names both distributions."""


class UnknownPluginObjectError(PluginError, KeyError):
    """No installed plugin registered an object of this kind under this name."""

    def __str__(self) -> str:
        # KeyError would print the message in quotes.
        return str(self.args[0])


class NoFormatForPathError(PluginError, ValueError):
    """No installed format claims a path."""


class AmbiguousFormatError(PluginError, ValueError):
    """Several installed formats claim a path equally well."""


class MissingCapabilityError(PluginError, NotImplementedError):
    """A format does not offer the requested capability (source, writer, ...)."""


class MissingPluginError(PluginError, ModuleNotFoundError):
    """A public name belongs to a first-party plugin that is not installed or not loaded.

    It is an ``ImportError`` so ``from grain_core.sources import ArrayRecordDataSource``
    keeps the install hint and ``except ImportError`` guards for optional formats work.
    """


class PluginWarning(UserWarning):
    """Emitted once per registry load when plugins failed or the environment is wrong."""

"""Shard patterns: the one parser that every format, ``grain-core inspect`` / ``convert`` and
the sources use to turn what the user wrote into files.

Forms (local paths or URLs), each also one of several paths:

* a file that exists as named: itself (even if its name holds ``@`` or glob characters);
* ``x@N``: ``x-00000-of-0000N`` ... ``x-0000(N-1)-of-0000N``, the names ``convert`` writes;
* ``x-*-of-N`` / ``x-?????-of-N``: those N files, all of which must exist;
* ``x-*`` and any other glob (``*``, ``?``, ``[...]``): the matches, sorted;
* anything else: itself (its opener says when it is missing).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from grain_core import storage

__all__ = ["expand", "shard_names"]

_AT_COUNT = re.compile(r"^(?P<base>.+)@(?P<count>\d+)$")
_OF_COUNT = re.compile(r"^(?P<base>.+)-(?:\*|\?+)-of-(?P<count>\d+)$")


def shard_names(base: str, count: int) -> list[str]:
    """The names of ``count`` shards of ``base``: ``base-0000i-of-0000N``."""
    return [f"{base}-{i:05d}-of-{count:05d}" for i in range(count)]


def expand(
    paths: storage.PathArg | Sequence[storage.PathArg],
    storage_options: Mapping[str, Any] | None = None,
    *,
    what: str = "Reading",
) -> list[str]:
    """The files ``paths`` (one path or pattern, or a sequence of them) name, in order.

    Args:
      paths: See the module docstring.
      storage_options: For URLs, passed to their fsspec file system (listings).
      what: Who reads the files, for messages.

    Raises:
      ValueError: If nothing is given.
      FileNotFoundError: If a pattern matches no file, or a shard of ``x@N`` /
        ``x-*-of-N`` is missing, naming it.
    """
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    files = [name for item in items for name in _expand_one(item, storage_options)]
    if not files:
        raise ValueError(f"{what} needs at least one path.")
    return files


def _expand_one(item: storage.PathArg, storage_options: Mapping[str, Any] | None) -> list[str]:
    text = storage.path_string(item)
    at_count = _AT_COUNT.match(text)
    of_count = _OF_COUNT.match(text)
    if (at_count or storage.has_magic(text)) and storage.exists(text, storage_options):
        return [text]
    if at_count:
        names = shard_names(at_count["base"], int(at_count["count"]))
        # Local names are checked here (a URL's, when opened: a check would cost a request).
        missing = [n for n in names if not storage.is_url(n) and not os.path.exists(n)]
        if missing:
            raise FileNotFoundError(
                f"{text!r} names {len(names)} shards, but {missing[0]!r}"
                + (f" and {len(missing) - 1} more are" if len(missing) > 1 else " is")
                + " missing; check the directory and the shard count."
            )
        return names
    if storage.has_magic(text):
        found = [storage.path_string(f) for f in storage.glob(text, storage_options)]
        if of_count and len(found) != int(of_count["count"]):
            raise FileNotFoundError(
                f"{text!r} names {of_count['count']} shards, but {len(found)} files match; "
                "check the directory and the shard count."
            )
        return found
    return [text]

"""Turning the ``paths`` argument into read instructions: files plus record ranges.

Accepted forms: a path, a shard pattern (``x@N``, ``x-*-of-N``, ``x-*``, any glob: see
``grain_core.shard_names``), ``"file[start:end]"`` (records ``start`` to ``end - 1``), or a
FileInstruction-like object (TFDS protocol: ``filename``, ``skip``, ``take``,
``examples_in_shard``), alone or in a sequence. Paths may be URLs (``gs://``, ``s3://``, any
fsspec URL): their globs are listed through ``grain_core.storage``, and their existence is
checked when they are opened (a local check would call every URL missing).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from grain_core import shard_names, storage

__all__ = ["FileInstructionLike", "ReadInstruction", "PathsArg", "parse_paths"]

# "file[start:end]". Any bracketed suffix holding a colon is taken as a read instruction (glob
# character classes never contain one), so a malformed range gets a clear error instead of
# being expanded as a glob that matches nothing.
_RANGE_SUFFIX_RE = re.compile(r"^(?P<path>.+)\[(?P<start>[^\[\]:]*):(?P<end>[^\[\]:]*)\]$")


@runtime_checkable
class FileInstructionLike(Protocol):
    """TFDS's FileInstruction: read records ``[skip, skip + take)`` of ``filename``."""

    filename: str
    skip: int
    take: int
    examples_in_shard: int


PathsArg = str | os.PathLike[str] | FileInstructionLike | Sequence[Any]


@dataclasses.dataclass(frozen=True)
class ReadInstruction:
    """Records ``[start, end)`` of ``path``; ``end`` is None until the file is opened.

    Attributes:
      path: The file.
      start: First record read.
      end: One past the last record read, or None for "to the end of the file".
      text: How the user wrote it, for error messages.
    """

    path: str
    start: int
    end: int | None
    text: str


def parse_paths(
    paths: PathsArg, storage_options: Mapping[str, Any] | None = None
) -> list[ReadInstruction]:
    """Returns the read instructions ``paths`` describes, globs expanded in sorted order.

    Args:
      paths: See the module docstring.
      storage_options: For URLs, passed to their fsspec file system (globs).

    Raises:
      ValueError: If ``paths`` is empty, an element has the wrong type, or a range is invalid.
      FileNotFoundError: If a file does not exist or a glob matches nothing.
    """
    items: Sequence[Any]
    if isinstance(paths, str | os.PathLike) or isinstance(paths, FileInstructionLike):
        items = [paths]
    elif isinstance(paths, Sequence):
        items = paths
    else:
        raise ValueError(
            "ArrayRecordDataSource paths must be a path, a glob, 'file[start:end]', a "
            f"FileInstruction or a sequence of those; got {type(paths).__name__}: {paths!r}."
        )
    if not items:
        raise ValueError("ArrayRecordDataSource needs at least one path; got an empty sequence.")
    instructions: list[ReadInstruction] = []
    for item in items:
        instructions.extend(_parse_one(item, storage_options))
    return instructions


def _exists(path: str) -> bool:
    """Whether a local file exists; URLs are taken to exist until they are opened."""
    return storage.is_url(path) or os.path.exists(path)


def _parse_one(item: Any, storage_options: Mapping[str, Any] | None) -> list[ReadInstruction]:
    if isinstance(item, FileInstructionLike):
        return [_from_file_instruction(item)]
    if not isinstance(item, str | os.PathLike):
        raise ValueError(
            "Each ArrayRecordDataSource path must be a str, os.PathLike or FileInstruction; "
            f"got {type(item).__name__}: {item!r}."
        )
    text = storage.path_string(item)
    if not storage.is_url(text) and os.path.exists(text):
        return [ReadInstruction(text, 0, None, text)]
    match = _RANGE_SUFFIX_RE.match(text)
    if match:
        return [_from_range_string(text, match)]
    files = shard_names.expand(text, storage_options, what="ArrayRecordDataSource")
    missing = [f for f in files if not _exists(f)]
    if missing:
        raise FileNotFoundError(f"ArrayRecord file {missing[0]!r} does not exist.")
    return [ReadInstruction(f, 0, None, f) for f in files]


def _from_range_string(text: str, match: re.Match[str]) -> ReadInstruction:
    path = match["path"]
    try:
        start, end = int(match["start"]), int(match["end"])
    except ValueError:
        raise ValueError(
            f"Read instruction {text!r} has an invalid range: write 'file[start:end]' with "
            "integers 0 <= start <= end."
        ) from None
    if not 0 <= start <= end:
        raise ValueError(
            f"Read instruction {text!r} has an invalid range [{start}:{end}]: need "
            "0 <= start <= end."
        )
    if not _exists(path):
        raise FileNotFoundError(f"ArrayRecord file {path!r} (from {text!r}) does not exist.")
    return ReadInstruction(path, start, end, text)


def _from_file_instruction(instruction: FileInstructionLike) -> ReadInstruction:
    path = storage.path_string(instruction.filename)
    skip, take, total = instruction.skip, instruction.take, instruction.examples_in_shard
    text = f"FileInstruction({path}, skip={skip}, take={take}, examples_in_shard={total})"
    if take == -1:  # TFDS spelling of "to the end of the shard"
        take = total - skip
    if not (0 <= skip and 0 <= take and skip + take <= total):
        raise ValueError(
            f"{text} is invalid: need skip >= 0, take >= 0 (or -1) and skip + take <= "
            "examples_in_shard."
        )
    if not _exists(path):
        raise FileNotFoundError(f"ArrayRecord file {path!r} (from {text}) does not exist.")
    return ReadInstruction(path, skip, skip + take, text)

"""The TFRecord frame: checksums, compression, byte streams and the errors for bad files.

A TFRecord file is a sequence of frames::

    uint64 length  (little-endian)
    uint32 masked CRC32C of the 8 length bytes
    byte   payload[length]
    uint32 masked CRC32C of the payload

A masked CRC is ``rotate_right(crc, 15) + 0xA282EAD8`` (mod 2**32): masking keeps the CRC of
data that itself contains CRCs well distributed. A whole file may be GZIP- or ZLIB-compressed
as one stream.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Final

import crc32c

from grain_core import shard_names

__all__ = [
    "COMPRESSIONS",
    "FOOTER_SIZE",
    "FRAME_OVERHEAD",
    "HEADER",
    "HEADER_SIZE",
    "MASK_DELTA",
    "U32",
    "U64",
    "WBITS",
    "CorruptRecordError",
    "PathLike",
    "compression_for",
    "compression_hint",
    "crc_error",
    "expand_paths",
    "masked_crc",
    "truncated_error",
]

# A local path, an os.PathLike, or a URL (s3://, gs://, any fsspec protocol).
PathLike = str | os.PathLike[str]

HEADER: Final = struct.Struct("<QI")
U32: Final = struct.Struct("<I")
U64: Final = struct.Struct("<Q")
HEADER_SIZE: Final = HEADER.size
FOOTER_SIZE: Final = U32.size
FRAME_OVERHEAD: Final = HEADER_SIZE + FOOTER_SIZE
MASK_DELTA: Final = 0xA282EAD8

COMPRESSIONS: Final = ("GZIP", "ZLIB")
WBITS: Final = {"GZIP": 16 + zlib.MAX_WBITS, "ZLIB": zlib.MAX_WBITS}
_SUFFIX_COMPRESSION: Final = {".gz": "GZIP", ".gzip": "GZIP", ".zz": "ZLIB", ".zlib": "ZLIB"}


def masked_crc(data: bytes | bytearray | memoryview) -> int:
    """Returns the masked CRC32C of ``data``, as stored in TFRecord frames."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & 0xFFFFFFFF


class CorruptRecordError(ValueError):
    """A TFRecord file is damaged, truncated or not a TFRecord file at all.

    Attributes:
      path: The file.
      offset: Byte offset of the frame that failed (in the decompressed stream for
        compressed files).
      reason: What failed: ``"length CRC"``, ``"data CRC"``, ``"truncated header"`` or
        ``"truncated payload"``.
    """

    def __init__(self, message: str, *, path: str, offset: int, reason: str) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps the attributes when the error crosses a process boundary (mp_prefetch).
        return (_rebuild_error, (str(self), self.path, self.offset, self.reason))


def _rebuild_error(message: str, path: str, offset: int, reason: str) -> CorruptRecordError:
    return CorruptRecordError(message, path=path, offset=offset, reason=reason)


def crc_error(path: str, offset: int, which: str, head: bytes) -> CorruptRecordError:
    """Builds the error for a frame at ``offset`` whose ``which`` checksum does not match."""
    message = f"{path}: {which} mismatch in the record at byte offset {offset}: the file is corrupt"
    if offset == 0 and which == "length CRC":
        message += f"{compression_hint(head)} or is not a TFRecord file"
    message += (
        ". Nothing was returned for this record. Re-create or re-download the file; "
        "verify_crc=False skips the check (unsafe: corrupt data is returned as is)."
    )
    return CorruptRecordError(message, path=path, offset=offset, reason=which)


def truncated_error(
    path: str, offset: int, needed: int, available: int, what: str
) -> CorruptRecordError:
    """Builds the error for a frame at ``offset`` that the end of the file cuts short."""
    return CorruptRecordError(
        f"Not a valid TFRecord. Fewer than {needed} bytes: {path} ends {available} bytes after "
        f"the {what} of the record at byte offset {offset} began (truncated file, or not a "
        "TFRecord file).",
        path=path,
        offset=offset,
        reason=f"truncated {what}",
    )


def compression_hint(head: bytes) -> str:
    """Returns ``" (it looks GZIP-compressed: pass compression='GZIP')"`` or ``""``."""
    if head[:2] == b"\x1f\x8b":
        return " (it looks GZIP-compressed: pass compression='GZIP')"
    if len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0:
        return " (it looks ZLIB-compressed: pass compression='ZLIB')"
    return ""


def compression_for(path: str, compression: str | None) -> str | None:
    """Returns ``"GZIP"``, ``"ZLIB"`` or None: the given ``compression`` or the path's suffix.

    Raises:
      ValueError: If ``compression`` is not None, ``""``, ``"GZIP"`` or ``"ZLIB"``.
    """
    if compression is None:
        # The suffix before a shard's: x.tfrecord.gz-00000-of-00004 is GZIP-compressed too.
        suffix = os.path.splitext(_SHARD_NAME.sub("", path))[1].lower()
        return _SUFFIX_COMPRESSION.get(suffix)
    name = compression.upper()
    if name in ("", "NONE"):
        return None
    if name not in COMPRESSIONS:
        raise ValueError(
            f"Unknown TFRecord compression {compression!r} for {path}; use None, 'GZIP' or 'ZLIB'."
        )
    return name


_SHARD_NAME = re.compile(r"-\d+-of-\d+$")


def expand_paths(
    paths: PathLike | Sequence[PathLike],
    what: str,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Turns a path, a sequence of paths or shard patterns into the list of files, in order
    (``grain_core.shard_names.expand``: ``x@N``, ``x-*-of-N``, ``x-*``, globs; local or URLs).

    Raises:
      ValueError: If nothing is given.
      FileNotFoundError: If a pattern matches no file or a named shard is missing, naming it.
    """
    return shard_names.expand(paths, storage_options, what=what)

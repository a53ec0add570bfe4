"""Fetching the bytes of remote row groups ahead of decoding, concurrently and within a budget.

A remote file read row group by row group costs one round trip per row group, one after
another, and the decoder waits for each. Here the row groups still to be read are grouped into
windows of consecutive row groups of about ``budget / _WINDOWS_IN_FLIGHT`` bytes (at least one
row group); up to ``_WINDOWS_IN_FLIGHT`` windows are fetched at once on a small thread pool,
each with one ranged read per run of adjacent column chunks, while the held bytes (fetched or
being fetched, not yet consumed) stay within the budget. Only the column chunks of the columns
read are fetched.

The decoder opens a window as a ``ParquetFile`` over the fetched bytes with the footer already
read (``metadata=``): pyarrow then reads exactly the column chunks, which are in memory.

A loopback S3 server (moto) copies the whole object for every ranged GET, so few large
windows pay there; on S3 itself several concurrent GETs of 8 MB and more are what reaches
full bandwidth. Measured figures, with the footer read once per dataset (``FooterCache``),
are in ``docs/storage.md``.
"""

from __future__ import annotations

import bisect
import concurrent.futures
from collections.abc import Sequence
from typing import Any

import pyarrow.parquet as pq

from grain_parquet._files import ParquetPath, RangeFile

__all__ = ["DEFAULT_PREFETCH_BYTES", "RowGroupPrefetcher"]

#: Default bound of the bytes one remote file's read-ahead holds.
DEFAULT_PREFETCH_BYTES = 128 * 1024 * 1024

# Windows fetched at the same time (the pool's width); the budget is split between them.
_WINDOWS_IN_FLIGHT = 4
# Column chunks closer than this are fetched by one ranged read, gap included.
_MAX_GAP = 64 * 1024


class RowGroupPrefetcher:
    """Fetches row groups of one file ahead of a reader that takes them in order.

    Args:
      file: The (remote) file.
      metadata: Its footer.
      row_groups: The row groups read, in reading order.
      columns: The top-level columns read (None: all).
      budget: Bound of the bytes held: fetched or in flight and not yet consumed; one window
        is always allowed, however large.
      read_kwargs: ``ParquetFile`` options for decoding.
      file_size: The file's size in bytes.
    """

    def __init__(
        self,
        file: ParquetPath,
        metadata: pq.FileMetaData,
        row_groups: Sequence[int],
        columns: Sequence[str] | None,
        budget: int,
        read_kwargs: dict[str, Any],
        file_size: int,
    ) -> None:
        self._file = file
        self._file_size = file_size
        self._metadata = metadata
        self._read_kwargs = {**read_kwargs, "pre_buffer": False}
        ranges = [_column_chunk_ranges(metadata, g, columns) for g in row_groups]
        self._windows = _plan_windows(ranges, max(1, budget // _WINDOWS_IN_FLIGHT))
        self._window_starts = [first for first, _ in self._windows]
        self._window_ranges = [
            _coalesce([r for p in range(first, stop) for r in ranges[p]])
            for first, stop in self._windows
        ]
        self._window_bytes = [sum(e - s for s, e in rs) for rs in self._window_ranges]
        self._budget = budget
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._fetching: dict[int, concurrent.futures.Future[_FetchedBytes]] = {}
        self._held = 0
        self._next = 0  # the next window to submit

    def parquet_file(self, pos: int) -> pq.ParquetFile:
        """The ``ParquetFile`` holding the row group at position ``pos`` of ``row_groups``.

        Waits for its window; windows before it are released and more are fetched ahead.
        Reading out of order (after a restore) starts the read-ahead again from ``pos``.

        Raises:
          OSError: If the fetch failed.
        """
        window = bisect.bisect_right(self._window_starts, pos) - 1
        if window not in self._fetching:
            self._cancel()
            self._next = window
        for done in [w for w in self._fetching if w < window]:
            self._release(done)
        self._fill()
        fetched = self._fetching[window].result()
        return pq.ParquetFile(fetched, metadata=self._metadata, **self._read_kwargs)

    def _fill(self) -> None:
        """Submits windows while they fit the budget (the first always does)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                _WINDOWS_IN_FLIGHT, thread_name_prefix="grain-parquet-fetch"
            )
        while self._next < len(self._windows):
            size = self._window_bytes[self._next]
            if self._fetching and self._held + size > self._budget:
                return
            ranges = self._window_ranges[self._next]
            self._fetching[self._next] = self._pool.submit(self._fetch, ranges)
            self._held += size
            self._next += 1

    def _fetch(self, ranges: list[tuple[int, int]]) -> _FetchedBytes:
        data = self._file.read_ranges(ranges)
        return _FetchedBytes(self._file, self._file_size, ranges, data)

    def _release(self, window: int) -> None:
        self._fetching.pop(window).cancel()
        self._held -= self._window_bytes[window]

    def _cancel(self) -> None:
        for window in list(self._fetching):
            self._release(window)

    def close(self) -> None:
        """Drops what was fetched and stops the threads (fetches in flight finish)."""
        self._cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _column_chunk_ranges(
    metadata: pq.FileMetaData, row_group: int, columns: Sequence[str] | None
) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of the column chunks ``columns`` needs in a row group.

    A leaf column belongs to top-level column ``c`` when its path is ``c`` or starts with
    ``c.``; a top-level name holding a dot may select a few chunks more, never fewer.
    """
    group = metadata.row_group(row_group)
    ranges = []
    for index in range(group.num_columns):
        chunk = group.column(index)
        path = chunk.path_in_schema
        if columns is not None and not any(path == c or path.startswith(c + ".") for c in columns):
            continue
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
        start = chunk.data_page_offset if start is None else min(start, chunk.data_page_offset)
        ranges.append((start, start + chunk.total_compressed_size))
    return ranges


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges, those at most ``_MAX_GAP`` apart merged."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start - merged[-1][1] <= _MAX_GAP:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _plan_windows(ranges: list[list[tuple[int, int]]], target: int) -> list[tuple[int, int]]:
    """Splits positions ``0 .. len(ranges)`` into runs ``(first, stop)`` of about ``target``
    bytes each (a row group larger than ``target`` is a window of its own)."""
    windows: list[tuple[int, int]] = []
    first, size = 0, 0
    for pos, chunks in enumerate(ranges):
        chunk_bytes = sum(e - s for s, e in chunks)
        if pos > first and size + chunk_bytes > target:
            windows.append((first, pos))
            first, size = pos, 0
        size += chunk_bytes
    windows.append((first, len(ranges)))
    return windows


class _FetchedBytes(RangeFile):
    """A read-only file of which only some byte ranges are held (in memory).

    pyarrow reads through it exactly the column chunks whose bytes were fetched; a read
    elsewhere (a writer that recorded a chunk size too small) is fetched from the file then.
    """

    def __init__(
        self,
        file: ParquetPath,
        size: int,
        ranges: list[tuple[int, int]],
        data: Sequence[bytes],
    ) -> None:
        super().__init__(self._held_or_fetched, size)
        self._file = file
        self._starts = [start for start, _ in ranges]
        self._ranges = ranges
        self._data = list(data)

    def _held_or_fetched(self, start: int, end: int) -> Any:
        """Bytes ``[start, end)``, as a view of the fetched bytes where held."""
        index = bisect.bisect_right(self._starts, start) - 1
        if index >= 0 and end <= self._ranges[index][1]:
            offset = start - self._starts[index]
            return memoryview(self._data[index])[offset : offset + end - start]
        (data,) = self._file.read_ranges([(start, end)])
        return data

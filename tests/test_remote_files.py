"""Remote files through fsspec: the streamed download behind ``storage.open_read``."""

from __future__ import annotations

from typing import Any

import pytest

from grain_core import _remote_files


class _StreamedFile:
    def __init__(self, data: bytes, closed: list[bool]) -> None:
        self.data, self.pos, self.size, self.closed = data, 0, len(data), closed

    async def read(self, length: int) -> bytes:
        out = self.data[self.pos : self.pos + length]
        self.pos += len(out)
        return out

    async def close(self) -> None:
        self.closed.append(True)


@pytest.mark.parametrize("read_to_end", [True, False])
def test_a_streamed_download_closes_its_file_when_done_or_left(read_to_end: bool) -> None:
    fsspec_asyn = pytest.importorskip("fsspec.asyn")
    closed: list[bool] = []

    class StreamingFileSystem(fsspec_asyn.AsyncFileSystem):  # type: ignore[misc, name-defined]
        async def open_async(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
            return _StreamedFile(b"x" * 3000, closed)

    fs = StreamingFileSystem(skip_instance_cache=True)
    download = _remote_files.StreamedDownload(fs, "f", budget=1000)
    assert download.size() == 3000
    if read_to_end:
        assert b"".join(iter(download.take, b"")) == b"x" * 3000
    else:  # the reader leaves the stream (the budget holds the download back meanwhile)
        download.take()
        download.cancel()
    fsspec_asyn.sync(fs.loop, _until_closed, closed)
    assert closed == [True]


async def _until_closed(closed: list[bool]) -> None:
    """Lets the event loop run the download's last steps (a cancellation takes a few)."""
    import asyncio

    for _ in range(100):
        if closed:
            return
        await asyncio.sleep(0)

"""Parquet on object storage, against a real S3-compatible server (moto) on 127.0.0.1: read
through ``grain_core.storage`` like every other reader (its options, retries and errors).
Runs where moto[server] and s3fs are installed (``nox -s tests-remote``, ``tests-all``).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
pytest.importorskip("grain_parquet")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from grain_parquet import ParquetDataSource, ParquetIterDataset  # noqa: E402
from s3_server import running_s3_server, running_s3_server_with_user  # noqa: E402

from grain_core import storage  # noqa: E402

ROWS, ROW_GROUP = 4000, 500


def _parquet_bytes() -> bytes:
    table = pa.table({"id": np.arange(ROWS), "x": np.arange(ROWS) * 0.5})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=ROW_GROUP)
    return buffer.getvalue()


def _ids(batches: Any) -> list[int]:
    return [int(i) for batch in batches for i in batch["id"]]


def test_storage_options_and_fsspec_configuration_reach_the_store(s3: Any) -> None:
    for k in range(2):
        storage.write_bytes(f"{s3.url}/pq/part-{k}.parquet", _parquet_bytes(), s3.options)
    pattern = f"{s3.url}/pq/part-*.parquet"
    ds = ParquetIterDataset(pattern, column_batch_size=ROW_GROUP, storage_options=s3.options)
    assert sorted(_ids(ds)) == sorted(list(range(ROWS)) * 2)
    source = ParquetDataSource(pattern, storage_options=s3.options)
    assert len(source) == 2 * ROWS and source[ROWS + 7]["id"] == 7
    # Without options, fsspec's configuration (here: the fixture's endpoint and keys) applies,
    # also to row groups read by pyarrow (no read-ahead).
    unfetched = ParquetIterDataset(f"{s3.url}/pq/part-0.parquet", prefetch_bytes=0)
    assert [int(row["id"]) for row in unfetched] == list(range(ROWS))


def test_a_refused_request_is_a_permission_error_naming_the_url() -> None:
    # A user who may look objects up (HEAD) and list them, but not read them.
    with running_s3_server_with_user(
        "locked", {"data.parquet": _parquet_bytes()}, ["s3:Head*", "s3:List*"]
    ) as (server, looker):
        url = "s3://locked/data.parquet"
        denied = f"Access to {url} was denied"
        # Refused at the first request (no IAM user), and at the first read of the bytes.
        with pytest.raises(PermissionError, match=denied):
            ParquetIterDataset(url, storage_options=server.storage_options())
        with pytest.raises(PermissionError, match=denied):
            ParquetIterDataset(url, storage_options=looker)
        with pytest.raises(PermissionError, match=denied):
            ParquetDataSource(url, storage_options=looker)


@pytest.mark.parametrize("prefetch_bytes", [1, 0])
def test_the_server_lost_mid_read_is_a_storage_error_naming_the_url_and_range(
    prefetch_bytes: int,
) -> None:
    with running_s3_server() as server:
        options = server.storage_options(config_kwargs={"retries": {"max_attempts": 2}})
        url = f"{server.make_bucket()}/data.parquet"
        storage.write_bytes(url, _parquet_bytes(), options)
        # A budget of 1 byte fetches one row group at a time, when it is reached.
        ds = ParquetIterDataset(
            url,
            column_batch_size=ROW_GROUP,
            prefetch_bytes=prefetch_bytes,
            storage_options=options,
        )
        source = ParquetDataSource(url, storage_options=options, cache_bytes=0)
        it = iter(ds)
        assert _ids([next(it)]) == list(range(ROW_GROUP))
        assert source[0]["id"] == 0
        server.process.kill()
        server.process.wait()
        pattern = f"Reading bytes \\d+-\\d+ of {url} failed after the file system's retries"
        for read in (lambda: next(it), lambda: source[ROWS - 1]):
            with pytest.raises(storage.StorageError, match=pattern) as info:
                read()
            assert info.value.url == url and info.value.byte_range is not None
            assert "corrupt" not in str(info.value)

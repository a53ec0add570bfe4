"""The grainpipe-parquet plugin: streaming, random access, writer, inspector and bad input.

Files are written by pyarrow (or the plugin's writer) in temporary directories.
"""

from __future__ import annotations

import json
import pickle
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

grain_parquet = pytest.importorskip("grain_parquet")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

import grain_core as grain  # noqa: E402
from grain_core import cli, plugins  # noqa: E402
from grain_core.experimental import (  # noqa: E402
    SupportsNextBlock,
    WindowShuffleMapDataset,
    get_next_index,
    set_next_index,
)
from grain_core.sources import ColumnBlock  # noqa: E402
from grain_core.testing import (  # noqa: E402
    assert_equal_output_after_checkpoint,
    assert_trees_equal,
    check_iterator_conformance,
    check_random_access_source,
)

ParquetDataSource = grain_parquet.ParquetDataSource
ParquetIterDataset = grain_parquet.ParquetIterDataset
ParquetWriter = grain_parquet.ParquetWriter


@pytest.fixture(autouse=True)
def _fresh_global_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAIN_CORE_PLUGINS", raising=False)
    monkeypatch.delenv("GRAIN_CORE_DISABLE_PLUGINS", raising=False)
    plugins.reset()


def _table(start: int, stop: int) -> pa.Table:
    ids = np.arange(start, stop, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "score": (ids / 4).astype(np.float32),
            "text": [f"row {i}" for i in ids],
            "vec": pa.FixedSizeListArray.from_arrays(
                pa.array(np.repeat(ids, 3).astype(np.float32)), 3
            ),
        }
    )


def _write(path: Path, start: int, stop: int, row_group_size: int) -> str:
    pq.write_table(_table(start, stop), path, row_group_size=row_group_size)
    return str(path)


@pytest.fixture
def one_file(tmp_path: Path) -> str:
    """23 rows in row groups of 5 (the last holds 3)."""
    return _write(tmp_path / "one.parquet", 0, 23, 5)


@pytest.fixture
def three_files(tmp_path: Path) -> list[str]:
    """Rows 0-9, 10-16, 17-29 in files with row groups of 4, 3 and 5."""
    return [
        _write(tmp_path / "a.parquet", 0, 10, 4),
        _write(tmp_path / "b.parquet", 10, 17, 3),
        _write(tmp_path / "c.parquet", 17, 30, 5),
    ]


def _row(i: int) -> dict[str, Any]:
    return {
        "id": np.int64(i),
        "score": np.float32(i / 4),
        "text": f"row {i}",
        "vec": np.full(3, i, dtype=np.float32),
    }


def _ids(elements: Sequence[dict[str, Any]]) -> list[int]:
    return [int(e["id"]) for e in elements]


# ------------------------------------------------------------------------ plugin
def test_registered_as_the_parquet_format() -> None:
    fmt = plugins.format_for_path("/data/train.parquet-00001-of-00004")
    assert fmt.name == "parquet"
    assert plugins.format_for_path("x.PQ") is fmt
    assert fmt.provides == ("source", "iter_dataset", "writer", "inspector")
    assert grain.experimental.ParquetIterDataset is ParquetIterDataset  # type: ignore[attr-defined]
    assert grain.experimental.ParquetDataSource is ParquetDataSource  # type: ignore[attr-defined]
    assert grain.sources.ParquetDataSource is ParquetDataSource  # type: ignore[attr-defined]


def test_write_then_read_through_the_lookup_api(tmp_path: Path) -> None:
    path = tmp_path / "rows.pq"
    fmt = plugins.format_for_path(path)
    with fmt.get("writer")(path, row_group_size=4) as writer:
        for i in range(10):
            writer.write({"id": i, "vec": np.full(2, i, dtype=np.int32)})
    assert _ids(list(fmt.get("iter_dataset")(str(path)))) == list(range(10))
    assert int(fmt.get("source")(str(path))[7]["id"]) == 7
    info = fmt.get("inspector")(str(path), 2)
    assert info.num_records == 10


# -------------------------------------------------------------------- streaming
def test_rows_are_dicts_of_numpy_values(one_file: str) -> None:
    rows = list(ParquetIterDataset(one_file))
    assert len(rows) == 23
    for i, row in enumerate(rows):
        assert_trees_equal(row, _row(i))
    assert type(rows[0]["id"]) is np.int64 and type(rows[0]["score"]) is np.float32


def test_single_file_state_is_row_group_and_index(one_file: str) -> None:
    it = iter(ParquetIterDataset(one_file))
    assert it.get_state() == {"row_group": 0, "index_within_row_group": 0}
    for _ in range(7):
        next(it)
    assert it.get_state() == {"row_group": 1, "index_within_row_group": 2}
    for _ in range(16):
        next(it)
    assert it.get_state() == {"row_group": 5, "index_within_row_group": 0}
    with pytest.raises(StopIteration):
        next(it)


def test_single_file_conformance_at_every_position(one_file: str) -> None:
    out = check_iterator_conformance(lambda: ParquetIterDataset(one_file), positions=range(24))
    assert _ids(out) == list(range(23))


def test_restoring_inside_small_record_batches(one_file: str) -> None:
    # Two rows per record batch: restores land in the middle of a row group's batches.
    out = check_iterator_conformance(
        lambda: ParquetIterDataset(one_file, read_batch_size=2), positions=range(24)
    )
    assert _ids(out) == list(range(23))
    assert_equal_output_after_checkpoint(ParquetIterDataset(one_file, read_batch_size=2))


def test_multiple_files_interleave_with_interleave_state(three_files: list[str]) -> None:
    ds = ParquetIterDataset(three_files)
    out = check_iterator_conformance(ds, positions=[0, 1, 5, 17, 29, 30])
    # cycle_length 16 >= 3 files: one row from each file in turn, exhausted files drop out.
    assert _ids(out)[:9] == [0, 10, 17, 1, 11, 18, 2, 12, 19]
    assert sorted(_ids(out)) == list(range(30))
    state = iter(ds).get_state()
    assert set(state) == {
        "next_index_in_cycle",
        "next_index_in_datasets",
        "iterators_in_use_indices",
        "iterators_in_use_states",
        "exhausted",
        "future_states",
    }
    assert state["iterators_in_use_states"][0] == {"row_group": 0, "index_within_row_group": 0}


def test_cycle_length_one_chains_files(three_files: list[str]) -> None:
    ds = ParquetIterDataset(three_files, cycle_length=1)
    assert _ids(check_iterator_conformance(ds, positions=[0, 9, 10, 11, 30])) == list(range(30))


def test_columns_projection_and_order(three_files: list[str]) -> None:
    ds = ParquetIterDataset(three_files, columns=["vec", "id"], cycle_length=1)
    assert ds.columns == ("vec", "id")
    rows = list(ds)
    assert list(rows[4]) == ["vec", "id"]
    assert_trees_equal(rows[4], {"vec": np.full(3, 4, dtype=np.float32), "id": np.int64(4)})


def _corrupt_column(path: str, column: str) -> None:
    """Overwrites the data of ``column`` in every row group with garbage."""
    metadata = pq.ParquetFile(path).metadata
    index = metadata.schema.to_arrow_schema().get_field_index(column)
    data = bytearray(Path(path).read_bytes())
    for g in range(metadata.num_row_groups):
        chunk = metadata.row_group(g).column(index)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    Path(path).write_bytes(bytes(data))


def test_projection_does_not_read_other_columns(one_file: str) -> None:
    _corrupt_column(one_file, "text")
    assert _ids(ParquetIterDataset(one_file, columns=["id", "vec"])) == list(range(23))
    source = ParquetDataSource(one_file, columns=["id"])
    assert int(source[22]["id"]) == 22
    with pytest.raises(ValueError, match=r"row group 0 of Parquet file .*one\.parquet"):
        list(ParquetIterDataset(one_file))
    with pytest.raises(ValueError, match=r"row group 4 of Parquet file .*one\.parquet"):
        ParquetDataSource(one_file)[21]


def _overwrite_values(path: str, row_group: int, column: str) -> None:
    """Overwrites 8 bytes of the values of ``column`` in ``row_group``, headers untouched."""
    metadata = pq.ParquetFile(path).metadata
    index = metadata.schema.to_arrow_schema().get_field_index(column)
    chunk = metadata.row_group(row_group).column(index)
    end = chunk.data_page_offset + chunk.total_compressed_size
    data = bytearray(Path(path).read_bytes())
    data[end - 8 : end] = bytes(255 - b for b in data[end - 8 : end])
    Path(path).write_bytes(bytes(data))


def _write_with_plugin(path: Path) -> str:
    with ParquetWriter(path, row_group_size=5, compression="none", use_dictionary=False) as w:
        w.write_columns({"id": np.arange(23, dtype=np.int64), "score": np.arange(23) / 4})
    return str(path)


def _write_with_pyarrow(path: Path) -> str:
    table = pa.table({"id": np.arange(23, dtype=np.int64), "score": np.arange(23) / 4})
    pq.write_table(
        table,
        path,
        row_group_size=5,
        compression="none",
        use_dictionary=False,
        write_page_checksum=True,
    )
    return str(path)


@pytest.mark.parametrize("write", [_write_with_plugin, _write_with_pyarrow])
def test_pages_that_fail_their_checksum_name_file_row_group_and_column(
    tmp_path: Path, write: Callable[[Path], str]
) -> None:
    path = write(tmp_path / "rot.parquet")
    _overwrite_values(path, 2, "score")
    expected = r"rot\.parquet: a page of row group 2, column 'score' does not match its checksum"
    with pytest.raises(ValueError, match=expected):
        list(ParquetIterDataset(path))
    with pytest.raises(ValueError, match=expected):
        list(ParquetIterDataset(path, read_batch_size=2, columns=["score", "id"]))
    source = ParquetDataSource(path)
    assert float(source[9]["score"]) == 9 / 4  # other row groups still read
    with pytest.raises(ValueError, match=expected):
        source[10]
    # Opting out reads the changed values without a word: what the default prevents.
    unchecked = ParquetDataSource(path, page_checksum_verification=False)
    changed = [unchecked[i]["score"] for i in range(10, 15)]
    assert changed != [i / 4 for i in range(10, 15)]
    assert [r["id"] for r in ParquetIterDataset(path, page_checksum_verification=False)] == list(
        range(23)
    )


def test_column_batches_equal_batched_rows(one_file: str) -> None:
    rows = grain.experimental.ParquetIterDataset(one_file).batch(4)  # type: ignore[attr-defined]
    columns = ParquetIterDataset(one_file, column_batch_size=4)
    for expected, batch in zip(rows, columns, strict=True):
        assert list(batch) == ["id", "score", "text", "vec"]
        for name in ("id", "score", "vec"):
            assert_trees_equal(batch[name], expected[name])
        assert batch["text"].tolist() == expected["text"].tolist()


def test_column_batches_of_several_files_come_from_one_file_each(three_files: list[str]) -> None:
    out = check_iterator_conformance(
        lambda: ParquetIterDataset(three_files, column_batch_size=4), positions=[0, 3, 8]
    )
    assert [b["id"].tolist() for b in out[:4]] == [
        [0, 1, 2, 3],
        [10, 11, 12, 13],
        [17, 18, 19, 20],
        [4, 5, 6, 7],
    ]


def test_column_batches_span_row_groups_and_restore(one_file: str) -> None:
    def make() -> Any:
        return ParquetIterDataset(one_file, column_batch_size=7, read_batch_size=3)

    out = check_iterator_conformance(make, positions=range(5))
    assert [len(b["id"]) for b in out] == [7, 7, 7, 2]
    assert np.concatenate([b["id"] for b in out]).tolist() == list(range(23))
    assert out[1]["vec"].shape == (7, 3)


def test_column_batches_are_zero_copy_for_numbers(one_file: str) -> None:
    batch = next(iter(ParquetIterDataset(one_file, column_batch_size=5)))
    assert not batch["id"].flags.writeable and not batch["vec"].flags.writeable
    assert batch["text"].dtype == object


@given(
    num_rows=st.integers(0, 40),
    row_group_size=st.integers(1, 10),
    read_batch_size=st.integers(1, 8),
    column_batch_size=st.one_of(st.none(), st.integers(1, 9)),
    position=st.integers(0, 41),
)
def test_any_layout_restores_anywhere(
    num_rows: int,
    row_group_size: int,
    read_batch_size: int,
    column_batch_size: int | None,
    position: int,
) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = _write(Path(directory) / "h.parquet", 0, num_rows, row_group_size)
        ds = ParquetIterDataset(
            path,
            columns=["id"],
            read_batch_size=read_batch_size,
            column_batch_size=column_batch_size,
        )
        out = list(ds)
        ids = [np.atleast_1d(e["id"]).tolist() for e in out]
        assert sum(ids, []) == list(range(num_rows))
        if column_batch_size is not None:
            assert all(len(b) == column_batch_size for b in ids[:-1])
        position = min(position, len(out))
        it = iter(ds)
        for _ in range(position):
            next(it)
        restored = iter(ds)
        restored.set_state(it.get_state())
        assert [np.atleast_1d(e["id"]).tolist() for e in restored] == ids[position:]


@given(
    num_rows=st.integers(0, 30),
    row_group_size=st.integers(1, 8),
    read_batch_size=st.integers(1, 6),
    column_batch_size=st.one_of(st.none(), st.integers(1, 7)),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5),
)
def test_blocks_are_the_rows_and_states_of_next(
    num_rows: int,
    row_group_size: int,
    read_batch_size: int,
    column_batch_size: int | None,
    sizes: list[int],
) -> None:
    import itertools
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = _write(Path(directory) / "b.parquet", 0, num_rows, row_group_size)
        ds = ParquetIterDataset(
            path,
            columns=["id"],
            read_batch_size=read_batch_size,
            column_batch_size=column_batch_size,
        )
        blocks, single = iter(ds), iter(ds)
        assert isinstance(blocks, SupportsNextBlock)
        for max_size in itertools.cycle(sizes):
            block = blocks.next_block(max_size)
            assert len(block) <= max_size
            for k, element in enumerate(block.elements):
                assert block.state_after(k) == single.get_state()
                assert np.array_equal(next(single)["id"], element["id"])
            assert block.state_after(len(block)) == single.get_state() == blocks.get_state()
            if not block.elements:
                break
        with pytest.raises(StopIteration):
            next(single)


def test_null_and_variable_length_values(tmp_path: Path) -> None:
    path = tmp_path / "nulls.parquet"
    table = pa.table(
        {
            "x": pa.array([1.5, None, 3.0]),
            "tags": pa.array([[1, 2], [], None]),
            "s": ["a", None, "c"],
        }
    )
    pq.write_table(table, path)
    rows = list(ParquetIterDataset(str(path)))
    assert np.isnan(rows[1]["x"]) and rows[1]["s"] is None and rows[2]["tags"] is None
    assert rows[0]["tags"].tolist() == [1, 2]
    assert_trees_equal(ParquetDataSource(str(path))[0], rows[0])


def test_empty_file_yields_nothing(tmp_path: Path) -> None:
    path = tmp_path / "empty.parquet"
    pq.write_table(_table(0, 0), path)
    check_iterator_conformance(ParquetIterDataset(str(path)))
    assert len(ParquetDataSource(str(path))) == 0


def test_a_file_rewritten_with_other_row_groups_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "f.parquet")
    pq.write_table(pa.table({"x": np.arange(100)}), path, row_group_size=10)
    ds = ParquetIterDataset(path)
    pq.write_table(pa.table({"x": np.arange(30)}), path, row_group_size=10)
    with pytest.raises(
        ValueError, match=r"f\.parquet has 3 row groups, where it had 10.*rewritten"
    ):
        iter(ds)


def test_next_index(one_file: str) -> None:
    it = iter(ParquetIterDataset(one_file))
    set_next_index(it, 12)
    assert int(next(it)["id"]) == 12
    assert get_next_index(it) == 13
    batches = iter(ParquetIterDataset(one_file, column_batch_size=10))
    set_next_index(batches, 2)
    assert next(batches)["id"].tolist() == [20, 21, 22]
    assert get_next_index(batches) == 3


def test_closed_iterator_raises(one_file: str) -> None:
    it = iter(ParquetIterDataset(one_file))
    next(it)
    it.close()
    with pytest.raises(ValueError, match="closed iterator"):
        next(it)


# ---------------------------------------------------------------------- slicing
def test_with_slice_splits_files_or_row_groups_without_mutating(
    one_file: str, three_files: list[str]
) -> None:
    for paths, first_shard in (
        (one_file, [0, 1, 2, 3, 4, 10, 11, 12, 13, 14, 20, 21, 22]),
        (three_files, [*range(10), *range(17, 30)]),
    ):
        ds = ParquetIterDataset(paths)
        shards = [ds.with_slice(slice(i, None, 2)) for i in range(2)]
        assert sorted(_ids(shards[0])) == first_shard
        assert sorted(_ids(shards[0]) + _ids(shards[1])) == list(range(len(_ids(ds))))
        check_iterator_conformance(shards[1], positions=[0, 3, 5])
    one = ParquetIterDataset(one_file)
    one.with_slice(slice(1, None, 2))
    assert len(list(one)) == 23


def test_checkpoint_of_another_slicing_is_rejected(one_file: str) -> None:
    it = iter(ParquetIterDataset(one_file).with_slice(slice(0, None, 2)))
    with pytest.raises(ValueError, match=r"one\.parquet points at row group 1, which this"):
        it.set_state({"row_group": 1, "index_within_row_group": 0})
    with pytest.raises(ValueError, match="row 9 of row group 0, which has 5 rows"):
        it.set_state({"row_group": 0, "index_within_row_group": 9})


def test_mp_prefetch_two_workers_is_deterministic_and_resumable(three_files: list[str]) -> None:
    options = grain.MultiprocessingOptions(num_workers=2)

    def make() -> Any:
        return (
            ParquetIterDataset(three_files, columns=["id"])
            .map(lambda r: int(r["id"]))
            .mp_prefetch(options)
        )

    # Worker 0 reads files a and c (interleaved), worker 1 file b; the parent alternates.
    out = check_iterator_conformance(make, positions=[7])
    assert sorted(out) == list(range(30))
    assert out[:6] == [0, 10, 17, 11, 1, 12]


def test_mp_prefetch_single_file_splits_row_groups(one_file: str) -> None:
    ds = ParquetIterDataset(one_file, column_batch_size=5).map(lambda b: b["id"].tolist())
    out = list(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    assert out == [list(range(k, min(k + 5, 23))) for k in range(0, 23, 5)]


# ----------------------------------------------------------------- random access
def test_source_conformance_over_files(three_files: list[str]) -> None:
    source = ParquetDataSource(three_files)
    assert len(source) == 30
    check_random_access_source(source)
    for i in (0, 9, 10, 16, 17, 29):
        assert_trees_equal(source[i], _row(i))
    assert _ids(source.__getitems__([29, 0, 13, 13, 4])) == [29, 0, 13, 13, 4]
    assert source.row_group_starts.tolist() == [0, 4, 8, 10, 13, 16, 17, 22, 27, 30]


def test_len_needs_no_data_pages(one_file: str) -> None:
    _corrupt_column(one_file, "id")
    assert len(ParquetDataSource(one_file)) == 23


def test_getitems_reads_each_row_group_once(one_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    original = pq.ParquetFile.read_row_group

    def counting(self: pq.ParquetFile, i: int, *args: Any, **kwargs: Any) -> pa.Table:
        reads.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    source = ParquetDataSource(one_file, cache_bytes=0)
    assert _ids(source.__getitems__([22, 0, 21, 1, 6, 2])) == [22, 0, 21, 1, 6, 2]
    assert sorted(reads) == [0, 1, 4]
    assert source.cached_bytes == 0
    reads.clear()
    cached = ParquetDataSource(one_file)
    cached.__getitems__([0, 1])
    cached.__getitems__([2, 3, 4, 7])
    assert reads == [0, 1]


class _RowsOnly:
    """The same source without its columnar read: what every batch would get without it."""

    def __init__(self, source: ParquetDataSource) -> None:
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._source[index]

    def __getitems__(self, keys: Sequence[int]) -> list[dict[str, Any]]:
        return self._source.__getitems__(keys)

    def __repr__(self) -> str:
        return repr(self._source)


class _CountingColumns(ParquetDataSource):
    column_reads = 0

    def read_columns(self, record_keys: Sequence[Any]) -> Sequence[dict[str, Any]]:
        type(self).column_reads += 1
        return super().read_columns(record_keys)


def test_read_columns_are_the_rows_of_getitems(three_files: list[str]) -> None:
    source = ParquetDataSource(three_files)
    keys = [29, 0, 12, 12, 5, 17, 3]  # across files and row groups, unordered, repeated
    block = source.read_columns(keys)
    assert isinstance(block, ColumnBlock) and len(block) == len(keys)
    assert_trees_equal(list(block), source.__getitems__(keys))
    assert source.read_columns([]) == []
    with pytest.raises(IndexError, match="out of range"):
        source.read_columns([30])


def _batches(ds: Any) -> list[Any]:
    return list(ds.to_iter_dataset()) if isinstance(ds, grain.MapDataset) else list(ds)


def test_batches_read_columns_and_equal_the_row_path(three_files: list[str]) -> None:
    counting = _CountingColumns(three_files)
    rows_only = _RowsOnly(ParquetDataSource(three_files))

    def pipelines(source: Any) -> list[Any]:
        base = grain.MapDataset.source(source).seed(5)
        return [
            base.batch(4),
            base.shuffle().repeat(2).batch(7, drop_remainder=True),
            WindowShuffleMapDataset(base, window_size=5).batch(3),
            grain.DataLoader(
                data_source=source,
                sampler=grain.samplers.IndexSampler(
                    len(source), shuffle=True, seed=2, num_epochs=1
                ),
                operations=[grain.transforms.Batch(4)],
            ),
        ]

    for ds, twin in zip(pipelines(counting), pipelines(rows_only), strict=True):
        before = _CountingColumns.column_reads
        assert_trees_equal(_batches(ds), _batches(twin))
        assert _CountingColumns.column_reads > before


@pytest.mark.parametrize("workers", [1, 2])
def test_dataloader_batches_in_workers_equal_the_row_path(
    three_files: list[str], workers: int
) -> None:
    def loader(source: Any, worker_count: int) -> grain.DataLoader:
        return grain.DataLoader(
            data_source=source,
            sampler=grain.samplers.IndexSampler(len(source), shuffle=True, seed=4, num_epochs=1),
            operations=[grain.transforms.Batch(4)],
            worker_count=worker_count,
        )

    expected = list(loader(_RowsOnly(ParquetDataSource(three_files)), 0))
    assert_trees_equal(list(loader(ParquetDataSource(three_files), workers)), expected)


def test_batches_of_columns_with_nulls_equal_the_row_path(tmp_path: Path) -> None:
    path = tmp_path / "nulls.parquet"
    table = pa.table(
        {
            "n": pa.array([1, 2, None, 4, 5, 6]),  # a float column with NaN in NumPy
            "s": pa.array(["a", "b", "c", None, "e", "f"]),
            "tags": pa.array([[1], [2, 3], [], [4], None, [5]]),
        }
    )
    pq.write_table(table, path, row_group_size=4)
    source, rows_only = ParquetDataSource(str(path)), _RowsOnly(ParquetDataSource(str(path)))
    for size in (1, 2, 3):
        ds, twin = (grain.MapDataset.source(s).batch(size) for s in (source, rows_only))
        for i in range(len(ds)):
            try:
                want = twin[i]
            except ValueError as error:
                with pytest.raises(ValueError) as got:
                    ds[i]
                assert str(got.value) == str(error)
            else:
                assert_trees_equal(ds[i], want)


def test_a_fixed_size_list_column_with_nulls_in_some_row_groups(tmp_path: Path) -> None:
    # A 2-D array in the row group without nulls, an object array of rows in the other: the
    # reads that span both give one object array of rows instead of NumPy's error.
    path = tmp_path / "fixed.parquet"
    values = pa.array([[0, 0], None, [2, 2], [3, 3]], pa.list_(pa.float32(), 2))
    pq.write_table(pa.table({"v": values}), path, row_group_size=2)
    source = ParquetDataSource(str(path))
    rows = source.__getitems__([0, 3, 1])
    assert [None if r["v"] is None else r["v"].tolist() for r in rows] == [[0, 0], [3, 3], None]
    (column,) = source.read_columns([0, 3]).columns
    assert column.dtype == object and [v.tolist() for v in column] == [[0, 0], [3, 3]]
    (batch,) = ParquetIterDataset(str(path), column_batch_size=4)
    assert [None if v is None else v.tolist() for v in batch["v"]] == [[0, 0], None, [2, 2], [3, 3]]


def test_cache_is_bounded_and_least_recently_used_goes_first(one_file: str) -> None:
    probe = ParquetDataSource(one_file)
    sizes = []
    for g in range(3):
        before = probe.cached_bytes
        probe[5 * g]
        sizes.append(probe.cached_bytes - before)
    assert 0 < sizes[1] <= sizes[2]
    source = ParquetDataSource(one_file, cache_bytes=sizes[0] + sizes[2])
    for i in (0, 5, 0, 10):  # row groups 0, 1, 0 (now most recent), 2 evicts 1
        source[i]
        assert source.cached_bytes <= source.cache_bytes
    assert list(source._cache) == [0, 2]
    with pytest.raises(ValueError, match="cache_bytes must be a non-negative int"):
        ParquetDataSource(one_file, cache_bytes=-1)


def test_concurrent_reads_decode_each_row_group_once(
    three_files: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    lock = threading.Lock()
    original = pq.ParquetFile.read_row_group

    def counting(self: pq.ParquetFile, i: int, *args: Any, **kwargs: Any) -> pa.Table:
        with lock:
            reads.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    source = ParquetDataSource(three_files)
    results: dict[int, list[int]] = {}
    barrier = threading.Barrier(8)

    keys = {k: np.random.default_rng(k).permutation(30).tolist() for k in range(8)}

    def read(k: int) -> None:
        barrier.wait(timeout=10)
        results[k] = _ids(source.__getitems__(keys[k]))

    threads = [threading.Thread(target=read, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == keys
    assert len(reads) == 9  # 3 + 3 + 3 row groups, each decoded once


def test_shuffled_sharded_batched_pipeline_with_checkpoints(three_files: list[str]) -> None:
    source = ParquetDataSource(three_files)
    policy = plugins.get_sharding_policy("even_split")
    shards = []
    for shard in range(2):
        ds = grain.MapDataset.source(source).seed(5)
        ds = policy.apply(ds, grain.sharding.ShardOptions(shard, 2)).shuffle().batch(4)
        out = check_iterator_conformance(ds, positions=[0, 2, 4])
        shards.append(np.concatenate([b["id"] for b in out]).tolist())
    assert sorted(shards[0] + shards[1]) == list(range(30))
    assert shards[0] != sorted(shards[0])


def test_window_shuffle_over_row_groups(three_files: list[str]) -> None:
    ds = grain.MapDataset.source(ParquetDataSource(three_files)).seed(3)
    ds = WindowShuffleMapDataset(ds, window_size=5).map(lambda r: int(r["id"]))
    out = check_iterator_conformance(ds, positions=[0, 4, 12])
    assert [sorted(out[k : k + 5]) for k in range(0, 30, 5)] == [
        list(range(k, k + 5)) for k in range(0, 30, 5)
    ]


def test_source_in_worker_processes(three_files: list[str]) -> None:
    shuffled = grain.MapDataset.source(ParquetDataSource(three_files)).seed(1).shuffle()
    ds = shuffled.map(lambda r: int(r["id"])).to_iter_dataset()
    expected = list(ds)
    out = check_iterator_conformance(
        ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)), positions=[11]
    )
    assert out == expected


# ---------------------------------------------------------------- file systems
def test_file_uris(one_file: str) -> None:
    uri = Path(one_file).as_uri()
    assert _ids(ParquetIterDataset(uri, memory_map=True)) == list(range(23))
    assert len(ParquetDataSource([uri, one_file])) == 46


def test_fsspec_filesystem(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    with ParquetWriter("/grain-parquet-test/mem.parquet", filesystem=fs, row_group_size=4) as w:
        w.write_columns({"id": np.arange(10)})
    ds = ParquetIterDataset("/grain-parquet-test/mem.parquet", filesystem=fs)
    assert _ids(ds) == list(range(10))
    source = ParquetDataSource("memory://grain-parquet-test/mem.parquet")
    assert int(source[9]["id"]) == 9
    fs.rm("/grain-parquet-test", recursive=True)


class _RecordingMemoryFS:
    """An fsspec memory filesystem that records the ranged reads of each ``cat_ranges``."""

    def __new__(cls) -> Any:
        from fsspec.implementations.memory import MemoryFileSystem

        class Recording(MemoryFileSystem):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__(skip_instance_cache=True)
                self.requests: list[list[tuple[int, int]]] = []

            def cat_ranges(self, paths: Any, starts: Any, ends: Any, **kwargs: Any) -> Any:
                self.requests.append(list(zip(starts, ends, strict=True)))
                return super().cat_ranges(paths, starts, ends, **kwargs)

        return Recording()


def _chunk_ranges(path: str, fs: Any, column: str) -> list[tuple[int, int]]:
    with fs.open(path, "rb") as f:
        metadata = pq.ParquetFile(f).metadata
    index = metadata.schema.to_arrow_schema().get_field_index(column)
    ranges = []
    for g in range(metadata.num_row_groups):
        chunk = metadata.row_group(g).column(index)
        start = (
            chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        )
        ranges.append((start, start + chunk.total_compressed_size))
    return ranges


@pytest.fixture
def remote_file() -> Any:
    """24 rows in 12 row groups of 2 on an fsspec memory filesystem (a remote file); each row
    holds a 40 KB ``blob`` of random bytes, so a row group's blobs are more than the gap that
    ranged reads bridge."""
    pytest.importorskip("fsspec")
    fs = _RecordingMemoryFS()
    path = "/grain-parquet-remote/r.parquet"
    blobs = [np.random.default_rng(i).bytes(40_000) for i in range(24)]
    with fs.open(path, "wb") as f:
        pq.write_table(_table(0, 24).append_column("blob", pa.array(blobs)), f, row_group_size=2)
    yield fs, path
    fs.rm("/grain-parquet-remote", recursive=True)


def test_remote_rows_are_fetched_ahead_in_windows_of_row_groups(remote_file: Any) -> None:
    fs, path = remote_file
    total = sum(e - s for s, e in _coalesced_all(path, fs))
    # Windows of at most a quarter of the budget, about 3 of the 12 row groups each, and
    # one ranged read per window (its column chunks are adjacent).
    ds = ParquetIterDataset(path, filesystem=fs, prefetch_bytes=total)
    assert _ids(ds) == list(range(24))
    assert 4 <= len(fs.requests) <= 6
    assert all(len(request) == 1 for request in fs.requests)
    fs.requests.clear()
    assert [int(r["id"]) for r in ParquetIterDataset(path, ["id"], filesystem=fs)] == list(
        range(24)
    )
    fetched = [r for request in fs.requests for r in request]
    blob = _chunk_ranges(path, fs, "blob")
    assert not any(s < be and bs < e for s, e in fetched for bs, be in blob)  # no blob bytes
    ids = _chunk_ranges(path, fs, "id")
    assert all(any(s <= i and ie <= e for s, e in fetched) for i, ie in ids)


def test_remote_footer_is_read_once_per_dataset_until_the_file_changes(remote_file: Any) -> None:
    fs, path = remote_file
    opened: list[str] = []
    real_open = fs._open

    def counting_open(name: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(name)
        return real_open(name, *args, **kwargs)

    fs._open = counting_open
    ds = ParquetIterDataset(path, ["id"], filesystem=fs)
    opened.clear()
    for _ in range(3):  # passes read the row groups' bytes only, by ranged reads
        assert _ids(ds) == list(range(24))
    assert opened == []
    with fs.open(path, "wb") as f:  # other content at the same path: its footer is read
        pq.write_table(_table(100, 124), f, row_group_size=2)
    opened.clear()
    assert _ids(ds) == list(range(100, 124))
    assert len(opened) == 1
    assert _ids(ds) == list(range(100, 124))
    assert len(opened) == 1


def _coalesced_all(path: str, fs: Any) -> list[tuple[int, int]]:
    return [r for c in ("id", "score", "text", "vec", "blob") for r in _chunk_ranges(path, fs, c)]


def test_remote_read_ahead_holds_at_most_its_budget(remote_file: Any) -> None:
    from grain_parquet._files import resolve_paths
    from grain_parquet._prefetch import RowGroupPrefetcher

    fs, path = remote_file
    (file,) = resolve_paths(path, fs)
    with fs.open(path, "rb") as f:
        metadata = pq.ParquetFile(f).metadata
    group_bytes = [
        sum(metadata.row_group(g).column(c).total_compressed_size for c in range(5))
        for g in range(12)
    ]
    budget = 4 * max(group_bytes)  # one row group per window, about 4 windows held
    prefetcher = RowGroupPrefetcher(file, metadata, range(12), None, budget, {}, file.size())
    try:
        for pos in range(12):
            table = prefetcher.parquet_file(pos).read_row_group(pos)
            assert table.column("id").to_pylist() == [2 * pos, 2 * pos + 1]
            assert 0 < prefetcher._held <= budget
            assert min(prefetcher._fetching) == pos  # earlier windows released
        prefetcher.parquet_file(3)  # a restore: starts again from there
        assert min(prefetcher._fetching) == 3
    finally:
        prefetcher.close()


@pytest.mark.parametrize("budget", [1, 10_000])
def test_remote_read_ahead_restores_anywhere(remote_file: Any, budget: int) -> None:
    fs, path = remote_file
    ds = ParquetIterDataset(path, filesystem=fs, prefetch_bytes=budget, read_batch_size=3)
    check_iterator_conformance(ds, positions=range(25))
    sliced = ds.with_slice(slice(1, None, 3))
    assert _ids(sliced) == [i for g in range(1, 12, 3) for i in (2 * g, 2 * g + 1)]


def test_remote_read_error_names_the_row_group(remote_file: Any) -> None:
    fs, path = remote_file
    (start, end) = _chunk_ranges(path, fs, "score")[5]
    data = bytearray(fs.cat(path))
    data[start:end] = b"\xff" * (end - start)
    fs.pipe(path, bytes(data))
    with pytest.raises(ValueError, match=r"row group 5 of Parquet file .*r\.parquet"):
        list(ParquetIterDataset(path, filesystem=fs))


# ------------------------------------------------------------------------ writer
def test_writer_row_groups_of_chosen_size(tmp_path: Path) -> None:
    path = tmp_path / "w.parquet"
    with ParquetWriter(path, row_group_size=4) as writer:
        for i in range(3):
            writer.write(_row(i))
        writer.write_columns(
            {
                "id": np.arange(3, 9),
                "score": np.arange(3, 9, dtype=np.float32) / 4,
                "text": [f"row {i}" for i in range(3, 9)],
                "vec": np.repeat(np.arange(3, 9, dtype=np.float32), 3).reshape(6, 3),
            }
        )
        for i in range(9, 11):
            writer.write(_row(i))
        assert not path.exists()
    metadata = pq.ParquetFile(path).metadata
    assert [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)] == [4, 4, 3]
    assert pq.read_schema(path).field("vec").type == pa.list_(pa.float32(), 3)
    for i, row in enumerate(ParquetIterDataset(str(path))):
        assert_trees_equal(row, _row(i))


def test_writer_with_schema_and_abort(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int32()), ("name", pa.string())])
    path = tmp_path / "s.parquet"
    with ParquetWriter(path, schema=schema) as writer:
        writer.write({"name": "a", "id": 1})
    assert pq.read_schema(path).remove_metadata() == schema
    with pytest.raises(RuntimeError), ParquetWriter(tmp_path / "gone.parquet") as writer:
        writer.write({"id": 1})
        raise RuntimeError
    assert list(tmp_path.iterdir()) == [path]


def test_writer_rejects_bad_records(tmp_path: Path) -> None:
    path = tmp_path / "x.parquet"
    writer = ParquetWriter(path)
    with pytest.raises(TypeError, match=r"x\.parquet: record 0 is list"):
        writer.write([1, 2])  # type: ignore[arg-type]
    writer.write({"id": 1, "v": 2})
    writer.write({"id": 2})
    with pytest.raises(ValueError, match=r"x\.parquet: record 1 has no column 'v'"):
        writer.close()
    writer.abort()
    assert not path.exists()
    with ParquetWriter(path, row_group_size=1) as writer:
        writer.write({"id": 1})
        with pytest.raises(ValueError, match=r"record 1 has extra column 'v'; the columns are"):
            writer.write({"id": 2, "v": 3})
    with pytest.raises(ValueError, match="row_group_size must be a positive int"):
        ParquetWriter(tmp_path / "y.parquet", row_group_size=0)


def test_writer_without_rows_writes_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "none.parquet"
    with ParquetWriter(path):
        pass
    assert list(ParquetIterDataset(str(path))) == []


# --------------------------------------------------------------------- inspector
def test_inspector_reports_schema_row_groups_sizes_and_sample(one_file: str) -> None:
    info = grain_parquet.inspect_parquet(one_file, 3)
    assert info.num_records == 23
    assert info.schema == {
        "id": "int64",
        "score": "float",
        "text": "string",
        "vec": "fixed_size_list<element: float>[3]",
    }
    assert info.details["row_groups"] == 5
    assert info.details["rows_per_row_group"] == [5, 5, 5, 5, 3]
    assert info.details["bytes"] == Path(one_file).stat().st_size
    assert info.details["compressed_bytes"] > 0 and info.details["uncompressed_bytes"] > 0
    assert [int(r["id"]) for r in info.sample] == [0, 1, 2]


def test_cli_inspect(one_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", one_file, "--sample", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["format"], summary["num_records"]) == ("parquet", 23)
    assert summary["details"]["row_groups"] == 5
    assert summary["sample"][0]["text"] == "row 0"


def test_cli_inspect_of_a_file_with_a_damaged_page_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"x": list(range(1000))}), path, compression="snappy")
    data = bytearray(path.read_bytes())
    data[100:400] = bytes(300)  # inside the first data page; the footer is intact
    path.write_bytes(bytes(data))
    assert cli.main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        f"grain-core inspect: error: Cannot read row group 0 of Parquet file {path}: "
    )


# --------------------------------------------------------------------- bad input
Opener = Callable[[Any], Any]
OPENERS: list[Opener] = [
    lambda p: ParquetIterDataset(p),
    lambda p: ParquetDataSource(p),
    lambda p: grain_parquet.inspect_parquet(p, 1),
]


@pytest.mark.parametrize("open_", OPENERS)
def test_missing_file(tmp_path: Path, open_: Opener) -> None:
    with pytest.raises(FileNotFoundError, match=r"Parquet file not found: .*nope\.parquet"):
        open_(str(tmp_path / "nope.parquet"))


@pytest.mark.parametrize("open_", OPENERS)
def test_not_a_parquet_file(tmp_path: Path, open_: Opener) -> None:
    path = tmp_path / "text.parquet"
    path.write_text("id,name\n1,a\n")
    with pytest.raises(ValueError, match=r"text\.parquet: it is not a Parquet file"):
        open_(str(path))


@pytest.mark.parametrize("open_", OPENERS)
def test_truncated_file(one_file: str, open_: Opener) -> None:
    data = Path(one_file).read_bytes()
    Path(one_file).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"one\.parquet: it is truncated or corrupted"):
        open_(one_file)


def test_unknown_column_lists_available_ones(one_file: str) -> None:
    expected = r"one\.parquet has no column 'label'. Available columns: \['id', 'score'"
    with pytest.raises(ValueError, match=expected):
        ParquetIterDataset(one_file, columns=["id", "label"])
    with pytest.raises(ValueError, match=expected):
        ParquetDataSource(one_file, columns=["label"])


def test_different_schemas_name_the_file_and_field(tmp_path: Path, one_file: str) -> None:
    other = tmp_path / "other.parquet"
    pq.write_table(_table(0, 3).set_column(1, "score", pa.array([1.0, 2.0, 3.0])), other)
    wider = tmp_path / "wider.parquet"
    pq.write_table(_table(0, 3).append_column("extra", pa.array([1, 2, 3])), wider)
    type_error = r"other\.parquet: field 'score' has type double, but float in .*one\.parquet"
    with pytest.raises(ValueError, match=type_error):
        ParquetDataSource([one_file, str(other)])
    with pytest.raises(ValueError, match=type_error):
        list(ParquetIterDataset([one_file, str(other)]))
    with pytest.raises(
        ValueError, match=r"wider\.parquet has field 'extra', which .*one\.parquet lacks"
    ):
        ParquetDataSource([one_file, str(wider)])
    with pytest.raises(ValueError, match=r"one\.parquet has no field 'extra'"):
        list(ParquetIterDataset([str(wider), one_file]))
    assert len(ParquetDataSource([one_file, str(wider)], columns=["id", "vec"])) == 26


def test_index_past_the_end_names_the_file(one_file: str, three_files: list[str]) -> None:
    with pytest.raises(
        IndexError, match=r"Row index 23 is out of range for .*one\.parquet: 23 rows"
    ):
        ParquetDataSource(one_file)[23]
    with pytest.raises(
        IndexError, match=r"Row index -1 is out of range for 3 files \(.*a\.parquet"
    ):
        ParquetDataSource(three_files).__getitems__([0, -1])
    with pytest.raises(TypeError, match="Record keys must be integers"):
        ParquetDataSource(one_file).__getitems__([1.9])


def test_bad_arguments(one_file: str) -> None:
    with pytest.raises(ValueError, match="needs at least one path"):
        ParquetIterDataset([])
    with pytest.raises(ValueError, match="column_batch_size must be a positive int"):
        ParquetIterDataset(one_file, column_batch_size=0)
    with pytest.raises(ValueError, match="columns must name at least one column"):
        ParquetIterDataset(one_file, columns=[])
    with pytest.raises(TypeError, match=r"Invalid Parquet read option for .*one\.parquet"):
        ParquetIterDataset(one_file, no_such_option=True)


def test_source_pickles_without_open_files(three_files: list[str]) -> None:
    source = ParquetDataSource(three_files, columns=["id"])
    source[3]
    copy = pickle.loads(pickle.dumps(source))
    assert repr(copy) == repr(source) and copy.cached_bytes == 0
    assert int(copy[25]["id"]) == 25


def test_globs_expand_sorted_and_an_empty_one_names_the_pattern(
    three_files: list[str], tmp_path: Path
) -> None:
    pattern = str(tmp_path / "[abc].parquet")
    assert _ids(list(grain_parquet.ParquetIterDataset(pattern, cycle_length=1))) == list(range(30))
    source = grain_parquet.ParquetDataSource(str(tmp_path / "*.parquet"))
    assert len(source) == 30 and int(source[29]["id"]) == 29
    with pytest.raises(FileNotFoundError, match="pattern .*none-\\*.parquet' matches no file"):
        grain_parquet.ParquetDataSource(str(tmp_path / "none-*.parquet"))


def test_writer_never_follows_a_symlink_at_the_old_temporary_name(tmp_path: Path) -> None:
    import os

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out.parquet"
    (tmp_path / f"out.parquet.tmp-{os.getpid()}").symlink_to(victim)
    with grain_parquet.ParquetWriter(out) as writer:
        writer.write(_row(0))
    assert victim.read_bytes() == b"precious"
    assert _ids(list(grain_parquet.ParquetIterDataset(str(out)))) == [0]


@pytest.mark.parametrize("bad", [1.5, True, -1])
def test_a_row_position_that_is_not_an_integer_is_refused(one_file: str, bad: Any) -> None:
    it = iter(ParquetIterDataset(one_file))
    with pytest.raises((TypeError, ValueError), match="checkpoint `index_within_row_group`"):
        it.set_state({"row_group": 1, "index_within_row_group": bad})
    with pytest.raises((TypeError, ValueError), match="checkpoint `row_group`"):
        it.set_state({"row_group": bad, "index_within_row_group": 0})

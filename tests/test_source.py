from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_core as grain
from grain_core._tree import flatten as tree_leaves
from grain_core.dataset.source import BatchedReader, StackedBlock, columns_wanted
from grain_core.sources import ColumnBlock

MD = grain.MapDataset


class CountingSource:
    """A source that records how it was read (one call per block, or one per index)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.single_reads = 0
        self.block_reads: list[list[int]] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.single_reads += 1
        return i * 10

    def __getitems__(self, keys: list[int]) -> list[int]:
        self.block_reads.append(list(keys))
        return [k * 10 for k in keys]


def test_source_reads_modulo_length():
    ds = MD.source([1, 2, 3])
    assert len(ds) == 3
    assert [ds[i] for i in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert ds._getitems([5, 0, 4]) == [3, 1, 2]


def test_source_uses_batched_read_once_per_block():
    src = CountingSource(1000)
    ds = MD.source(src).seed(0).shuffle().map(lambda x: x + 1).batch(100)
    batch = ds[3]
    assert src.single_reads == 0
    assert len(src.block_reads) == 1 and len(src.block_reads[0]) == 100
    assert sorted(batch.tolist()) == sorted(k * 10 + 1 for k in src.block_reads[0])


def test_source_of_source_dataset_and_numpy_array():
    assert list(MD.source(MD.range(3))) == [0, 1, 2]
    arr = np.arange(4) * 2
    assert list(MD.source(arr)) == [0, 2, 4, 6]
    assert "ndarray(len=4)" in repr(MD.source(arr))


def test_empty_source_reads_raise_index_error():
    ds = MD.source([])
    assert len(ds) == 0 and list(ds) == []
    with pytest.raises(IndexError):
        ds[0]


@pytest.mark.parametrize(
    "args, expected",
    [((5,), [0, 1, 2, 3, 4]), ((2, 5), [2, 3, 4]), ((10, 0, -3), [10, 7, 4, 1]), ((3, 3), [])],
)
def test_range_follows_python_range(args, expected):
    ds = MD.range(*args)
    assert list(ds) == expected
    assert len(ds) == len(expected)
    if expected:
        assert ds[len(expected)] == expected[0]
        assert ds._getitems(list(range(len(expected)))) == expected


def test_range_reads_synchronously_by_default():
    it = iter(MD.range(5).to_iter_dataset())
    assert not it._threaded
    assert it._chunk_cap > 1  # values are read in blocks, not one call per element
    assert repr(MD.range(1, 4)) == "RangeMapDataset(start=1, stop=4, step=1)"


# ----------------------------------------------------------------- columnar reads
class RowSource:
    """Dict rows stored as NumPy columns, read one dict per row; counts its reads."""

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self.columns = columns
        self.names = list(columns)
        self.column_reads = 0

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])[0]

    def __getitems__(self, keys: list[int]) -> list[dict]:
        return list(self._block(keys))

    def _block(self, keys: list[int]) -> ColumnBlock:
        return ColumnBlock(self.names, [c[keys] for c in self.columns.values()])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(len={len(self)})"


class ColumnarSource(RowSource):
    """The same rows, with the columnar read."""

    def read_columns(self, keys: list[int]) -> ColumnBlock:
        self.column_reads += 1
        return self._block(keys)


def _columns(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    text = np.empty(n, object)
    text[:] = [f"row {i}" * (i % 3) for i in range(n)]
    return {
        "z_id": np.arange(n, dtype=np.int64),
        "score": rng.random(n, dtype=np.float32),
        "text": text,
        "vec": rng.random((n, 3), dtype=np.float32),
        "when": np.arange(n).astype("datetime64[s]"),
    }


def test_column_block_is_the_sequence_of_its_rows():
    columns = _columns(5)
    block = ColumnBlock(list(columns), list(columns.values()))
    rows = [{name: column[i] for name, column in columns.items()} for i in range(5)]
    assert len(block) == 5
    for got, want in zip([*block, *(block[i] for i in range(5))], rows * 2, strict=True):
        assert list(got) == list(want)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    part = block[1:4]
    assert isinstance(part, ColumnBlock) and [r["z_id"] for r in part] == [1, 2, 3]
    with pytest.raises(ValueError, match="differ in length"):
        ColumnBlock(["a", "b"], [np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match="one column per name"):
        ColumnBlock(["a"], [])


def _assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)  # sorted keys, as make_batch builds them
        for k in w:
            assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, k
            assert g[k].tolist() == w[k].tolist(), k


def _pipelines(source: object) -> list:
    base = MD.source(source)
    return [
        base.batch(4),
        base.seed(3).shuffle().repeat(2)[3:].batch(5, drop_remainder=True),
        base.batch(1),
        base.map(lambda row: row).batch(4),  # a map between: rows, not columns
    ]


def test_batches_over_a_columnar_source_equal_the_row_path():
    n = 23
    columnar, rows_only = ColumnarSource(_columns(n)), RowSource(_columns(n))
    pipelines = zip(_pipelines(columnar), _pipelines(rows_only), strict=True)
    for position, (ds, twin) in enumerate(pipelines):
        before = columnar.column_reads
        _assert_same_batches(list(ds), list(twin))
        _assert_same_batches([ds[i] for i in range(3)], [twin[i] for i in range(3)])
        # Columns are read unless a node other than seed/shuffle/slice/repeat is in between.
        assert (columnar.column_reads > before) == (position < 3)


def test_a_custom_batch_fn_gets_a_list_of_rows():
    seen = []

    def batch_fn(values):
        seen.append(type(values))
        return len(values)

    source = ColumnarSource(_columns(8))
    assert list(MD.source(source).batch(4, batch_fn=batch_fn)) == [4, 4]
    assert seen == [list, list] and source.column_reads == 0


def test_an_unstackable_column_raises_the_row_path_error():
    text = np.empty(4, object)
    text[:] = ["a", None, "c", "d"]
    columns = {"text": text}
    columnar, rows_only = ColumnarSource(columns), RowSource(columns)
    with pytest.raises(ValueError) as from_columns:
        MD.source(columnar).batch(4)[0]
    with pytest.raises(ValueError) as from_rows:
        MD.source(rows_only).batch(4)[0]
    assert str(from_columns.value) == str(from_rows.value)
    assert columnar.column_reads == 1


def test_batched_read_reads_columns_only_when_asked():
    read = BatchedReader(ColumnarSource(_columns(4)))
    assert isinstance(read([0, 1]), list)
    with columns_wanted():
        assert isinstance(read([0, 1]), ColumnBlock)
        assert isinstance(BatchedReader(CountingSource(3))([0, 1]), list)
    assert isinstance(read([2]), list)


# ------------------------------------------------------------------ sources of arrays
_NUMERIC_DTYPES = st.sampled_from(["uint8", "int32", "int64", "float32", "float64", "bool"])


def _arrays(rng: np.random.Generator, n: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.integers(0, 200, (n, *shape)) % (2 if dtype == "bool" else 200)).astype(dtype)


def _assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for leaf_x, leaf_y in zip(tree_leaves(x), tree_leaves(y), strict=True):
            assert leaf_x.dtype == leaf_y.dtype and np.array_equal(leaf_x, leaf_y)


@given(
    n=st.integers(1, 40),
    dtype=_NUMERIC_DTYPES,
    shape=st.sampled_from([(), (3,), (2, 2)]),
    as_dict=st.booleans(),
    batch_size=st.integers(1, 9),
    drop_remainder=st.booleans(),
    seed=st.integers(0, 3),
)
@settings(max_examples=60, deadline=None)
def test_arrays_gather_whole_batches_equal_to_the_element_path(
    n, dtype, shape, as_dict, batch_size, drop_remainder, seed
):
    rng = np.random.default_rng(n)
    image = _arrays(rng, n, dtype, shape)
    source = {"image": image, "label": np.arange(n, dtype=np.int64)} if as_dict else image
    rows = [{"image": image[i], "label": np.int64(i)} for i in range(n)] if as_dict else list(image)

    def pipeline(src):
        return grain.MapDataset.source(src).seed(seed).shuffle().repeat(2)

    gathered = pipeline(source).batch(batch_size, drop_remainder=drop_remainder)
    element_wise = pipeline(rows).batch(batch_size, drop_remainder=drop_remainder)
    _assert_same_batches(list(gathered), list(element_wise))
    assert len(gathered) == len(element_wise)
    if len(gathered):
        _assert_same_batches([gathered[3]], [element_wise[3]])
    _assert_same_batches(
        pipeline(source)._getitems([0, n + 1]), pipeline(rows)._getitems([0, n + 1])
    )
    # One read of the block, as one fancy index per array.
    with columns_wanted():
        block = pipeline(source)._getitems(range(batch_size))
    assert isinstance(block, ColumnBlock if as_dict else StackedBlock)
    # Checkpoints are interchangeable between the two.
    it, other = iter(gathered.to_iter_dataset()), iter(element_wise.to_iter_dataset())
    next(it, None)
    other.set_state(it.get_state())
    _assert_same_batches(list(other), list(it))


def test_only_dicts_of_equally_long_numeric_arrays_are_read_as_arrays():
    assert grain.MapDataset.source({"a": np.zeros(3), "b": np.ones(3)})[1] == {"a": 0.0, "b": 1.0}
    assert len(grain.MapDataset.source({"a": np.zeros(3), "b": np.ones(3)})) == 3
    # Other dicts are sources as they are: keys are the indices.
    assert len(grain.MapDataset.source({0: "x", 1: "y"})) == 2
    assert grain.MapDataset.source({0: np.zeros(3), 1: np.ones(3)})[1].tolist() == [1, 1, 1]
    assert len(grain.MapDataset.source({"a": np.zeros(3), "b": np.ones(4)})) == 2
    strings = np.array(["a", "bb", "c"])
    assert not grain.MapDataset.source(strings).reads_columns
    assert list(grain.MapDataset.source(strings).batch(2)[0]) == ["a", "bb"]


def test_stacked_block_is_the_sequence_of_its_elements():
    block = StackedBlock({"x": np.arange(6).reshape(3, 2), "y": np.arange(3)}, 3)
    assert len(block) == 3 and block[1]["x"].tolist() == [2, 3] and block[-1]["y"] == 2
    assert [e["y"] for e in block] == [0, 1, 2]
    assert [e["y"] for e in block[1:]] == [1, 2]
    with pytest.raises(IndexError):
        block[3]


@pytest.mark.parametrize(
    "make",
    [
        lambda n: MD.range(n),
        lambda n: MD.source(list(range(n))),
        lambda n: MD.source(np.arange(n)),
        lambda n: MD.source({"x": np.arange(n)}),
    ],
    ids=["range", "list", "array", "dict_of_arrays"],
)
def test_set_slice_reads_the_workers_contiguous_block_of_the_whole_source(make) -> None:
    ds = make(21)
    ds.set_slice(slice(2, None, 3), sequential_slice=True)
    values = [int(tree_leaves(e)[0]) for e in ds]
    assert values == list(range(14, 21))
    assert [int(tree_leaves(e)[0]) for e in ds._getitems([0, 8])] == [14, 15]
    # A second call slices the whole source again, not the block.
    ds.set_slice(slice(0, None, 2), sequential_slice=True)
    assert [int(tree_leaves(e)[0]) for e in ds] == list(range(11))


def test_set_slice_on_a_range_with_a_step_keeps_the_step() -> None:
    ds = MD.range(2, 22, 2)
    ds.set_slice(slice(1, None, 2), sequential_slice=True)
    assert list(ds) == [12, 14, 16, 18, 20]


@pytest.mark.parametrize("ds", [MD.range(10), MD.source(list(range(10)))], ids=["range", "list"])
def test_set_slice_refuses_strided_slices(ds) -> None:
    with pytest.raises(AssertionError, match="sequential_slice=True"):
        ds.set_slice(slice(0, 1, 1), sequential_slice=False)

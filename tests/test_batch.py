from __future__ import annotations

import collections

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

import grain_core as grain
from grain_core import _tree
from grain_core.dataset.ops.batch import BatchIterDataset, BatchMapDataset, make_batch
from grain_core.sources import ColumnBlock
from grain_core.testing import check_iterator_conformance

MD = grain.MapDataset
Pair = collections.namedtuple("Pair", ["a", "b"])


def test_batch_datasets_take_drop_remainder_by_position():
    # As Grain's classes do: (parent, batch_size, drop_remainder, batch_fn).
    source = grain.MapDataset.range(5)
    assert len(BatchMapDataset(source, 2, True)) == 2
    assert [b.tolist() for b in BatchIterDataset(source.to_iter_dataset(), 2, True)] == [
        [0, 1],
        [2, 3],
    ]


def test_make_batch_stacks_leaves():
    out = make_batch([{"x": np.zeros(2), "y": 1}, {"x": np.ones(2), "y": 2}])
    assert out["x"].shape == (2, 2) and out["y"].tolist() == [1, 2]
    assert make_batch([1, 2, 3]).tolist() == [1, 2, 3]
    single = make_batch([Pair(np.zeros(3), 5)])
    assert isinstance(single, Pair) and single.a.shape == (1, 3) and single.b.shape == (1,)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
    st.lists(st.binary(max_size=12) | st.sampled_from([b"", b"\0", b"a\0\0"]), min_size=1)
)
def test_make_batch_stacks_bytes_as_numpy_does(records: list[bytes]):
    # Empty records, records ending in NULs and mixed lengths stack exactly as NumPy's own
    # S array does (trailing NULs dropped on read, as before).
    stacked = make_batch(records)
    expected = np.asarray(records)
    assert stacked.dtype == expected.dtype and stacked.shape == expected.shape
    assert stacked.tobytes() == expected.tobytes()
    assert stacked.tolist() == [r.rstrip(b"\0") for r in records]


def test_make_batch_of_bytes_and_other_types_is_not_the_bytes_path():
    # Mixed leaves keep NumPy's promotion, and differing structures the tree's error.
    assert make_batch([b"ab", 1]).tolist() == [b"ab", b"1"]
    with pytest.raises(ValueError, match="same structure"):
        make_batch([b"ab", {"x": 1}])


def test_make_batch_keeps_strings_untruncated():
    out = make_batch([np.array("a"), np.array("abcdef")])
    assert out.tolist() == ["a", "abcdef"]
    assert make_batch([b"x", b"yyy"]).tolist() == [b"x", b"yyy"]
    # NumPy string scalars have a dtype each: the first one's must not be imposed.
    assert make_batch([np.str_("a"), np.str_("abcdef")]).tolist() == ["a", "abcdef"]
    assert make_batch([np.bytes_(b"x"), np.bytes_(b"yyy")]).tolist() == [b"x", b"yyy"]


@pytest.mark.parametrize(
    "kind", [np.int8, np.uint16, np.float16, np.float32, np.bool_, np.complex64]
)
def test_make_batch_of_numpy_scalars_keeps_their_dtype(kind):
    values = [kind(1), kind(0), kind(1)]
    for batch in (make_batch(values), make_batch([{"x": v} for v in values])["x"]):
        assert batch.dtype == np.dtype(kind) and batch.tolist() == [kind(1), kind(0), kind(1)]


def test_make_batch_of_datetimes_keeps_every_unit():
    values = [np.datetime64("2026-01-01", "D"), np.datetime64("2026-01-01T00:00:01", "s")]
    assert make_batch(values).tolist() == [np.datetime64(v, "s").item() for v in values]


def test_make_batch_of_structured_arrays_and_records():
    record = np.dtype([("a", "<i4"), ("b", "<f8")])
    rows = [np.array([(i, 0.5)] * 3, dtype=record) for i in range(2)]
    batch = make_batch(rows)
    assert batch.dtype == record and batch.shape == (2, 3)
    assert batch["a"].tolist() == [[0, 0, 0], [1, 1, 1]]
    assert make_batch([row[0] for row in rows]).tolist() == [(0, 0.5), (1, 0.5)]


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1, 2.5], np.array([1.0, 2.5])),
        ([True, 2], np.array([1, 2])),
        ([np.int32(1), np.int64(2)], np.array([1, 2], np.int64)),
        ([np.float32(1), 2.0], np.array([1.0, 2.0])),
        ([1, "x"], np.stack([1, "x"])),  # strings, as np.stack makes them
    ],
)
def test_make_batch_of_mixed_scalars_promotes_as_np_stack(values, expected):
    for batch in (make_batch(values), make_batch([{"w": v} for v in values])["w"]):
        assert batch.dtype == expected.dtype and batch.tolist() == expected.tolist()
        assert batch.dtype == np.stack(values).dtype


def test_make_batch_of_arrays_with_different_dtypes_promotes():
    out = make_batch([np.zeros(2, np.int8), np.full(2, 0.5, np.float64)])
    assert out.dtype == np.float64 and out.tolist() == [[0, 0], [0.5, 0.5]]


@pytest.mark.parametrize(
    "values, match",
    [
        ([], "0 values"),
        ([np.zeros(2), np.zeros(3)], "element 1 is ndarray\\[float64\\[3\\]\\]"),
        ([{"a": 1}, {"b": 1}], "element 1 is \\{'b': int\\}"),
        ([(1, 2), (1, 2, 3)], "same structure"),
        # The start of the text is Grain's, which users match on.
        (
            [np.zeros(2), np.zeros(3)],
            "^Expected all input elements to have the same structure but got:",
        ),
    ],
)
def test_make_batch_errors_name_the_offending_element(values, match):
    with pytest.raises(ValueError, match=match):
        make_batch(values)


def test_map_batch_lengths_and_contents():
    ds = MD.range(10).batch(3)
    assert len(ds) == 4
    assert [b.tolist() for b in ds] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert len(MD.range(10).batch(3, drop_remainder=True)) == 3
    assert ds[4].tolist() == [0, 1, 2]  # next epoch
    assert [b.tolist() for b in ds._getitems([3, 0])] == [[9], [0, 1, 2]]


def test_map_batch_with_another_batch_fn_keeps_its_batching():
    ds = grain.MapDataset.range(7).batch(3, drop_remainder=True)
    summed = ds.with_batch_fn(sum)
    assert len(summed) == 2 and list(summed) == [3, 12]
    assert ds.batch_fn is make_batch and summed.batch_fn is sum


def test_batch_epoch_boundaries_with_repeat_before_and_after():
    before = MD.range(5).repeat(2).batch(3)
    assert [b.tolist() for b in before] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4]]
    after = MD.range(5).batch(3).repeat(2)
    assert [b.tolist() for b in after] == [[0, 1, 2], [3, 4], [0, 1, 2], [3, 4]]


@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_map_batch_reads_of_many_batches_equal_single_reads(batch_size):
    # Consecutive batches are read as one block of consecutive parent indices, batches across
    # an epoch's end index by index: the same batches either way.
    ds = grain.MapDataset.source({"x": np.arange(10) * 2}).seed(1).shuffle().batch(batch_size)
    n = len(ds)
    for indices in ([0, 1, 2], [n - 1, n, n + 1], [2 * n + 1, 2 * n + 2], [3, 1]):
        got = ds._getitems(indices)
        assert [b["x"].tolist() for b in got] == [ds[i]["x"].tolist() for i in indices]


def test_custom_batch_fn_and_error_note():
    ds = MD.range(6).batch(2, batch_fn=lambda xs: sum(xs))
    assert list(ds) == [1, 5, 9]

    def bad(xs):
        raise ValueError("nope")

    with pytest.raises(ValueError, match="nope") as info:
        MD.range(4).batch(2, batch_fn=bad)[0]
    assert any("to_iter_dataset" in n for n in info.value.__notes__)


@pytest.mark.parametrize("size", [0, -3])
def test_invalid_batch_size(size):
    with pytest.raises(ValueError, match="batch_size"):
        MD.range(3).batch(size)
    with pytest.raises(ValueError, match="batch_size"):
        MD.range(3).to_iter_dataset().batch(size)


def test_map_batch_after_filter_is_refused():
    # Grain's words come first (users match on them), then what to do.
    with pytest.raises(ValueError, match="^`MapDataset.batch` can not follow `MapDataset.filter`"):
        MD.range(10).filter(lambda x: x % 2).map(lambda x: x).batch(2)
    with pytest.raises(ValueError, match="to_iter_dataset"):
        MD.range(10).filter(lambda x: x % 2).batch(2)


def test_iter_batch_and_checkpoints():
    ds = MD.range(11).to_iter_dataset().filter(lambda x: x != 4).batch(3)
    out = check_iterator_conformance(ds)
    assert [b.tolist() for b in out] == [[0, 1, 2], [3, 5, 6], [7, 8, 9], [10]]
    dropped = MD.range(11).to_iter_dataset().batch(3, drop_remainder=True)
    assert len(list(dropped)) == 3


def test_iter_batch_next_index():
    it = iter(MD.range(10).to_iter_dataset().batch(4))
    next(it)
    assert it._get_next_index() == 1
    it._set_next_index(2)
    assert next(it).tolist() == [8, 9]


def test_infinite_batch_length():
    import sys

    assert len(MD.range(4).repeat().batch(3)) == sys.maxsize // 3


def _object_column(values: list) -> np.ndarray:
    column = np.empty(len(values), object)
    column[:] = values
    return column


def _read_only(column: np.ndarray) -> np.ndarray:
    column.flags.writeable = False  # as a zero-copy view of Arrow memory is
    return column


_column_kinds = {
    "int": lambda n, draw: np.arange(n, dtype=np.int16) * draw(st.integers(-3, 3)),
    "float": lambda n, draw: np.linspace(0, 1, n, dtype=np.float32),
    "bool": lambda n, draw: np.arange(n) % 2 == 0,
    "read_only": lambda n, draw: _read_only(np.arange(n, dtype=np.uint8)),
    "matrix": lambda n, draw: np.arange(n * 6, dtype=np.float64).reshape(n, 2, 3),
    "datetime": lambda n, draw: np.arange(n).astype("datetime64[ms]"),
    # The longest value first: outside the block, which starts at row 1.
    "fixed_str": lambda n, draw: np.array(
        ["abcdef", *(draw(st.text("ab", max_size=4)) for _ in range(n - 1))]
    ),
    "str": lambda n, draw: _object_column([draw(st.text("xy", max_size=5)) for _ in range(n)]),
    "maybe_str": lambda n, draw: _object_column(
        [draw(st.one_of(st.none(), st.text("z", max_size=2))) for _ in range(n)]
    ),
    "struct": lambda n, draw: _object_column([{"b": i, "a": float(i)} for i in range(n)]),
    "ragged": lambda n, draw: _object_column(
        [np.arange(draw(st.integers(1, 2)), dtype=np.int32) for _ in range(n)]
    ),
}


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
    st.lists(st.sampled_from(sorted(_column_kinds)), min_size=1, max_size=4, unique=True),
    st.integers(1, 6),
    st.data(),
)
def test_make_batch_of_a_column_block_equals_make_batch_of_its_rows(kinds, n, data):
    names = [f"{kind}_{i}" for i, kind in enumerate(reversed(kinds))]
    # A slice of longer columns, as a batch is of a read: the column's dtype may be wider
    # than its rows need (fixed-size strings).
    columns = [_column_kinds[kind](n + 2, data.draw) for kind in reversed(kinds)]
    block = ColumnBlock(names, columns)[1 : n + 1]
    try:
        want = make_batch(list(block))
    except ValueError as error:
        with pytest.raises(ValueError) as got:
            make_batch(block)
        assert str(got.value) == str(error)
        return
    got = make_batch(block)
    assert list(got) == list(want)
    flat_got, flat_want = _tree.flatten(got), _tree.flatten(want)
    assert _tree.spec_str(got) == _tree.spec_str(want)
    for g, w in zip(flat_got, flat_want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.tolist() == w.tolist()
        assert g.flags.writeable


class _FlaggedBatchFn:
    """A batch function that records whether it was asked for shared-memory output."""

    def __init__(self) -> None:
        self.shared = False

    def enable_shared_memory_output(self) -> None:
        self.shared = True

    def __call__(self, values):
        return self.shared


@pytest.mark.parametrize("kind", ["map", "iter"])
def test_enable_shared_memory_output_writes_large_leaves_into_shared_memory(kind) -> None:
    rows = [{"x": np.full(8192, i, np.float64), "s": f"{'long' * i}-{i}"} for i in range(4)]
    ds = MD.source(rows).batch(2) if kind == "map" else MD.source(rows).to_iter_dataset().batch(2)
    ds.enable_shared_memory_output()
    batches = list(ds)
    for b in batches:
        assert isinstance(b["x"], grain.multiprocessing.SharedMemoryArray)
        b["x"].unlink_on_del()
    assert [b["x"][:, 0].tolist() for b in batches] == [[0, 1], [2, 3]]
    # Strings are batched as usual, never truncated to a shared-memory dtype.
    assert [b["s"].tolist() for b in batches] == [
        ["-0", "long-1"],
        ["longlong-2", "longlonglong-3"],
    ]


@pytest.mark.parametrize("kind", ["map", "iter"])
def test_enable_shared_memory_output_asks_a_custom_batch_fn_that_supports_it(kind) -> None:
    fn = _FlaggedBatchFn()
    base = MD.range(4)
    ds = (
        base.batch(2, batch_fn=fn)
        if kind == "map"
        else base.to_iter_dataset().batch(2, batch_fn=fn)
    )
    assert list(ds) == [False, False]
    ds.enable_shared_memory_output()
    assert list(ds) == [True, True]
    plain = (
        base.batch(2, batch_fn=sum)
        if kind == "map"
        else base.to_iter_dataset().batch(2, batch_fn=sum)
    )
    plain.enable_shared_memory_output()  # a function without the capability is kept as it is
    assert list(plain) == [1, 5]

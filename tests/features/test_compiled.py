"""The compiled (numba) transform path against the vectorized one it replaces.

``BatchTransform`` takes the compiled path for one-hot plain int64 IDs hashed by
``HashIds`` with dense columns of one type; everything else takes the vectorized path.
Both must give bitwise the same batch, and ``window`` must equal concatenating the
transformed tables and gathering ``order`` from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrmflow.features.batch import Batch
from dlrmflow.features.dense import log1p
from dlrmflow.features.ids import HashIds, Vocabulary
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.loader import make_loader
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.splits import list_splits
from dlrmflow.sparse import KeyedJaggedTensor

SPEC = FeatureSpec(
    dense=("I1", "I2", "I3"),
    sparse=(SparseFeature("C1", 1000, 4), SparseFeature("C2", 7, 4), SparseFeature("C3", 1, 4)),
    label="label",
)


class KeyedOnly:
    """A mapper without ``map_one_hot``: forces the vectorized path, same rows."""

    def __init__(self, ids: HashIds | Vocabulary) -> None:
        self._ids = ids

    def num_embeddings(self, name: str) -> int:
        return self._ids.num_embeddings(name)

    def map(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self._ids.map(name, ids)

    def map_keyed(self, names: Sequence[str], ids: Sequence[np.ndarray]) -> np.ndarray:
        return self._ids.map_keyed(names, ids)


def table(n: int, seed: int, dense_type: pa.DataType | None = None) -> pa.Table:
    dense_type = dense_type or pa.int32()
    rng = np.random.default_rng(seed)

    def dense() -> pa.Array:
        values = rng.integers(-5, 10_000, n)
        if pa.types.is_floating(dense_type):
            values = values.astype(np.float64)
            values[rng.random(n) < 0.1] = np.nan
        return pa.array(values, dense_type, mask=rng.random(n) < 0.2)

    def ids(null_share: float) -> pa.Array:
        raw = rng.integers(-(2**62), 2**62, n)
        return pa.array(raw, pa.int64(), mask=rng.random(n) < null_share)

    return pa.table(
        {
            "label": pa.array(rng.integers(0, 2, n), pa.int8()),
            "I1": dense(),
            "I2": dense(),
            "I3": dense(),
            "C1": ids(0.3),
            "C2": ids(0.0),
            "C3": ids(1.0),
        }
    )


def chunked(t: pa.Table, cuts: Sequence[int]) -> pa.Table:
    """``t`` with every column cut into the same chunks (as a window of row groups is)."""
    bounds = [0, *cuts, t.num_rows]
    return pa.concat_tables(t.slice(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False))


def assert_same_batch(a: Batch, b: Batch) -> None:
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.labels, b.labels)
    assert a.sparse.keys == b.sparse.keys
    assert torch.equal(a.sparse.values, b.sparse.values)
    assert torch.equal(a.sparse.lengths, b.sparse.lengths)


def vocabulary_of(data: pa.Table) -> Vocabulary:
    """A vocabulary holding every other ID of ``data``'s sparse columns: half of them hit."""
    ids = {name: np.unique(data[name].drop_null().to_numpy())[::2] for name in SPEC.sparse_names}
    return Vocabulary(ids, {k: np.ones(len(v)) for k, v in ids.items()}, min_count=1)


def transforms(
    spec: FeatureSpec = SPEC, ids: HashIds | Vocabulary | None = None
) -> tuple[BatchTransform, BatchTransform]:
    if isinstance(ids, Vocabulary):  # the tables the vocabulary gives
        rows = ids.table_rows
        sparse = tuple(SparseFeature(f.name, rows[f.name], f.embedding_dim) for f in spec.sparse)
        spec = FeatureSpec(dense=spec.dense, sparse=sparse, label=spec.label)
    ids = ids or HashIds.from_spec(spec, seed=3)
    return BatchTransform(spec, ids), BatchTransform(spec, KeyedOnly(ids))


@pytest.mark.parametrize("dense_type", [pa.int32(), pa.int64(), pa.float32(), pa.float64()])
@pytest.mark.parametrize("cuts", [(), (1,), (100, 101, 400)])
@pytest.mark.parametrize("mapper", ["hash", "vocabulary"])
def test_compiled_path_gives_the_vectorized_batch_bitwise(dense_type, cuts, mapper):
    data = chunked(table(777, seed=1, dense_type=dense_type), cuts)
    ids = vocabulary_of(data) if mapper == "vocabulary" else None
    compiled, vectorized = transforms(ids=ids)
    out, reference = compiled(data), vectorized(data)
    assert compiled._layout is not None and compiled._layout.compiled
    assert vectorized._layout is not None and not vectorized._layout.compiled
    assert out.sparse.one_hot_rows is not None and out.sparse.one_hot_rows.dtype == torch.int32
    assert_same_batch(out, reference)
    rows = out.sparse.one_hot_rows
    assert (rows[:, 2] == -1).all()  # the all-null key: every bag empty
    limit = 7 if ids is None else ids.num_embeddings("C2")
    assert rows[:, 1].min() >= 0 and rows[:, 1].max() < limit  # no null, in range
    if ids is not None:  # hits and misses (row 0) both occur
        assert (rows[:, 1] == 0).any() and (rows[:, 1] > 0).any()


def test_columns_chunked_differently_take_the_vectorized_path_with_the_same_result():
    compiled, vectorized = transforms()
    data = table(300, seed=2)
    # One column cut elsewhere than the others: the compiled path needs aligned chunks.
    at_50, at_17 = chunked(data, (50,)), chunked(data, (17,))
    mixed = pa.Table.from_arrays(
        [(at_17 if name == "I2" else at_50)[name] for name in data.column_names],
        names=data.column_names,
    )
    assert_same_batch(compiled(mixed), vectorized(data))


@pytest.mark.parametrize("kind", ["compiled", "vectorized", "vocabulary", "multi-hot"])
def test_window_is_the_concatenation_gathered_in_order(kind):
    compiled, vectorized = transforms()
    tables = [table(n, seed=s) for s, n in enumerate([120, 1, 64])]
    transform = {"compiled": compiled, "vectorized": vectorized}.get(kind)
    if kind == "vocabulary":
        ones = np.ones(3)
        vocab = {name: np.array([1, 2, 3]) for name in SPEC.sparse_names}
        spec = FeatureSpec(
            dense=SPEC.dense,
            sparse=tuple(SparseFeature(f.name, 4, 4) for f in SPEC.sparse),
            label="label",
        )
        transform = BatchTransform(spec, Vocabulary(vocab, {k: ones for k in vocab}, min_count=1))
    if kind == "multi-hot":
        transform = compiled

        def listed(t: pa.Table) -> pa.Table:
            c1 = pa.array([[v] if v is not None else None for v in t["C1"].to_pylist()])
            return t.set_column(t.schema.get_field_index("C1"), "C1", c1)

        tables = [listed(t) for t in tables]
    assert transform is not None
    order = np.random.default_rng(7).permutation(185)
    window = transform.window(tables, order)
    expected = Batch.concat([transform(t) for t in tables]).take(order)
    assert_same_batch(window, expected)
    for start, stop in [(0, 64), (64, 128), (128, 185), (5, 5)]:
        assert_same_batch(window.slice(start, stop), expected.take(np.arange(start, stop)))
    # The reader's way: the same window, built one table at a time, with or without the
    # order's inverse given.
    for dest in (None, np.argsort(order)):
        writer = transform.window_writer(order, dest)
        for t in tables:
            writer.add(t)
        assert_same_batch(writer.finish(), expected)


def test_window_writer_takes_any_chunking_and_empty_tables():
    compiled, vectorized = transforms()
    data = table(300, seed=2)
    at_50, at_17 = chunked(data, (50,)), chunked(data, (17,))
    mixed = pa.Table.from_arrays(  # one column cut elsewhere: combined, then compiled
        [(at_17 if name == "I2" else at_50)[name] for name in data.column_names],
        names=data.column_names,
    )
    tables = [data.slice(0, 0), chunked(table(90, seed=3), (30, 31)), data.slice(0, 0), mixed]
    order = np.random.default_rng(1).permutation(390)
    writer = compiled.window_writer(order)
    for t in tables:
        writer.add(t)
    out = writer.finish()
    assert out.sparse.one_hot_rows is not None  # the compiled path took every table
    assert_same_batch(out, Batch.concat([vectorized(t) for t in tables]).take(order))


def test_window_writer_of_no_rows_is_empty():
    compiled, _ = transforms()
    writer = compiled.window_writer(np.arange(0))
    writer.add(table(0, seed=0))
    assert len(writer.finish()) == 0
    assert len(compiled.window_writer(np.arange(0)).finish()) == 0


def test_window_writer_refuses_rows_that_do_not_match_the_order():
    compiled, _ = transforms()
    writer = compiled.window_writer(np.arange(10))
    writer.add(table(6, seed=0))
    with pytest.raises(ValueError, match="11 rows added, but order holds 10"):
        writer.add(table(5, seed=1))
    with pytest.raises(ValueError, match="order holds 10 rows, but 6 were added"):
        writer.finish()
    with pytest.raises(ValueError, match="order must be a permutation"):
        compiled.window_writer(np.array([0, 0, 1]))
    with pytest.raises(ValueError, match="dest has shape"):
        compiled.window_writer(np.arange(3), np.arange(4))


def test_window_writer_refuses_a_layout_change_after_compiled_tables():
    compiled, _ = transforms()
    first = table(8, seed=0)
    c1 = pa.array([[v] if v is not None else None for v in first["C1"].to_pylist()])
    listed = first.set_column(first.schema.get_field_index("C1"), "C1", c1)
    writer = compiled.window_writer(np.arange(16))
    writer.add(first)
    with pytest.raises(ValueError, match="must share one schema"):
        writer.add(listed)


@pytest.mark.parametrize(
    "order",
    [
        np.arange(9),
        np.array([0, 1, 2, 3, 4, 5, 6, 7, 7, 9]),
        np.arange(-1, 9),
        np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 10]),
    ],
)
def test_window_refuses_an_order_that_is_not_a_permutation(order):
    compiled, _ = transforms()
    with pytest.raises(ValueError, match="order"):
        compiled.window([table(10, seed=0)], order)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("mapper", ["hash", "vocabulary"])
def test_map_one_hot_places_rows_and_marks_nulls(dtype, mapper):
    ids: HashIds | Vocabulary = HashIds({"a": 50, "b": 2**32}, seed=1)
    rng = np.random.default_rng(0)
    a, b = rng.integers(-(2**63), 2**63 - 1, 40), rng.integers(0, 100, 40)
    valid_b = rng.random(40) < 0.5
    dest = rng.permutation(60)[:40]
    out = np.full((60, 2), 7, dtype)
    if dtype is np.int32:
        ids = HashIds({"a": 50, "b": 2**31}, seed=1)
    if mapper == "vocabulary":  # a's IDs in reverse, b's first 50: misses and a shared one
        known = {"a": a[::-1][:30].copy(), "b": np.arange(50)}
        ids = Vocabulary(known, {k: np.ones(len(v)) for k, v in known.items()}, min_count=1)
    ids.map_one_hot(["a", "b"], [a, b], [None, valid_b], out, dest)
    np.testing.assert_array_equal(out[dest, 0], ids.map("a", a))
    np.testing.assert_array_equal(out[dest, 1], np.where(valid_b, ids.map("b", b), -1))
    untouched = np.setdiff1d(np.arange(60), dest)
    assert (out[untouched] == 7).all()


def test_map_one_hot_refuses_what_would_go_out_of_bounds():
    ids = HashIds({"a": 5}, seed=0)
    out = np.zeros((4, 1), np.int64)
    with pytest.raises(IndexError, match="dest"):
        ids.map_one_hot(["a"], [np.arange(2)], [None], out, np.array([0, 4]))
    with pytest.raises(IndexError, match="dest"):
        ids.map_one_hot(["a"], [np.arange(2)], [None], out, np.array([-1, 0]))
    with pytest.raises(ValueError, match="one length"):
        ids.map_one_hot(["a"], [np.arange(3)], [None], out, np.array([0, 1]))
    with pytest.raises(ValueError, match="out must be"):
        ids.map_one_hot(["a"], [np.arange(2)], [None], np.zeros((4, 2)), np.array([0, 1]))


def test_slice_of_the_one_hot_form_is_a_view_and_of_the_jagged_form_a_gather():
    rows = torch.tensor([[1, -1], [2, 3], [-1, 4], [5, 6]], dtype=torch.int32)
    one_hot = KeyedJaggedTensor.from_one_hot(["a", "b"], rows)
    part = one_hot.slice(1, 3)
    assert part.one_hot_rows is not None
    assert part.one_hot_rows.data_ptr() == rows[1].data_ptr()
    jagged = KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([1, 2, 2, 9, 3, 4, 5]),
        torch.tensor([1, 2, 0, 1, 0, 1, 1, 1], dtype=torch.int32),
        weights=torch.arange(7, dtype=torch.float32),
    )
    for start, stop in [(1, 3), (0, 4), (2, 2), (3, 9)]:
        got, want = jagged.slice(start, stop), jagged.take(np.arange(start, min(stop, 4)))
        assert torch.equal(got.values, want.values)
        assert torch.equal(got.lengths, want.lengths)
        assert got.weights is not None and want.weights is not None
        assert torch.equal(got.weights, want.weights)


def test_the_dense_log_of_a_value_does_not_depend_on_where_it_sits():
    # The compiled path logs a row group a slice at a time, the vectorized path a whole
    # table at once: they agree only if the log of a value is the same at any position.
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.integers(0, 100_000, 5000).astype(np.float32),
            rng.random(5000, dtype=np.float32) * 1e6,
            np.float32(2.0) ** rng.integers(-30, 30, 5000).astype(np.float32),
        ]
    )
    whole = values.copy()
    log1p(whole)
    for start in range(33):
        for size in (1, 7, 15, 16, 17, 63, 100):
            part = values[start : start + size].copy()
            log1p(part)
            assert np.array_equal(part, whole[start : start + size])
    scratch = values[: 13 * 1000].reshape(13, 1000).copy()
    rows = scratch[:, 3:900]  # strided rows, as the last slice of a row group is
    log1p(rows)
    assert np.array_equal(rows, whole[: 13 * 1000].reshape(13, 1000)[:, 3:900])
    assert np.allclose(whole, np.log1p(values.astype(np.float64)), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "label_type", [pa.int8(), pa.int64(), pa.bool_(), pa.float32(), pa.float64()]
)
def test_compiled_path_takes_any_label_type(label_type):
    compiled, vectorized = transforms()
    data = chunked(table(300, seed=4), (100,))
    labels = pa.chunked_array([c.cast(label_type) for c in data["label"].chunks])
    data = data.set_column(data.schema.get_field_index("label"), "label", labels)
    order = np.random.default_rng(2).permutation(300)
    writer = compiled.window_writer(order)
    writer.add(data)
    out = writer.finish()
    assert out.sparse.one_hot_rows is not None  # the compiled path took it
    expected = vectorized(data).take(order)
    assert_same_batch(out, expected)
    assert set(out.labels.tolist()) <= {0.0, 1.0}


F32_MAX = float(np.finfo(np.float32).max)


def with_i2(data: pa.Table, values: np.ndarray, null: np.ndarray, cuts: Sequence[int]) -> pa.Table:
    """``data`` with column I2 replaced (its type kept, nulls where ``null``), chunked at
    ``cuts``. A null slot keeps the value under it, as Arrow allows."""
    dense_type = data.schema.field("I2").type
    column = pa.array(values.astype(dense_type.to_pandas_dtype()), dense_type, mask=null)
    return chunked(data.set_column(data.schema.get_field_index("I2"), "I2", column), cuts)


def every_path(compiled: BatchTransform, vectorized: BatchTransform, data: pa.Table):
    """Each way a table becomes a batch: (name, thunk)."""
    order = np.random.default_rng(0).permutation(data.num_rows)

    def written() -> Batch:
        writer = compiled.window_writer(order)
        writer.add(data)
        return writer.finish()

    return [
        ("validate", lambda: compiled.validate(data)),
        ("compiled", lambda: compiled(data)),
        ("window writer", written),
        ("vectorized", lambda: vectorized(data)),
    ]


PATHS = ["validate", "compiled", "window writer", "vectorized"]


def errors(paths: list[tuple[str, Callable[[], object]]]) -> dict[str, str | None]:
    """The ValueError message of each path (None: it passed)."""
    found: dict[str, str | None] = {}
    for name, run in paths:
        try:
            run()
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    return found


@pytest.mark.parametrize(
    ("dense_type", "bad"),
    [
        (pa.float64(), 1e300),
        (pa.float64(), -1e300),
        (pa.float64(), 3.5e38),
        (pa.float64(), -3.5e38),
        (pa.float64(), 1.7976931348623157e308),
        (pa.float64(), float("inf")),
        (pa.float32(), float("-inf")),
        (pa.float32(), float("inf")),
        (pa.float16(), float("inf")),  # the compiled path does not take float16: vectorized
        (pa.float16(), float("-inf")),
    ],
)
@pytest.mark.parametrize("cuts", [(), (100, 400)])
def test_dense_values_float32_cannot_hold_are_errors_on_every_path(dense_type, bad, cuts):
    compiled, vectorized = transforms()
    data = table(777, seed=5, dense_type=dense_type)
    values = data["I2"].to_numpy().astype(np.float64)  # nulls read as NaN
    null = data["I2"].is_null().to_numpy(zero_copy_only=False)
    values[[450, 451]] = bad
    null[[450, 451]] = [False, True]  # the same value under a null is no value: ignored
    broken = with_i2(data, values, null, cuts)
    message = (
        f"column I2: 1 value(s) infinite or beyond float32's range (e.g. {bad!r}); "
        "dense values must be finite and within ±3.4028235e+38"
    )
    assert errors(every_path(compiled, vectorized, broken)) == dict.fromkeys(PATHS, message)

    # Under the null alone, the value is not there: every path takes the table.
    null[450] = True
    hidden = with_i2(data, values, null, cuts)
    chunk = hidden["I2"].combine_chunks()
    assert chunk.is_null()[451].as_py()
    if not pa.types.is_float16(dense_type):  # the value really sits under the null
        under = np.frombuffer(chunk.buffers()[1], dense_type.to_pandas_dtype())[451]
        assert under == np.asarray(bad).astype(dense_type.to_pandas_dtype())
    results = {name: run() for name, run in every_path(compiled, vectorized, hidden)}
    assert torch.isfinite(results["vectorized"].dense).all()
    assert_same_batch(results["compiled"], results["vectorized"])


@pytest.mark.parametrize(
    ("dense_type", "extremes"),
    [
        (pa.float64(), [F32_MAX, -F32_MAX, 1e38, float("nan")]),
        (pa.float32(), [F32_MAX, -F32_MAX, float("nan")]),
        (pa.int64(), [2**63 - 1, -(2**63)]),
        (pa.uint64(), [2**64 - 1, 0]),
        (pa.int32(), [2**31 - 1, -(2**31)]),
    ],
)
def test_dense_values_float32_holds_pass_on_every_path(dense_type, extremes):
    """The largest values of every accepted type that float32 holds are no error."""
    compiled, vectorized = transforms()
    data = table(300, seed=6, dense_type=dense_type)
    values = data["I2"].to_numpy(zero_copy_only=False).astype(object)
    values[10 : 10 + len(extremes)] = extremes
    null = data["I2"].is_null().to_numpy(zero_copy_only=False)
    null[10 : 10 + len(extremes)] = False
    column = pa.array(
        [None if n else v for v, n in zip(values.tolist(), null.tolist(), strict=True)],
        dense_type,
        from_pandas=True,
    )
    data = data.set_column(data.schema.get_field_index("I2"), "I2", column)

    results = {name: run() for name, run in every_path(compiled, vectorized, data)}
    dense = results["vectorized"].dense
    assert torch.isfinite(dense).all()
    assert dense[10, 1].item() == np.log1p(np.float32(max(extremes[0], 0)))
    assert_same_batch(results["compiled"], results["vectorized"])


@pytest.mark.parametrize("validated", [True, False])
@pytest.mark.parametrize("path", ["compiled", "vectorized"])
def test_reader_names_file_row_group_and_column_of_a_dense_value_beyond_float32(
    tmp_path, path, validated
):
    """As training reads: the error names where the value is, whether ``validate`` or the
    transform itself (on either path) finds it."""
    data = table(600, seed=8, dense_type=pa.float64())
    values = data["I3"].to_numpy(zero_copy_only=False)
    values[[250, 251]] = [1e300, -1e300]
    null = data["I3"].is_null().to_numpy(zero_copy_only=False)
    null[[250, 251]] = False
    data = data.set_column(
        data.schema.get_field_index("I3"), "I3", pa.array(values, pa.float64(), mask=null)
    )
    file = tmp_path / "part-0.parquet"
    pq.write_table(data, file, row_group_size=200)
    compiled, vectorized = transforms()
    transform = compiled if path == "compiled" else vectorized
    dataset = ParquetBatchDataset(
        list_splits([str(file)]),
        SPEC.columns,
        64,
        shuffle_window=1,
        validate=transform.validate if validated else None,
        transform=transform,
    )

    with pytest.raises(DataError) as info:
        list(make_loader(dataset, num_workers=0))
    found_by = "" if validated else "transform failed: ValueError: "
    assert str(info.value) == (
        f"{file}, row group 1: {found_by}column I3: 2 value(s) infinite or beyond float32's "
        "range (e.g. 1e+300); dense values must be finite and within ±3.4028235e+38"
    )

"""The reader's shuffled window for layouts the compiled path does not take (lists, per-ID
weights, string IDs, dictionaries, declared transforms, a weight column): built one table
at a time by ``window_writer`` (whole, or cut into batches), or whole by ``window``, it
must be bitwise the concatenation of the tables' batches gathered in order, in the same
form."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dlrmflow.features.batch import Batch
from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.features.transform import BatchTransform
from dlrmflow.schema import DenseFeature
from tests.features.test_transform import assert_batches_equal


def rows(n: int, seed: int, *, dictionary: bool = False) -> pa.Table:
    """``n`` rows shaped like a team's logs, nulls wherever they are allowed: string IDs,
    a list of IDs (null lists, null elements, empty lists) with a weight per element,
    nullable float dense columns, a weight per row."""
    rng = np.random.default_rng(seed)
    tags, tag_w = [], []
    for _ in range(n):
        size = int(rng.integers(0, 6))
        if rng.random() < 0.15:
            tags.append(None)
            tag_w.append(None)
            continue
        ids = [None if rng.random() < 0.1 else int(v) for v in rng.integers(-50, 50, size)]
        tags.append(ids)
        tag_w.append([float(w) for w in rng.random(size).astype(np.float32)])
    users = [None if rng.random() < 0.2 else f"u{v}" for v in rng.integers(0, 30, n)]
    table = pa.table(
        {
            "click": pa.array(rng.integers(0, 2, n), pa.int8()),
            "w": pa.array(rng.random(n) * 3),
            "price": pa.array(rng.random(n) * 100, pa.float32(), mask=rng.random(n) < 0.2),
            "user": pa.array(users, pa.string()),
            "item": pa.array(rng.integers(0, 40, n), pa.int64(), mask=rng.random(n) < 0.1),
            "tags": pa.array(tags, pa.list_(pa.int64())),
            "tag_w": pa.array(tag_w, pa.list_(pa.float32())),
        }
    )
    if not dictionary:
        return table
    for name in ("user", "item"):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, table.column(name).dictionary_encode())
    lists = table.column("tags").combine_chunks()
    encoded = pa.ListArray.from_arrays(
        lists.offsets, lists.values.dictionary_encode(), mask=lists.is_null()
    )
    return table.set_column(table.schema.get_field_index("tags"), "tags", encoded)


def transform_of(*sparse: SparseFeature, weight: str | None = "w") -> BatchTransform:
    spec = FeatureSpec(
        dense=("price",),
        sparse=sparse,
        label="click",
        dense_transforms=(DenseFeature(column="price", transform="log"),),
        weight=weight,
    )
    return BatchTransform(spec, HashIds.from_spec(spec, seed=3))


JAGGED = (
    SparseFeature("user", 64, 4),
    SparseFeature("item", 64, 4),
    SparseFeature("tags", 97, 4, weights="tag_w", max_length=3, keep="last"),
)
# Dictionary-encoded one-hot IDs: the one-hot form, yet not the compiled path.
ONE_HOT = (SparseFeature("user", 64, 4), SparseFeature("item", 64, 4))


def assert_same(a: Batch, b: Batch) -> None:
    """Bitwise equal, in the same form and dtypes."""
    assert_batches_equal(a, b)
    rows_a, rows_b = a.sparse.one_hot_rows, b.sparse.one_hot_rows
    assert (rows_a is None) == (rows_b is None)
    assert rows_a is None or (rows_a.dtype == rows_b.dtype and torch.equal(rows_a, rows_b))
    assert a.dense.dtype == b.dense.dtype == torch.float32
    assert a.sparse.weights is None or a.sparse.weights.dtype == torch.float32


def writer_of(transform: BatchTransform, tables: list[pa.Table], order: np.ndarray):
    writer = transform.window_writer(order, np.argsort(order))
    for t in tables:
        writer.add(t)
    return writer


def written(transform: BatchTransform, tables: list[pa.Table], order: np.ndarray) -> Batch:
    return writer_of(transform, tables, order).finish()


def assert_cut_alike(
    transform: BatchTransform, tables: list[pa.Table], order: np.ndarray, expected: Batch
) -> None:
    """The writer's batches are the expected window's slices, each on its own."""
    pieces = [(0, 64), (64, 300), (300, len(order)), (7, 7), (0, len(order))]
    batches = writer_of(transform, tables, order).batches(pieces)
    assert len(batches) == len(pieces)
    for (start, stop), batch in zip(pieces, batches, strict=True):
        assert_same(batch, expected.take(np.arange(start, stop)))


@pytest.mark.parametrize(
    ("features", "dictionary", "weight"),
    [
        (JAGGED, False, "w"),
        (JAGGED, True, None),
        (JAGGED[:2] + (SparseFeature("tags", 97, 4),), False, "w"),  # lists, no weights
        (ONE_HOT, True, "w"),
    ],
)
def test_a_window_is_its_tables_batches_concatenated_and_gathered(features, dictionary, weight):
    transform = transform_of(*features, weight=weight)
    tables = [rows(n, seed, dictionary=dictionary) for seed, n in enumerate([300, 1, 157, 64])]
    # Sliced tables: offsets that do not start at 0, as a reader's row groups may hold.
    tables[2] = tables[2].slice(20)
    order = np.random.default_rng(11).permutation(sum(t.num_rows for t in tables))
    for t in tables:
        transform.validate(t)
    expected = Batch.concat([transform(t) for t in tables]).take(order)
    assert (expected.sparse.one_hot_rows is not None) == (features is ONE_HOT)
    window = written(transform, tables, order)
    assert_same(window, expected)
    assert_same(transform.window(tables, order), expected)
    for start, stop in [(0, 64), (64, 300), (300, len(order)), (7, 7)]:
        assert_same(window.slice(start, stop), expected.take(np.arange(start, stop)))
    assert_cut_alike(transform, tables, order, expected)


def test_a_list_column_with_single_ids_at_first_is_still_a_list():
    """The first table's lists hold one ID each, a later one's more: the window takes every
    bag whole (first as IDs kept in place, then as lists)."""
    transform = transform_of(*JAGGED[:2], SparseFeature("tags", 97, 4, weights="tag_w"))
    first = rows(200, 0)
    singles = pa.array([None if t is None else t[:1] for t in first.column("tags").to_pylist()])
    weights = first.column("tag_w").to_pylist()
    first = first.set_column(5, "tags", singles.cast(pa.list_(pa.int64())))
    first = first.set_column(
        6, "tag_w", pa.array([w and w[:1] for w in weights], first.schema.field("tag_w").type)
    )
    tables = [first, rows(200, 1)]
    order = np.random.default_rng(4).permutation(400)
    for t in tables:
        transform.validate(t)
    expected = Batch.concat([transform(t) for t in tables]).take(order)
    assert_same(written(transform, tables, order), expected)
    assert_cut_alike(transform, tables, order, expected)


def _lists_cut_or_repeated(table: pa.Table, keep: int | None, times: int = 1) -> pa.Table:
    """``table`` with each list of tags (and its weights) cut to ``keep`` IDs or repeated."""

    def changed(name: str) -> pa.Array:
        lists = [v if v is None else (v[:keep] * times) for v in table.column(name).to_pylist()]
        return pa.array(lists, table.schema.field(name).type)

    for name in ("tags", "tag_w"):
        table = table.set_column(table.schema.get_field_index(name), name, changed(name))
    return table


def test_a_window_whose_later_lists_are_longer_keeps_every_id():
    """The first table's lists are short and a later one's long: every ID of every list
    is where the window's batches read it."""
    transform = transform_of(*JAGGED[:2], SparseFeature("tags", 97, 4, weights="tag_w"))
    tables = [
        _lists_cut_or_repeated(rows(200, 0), keep=2),
        rows(150, 1),
        _lists_cut_or_repeated(rows(250, 2), keep=None, times=4),
    ]
    order = np.random.default_rng(5).permutation(600)
    for t in tables:
        transform.validate(t)
    expected = Batch.concat([transform(t) for t in tables]).take(order)
    assert expected.sparse.lengths.max() >= 12  # lists far longer than the first table's
    assert_same(written(transform, tables, order), expected)
    assert_cut_alike(transform, tables, order, expected)


def test_a_window_of_mixed_forms_is_joined_as_before():
    """An empty table's batch is jagged: among one-hot ones it takes the plain way."""
    transform = transform_of(*ONE_HOT)
    tables = [rows(0, 0, dictionary=True), rows(50, 1, dictionary=True)]
    order = np.random.default_rng(2).permutation(50)
    expected = Batch.concat([transform(t) for t in tables]).take(order)
    assert expected.sparse.one_hot_rows is None
    assert_same(written(transform, tables, order), expected)
    assert_same(writer_of(transform, tables, order).batches([(0, 50)])[0], expected)


def test_a_window_of_one_table_without_rows_is_empty():
    transform = transform_of(*JAGGED)
    window = written(transform, [rows(0, 0)], np.arange(0))
    assert len(window) == 0 and window.sparse.weights is not None

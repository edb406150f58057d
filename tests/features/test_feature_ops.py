"""The schema's feature operations through ``BatchTransform``'s public API: lists cut to
``max_length`` (first or last), per-ID weights, hashed crosses, bucketized and standardized
dense columns. Each output is checked against a plain-Python reference, on whole tables,
slices and chunked or dictionary-encoded columns, and each bad input fails in one line
naming the column or feature."""

from __future__ import annotations

import math
import re

import numpy as np
import pyarrow as pa
import pytest
import torch

from dlrmflow.features.bags import cross_ids
from dlrmflow.features.batch import Batch
from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.features.transform import BatchTransform
from dlrmflow.features.wire import decode_batch, encode_batch
from dlrmflow.schema import DenseFeature
from tests.features.test_transform import assert_batches_equal, rechunk
from tests.ingest.test_strings import reference_hash

NAN = float("nan")
MASK = (1 << 64) - 1
ROWS = {
    "click": [0, 1, 0, 1, 1, 0, 0, 1],
    "tags": [[1, 2, 3, 4], None, [5, None, 6], [7], [], [8, 9, 10], [11, 12, None, 13, 14], [1]],
    "tag_w": [
        [0.5, 1.0, 1.5, 2.0],
        None,
        [0.25, 99.0, 0.75],
        [3.0],
        [],
        [1.0, -1.0, 2.0],
        [0.1, 0.2, 0.3, 0.4, 0.5],
        [4.0],
    ],
    "user": ["a", None, "b", "a", "c", "b", None, "d"],
    "item": [10, 20, None, 10, 30, 20, 40, 50],
    "item_w": [1.0, 2.0, None, 0.5, 4.0, 8.0, 0.25, 16.0],
    "price": [1.5, None, NAN, -2.0, 10.0, 0.0, 7.25, 2.0],
    "qty": [3, None, 0, -1, 50, 2, None, 9],
}


def table(**types: pa.DataType) -> pa.Table:
    default = {
        "click": pa.int8(),
        "tags": pa.list_(pa.int64()),
        "tag_w": pa.list_(pa.float32()),
        "user": pa.string(),
        "item": pa.int64(),
        "item_w": pa.float64(),
        "price": pa.float32(),
        "qty": pa.int32(),
    }
    default.update(types)
    return pa.table({name: pa.array(ROWS[name], t) for name, t in default.items()})


def transform_of(*sparse: SparseFeature, dense: tuple[DenseFeature, ...] = ()) -> BatchTransform:
    spec = FeatureSpec(
        dense=tuple(d.column for d in dense),
        sparse=sparse,
        label="click",
        dense_transforms=dense or None,
    )
    return BatchTransform(spec, HashIds.from_spec(spec, seed=5))


def raw(value: int | str) -> int:
    return reference_hash(value) if isinstance(value, str) else value


def bags_of(batch: Batch, key: str) -> list[list[int]]:
    """Each sample's bag of rows for ``key``, read from the jagged form."""
    k = batch.sparse.keys.index(key)
    n = len(batch)
    lengths = batch.sparse.lengths.tolist()
    starts = [0, *np.cumsum(lengths).tolist()]
    values = batch.sparse.values.tolist()
    return [values[starts[k * n + i] : starts[k * n + i + 1]] for i in range(n)]


def weights_of(batch: Batch, key: str) -> list[list[float]]:
    k = batch.sparse.keys.index(key)
    n = len(batch)
    lengths = batch.sparse.lengths.tolist()
    starts = [0, *np.cumsum(lengths).tolist()]
    weights = batch.sparse.weights.tolist()
    return [weights[starts[k * n + i] : starts[k * n + i + 1]] for i in range(n)]


def hashed(transform: BatchTransform, name: str, ids: list[int]) -> list[int]:
    return transform.ids.map(name, np.array(ids, np.int64)).tolist()


def every_form(transform: BatchTransform, t: pa.Table) -> Batch:
    """The batch of ``t``, checked equal to that of its columns chunked otherwise, of a
    record batch and of its slices' concatenation."""
    transform.validate(t)
    whole = transform(t)
    cuts = {name: [3] if i % 2 else [1, 5] for i, name in enumerate(t.column_names)}
    chunked = rechunk(t, cuts)
    transform.validate(chunked)
    assert_batches_equal(transform(chunked), whole)
    assert_batches_equal(transform(t.to_batches()[0]), whole)
    parts = Batch.concat([transform(t.slice(0, 3)), transform(t.slice(3))])
    assert_batches_equal(parts, whole)
    return whole


# -- ListSlice: max_length, keep --------------------------------------------------------------


@pytest.mark.parametrize("keep", ["first", "last"])
@pytest.mark.parametrize("dictionary", [False, True])
def test_lists_keep_their_first_or_last_ids(keep, dictionary):
    feature = SparseFeature("tags", 97, 4, max_length=2, keep=keep)
    transform = transform_of(feature)
    t = table()
    if dictionary:
        tags = pa.array(ROWS["tags"], pa.list_(pa.int64()))
        values = tags.values.dictionary_encode()
        t = t.set_column(
            1, "tags", pa.ListArray.from_arrays(tags.offsets, values, mask=tags.is_null())
        )
    batch = every_form(transform, t)
    for row, bag in zip(ROWS["tags"], bags_of(batch, "tags"), strict=True):
        ids = [v for v in row or [] if v is not None]  # nulls dropped before the cut
        kept = ids[:2] if keep == "first" else ids[-2:]
        assert bag == hashed(transform, "tags", kept)


def test_max_length_of_a_one_hot_column_changes_nothing():
    plain = transform_of(SparseFeature("item", 50, 4))(table())
    cut = transform_of(SparseFeature("item", 50, 4, max_length=1, keep="last"))(table())
    assert_batches_equal(cut, plain)
    assert cut.sparse.one_hot_rows is not None


# -- per-ID weights ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_length", [None, 3])
@pytest.mark.parametrize("kind", [pa.float32(), pa.float64(), pa.float16()])
def test_list_weights_travel_with_their_ids(max_length, kind):
    """Each kept ID keeps its own weight: a null ID's weight is dropped with it, and the
    cut to ``max_length`` cuts the weights alike. Unweighted features weigh 1."""
    feature = SparseFeature("tags", 97, 4, max_length=max_length, keep="last", weights="tag_w")
    transform = transform_of(feature, SparseFeature("item", 50, 4))
    batch = every_form(transform, table(tag_w=pa.list_(kind)))
    assert batch.sparse.weights.dtype == torch.float32
    for i, (ids, bag, weights) in enumerate(
        zip(ROWS["tags"], bags_of(batch, "tags"), weights_of(batch, "tags"), strict=True)
    ):
        pairs = [
            (v, float(np.float32(np.array(w, kind.to_pandas_dtype()))))
            for v, w in zip(ids or [], ROWS["tag_w"][i] or [], strict=True)
            if v is not None
        ]
        if max_length is not None:
            pairs = pairs[-max_length:]
        assert bag == hashed(transform, "tags", [v for v, _ in pairs])
        assert weights == [w for _, w in pairs]
    assert all(w == [1.0] * len(w) for w in weights_of(batch, "item"))


@pytest.mark.parametrize("max_length", [None, 3])
@pytest.mark.parametrize("large", [False, True])
def test_list_weights_are_found_whatever_the_lists_offsets(max_length, large):
    """Weight lists laid out unlike the ID lists (a null list owning values, the other
    list width) give each ID the weight of plain ones: the lookup by row, not the shortcut
    for offsets that match."""
    plain = pa.array(ROWS["tag_w"], pa.list_(pa.float32()))
    offsets, values = [0], []
    for i, row in enumerate(ROWS["tag_w"]):
        values += [123.0, 456.0] if row is None else row  # the null list owns two values
        offsets.append(len(values))
        assert (row is None) == (i == 1)
    kind = pa.LargeListArray if large else pa.ListArray
    laid_out = kind.from_arrays(
        pa.array(offsets, pa.int64() if large else pa.int32()),
        pa.array(values, pa.float32()),
        mask=pa.array([row is None for row in ROWS["tag_w"]]),
    )
    assert laid_out.to_pylist() == plain.to_pylist()
    feature = SparseFeature("tags", 97, 4, max_length=max_length, weights="tag_w")
    transform = transform_of(feature, SparseFeature("item", 50, 4))
    expected = every_form(transform, table())
    assert_batches_equal(every_form(transform, table().set_column(2, "tag_w", laid_out)), expected)


def test_one_hot_ids_take_a_weight_column_of_numbers():
    transform = transform_of(SparseFeature("item", 50, 4, weights="item_w"))
    t = table()
    t = t.set_column(5, "item_w", pa.array([1.0, 2.0, 7.0, 0.5, 4.0, 8.0, 0.25, 16.0]))
    batch = every_form(transform, t)
    assert batch.sparse.one_hot_rows is None  # weights need the jagged form
    pairs = zip(ROWS["item"], t.column("item_w").to_pylist(), strict=True)
    expected = [[w] for v, w in pairs if v is not None]
    assert [w for w in weights_of(batch, "item") if w] == expected
    # A null weight beside a null ID is no weight of an ID.
    transform.validate(table())


@pytest.mark.parametrize(
    ("tag_w", "message"),
    [
        ({1: [1.0]}, "column tag_w: 1 row(s) whose weights are not as many as feature tags's IDs"),
        ({0: [1.0, 2.0, 3.0]}, "(e.g. row 0: 4 IDs, 3 weights)"),
        ({0: None}, "(e.g. row 0: 4 IDs, 0 weights)"),
        ({2: [1.0, None, 2.0]}, "column tag_w: 1 null weight(s) of tags's IDs"),
        ({3: [NAN]}, "column tag_w: 1 weight(s) of tags's IDs NaN, infinite"),
        ({3: [math.inf], 7: [-math.inf]}, "2 weight(s) of tags's IDs NaN, infinite"),
    ],
)
@pytest.mark.parametrize("kind", [pa.float64(), pa.float32()])
def test_bad_list_weights_name_their_column(tag_w, message, kind):
    weights = [tag_w.get(i, w) for i, w in enumerate(ROWS["tag_w"])]
    t = table().set_column(2, "tag_w", pa.array(weights, pa.list_(kind)))
    transform = transform_of(SparseFeature("tags", 97, 4, weights="tag_w"))
    with pytest.raises(ValueError, match=re.escape(message)):
        transform.validate(t)


@pytest.mark.parametrize("under_null_list", [NAN, math.inf, 1e300, None])
def test_weights_a_null_list_owns_are_no_weights_of_ids(under_null_list):
    """Validation looks at the weights of IDs only: a null weight list may own any values
    (Arrow allows it), and its null ID list owns no IDs."""
    values, offsets, mask = [], [0], []
    for row in ROWS["tag_w"]:
        values += [under_null_list, 1.0] if row is None else row
        offsets.append(len(values))
        mask.append(row is None)
    weights = pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(values, pa.float64()), mask=pa.array(mask)
    )
    ids = pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()),
        pa.array(range(len(values)), pa.int64()),
        mask=pa.array(mask),
    )
    t = table().set_column(2, "tag_w", weights).set_column(1, "tags", ids)
    transform_of(SparseFeature("tags", 97, 4, weights="tag_w")).validate(t)


def test_misaligned_weight_chunks_are_checked_row_by_row():
    """IDs and weights chunked differently still line up row by row; one weight list
    short of its IDs is found whichever chunk it is in."""
    t = table()
    weights = t.column("tag_w").combine_chunks()
    rechunked = pa.chunked_array([weights.slice(0, 3), weights.slice(3)])
    transform = transform_of(SparseFeature("tags", 97, 4, weights="tag_w"))
    transform.validate(t.set_column(2, "tag_w", rechunked))
    rows = weights.to_pylist()
    rows[5] = rows[5][:-1]  # three IDs, two weights
    short = pa.array(rows, weights.type)
    bad = pa.chunked_array([short.slice(0, 3), short.slice(3)])
    with pytest.raises(ValueError, match=r"e\.g\. row 5"):
        transform.validate(t.set_column(2, "tag_w", bad))


def test_bad_one_hot_weights_and_weight_types_name_their_column():
    transform = transform_of(SparseFeature("item", 50, 4, weights="item_w"))
    with pytest.raises(ValueError, match=r"column item_w: 1 null weight\(s\) of item's IDs"):
        transform.validate(table().set_column(5, "item_w", pa.array([None] + [1.0] * 7)))
    with pytest.raises(ValueError, match=r"column item_w: 1 weight\(s\) of item's IDs NaN"):
        transform.validate(table().set_column(5, "item_w", pa.array([NAN] + [1.0] * 7)))
    wrong = transform_of(SparseFeature("tags", 97, 4, weights="item_w"))
    message = "column item_w: the weights of feature tags must be a list of numbers a row"
    with pytest.raises(ValueError, match=re.escape(message)):
        wrong.validate(table())
    strings = table().set_column(5, "item_w", pa.array(["1"] * 8))
    with pytest.raises(ValueError, match="must be a number a row, like its IDs; got string"):
        transform(strings)


# -- HashedCross ------------------------------------------------------------------------------


def reference_cross(values: list[int]) -> int:
    """``cross_ids`` in plain Python: stable_hash of the first, then of each next plus it."""

    def mix(z: int) -> int:
        z ^= z >> 32
        z = (z * 0xBF58476D1CE4E5B9) & MASK
        z ^= z >> 32
        z = (z * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 32)

    h = mix(values[0] & MASK)
    for v in values[1:]:
        h = mix(((v & MASK) + h) & MASK)
    return h - (1 << 64) if h >> 63 else h


def test_cross_ids_follow_the_documented_formula_and_are_pinned():
    got = cross_ids([np.array([1, -5, 2**62]), np.array([2, 7, -1])]).tolist()
    assert got == [reference_cross([1, 2]), reference_cross([-5, 7]), reference_cross([2**62, -1])]
    # Pinned: a change here silently remaps every cross of every saved model.
    assert got[0] == -1880958426102861082
    assert cross_ids([np.array([1]), np.array([2])]) != cross_ids([np.array([2]), np.array([1])])


@pytest.mark.parametrize("encoding", ["plain", "dictionary", "large"])
def test_a_cross_is_one_id_a_row_hashed_into_its_own_table(encoding):
    cross = SparseFeature("user_x_item", 64, 4, cross=("user", "item"))
    transform = transform_of(SparseFeature("user", 50, 4), SparseFeature("item", 50, 4), cross)
    t = table(user=pa.large_string()) if encoding == "large" else table()
    if encoding == "dictionary":
        t = t.set_column(3, "user", t.column("user").dictionary_encode())
    batch = every_form(transform, t)
    assert batch.sparse.one_hot_rows is not None  # one-hot: crosses are one ID a row
    rows = batch.sparse.one_hot_rows[:, 2].tolist()
    for user, item, row in zip(ROWS["user"], ROWS["item"], rows, strict=True):
        if user is None or item is None:
            assert row == -1  # any null crossed ID: an empty bag
        else:
            assert row == hashed(transform, "user_x_item", [reference_cross([raw(user), item])])[0]
    # Beside a list feature the batch is jagged, with the same bags.
    jagged = transform_of(SparseFeature("tags", 97, 4), cross)(t)
    assert bags_of(jagged, "user_x_item") == [[r] if r >= 0 else [] for r in rows]


def test_a_list_in_a_cross_is_refused_naming_the_cross_and_column():
    cross = SparseFeature("tags_x_item", 64, 4, cross=("tags", "item"))
    transform = transform_of(SparseFeature("tags", 97, 4), SparseFeature("item", 50, 4), cross)
    message = "cross tags_x_item: column tags is a list; a cross takes columns of one ID a row"
    with pytest.raises(ValueError, match=re.escape(message)):
        transform.validate(table())
    with pytest.raises(ValueError, match=re.escape(message)):
        transform(table())


# -- Bucketize ------------------------------------------------------------------------------


@pytest.mark.parametrize("column", ["price", "qty"])
def test_bucketized_columns_are_categorical_bucket_rows(column):
    boundaries = (0.0, 2.0, 7.25)
    d = DenseFeature(column=column, fill=5.0, transform="bucketize", boundaries=boundaries)
    bucket = SparseFeature(column, len(boundaries) + 1, 4, bucketize=d)
    transform = transform_of(SparseFeature("item", 50, 4), bucket)
    batch = every_form(transform, table())
    for value, row in zip(ROWS[column], batch.sparse.one_hot_rows[:, 1].tolist(), strict=True):
        x = 5.0 if value is None or math.isnan(value) else value
        # numpy.digitize's convention: a value equal to a boundary goes up.
        assert row == sum(x >= b for b in boundaries)
    assert transform._layout_of(table().schema).compiled is False


def test_a_bucketized_column_beyond_float32_or_of_strings_is_named():
    d = DenseFeature(column="price", transform="bucketize", boundaries=(1.0,))
    transform = transform_of(SparseFeature("price", 2, 4, bucketize=d))
    huge = table().set_column(6, "price", pa.array([1e300] + [1.0] * 7))
    with pytest.raises(ValueError, match=r"column price: 1 value\(s\) infinite or beyond"):
        transform.validate(huge)
    strings = table().set_column(6, "price", pa.array(["x"] * 8))
    with pytest.raises(ValueError, match="column price: expected an integer or float value to"):
        transform(strings)


# -- Normalize: standardize -------------------------------------------------------------------


def test_standardize_centres_and_scales_after_the_fill():
    d = DenseFeature(column="price", fill=1.0, transform="standardize", mean=2.5, std=4.0)
    flat = DenseFeature(column="qty", transform="standardize", mean=3.0, std=0.0)
    transform = transform_of(SparseFeature("item", 50, 4), dense=(d, flat))
    batch = every_form(transform, table())
    for i, (price, qty) in enumerate(zip(ROWS["price"], ROWS["qty"], strict=True)):
        x = np.float32(1.0 if price is None or math.isnan(price) else price)
        assert batch.dense[i, 0].item() == (x - np.float32(2.5)) / np.float32(4.0)
        # std 0: only centred, never a division by zero.
        assert batch.dense[i, 1].item() == np.float32(0.0 if qty is None else qty) - 3
    assert torch.isfinite(batch.dense).all()


# -- everything at once ------------------------------------------------------------------------


def test_all_operations_together_and_over_the_wire():
    d = DenseFeature(column="qty", transform="bucketize", boundaries=(1.0, 10.0))
    features = (
        SparseFeature("tags", 97, 4, max_length=2, weights="tag_w"),
        SparseFeature("user", 50, 4),
        SparseFeature("item", 50, 4, weights="item_w"),
        SparseFeature("qty", 3, 4, bucketize=d),
        SparseFeature("user_x_item", 64, 4, cross=("user", "item")),
    )
    transform = transform_of(*features, dense=(DenseFeature(column="price"),))
    t = table().set_column(5, "item_w", pa.array([1.0] * 8))
    batch = every_form(transform, t)
    assert batch.sparse.keys == [f.name for f in features]
    assert_batches_equal(decode_batch(encode_batch(batch)), batch)
    order = np.array([7, 3, 0, 5, 1, 6, 2, 4])
    writer = transform.window_writer(order)
    writer.add(t.slice(0, 5))
    writer.add(t.slice(5))
    assert_batches_equal(writer.finish(), batch.take(order))
    empty = transform(t.slice(0, 0))
    assert empty.sparse.weights is not None and len(empty) == 0
    assert_batches_equal(Batch.concat([empty, batch]), batch)

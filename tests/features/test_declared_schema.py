"""``BatchTransform`` on a user's declared schema: any label column (soft labels too),
declared dense transforms, string IDs (plain, large, dictionary-encoded, in lists).

Every output is checked against an independent pure-Python reference (the string hash
included, reimplemented in ``tests/ingest/test_strings.py``), whatever the table's
chunking or slicing.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrmflow.features.batch import Batch
from dlrmflow.features.ids import HashIds, Vocabulary, build_vocabulary
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.features.transform import BatchTransform
from dlrmflow.features.wire import decode_batch, encode_batch
from dlrmflow.schema import DenseFeature
from tests.features.test_transform import assert_batches_equal, rechunk
from tests.ingest.test_strings import reference_hash

NAN = float("nan")
ROWS = {
    "click": [0, 1, 0, 1, 1, 0, 0, 1],
    "price": [1.5, None, NAN, -2.0, 100.0, 0.0, 7.25, None],
    "qty": [3, None, 0, -1, 50, 2, None, 9],
    "user_id": ["alice", None, "bob", "alice", "", "日本", None, "carol"],
    "tags": [["a", None, "b"], None, [], ["a"], [None], ["c", "c"], None, ["b", "d"]],
    "item_id": [10, 20, None, -5, 10, 2**62, 7, None],
}
SOFT = [0.0, 1.0, 0.25, 1.0, 0.5, 0.0, 0.75, 1.0]
SPARSE = ("user_id", "tags", "item_id")
TABLE_ROWS = {"user_id": 50, "tags": 20, "item_id": 30}

TRANSFORMS = {
    "log": DenseFeature(column="price"),
    "log-fill": DenseFeature(column="price", fill=5.0),
    "clip": DenseFeature(column="price", fill=-1.0, transform="clip", clip_min=0.0, clip_max=50.0),
    "none": DenseFeature(column="price", fill=2.5, transform="none"),
}
QTY = DenseFeature(column="qty", fill=-7.0, transform="clip", clip_min=-3.0, clip_max=10.5)


def spec_of(price: DenseFeature, *, sparse: tuple[str, ...] = SPARSE, qty=QTY) -> FeatureSpec:
    return FeatureSpec(
        dense=("price", "qty"),
        sparse=tuple(SparseFeature(name, TABLE_ROWS[name], 4) for name in sparse),
        label="click",
        dense_transforms=None if qty is None else (price, qty),
    )


def mapper(sparse: tuple[str, ...] = SPARSE) -> HashIds:
    return HashIds({name: TABLE_ROWS[name] for name in sparse}, seed=3)


# (user_id's type, tags' type, click's type): every string encoding and label kind.
ENCODINGS = {
    "string": (pa.string(), pa.list_(pa.string()), pa.int8()),
    "large": (pa.large_string(), pa.large_list(pa.large_string()), pa.bool_()),
    "dictionary": ("dictionary", pa.list_(pa.dictionary(pa.int32(), pa.string())), "soft"),
}


def make_table(encoding: str = "string") -> pa.Table:
    user_type, tags_type, click_type = ENCODINGS[encoding]
    if user_type == "dictionary":
        user_id = pa.array(ROWS["user_id"]).dictionary_encode()
    else:
        user_id = pa.array(ROWS["user_id"], user_type)
    if click_type == "soft":
        click = pa.array(SOFT, pa.float32())
    else:
        click = pa.array(ROWS["click"], pa.int8()).cast(click_type)
    return pa.table(
        {
            "click": click,
            "price": pa.array(ROWS["price"], pa.float32()),
            "qty": pa.array(ROWS["qty"], pa.int32()),
            "user_id": user_id,
            "tags": pa.array(ROWS["tags"], tags_type),
            "item_id": pa.array(ROWS["item_id"], pa.int64()),
        }
    )


# -- the reference, in plain Python --------------------------------------------------------


def reference_value(value: float | None, t: DenseFeature) -> float:
    x = t.fill if value is None or math.isnan(value) else value
    x = float(np.float32(x))
    if t.transform == "log":
        return math.log1p(max(x, 0.0))
    if t.transform == "clip":
        return min(max(x, float(np.float32(t.clip_min))), float(np.float32(t.clip_max)))
    return x


def raw_id(value: int | str) -> int:
    return reference_hash(value) if isinstance(value, str) else value


def reference_bag(value: object) -> list[int]:
    """The raw int64 IDs of one row's bag: nulls dropped, strings hashed."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    return [raw_id(v) for v in items if v is not None]


def check_against_reference(
    batch: Batch,
    rows: slice,
    spec: FeatureSpec,
    ids: HashIds,
    labels: list[float],
) -> None:
    transforms = spec.dense_transforms or tuple(DenseFeature(column=c) for c in spec.dense)
    expected = np.array(
        [[reference_value(ROWS[t.column][i], t) for t in transforms] for i in range(8)][rows]
    )
    np.testing.assert_allclose(batch.dense.numpy(), expected, rtol=1e-6, atol=0)
    assert batch.dense.dtype == torch.float32
    assert batch.labels.tolist() == labels[rows]
    values, lengths = [], []
    for name in spec.sparse_names:
        for value in ROWS[name][rows]:
            bag = reference_bag(value)
            lengths.append(len(bag))
            values += ids.map(name, np.array(bag, np.int64)).tolist()
    assert batch.sparse.keys == list(spec.sparse_names)
    assert batch.sparse.lengths.tolist() == lengths
    assert batch.sparse.values.tolist() == values


def labels_of(encoding: str) -> list[float]:
    return SOFT if ENCODINGS[encoding][2] == "soft" else [float(v) for v in ROWS["click"]]


# -- outputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", list(ENCODINGS))
@pytest.mark.parametrize("price", list(TRANSFORMS))
def test_output_equals_the_reference_whatever_the_chunks(encoding, price):
    spec, ids = spec_of(TRANSFORMS[price]), mapper()
    transform = BatchTransform(spec, ids)
    table = make_table(encoding)
    transform.validate(table)
    whole = transform(table)
    check_against_reference(whole, slice(None), spec, ids, labels_of(encoding))
    # Columns cut at different places, an empty chunk included; a record batch.
    cuts = {"click": [3], "price": [1, 1, 6], "qty": [5], "user_id": [2, 7], "tags": [1, 4]}
    chunked = rechunk(table, cuts)
    transform.validate(chunked)
    assert_batches_equal(transform(chunked), whole)
    assert_batches_equal(transform(table.to_batches()[0]), whole)
    # Slices, which start deep inside their buffers (offsets, bitmaps, strings).
    for start, stop in [(1, 8), (2, 6), (5, 8)]:
        part = transform(table.slice(start, stop - start))
        check_against_reference(part, slice(start, stop), spec, ids, labels_of(encoding))
        assert_batches_equal(transform(chunked.slice(start, stop - start)), part)


@pytest.mark.parametrize(
    "kind", [pa.int8(), pa.uint32(), pa.int64(), pa.float16(), pa.float32(), pa.float64()]
)
def test_a_declared_fill_takes_every_numeric_type(kind):
    """Each value as float32 (numpy's cast), each null or NaN as the fill, whatever the
    column's type and wherever a slice starts in its buffers."""
    values = [3, None, 7, 0, None, 120, 1, 9]
    floating = pa.types.is_floating(kind)
    if floating:
        values = [2.5, None, float("nan"), -0.75, None, 1e4, 0.1, 7.0]
    table = make_table()
    table = table.set_column(table.schema.get_field_index("price"), "price", pa.array(values, kind))
    transform = BatchTransform(spec_of(TRANSFORMS["none"]), mapper())
    for start in (0, 3):
        part = table.slice(start)
        transform.validate(part)
        dtype = kind.to_pandas_dtype()
        expected = [
            2.5 if v is None or v != v else float(np.array(v, dtype).astype(np.float32))
            for v in values[start:]
        ]
        assert transform(part).dense[:, 0].tolist() == expected


@pytest.mark.parametrize("declared", [False, True])
def test_string_ids_map_like_their_int64_hashes(declared):
    """One-hot string IDs (the compiled path when the dense transforms are Criteo's): the
    same rows as the hashes given as int64, and as the dictionary-encoded strings."""
    sparse = ("user_id", "item_id")
    spec = spec_of(TRANSFORMS["log"], sparse=sparse, qty=QTY if declared else None)
    transform = BatchTransform(spec, mapper(sparse))
    # Dense columns of one type, as the compiled path wants them.
    table = make_table().drop_columns(["tags"])
    table = table.set_column(2, "qty", table.column("qty").cast(pa.float32()))
    assert transform._layout_of(table.schema).compiled is not declared
    batch = transform(table)
    check_against_reference(batch, slice(None), spec, mapper(sparse), labels_of("string"))
    hashed = [None if u is None else reference_hash(u) for u in ROWS["user_id"]]
    as_int64 = table.set_column(3, "user_id", pa.array(hashed, pa.int64()))
    assert_batches_equal(transform(as_int64), batch)
    encoded = table.set_column(3, "user_id", table.column("user_id").dictionary_encode())
    assert_batches_equal(transform(encoded), batch)
    # The reader's shuffled window, built one table at a time.
    order = np.array([5, 0, 7, 2, 1, 6, 3, 4])
    writer = transform.window_writer(order)
    writer.add(table.slice(0, 3))
    writer.add(table.slice(3))
    assert_batches_equal(writer.finish(), batch.take(order))


@pytest.mark.parametrize("price", ["log", "clip"])
def test_windows_of_declared_schemas(price):
    transform = BatchTransform(spec_of(TRANSFORMS[price]), mapper())
    table = make_table()
    order = np.array([3, 7, 0, 1, 6, 2, 5, 4])
    expected = transform(table).take(order)
    writer = transform.window_writer(order)
    for start in (0, 2, 5):
        writer.add(table.slice(start, {0: 2, 2: 3, 5: 3}[start]))
    assert_batches_equal(writer.finish(), expected)
    assert_batches_equal(transform.window([table.slice(0, 4), table.slice(4)], order), expected)


def test_declared_plain_log_is_criteos_transform():
    plain = DenseFeature(column="qty")
    declared = BatchTransform(spec_of(DenseFeature(column="price"), qty=plain), mapper())
    criteo = BatchTransform(spec_of(DenseFeature(column="price"), qty=None), mapper())
    table = make_table()
    assert_batches_equal(declared(table), criteo(table))


def test_string_batches_travel_the_reader_service_codec():
    batch = BatchTransform(spec_of(TRANSFORMS["clip"]), mapper())(make_table("large"))
    assert_batches_equal(decode_batch(encode_batch(batch)), batch)


# -- vocabularies count strings by the same hash --------------------------------------------


def test_vocabulary_counts_string_ids_by_their_hash(tmp_path):
    # Two files: plain strings in row groups of 5, then dictionary-encoded ones (which
    # Parquet gives back dictionary-encoded, as they were written).
    paths = [str(tmp_path / "plain.parquet"), str(tmp_path / "dictionary.parquet")]
    table = make_table("string")
    encoded = table.set_column(3, "user_id", table.column("user_id").dictionary_encode())
    pq.write_table(table, paths[0], row_group_size=5)
    pq.write_table(encoded, paths[1])
    assert pa.types.is_dictionary(pq.read_schema(paths[1]).field("user_id").type)
    vocab = build_vocabulary(paths, ["user_id", "tags"], min_count=1)
    # user_id: alice x4, then bob, "", 日本, carol x2 each (ties by ascending hash).
    twice = sorted(reference_hash(s) for s in ["bob", "", "日本", "carol"])
    assert vocab.ids["user_id"].tolist() == [reference_hash("alice"), *twice]
    assert vocab.counts["user_id"].tolist() == [4, 2, 2, 2, 2]
    # tags: a x4, b x4, c x4, d x2 (null elements and null lists are no IDs).
    assert vocab.counts["tags"].tolist() == [4, 4, 4, 2]
    assert vocab.ids["tags"].tolist()[3] == reference_hash("d")
    assert sorted(vocab.ids["tags"].tolist()[:3]) == sorted(reference_hash(s) for s in "abc")
    # The transform maps the strings through it: alice -> row 1, unknown -> row 0.
    ones = np.ones(2)
    small = Vocabulary(
        {"user_id": np.array([reference_hash("alice"), reference_hash("bob")])},
        {"user_id": ones},
        min_count=1,
    )
    spec = FeatureSpec(
        dense=("price",),
        sparse=(SparseFeature("user_id", 3, 4),),
        label="click",
        dense_transforms=(TRANSFORMS["none"],),
    )
    rows = BatchTransform(spec, small)(table.select(["click", "price", "user_id"]))
    assert rows.sparse.values.tolist() == [1, 2, 1, 0, 0, 0]
    assert rows.sparse.lengths.tolist() == [1, 0, 1, 1, 1, 1, 0, 1]


# -- errors name the column ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("click", "message"),
    [
        (pa.array([0, None, 1, 1, 0, 0, 1, 0], pa.int8()), r"column click: 1 null label\(s\)"),
        (
            pa.array([0.0, 1.5, 1.0, 1, 0, 0, 1, 0], pa.float32()),
            r"column click: 1 label\(s\) not in \[0, 1\] \(e.g. 1.5\)",
        ),
        (
            pa.array([0.0, -0.1, 1.0, 1, 0, 0, 1, 0], pa.float64()),
            r"column click: 1 label\(s\) not in \[0, 1\] \(e.g. -0.1\)",
        ),
        (
            pa.array([0.0, NAN, 1.0, 1, 0, 0, NAN, 0], pa.float64()),
            r"column click: 2 label\(s\) not in \[0, 1\] \(e.g. nan\)",
        ),
        (pa.array([0.0, None, 1, 1, 0, 0, 1, 0]), r"column click: 1 null label\(s\)"),
        (
            pa.array(np.array([0, 1.5, 1, 1, 0, 0, 1, 0], np.float16)),
            r"column click: 1 label\(s\) not in \[0, 1\] \(e.g. 1.5\)",
        ),
        (
            pa.array([0, 2, 1, 1, 0, 0, 1, 0], pa.int64()),
            r"column click: 1 label\(s\) not 0 or 1 \(e.g. 2\)",
        ),
    ],
)
def test_bad_labels_name_the_column(click, message):
    table = make_table().set_column(0, "click", click)
    with pytest.raises(ValueError, match=message):
        BatchTransform(spec_of(TRANSFORMS["log"]), mapper()).validate(table)


def test_soft_labels_of_any_float_type():
    for dtype in (np.float16, np.float32, np.float64):
        table = make_table().set_column(0, "click", pa.array(np.array(SOFT, dtype)))
        transform = BatchTransform(spec_of(TRANSFORMS["log"]), mapper())
        transform.validate(table)
        assert transform(table).labels.tolist() == SOFT


ID_TYPES = "int64 or string IDs, or lists of them (optionally dictionary-encoded)"


@pytest.mark.parametrize(
    ("column", "array", "message"),
    [
        ("price", pa.array(["1"] * 8), "column price: expected an integer or float dense value"),
        ("click", pa.array(["1"] * 8), "column click: expected an integer, bool or float label"),
        ("user_id", pa.array([b"x"] * 8), f"column user_id: expected {ID_TYPES}, got binary"),
        ("user_id", pa.array([1.0] * 8), f"column user_id: expected {ID_TYPES}, got double"),
        (
            "user_id",
            pa.DictionaryArray.from_arrays(pa.array([0] * 8, pa.uint8()), pa.array(["a"])),
            f"column user_id: expected {ID_TYPES}, got dictionary<values=string, indices=uint8",
        ),
        (
            "tags",
            pa.array([[b"x"]] * 8, pa.list_(pa.binary())),
            f"column tags: expected {ID_TYPES}, got list<item: binary>",
        ),
        (
            "tags",
            pa.array([[["x"]]] * 8, pa.list_(pa.list_(pa.string()))),
            f"column tags: expected {ID_TYPES}, got list<item: list<item: string>>",
        ),
    ],
)
def test_bad_column_types_name_the_column(column, array, message):
    table = make_table()
    table = table.set_column(table.schema.get_field_index(column), column, array)
    transform = BatchTransform(spec_of(TRANSFORMS["clip"]), mapper())
    with pytest.raises(ValueError, match=re.escape(message)):
        transform.validate(table)
    with pytest.raises(ValueError, match=column):
        transform(table)


def test_dense_values_and_declared_numbers_beyond_float32_name_the_column():
    transform = BatchTransform(spec_of(TRANSFORMS["none"]), mapper())
    table = make_table()
    wide = pa.array([1.0, 1e300, None, 0, 0, 0, 0, 0], pa.float64())
    bad = table.set_column(1, "price", wide)
    message = r"column price: 1 value\(s\) infinite or beyond float32's range \(e.g. 1e\+300\)"
    with pytest.raises(ValueError, match=message):
        transform.validate(bad)
    with pytest.raises(ValueError, match=message):
        transform(bad)
    for declared in (
        DenseFeature(column="price", fill=1e39, transform="none"),
        DenseFeature(column="price", transform="clip", clip_min=0.0, clip_max=1e39),
    ):
        with pytest.raises(ValueError, match=r"column price: (fill|clip_max) 1e\+39 is beyond"):
            BatchTransform(spec_of(declared), mapper())

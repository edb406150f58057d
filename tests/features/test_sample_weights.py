"""Per-example weights (the schema's ``weight`` column): read by the transform on every path,
carried by ``Batch`` through each of its operations and the reader service's wire format,
known to the feature spec, and absent (None) wherever no weight column is declared."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pytest
import torch

from dlrmflow.features.batch import Batch
from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.features.transform import BatchTransform
from dlrmflow.features.wire import decode_batch, encode_batch, features_digest
from dlrmflow.sparse import KeyedJaggedTensor
from tests.features.test_transform import assert_batches_equal

N = 8
WEIGHTS = [1.0, 0.5, 0.0, 2.0, 3.25, 1.0, 7.0, 0.125]


def spec_of(weight: str | None = "w", *, multi_hot: bool = False) -> FeatureSpec:
    sparse = (SparseFeature("item", 64, 4), SparseFeature("tags" if multi_hot else "user", 32, 4))
    return FeatureSpec(dense=("price",), sparse=sparse, label="click", weight=weight)


def table_of(weights: pa.Array | None = None, *, multi_hot: bool = False) -> pa.Table:
    columns = {
        "click": pa.array([0, 1, 0, 1, 1, 0, 0, 1], pa.int8()),
        "price": pa.array([1.0, None, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], pa.float32()),
        "item": pa.array([1, 2, 3, None, 5, 6, 7, 8], pa.int64()),
    }
    if multi_hot:
        columns["tags"] = pa.array([[1, 2], [], None, [3], [4, 5, 6], [7], [8], []])
    else:
        columns["user"] = pa.array(["a", "b", None, "d", "e", "f", "g", "h"])
    if weights is not None:
        columns["w"] = weights
    return pa.table(columns)


def transform_of(spec: FeatureSpec) -> BatchTransform:
    return BatchTransform(spec, HashIds.from_spec(spec, seed=1))


@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("kind", [pa.float32(), pa.float64(), pa.int32(), pa.uint8()])
def test_weights_become_float32_sample_weights_on_every_path(kind, multi_hot):
    """The compiled path (one-hot IDs, Criteo's dense transform) and the numpy path (lists)
    read the weight column alike, as do ``window`` and the window writer."""
    values = [round(w) for w in WEIGHTS] if pa.types.is_integer(kind) else WEIGHTS
    table = table_of(pa.array(values, kind), multi_hot=multi_hot)
    transform = transform_of(spec_of(multi_hot=multi_hot))
    transform.validate(table)
    batch = transform(table)
    expected = torch.tensor(values, dtype=torch.float32)
    assert batch.sample_weights is not None and batch.sample_weights.dtype == torch.float32
    assert torch.equal(batch.sample_weights, expected)
    # The same rows without the weight column give the same everything else.
    unweighted = transform_of(spec_of(None, multi_hot=multi_hot))(table)
    assert unweighted.sample_weights is None
    assert torch.equal(batch.labels, unweighted.labels)
    assert torch.equal(batch.dense, unweighted.dense)
    order = np.array([3, 0, 7, 5, 1, 6, 2, 4])
    halves = [table.slice(0, 3), table.slice(3)]
    windowed = transform.window(halves, order)
    assert torch.equal(windowed.sample_weights, expected[order])
    writer = transform.window_writer(order)
    for half in halves:
        writer.add(half)
    assert_batches_equal(writer.finish(), windowed)
    assert torch.equal(windowed.labels, batch.labels[order])


def test_without_a_weight_column_batches_carry_none():
    """Criteo's layout and every schema without ``weight``: no sample weights at all."""
    table = table_of(pa.array(WEIGHTS))  # a column named w that is not declared
    transform = transform_of(spec_of(None))
    assert transform(table).sample_weights is None
    assert transform.window([table], np.arange(N)).sample_weights is None
    assert transform(table.slice(0, 0)).sample_weights is None
    assert transform_of(spec_of())(table.slice(0, 0)).sample_weights.shape == (0,)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (pa.array([1.0, None] + [1.0] * 6), "column w: 1 null weight(s)"),
        (pa.array([1.0, NAN] + [1.0] * 6), "column w: 1 weight(s) negative, NaN"),
        (pa.array([1.0, -0.5, -1.0] + [1.0] * 5), "column w: 2 weight(s) negative"),
        (pa.array([INF] + [1.0] * 7), "(e.g. inf)"),
        (pa.array([1e300] + [1.0] * 7, pa.float64()), "(e.g. 1e+300)"),
        (pa.array([-3] + [1] * 7, pa.int64()), "column w: 1 negative weight(s) (e.g. -3)"),
        (pa.array([1.0, -2.0] + [1.0] * 6, pa.float16()), "(e.g. -2.0)"),
    ],
)
def test_bad_weights_name_the_column(weights, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        transform_of(spec_of()).validate(table_of(weights))


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (pa.array(["1"] * N), "column w: expected an integer or float weight, got string"),
        (pa.array([True] * N), "column w: expected an integer or float weight, got bool"),
        (None, "column w: missing"),
    ],
)
def test_a_weight_column_of_another_type_or_none_is_named(weights, message):
    transform = transform_of(spec_of())
    with pytest.raises(ValueError, match=re.escape(message)):
        transform.validate(table_of(weights))
    with pytest.raises(ValueError, match=re.escape(message)):
        transform(table_of(weights))


def weighted_batch(rows: int, first: float = 0.0) -> Batch:
    ids = torch.arange(rows * 2, dtype=torch.int32).view(rows, 2) % 5
    return Batch(
        dense=torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + first,
        sparse=KeyedJaggedTensor.from_one_hot(["a", "b"], ids),
        labels=(torch.arange(rows) % 2).float(),
        sample_weights=torch.arange(rows, dtype=torch.float32) / 4 + first,
    )


def test_batch_operations_keep_each_weight_beside_its_row():
    a, b = weighted_batch(5), weighted_batch(3, first=100.0)
    both = Batch.concat([a, b])
    expected = torch.cat([a.sample_weights, b.sample_weights])
    assert torch.equal(both.sample_weights, expected)
    assert torch.equal(both.labels, torch.cat([a.labels, b.labels]))
    order = torch.tensor([7, 0, 3, 3, 5])
    taken = both.take(order)
    assert torch.equal(taken.sample_weights, expected[order])
    assert torch.equal(taken.dense, both.dense[order])
    assert torch.equal(both.slice(2, 6).sample_weights, expected[2:6])
    assert torch.equal(both.to("cpu").sample_weights, expected)
    with pytest.raises(ValueError, match="some batches have sample weights and some do not"):
        Batch.concat([a, Batch(b.dense, b.sparse, b.labels)])
    unweighted = Batch.concat([Batch(a.dense, a.sparse, a.labels)] * 2)
    assert unweighted.sample_weights is None and unweighted.dense.shape == (10, 3)


def test_empty_batches_are_weighted_when_asked():
    assert Batch.empty(3, ["a"]).sample_weights is None
    empty = Batch.empty(3, ["a", "b"], weighted=True)
    assert empty.sample_weights.shape == (0,) and len(empty) == 0
    both = Batch.concat([empty, weighted_batch(2)])
    assert torch.equal(both.sample_weights, weighted_batch(2).sample_weights)


@pytest.mark.parametrize("multi_hot", [False, True])
def test_the_wire_format_carries_sample_weights(multi_hot):
    transform = transform_of(spec_of(multi_hot=multi_hot))
    batch = transform(table_of(pa.array(WEIGHTS), multi_hot=multi_hot))
    record = encode_batch(batch)
    assert "sample_weights" in record.schema.names
    assert_batches_equal(decode_batch(record), batch)
    plain = transform_of(spec_of(None, multi_hot=multi_hot))(table_of(multi_hot=multi_hot))
    record = encode_batch(plain)
    assert "sample_weights" not in record.schema.names
    assert decode_batch(record).sample_weights is None


def test_the_spec_knows_the_weight_column_and_keeps_old_specs_as_they_were():
    spec = spec_of()
    assert spec.columns == ["click", "w", "price", "item", "user"]
    assert spec.to_dict()["weight"] == "w"
    assert FeatureSpec.from_dict(spec.to_dict()) == spec
    plain = spec_of(None)
    assert "weight" not in plain.to_dict()
    assert FeatureSpec.from_dict(plain.to_dict()).weight is None
    ids = HashIds.from_spec(plain)
    # Another weight column gives other batches: another digest; none keeps the old one.
    digests = {features_digest(s, ids) for s in (plain, spec, spec_of("v"))}
    assert len(digests) == 3

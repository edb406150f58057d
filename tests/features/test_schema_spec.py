"""The declared schema's per-feature operations as the feature spec resolves them: table
sizes, pooling, crosses, bucketized and standardized columns frozen from the statistics,
the spec's plain data (a run's identity) and the ID mapping fitted per feature."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmflow.config import FeaturesConfig, ModelConfig
from dlrmflow.features.fit import feature_ids, fit_features, needs_statistics, vocabulary_columns
from dlrmflow.features.ids import FeatureIds, HashIds, Vocabulary, build_vocabulary
from dlrmflow.features.spec import MIN_HASH_ROWS, FeatureSpec, SparseFeature
from dlrmflow.features.transform import BatchTransform
from dlrmflow.features.wire import features_digest
from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.stats.scan import Columns, StatsAccumulator
from dlrmflow.schema import FeatureSchema, SchemaError, parse_schema

SCHEMA = {
    "label": "click",
    "weight": "w",
    "dense": [
        {"column": "price", "transform": "standardize", "fill": 1.0},
        {"column": "age", "transform": "bucketize", "buckets": 4},
        {"column": "qty", "transform": "bucketize", "boundaries": [1, 5, 10]},
        {"column": "score", "transform": "none"},
    ],
    "sparse": [
        {"column": "user", "ids": "vocab", "min_count": 2, "rows": 4},
        {"column": "item", "rows": 500},
        {"column": "tags", "max_length": 3, "keep": "last", "weights": "tag_w"},
        {"column": "genre"},
    ],
    "crosses": [{"name": "user_x_item", "columns": ["user", "item"]}],
}
CARDS = {"user": 6, "item": 400, "tags": 30, "genre": 5}


def manifest_of(schema: dict) -> Manifest:
    return Manifest(
        source="registered", rows=8, days=2, test_day=1, positive_rate=0.5, files=[],
        schema=[], cardinalities=CARDS, features=schema,
    )  # fmt: skip


def stats_of(columns: dict[str, list]) -> object:
    acc = StatsAccumulator(Columns("click", tuple(columns), ()))
    table = {"click": pa.array([0] * len(next(iter(columns.values()))), pa.int8())}
    acc.add(pa.table({**table, **{k: pa.array(v) for k, v in columns.items()}}), "t")
    return acc.result("t", False)


STATS = stats_of(
    {
        "price": [2.0, 4.0, None, 6.0, 8.0, None, 10.0, 12.0],
        "age": [18, 25, 30, 30, 42, 55, 61, None],
        "qty": [1, 2, 3, 4, 5, 6, 7, 8],
        "score": [0.1] * 8,
    }
)
FEATURES = FeaturesConfig(pooling="sum", hash_size_factor=2, max_rows_per_table=10_000)
MODEL = ModelConfig(embedding_dim=8, bottom_mlp=[8])


def test_the_spec_resolves_every_operation():
    spec = FeatureSpec.for_dataset(manifest_of(SCHEMA), FEATURES, MODEL, stats=STATS)
    assert spec.dense == ("price", "score")
    price = spec.dense_transforms[0]
    filled = np.array([2.0, 4.0, 1.0, 6.0, 8.0, 1.0, 10.0, 12.0])  # nulls as the fill
    assert price.mean == pytest.approx(filled.mean()) and price.std == pytest.approx(filled.std())
    features = {f.name: f for f in spec.sparse}
    assert list(features) == ["user", "item", "tags", "genre", "age", "qty", "user_x_item"]
    assert features["user"].ids == "vocab" and features["user"].min_count == 2
    assert features["item"].num_embeddings == 500
    assert features["tags"].num_embeddings == max(60, MIN_HASH_ROWS)
    assert (features["tags"].max_length, features["tags"].keep) == (3, "last")
    assert features["tags"].weights == "tag_w"
    # Quartiles of [18, 25, 30, 30, 42, 55, 61, 0 (the fill)]: ranks 2, 4 and 6.
    assert features["age"].bucketize.boundaries == (25.0, 30.0, 55.0)
    assert features["age"].num_embeddings == 4
    assert features["qty"].bucketize.boundaries == (1.0, 5.0, 10.0)
    assert features["user_x_item"].cross == ("user", "item")
    assert features["user_x_item"].num_embeddings == 6 * 400 * 2  # distinct pairs at most
    assert spec.weight == "w"
    assert spec.columns == [
        "click", "w", "price", "score", "user", "item", "tags", "tag_w", "genre", "age", "qty",
    ]  # fmt: skip


def test_pooling_per_feature_and_per_id_weights_refuse_a_mean_pooled_table():
    unweighted = [{k: v for k, v in f.items() if k != "weights"} for f in SCHEMA["sparse"]]
    schema = {**SCHEMA, "sparse": [*unweighted[:3], {"column": "genre", "pooling": "mean"}]}
    spec = FeatureSpec.for_dataset(manifest_of(schema), FEATURES, MODEL, stats=STATS)
    pooling = {f.name: f.pooling for f in spec.sparse}
    assert pooling["genre"] == "mean" and set(pooling.values()) == {"sum", "mean"}
    schema["sparse"][2] = SCHEMA["sparse"][2]  # tags weighted again
    with pytest.raises(SchemaError, match="sparse feature genre: pooling mean, but tags has"):
        FeatureSpec.for_dataset(manifest_of(schema), FEATURES, MODEL, stats=STATS)
    mean = FeaturesConfig(pooling="mean")
    schema["sparse"] = [{**f, "pooling": "sum"} for f in SCHEMA["sparse"]]
    with pytest.raises(SchemaError, match="sparse feature age: pooling mean"):
        FeatureSpec.for_dataset(manifest_of(schema), mean, MODEL, stats=STATS)
    with pytest.raises(SchemaError, match=re.escape("f: sparse.0: x: per-ID weights need sum")):
        parse_schema(
            {"label": "y", "sparse": [{"column": "x", "weights": "w", "pooling": "mean"}]}, "f"
        )


def test_values_from_the_statistics_need_them():
    with pytest.raises(SchemaError, match="dense feature price: transform standardize takes"):
        FeatureSpec.for_dataset(manifest_of(SCHEMA), FEATURES, MODEL)
    old = STATS.__class__(**{**STATS.__dict__, "dense": tuple(
        d.__class__(**{**d.__dict__, "std": None, "sketch_keys": (), "sketch_counts": ()})
        for d in STATS.dense
    )})  # fmt: skip
    with pytest.raises(SchemaError, match="dense feature price: the dataset's statistics predate"):
        FeatureSpec.for_dataset(manifest_of(SCHEMA), FEATURES, MODEL, stats=old)
    given = {**SCHEMA, "dense": [
        {"column": "price", "transform": "standardize", "mean": 3.0, "std": 2.0},
        {"column": "age", "transform": "bucketize", "boundaries": [30]},
    ]}  # fmt: skip
    assert not needs_statistics(parse_schema(given, "x")) and needs_statistics(
        parse_schema(SCHEMA, "x")
    )
    spec = FeatureSpec.for_dataset(manifest_of(given), FEATURES, MODEL)
    assert (spec.dense_transforms[0].mean, spec.dense_transforms[0].std) == (3.0, 2.0)


MISTAKES = [
    ({"crosses": [{"name": "user", "columns": ["user", "genre"]}]}, "cross user: the name of"),
    ({"crosses": [{"name": "x", "columns": ["user", "price"]}]}, "price is not a declared"),
    ({"crosses": [{"name": "x", "columns": ["user"]}]}, "crosses.0.columns"),
    ({"dense": [{"column": "a", "transform": "bucketize"}]}, "bucketize needs boundaries or"),
    (
        {"dense": [{"column": "a", "transform": "bucketize", "boundaries": [2, 1]}]},
        "boundaries must be strictly increasing",
    ),
    ({"dense": [{"column": "a", "buckets": 3}]}, "boundaries and buckets are for transform"),
    ({"dense": [{"column": "a", "transform": "standardize", "mean": 1.0}]}, "both mean and"),
    ({"sparse": [{"column": "t", "keep": "last"}]}, "t: keep is for max_length"),
    ({"sparse": [{"column": "t", "ids": "hash", "min_count": 3}]}, "min_count is for ids: vocab"),
    ({"sparse": [{"column": "t", "weights": "t"}]}, "its weights are in a column of their own"),
    ({"sparse": [{"column": "t", "weights": "click"}]}, "column click is declared twice"),
]


@pytest.mark.parametrize(("change", "message"), MISTAKES)
def test_schema_mistakes_name_the_feature(change, message):
    with pytest.raises(SchemaError, match=re.escape(message)):
        parse_schema({"label": "click", "sparse": [{"column": "user"}], **change}, "s.yaml")


def test_old_specs_read_and_compare_as_they_did():
    """A spec written before these fields (every sparse feature four keys) reads back to
    itself, and a spec that uses none of them writes exactly those four keys."""
    old = {"dense": ["I1"], "sparse": [
        {"name": "C1", "num_embeddings": 10, "embedding_dim": 4, "pooling": "sum"}
    ], "label": "label"}  # fmt: skip
    assert FeatureSpec.from_dict(old).to_dict() == old
    # A declared transform recorded before standardize and bucketize: the same record.
    clip = {"column": "I1", "fill": 1.0, "transform": "clip", "clip_min": 0.0, "clip_max": 5.0}
    declared = {**old, "dense_transforms": [clip]}
    assert FeatureSpec.from_dict(declared).to_dict() == declared
    spec = FeatureSpec.for_dataset(manifest_of(SCHEMA), FEATURES, MODEL, stats=STATS)
    assert FeatureSpec.from_dict(spec.to_dict()) == spec
    tags = spec.to_dict()["sparse"][2]
    assert tags == {
        "name": "tags", "num_embeddings": 1024, "embedding_dim": 8, "pooling": "sum",
        "max_length": 3, "keep": "last", "weights": "tag_w",
    }  # fmt: skip


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s["sparse"][2].update(max_length=4),
        lambda s: s["sparse"][2].update(keep="first"),
        lambda s: s["sparse"][1].update(ids="vocab"),
        lambda s: s["crosses"][0].update(columns=["item", "user"]),
        lambda s: s["dense"][2].update(boundaries=[1, 5, 11]),
        lambda s: s["dense"][0].update(fill=0.0),
    ],
)
def test_a_changed_operation_changes_the_spec_and_the_batches_digest(edit):
    """A run's identity is its spec's plain data (a resume compares it) and reader servers
    compare the digest: each operation's change shows in both."""
    import copy

    spec = FeatureSpec.for_dataset(manifest_of(SCHEMA), FEATURES, MODEL, stats=STATS)
    changed_schema = copy.deepcopy(SCHEMA)
    edit(changed_schema)
    changed = FeatureSpec.for_dataset(manifest_of(changed_schema), FEATURES, MODEL, stats=STATS)
    assert changed.to_dict() != spec.to_dict()
    ids = HashIds({f.name: f.num_embeddings for f in spec.sparse})
    other = HashIds({f.name: f.num_embeddings for f in changed.sparse})
    if changed_schema["sparse"][1].get("ids") != "vocab":
        assert features_digest(changed, other) != features_digest(spec, ids)


# -- the ID mapping per feature ---------------------------------------------------------------


@pytest.fixture
def day_file(tmp_path):
    path = tmp_path / "day.parquet"
    pq.write_table(
        pa.table({
            "user": ["a", "a", "b", "b", "c", "d", "a", "b"],
            "item": [1, 1, 1, 2, 2, 3, 3, 3],
            "genre": [7, 7, 7, 7, 8, 8, 9, 9],
        }),
        path,
    )  # fmt: skip
    return str(path)


def test_vocabularies_per_feature_with_their_own_thresholds_and_caps(day_file):
    schema = FeatureSchema.model_validate({
        "label": "click",
        "sparse": [
            {"column": "user", "ids": "vocab", "min_count": 2},
            {"column": "item", "ids": "vocab", "rows": 2},
            {"column": "genre"},
        ],
    })  # fmt: skip
    features = FeaturesConfig(min_count=1)
    assert vocabulary_columns(schema, features) == {"user": (2, 99_999), "item": (1, 1)}
    manifest = manifest_of(schema.to_dict())
    spec, ids, vocab = fit_features(manifest, features, MODEL, [day_file])
    assert isinstance(ids, FeatureIds)
    assert len(vocab.ids["user"]) == 2  # a and b seen 3 times, c and d once
    assert vocab.ids["item"].tolist() == [1]  # the most frequent (then lowest), capped
    rows = {f.name: f.num_embeddings for f in spec.sparse}
    assert rows == {"user": 3, "item": 2, "genre": MIN_HASH_ROWS}
    # Each feature maps exactly as its own mapper alone would.
    alone = build_vocabulary([day_file], ["user", "item"], min_count={"user": 2, "item": 1},
                             max_size={"user": 99_999, "item": 1})  # fmt: skip
    probe = np.array([1, 2, 3, 99])
    assert ids.map("item", probe).tolist() == alone.map("item", probe).tolist() == [1, 0, 0, 0]
    hashed = HashIds({"genre": MIN_HASH_ROWS})
    assert ids.map("genre", probe).tolist() == hashed.map("genre", probe).tolist()
    keyed = ids.map_keyed(["genre", "item", "genre"], [probe, probe, probe[:2]])
    expected = [
        *hashed.map("genre", probe),
        *alone.map("item", probe),
        *hashed.map("genre", probe[:2]),
    ]
    assert keyed.tolist() == expected
    BatchTransform(spec, ids)  # table sizes agree


def test_a_run_that_chooses_nothing_per_feature_maps_as_it_always_did(day_file):
    schema = FeatureSchema.model_validate(
        {"label": "click", "sparse": [{"column": "user"}, {"column": "item"}]}
    )
    manifest = manifest_of(schema.to_dict())
    spec, ids, vocab = fit_features(manifest, FeaturesConfig(), MODEL, [day_file])
    assert vocab is None and isinstance(ids, HashIds)
    assert ids.table_rows == HashIds.from_spec(spec).table_rows
    spec, ids, vocab = fit_features(
        manifest, FeaturesConfig(ids="vocab", min_count=1), MODEL, [day_file]
    )
    assert ids is vocab and isinstance(ids, Vocabulary)
    old = build_vocabulary([day_file], ["user", "item"], min_count=1, max_size=99_999)
    assert all(np.array_equal(old.ids[n], vocab.ids[n]) for n in ("user", "item"))
    assert vocab.min_count == 1


def test_a_vocabulary_feature_is_never_hashed_by_mistake():
    spec = FeatureSpec((), (SparseFeature("user", 10, 4, ids="vocab"),), "click")
    with pytest.raises(SchemaError, match="sparse feature user: ids vocab, but this run hashes"):
        HashIds.from_spec(spec)
    with pytest.raises(SchemaError, match="sparse feature user: ids vocab, but no vocabulary"):
        feature_ids(spec, "hash", None)

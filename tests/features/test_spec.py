from dlrmflow.config import FeaturesConfig, ModelConfig
from dlrmflow.features.spec import MIN_HASH_ROWS, FeatureSpec
from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.schema import DENSE, SPARSE


def _manifest(cardinalities):
    return Manifest(
        source="test", rows=1, days=2, test_day=1, positive_rate=0.5, files=[], schema=[],
        cardinalities=cardinalities,
    )  # fmt: skip


def test_hash_tables_scale_with_cardinality_within_floor_and_cap():
    cards = {name: 10 for name in SPARSE} | {"C1": 3000, "C2": 1_000_000}
    spec = FeatureSpec.for_dataset(
        _manifest(cards),
        FeaturesConfig(max_rows_per_table=50_000, hash_size_factor=4),
        ModelConfig(embedding_dim=8, bottom_mlp=[8]),
    )
    rows = {f.name: f.num_embeddings for f in spec.sparse}
    assert rows["C1"] == 12_000
    assert rows["C2"] == 50_000
    assert rows["C3"] == MIN_HASH_ROWS
    assert spec.columns == ["label", *DENSE, *SPARSE]
    assert {f.embedding_dim for f in spec.sparse} == {8}


def test_unknown_cardinality_takes_the_cap_and_vocab_sizes_win():
    features = FeaturesConfig(max_rows_per_table=777)
    spec = FeatureSpec.for_dataset(_manifest(None), features, ModelConfig())
    assert {f.num_embeddings for f in spec.sparse} == {777}
    sizes = {name: i + 1 for i, name in enumerate(SPARSE)}
    spec = FeatureSpec.for_dataset(_manifest(None), features, ModelConfig(), sizes)
    assert [f.num_embeddings for f in spec.sparse] == list(range(1, 27))


def test_pooling_comes_from_the_features_config():
    spec = FeatureSpec.for_dataset(_manifest(None), FeaturesConfig(pooling="mean"), ModelConfig())
    assert {f.pooling for f in spec.sparse} == {"mean"}


def test_the_batch_digest_covers_declared_transforms_and_keeps_criteos():
    """Reader servers and trainers compare it: another fill or clip bound gives other
    batches, so another digest; Criteo's spec keeps the digest it always had."""
    from dlrmflow.features.ids import HashIds
    from dlrmflow.features.spec import FeatureSpec, SparseFeature
    from dlrmflow.features.wire import features_digest
    from dlrmflow.schema import DenseFeature

    sparse = (SparseFeature("item", 100, 8),)
    plain = FeatureSpec(dense=("price",), sparse=sparse, label="click")
    ids = HashIds.from_spec(plain)
    clip = DenseFeature(column="price", transform="clip", clip_min=0, clip_max=9)
    clipped = FeatureSpec(("price",), sparse, "click", (clip,))
    wider = FeatureSpec(("price",), sparse, "click", (clip.model_copy(update={"clip_max": 10}),))
    digests = {features_digest(s, ids) for s in (plain, clipped, wider)}
    assert len(digests) == 3
    assert features_digest(plain, ids) == features_digest(
        FeatureSpec.from_dict(plain.to_dict()), ids
    )

"""A run's ID mapping, fitted from its dataset's schema: which features look up a vocabulary
(``ids: vocab``, Categorify) and which are hashed (``ids: hash``, HashBucket, and every
cross), each feature by its own settings or the run's ``features`` section.

The steps, in the order a run takes them: ``vocabulary_columns`` says which columns need a
vocabulary and with what threshold and cap; ``fit_vocabulary`` counts them over the
training days; the spec is made with the vocabulary's table sizes
(``FeatureSpec.for_dataset(table_rows=...)``, with the statistics where
``needs_statistics``); ``feature_ids`` puts the mapping together. ``fit_features`` does
all of it. A schema that chooses nothing per feature gets exactly the mapping it always
got: ``HashIds`` for ``features.ids: hash``, one ``Vocabulary`` of every column for
``vocab``.
"""

from __future__ import annotations

from collections.abc import Sequence

from dlrmflow.config import FeaturesConfig, ModelConfig
from dlrmflow.features.ids import (
    FeatureIds,
    HashIds,
    IdMapper,
    RawIds,
    Vocabulary,
    build_vocabulary,
    shared,
)
from dlrmflow.features.spec import FeatureSpec, dataset_schema
from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.stats.results import DatasetStats
from dlrmflow.schema import FeatureSchema, SchemaError


def vocabulary_columns(
    schema: FeatureSchema, features: FeaturesConfig
) -> dict[str, tuple[int, int]]:
    """``{column: (min_count, most IDs kept)}`` of the sparse columns whose IDs look up a
    vocabulary, in schema order. A feature's ``rows`` caps its table (IDs kept plus the
    out-of-vocabulary row), else ``features.max_rows_per_table`` does."""
    wanted = {}
    for f in schema.sparse:
        table = schema.table_settings(f.table_name)  # a shared table's, as declared
        if (table.get("ids") or features.ids) != "vocab":
            continue
        rows = table.get("rows") or features.max_rows_per_table
        wanted[f.column] = (table.get("min_count") or features.min_count, max(rows - 1, 0))
    return wanted


def needs_statistics(schema: FeatureSchema) -> bool:
    """Whether the spec takes values from the dataset's statistics: a ``standardize``
    without its own ``mean`` and ``std``, or a ``bucketize`` with ``buckets``."""
    return any(
        (d.transform == "standardize" and d.std is None) or d.buckets is not None
        for d in schema.dense
    )


def fit_vocabulary(
    schema: FeatureSchema, features: FeaturesConfig, paths: Sequence[str]
) -> Vocabulary | None:
    """The vocabulary of the columns ``vocabulary_columns`` names, counted over the Parquet
    files ``paths`` (the training days), or None when every feature is hashed."""
    wanted = vocabulary_columns(schema, features)
    if not wanted:
        return None
    thresholds = {c: count for c, (count, _) in wanted.items()}
    distinct = set(thresholds.values())
    return build_vocabulary(
        paths,
        list(wanted),
        # One threshold for all is recorded as the one it always was.
        min_count=distinct.pop() if len(distinct) == 1 else thresholds,
        max_size={c: cap for c, (_, cap) in wanted.items()},
        tables={f.column: f.table for f in schema.sparse if f.table and f.column in wanted},
    )


def feature_ids(
    spec: FeatureSpec, default: str, vocabulary: Vocabulary | None, *, seed: int = 0
) -> IdMapper:
    """The ID mapping of ``spec``: ``vocabulary`` for its features whose IDs look it up
    (``ids``, else ``default``, the run's ``features.ids``), hashing for the others. A
    spec that looks nothing up is hashed as ``HashIds.from_spec``; one whose every feature
    is in the vocabulary is the vocabulary itself (the compiled transform's mappers).
    Features of ``ids: dynamic`` are handed on raw (``RawIds``) for the trainer's maps."""
    looked_up = [f.name for f in spec.sparse if f.mapping(default) == "vocab"]
    dynamic = {f.name: f.num_embeddings for f in spec.sparse if f.mapping(default) == "dynamic"}
    hashed = {
        f.name: f.num_embeddings
        for f in spec.sparse
        if f.name not in looked_up and f.name not in dynamic
    }
    hashing = HashIds(hashed, seed=seed, tables=shared(spec))
    if not looked_up and not dynamic:
        return hashing
    if looked_up:
        if vocabulary is None:
            raise SchemaError(f"sparse feature {looked_up[0]}: ids vocab, but no vocabulary given")
        missing = [name for name in looked_up if name not in vocabulary.ids]
        if missing:
            raise SchemaError(f"sparse feature {missing[0]}: ids vocab, not in the vocabulary")
        if not hashed and not dynamic and set(vocabulary.names) == set(looked_up):
            return vocabulary
    # Raw IDs for the trainer's dynamic maps (``RawIds``); the others as without them.
    return FeatureIds(
        vocabulary if looked_up else None, hashing, RawIds(dynamic) if dynamic else None
    )


def fit_features(
    manifest: Manifest,
    features: FeaturesConfig,
    model: ModelConfig,
    paths: Sequence[str],
    *,
    stats: DatasetStats | None = None,
    vocabulary: Vocabulary | None = None,
) -> tuple[FeatureSpec, IdMapper, Vocabulary | None]:
    """The spec, the ID mapping and the vocabulary (None: nothing looks one up) of a run
    on ``manifest``'s dataset whose training days are the files ``paths``. ``vocabulary``
    is one fitted before (a run that continues keeps its own); ``stats`` are needed where
    ``needs_statistics``."""
    schema = dataset_schema(manifest)
    if vocabulary is None:
        vocabulary = fit_vocabulary(schema, features, paths)
    rows = None if vocabulary is None else vocabulary.table_rows
    spec = FeatureSpec.for_dataset(manifest, features, model, rows, stats)
    return spec, feature_ids(spec, features.ids, vocabulary), vocabulary

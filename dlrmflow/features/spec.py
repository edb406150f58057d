"""The feature spec: which columns feed the model, how each dense column is transformed and
how big each embedding table is, made from the dataset's declared schema
(``dlrmflow.schema``; Criteo's layout when it declares none)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

from dlrmflow.config import FeaturesConfig, ModelConfig
from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.schema import LABEL
from dlrmflow.schema import DenseFeature, FeatureSchema, criteo_schema, parse_schema

# Hash tables are never smaller than this: tiny features (2-3 values) would otherwise see
# their few IDs collide, and a 1024-row table costs nothing.
MIN_HASH_ROWS = 1024


@dataclass(frozen=True)
class SparseFeature:
    """One categorical feature and the embedding table its IDs index."""

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling: Literal["sum", "mean"] = "sum"


@dataclass(frozen=True)
class FeatureSpec:
    """Dense column names, sparse features and the label column, in model order.

    ``dense_transforms``: each dense column's null fill and transform, in ``dense`` order;
    None is Criteo's for every column (nulls as 0, then ``log(1 + max(x, 0))``), which
    the compiled transform runs and which specs written before schemas mean.
    ``weight``: the column of per-example weights (``Batch.sample_weights``), None when
    the dataset declares none.
    """

    dense: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    label: str = LABEL
    dense_transforms: tuple[DenseFeature, ...] | None = None
    weight: str | None = None

    def __post_init__(self) -> None:
        if self.dense_transforms is not None:
            columns = tuple(t.column for t in self.dense_transforms)
            if columns != self.dense:
                raise ValueError(f"dense transforms of {columns}, columns {self.dense}")

    @property
    def columns(self) -> list[str]:
        """The Parquet columns the transform needs (everything else is never read)."""
        weight = [] if self.weight is None else [self.weight]
        return [self.label, *weight, *self.dense, *(f.name for f in self.sparse)]

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    def to_dict(self) -> dict:
        """Plain data for a checkpoint, so table sizes and transforms are known without the
        dataset (Criteo's transforms left out: such a spec reads as it always did)."""
        data = {
            "dense": list(self.dense),
            "sparse": [asdict(f) for f in self.sparse],
            "label": self.label,
        }
        if self.dense_transforms is not None:
            data["dense_transforms"] = [t.model_dump(mode="json") for t in self.dense_transforms]
        if self.weight is not None:
            data["weight"] = self.weight
        return data

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSpec:
        transforms = data.get("dense_transforms")
        return cls(
            dense=tuple(data["dense"]),
            sparse=tuple(SparseFeature(**f) for f in data["sparse"]),
            label=data["label"],
            dense_transforms=None
            if transforms is None
            else tuple(DenseFeature.model_validate(t) for t in transforms),
            weight=data.get("weight"),
        )

    @classmethod
    def for_dataset(
        cls,
        manifest: Manifest,
        features: FeaturesConfig,
        model: ModelConfig,
        table_rows: dict[str, int] | None = None,
    ) -> FeatureSpec:
        """The spec for ``manifest``'s dataset, from its declared schema (``dataset_schema``).

        A table has ``table_rows[name]`` rows when given (a vocabulary's size), else the
        schema's ``rows`` for the feature. Otherwise IDs are hashed: with a known
        cardinality (synthetic and registered data) into ``hash_size_factor`` buckets per
        distinct ID, at least ``MIN_HASH_ROWS``, so that few IDs share a row; with none
        (converted Criteo data) into ``max_rows_per_table`` buckets. Hash tables never
        exceed ``max_rows_per_table``.
        """
        schema = dataset_schema(manifest)
        cards = manifest.cardinalities or {}
        cap = features.max_rows_per_table
        sparse = []
        for feature in schema.sparse:
            name = feature.column
            if table_rows is not None:
                rows = table_rows[name]
            elif feature.rows is not None:
                rows = feature.rows
            elif name in cards:
                wanted = math.ceil(cards[name] * features.hash_size_factor)
                rows = min(max(wanted, MIN_HASH_ROWS), cap)
            else:
                rows = cap
            sparse.append(
                SparseFeature(name, max(int(rows), 1), model.embedding_dim, features.pooling)
            )
        plain = all(d.plain_log for d in schema.dense)
        return cls(
            dense=schema.dense_names,
            sparse=tuple(sparse),
            label=schema.label,
            dense_transforms=None if plain else schema.dense,
            weight=schema.weight,
        )


def dataset_schema(manifest: Manifest) -> FeatureSchema:
    """The feature schema ``manifest`` records (``dlrmflow register``), else Criteo's."""
    if manifest.features is None:
        return criteo_schema()
    return parse_schema(manifest.features, "manifest.json: features")

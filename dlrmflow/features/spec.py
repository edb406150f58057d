"""The feature spec: which columns feed the model and how big each embedding table is."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

from dlrmflow.config import FeaturesConfig, ModelConfig
from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.schema import DENSE, LABEL, SPARSE

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
    """Dense column names, sparse features and the label column, in model order."""

    dense: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    label: str = LABEL

    @property
    def columns(self) -> list[str]:
        """The Parquet columns the transform needs (everything else is never read)."""
        return [self.label, *self.dense, *(f.name for f in self.sparse)]

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    def to_dict(self) -> dict:
        """Plain data for a checkpoint, so table sizes are known without the dataset."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSpec:
        return cls(
            dense=tuple(data["dense"]),
            sparse=tuple(SparseFeature(**f) for f in data["sparse"]),
            label=data["label"],
        )

    @classmethod
    def for_dataset(
        cls,
        manifest: Manifest,
        features: FeaturesConfig,
        model: ModelConfig,
        table_rows: dict[str, int] | None = None,
    ) -> FeatureSpec:
        """The spec for a Criteo-layout dataset.

        A table has ``table_rows[name]`` rows when given (a vocabulary's size). Otherwise
        IDs are hashed: with a known cardinality (synthetic data) into ``hash_size_factor``
        buckets per distinct ID, at least ``MIN_HASH_ROWS``, so that few IDs share a row;
        with none (converted Criteo data) into ``max_rows_per_table`` buckets. Hash tables
        never exceed ``max_rows_per_table``.
        """
        cards = manifest.cardinalities or {}
        cap = features.max_rows_per_table
        sparse = []
        for name in SPARSE:
            if table_rows is not None:
                rows = table_rows[name]
            elif name in cards:
                wanted = math.ceil(cards[name] * features.hash_size_factor)
                rows = min(max(wanted, MIN_HASH_ROWS), cap)
            else:
                rows = cap
            sparse.append(
                SparseFeature(name, max(int(rows), 1), model.embedding_dim, features.pooling)
            )
        return cls(dense=DENSE, sparse=tuple(sparse))

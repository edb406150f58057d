"""The feature spec: which columns feed the model and how big each embedding table is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dlrmflow.config import FeaturesConfig, ModelConfig
from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.schema import DENSE, LABEL, SPARSE


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

    @classmethod
    def for_dataset(
        cls,
        manifest: Manifest,
        features: FeaturesConfig,
        model: ModelConfig,
        table_rows: dict[str, int] | None = None,
    ) -> FeatureSpec:
        """The spec for a Criteo-layout dataset.

        A table has ``table_rows[name]`` rows when given (a vocabulary's size); otherwise
        the feature's cardinality from the manifest, capped at ``max_rows_per_table`` hash
        buckets (converted Criteo data has no known cardinality and takes the cap).
        """
        cards = manifest.cardinalities or {}
        sparse = []
        for name in SPARSE:
            if table_rows is not None:
                rows = table_rows[name]
            else:
                rows = min(
                    cards.get(name, features.max_rows_per_table), features.max_rows_per_table
                )
            sparse.append(SparseFeature(name, max(int(rows), 1), model.embedding_dim))
        return cls(dense=DENSE, sparse=tuple(sparse))

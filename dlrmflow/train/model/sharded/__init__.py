"""The sharded embedding collection, in pieces by job (as TorchRec splits a sharded
module): ``routing`` (who holds what), ``input_dist`` (IDs to the ranks holding their
shards), ``lookup`` (the rank's bags: in memory, on disk, replicated), ``output_dist``
(pooled vectors back to their samples' ranks), ``checkpoint`` (shards saved and loaded in
place), ``tiers`` (the memory budget of shards on disk), composed by ``collection``."""

from __future__ import annotations

from dlrmflow.train.model.sharded.collection import ShardedEmbeddingCollection
from dlrmflow.train.model.sharded.tiers import TierBudgetError, TierStorage, cache_budget_error

__all__ = [
    "ShardedEmbeddingCollection",
    "TierBudgetError",
    "TierStorage",
    "cache_budget_error",
]

"""Where a rank keeps the shards its plan puts in DRAM or on SSD, and how much of its
memory budget is left for their cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dlrmflow.errors import DlrmflowError
from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.kernels.row_cache import SLOT_BOOKKEEPING_BYTES, CacheTooSmall, cache_rows_for
from dlrmflow.kernels.row_file import record_width
from dlrmflow.memory import format_bytes
from dlrmflow.sparse import EmbeddingTable


class TierBudgetError(DlrmflowError):
    """A rank's memory budget leaves no room for the cache of its shards on disk."""


def cache_budget_error(error: CacheTooSmall, rank: int | None = None) -> TierBudgetError:
    """A batch that did not fit a tiered bag's cache, told in configuration keys: the
    cache is what ``train.embedding_memory_bytes`` leaves, and a smaller batch needs fewer
    rows at once."""
    where = "" if rank is None else f"on rank {rank}, "
    return TierBudgetError(
        f"train.embedding_memory_bytes: {where}{error}; raise it by at least "
        f"{format_bytes(error.missing_bytes)} or lower train.batch_size"
    )


@dataclass(frozen=True)
class TierStorage:
    """Where a rank keeps the shards its plan puts in DRAM or on SSD, and its memory.

    ``memory_bytes`` is the rank's budget for embedding rows and optimizer state
    (``train.embedding_memory_bytes``): the shards kept in memory and the replicas of
    data-parallel tables take theirs first; the cache of hot rows of the shards on disk
    gets the rest, its slots' bookkeeping included. The cache's row map (4 bytes per row on
    disk) is not counted.
    ``fill=False`` leaves the new file's rows unwritten (zeros, sparse on disk): for a
    model that a checkpoint load fills at once (evaluation), drawing them would be waste.
    """

    directory: Path
    memory_bytes: int
    fill: bool = True


def in_memory_bytes(tables: Sequence[EmbeddingTable], optimizer: EmbeddingOptimizer) -> int:
    """Rows and optimizer state of ``tables`` kept in memory."""
    return sum(4 * t.num_embeddings * record_width(optimizer, t.embedding_dim) for t in tables)


def cache_rows_left(
    tiers: TierStorage,
    kept: int,
    tables: Sequence[EmbeddingTable],
    optimizer: EmbeddingOptimizer,
    rank: int,
) -> int:
    """The cache rows for the shards on disk (``tables``) that the rank's budget leaves
    after ``kept`` bytes in memory; a ``TierBudgetError`` naming the key when none."""
    rows = cache_rows_for(tiers.memory_bytes - kept, tables, optimizer)
    if rows < 1:
        slot = 4 * max(record_width(optimizer, t.embedding_dim) for t in tables)
        raise TierBudgetError(
            f"train.embedding_memory_bytes: rank {rank} keeps {kept} bytes of "
            f"embeddings in memory, so {tiers.memory_bytes} bytes leave no room for a "
            f"cache of its {sum(t.num_embeddings for t in tables)} rows on disk "
            f"({slot} bytes a row, plus {SLOT_BOOKKEEPING_BYTES} to track it); raise it"
        )
    return rows

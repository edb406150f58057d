"""What every table-batched embedding bag offers, whatever holds its rows.

The bag in memory (``tbe.TableBatchedEmbeddingBag``) and the bag over a file on disk
(``tiered.TieredEmbeddingBag``) differ only in where the rows and their optimizer state
live; their lookup and fused update are the TBE's in both (the disk bag runs each batch
in a working set that is itself a TBE). This base is the surface they share, written
once: the tables and their checks, the names and width of the output, the learning rate,
and a table's rows and optimizer state by name, each storage saying only how it reads
one part of a table (``_table_part``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dlrmflow.kernels import backends, optimizers
from dlrmflow.kernels.optimizers import EmbeddingOptimizer, StatePart
from dlrmflow.sparse import EmbeddingTable

__all__ = ["EmbeddingBagBase", "check_tables"]


class EmbeddingBagBase(nn.Module):
    """Tables, optimizer and learning rate of a bag; ``table(name)`` and ``state(name)``
    from the storage's ``_table_part``."""

    def __init__(
        self, tables: Sequence[EmbeddingTable], optimizer: EmbeddingOptimizer, kernels: str
    ) -> None:
        super().__init__()
        check_tables(tables, optimizer)
        if kernels not in backends.KERNELS:
            raise ValueError(f"kernels must be one of {backends.KERNELS}, got {kernels!r}")
        self.kernels = kernels
        self.tables = list(tables)
        self.optimizer = optimizer
        self.lr = optimizer.lr

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tables]

    @property
    def output_dim(self) -> int:
        return sum(t.embedding_dim for t in self.tables)

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next updates (a scheduler calls this each step)."""
        if not lr >= 0:
            raise ValueError(f"{type(self).__name__}: learning rate must be >= 0, got {lr}")
        self.lr = float(lr)

    def table(self, name: str) -> torch.Tensor:
        """One table's ``[num_embeddings, dim]`` rows as they are now (a view where the
        rows are in memory, else a copy)."""
        return self._table_part(self.names.index(name), None)

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """One table's optimizer state by part name: ``[num_embeddings]`` per row,
        ``[num_embeddings, dim]`` per element (views or copies, as ``table``)."""
        k = self.names.index(name)
        return {part.name: self._table_part(k, part) for part in self.optimizer.state_parts}

    def _table_part(self, k: int, part: StatePart | None) -> torch.Tensor:
        """Table ``k``'s weights (``part`` None) or one optimizer state part."""
        raise NotImplementedError


def check_tables(tables: Sequence[EmbeddingTable], optimizer: EmbeddingOptimizer) -> None:
    """Refuse tables and optimizers no bag can hold, naming the table."""
    if not tables:
        raise ValueError("an embedding bag needs at least one table")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    for t in tables:
        if t.num_embeddings <= 0 or t.embedding_dim <= 0:
            raise ValueError(f"table {t.name!r}: num_embeddings and dim must be positive")
        if t.pooling not in ("sum", "mean"):
            raise ValueError(
                f"table {t.name!r}: pooling must be 'sum' or 'mean', not {t.pooling!r}"
            )
    optimizers.checked(optimizer)

"""What every backend of the table-batched embedding bag shares: the groups of tables that
share one view of the flat weight, and a group's lookup record.

``tbe`` picks a backend per step and hands these to it; the backends (``cpu_tbe``,
``triton_tbe``) import this module, never ``tbe``, so no backend depends on its caller.
The optimizers are described in ``dlrmflow.kernels.optimizers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dlrmflow.sparse import EmbeddingTable

__all__ = ["GroupLookup", "TableGroup", "groups_of"]


@dataclass(frozen=True)
class TableGroup:
    """A run of consecutive tables sharing one dim: one 2-D view of the flat weight."""

    first_key: int
    end_key: int
    dim: int
    first_row: int  # global row of the group's first row (row-wise state is indexed by it)
    num_rows: int
    first_element: int  # position of the group's first element in the flat weight
    first_column: int  # where its tables start in the pooled output
    has_mean: bool


@dataclass
class GroupLookup:
    """What backward needs of one group's lookup.

    ``ids`` are group-local rows, one per looked-up ID; ``positions`` are the bags they
    pooled into, sample-major (``sample * n_keys + key``, the rows of the output slice
    viewed as ``[B * n_keys, dim]``), or None when ID ``i`` pooled into bag ``i``.
    ``key_counts`` is the number of IDs of each key when ``ids`` are key-major (the jagged
    form), None when they are sample-major (the one-hot form).
    """

    ids: torch.Tensor
    positions: torch.Tensor | None
    divisor: torch.Tensor | None  # per ID: its bag's length for mean pooling, else 1
    weights: torch.Tensor | None  # per-sample weights
    key_counts: list[int] | None = None


def groups_of(tables: Sequence[EmbeddingTable]) -> list[TableGroup]:
    """The groups of ``tables`` laid out back to back: a group per run of equal dims."""
    groups: list[TableGroup] = []
    row = element = column = 0
    start = 0
    for k in range(1, len(tables) + 1):
        if k < len(tables) and tables[k].embedding_dim == tables[start].embedding_dim:
            continue
        members = tables[start:k]
        dim = members[0].embedding_dim
        num_rows = sum(t.num_embeddings for t in members)
        groups.append(
            TableGroup(
                first_key=start,
                end_key=k,
                dim=dim,
                first_row=row,
                num_rows=num_rows,
                first_element=element,
                first_column=column,
                has_mean=any(t.pooling == "mean" for t in members),
            )
        )
        row += num_rows
        element += num_rows * dim
        column += len(members) * dim
        start = k
    return groups

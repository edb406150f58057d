"""Random batches for the embedding-bag tests (the in-memory and the tiered bag alike)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dlrmflow.features.spec import SparseFeature
from dlrmflow.sparse import KeyedJaggedTensor


def random_jagged(
    seed: int,
    tables: Sequence[SparseFeature],
    batch: int,
    max_len: int = 3,
    weighted: bool = False,
) -> KeyedJaggedTensor:
    """A key-major batch with empty bags (the first one always) and duplicate IDs."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(tables) * batch,), generator=gen)
    lengths[0] = 0
    per_key = lengths.view(len(tables), batch).sum(1).tolist()
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (n,), generator=gen)
            for t, n in zip(tables, per_key, strict=True)
        ]
    )
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor([t.name for t in tables], values, lengths.to(torch.int32), weights)


def random_one_hot(seed: int, tables: Sequence[SparseFeature], batch: int) -> KeyedJaggedTensor:
    """A one-hot batch in the sample-major form, a fifth of its bags empty."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack(
        [torch.randint(0, t.num_embeddings, (batch,), generator=gen) for t in tables], 1
    )
    rows[torch.rand(rows.shape, generator=gen) < 0.2] = -1
    return KeyedJaggedTensor.from_one_hot([t.name for t in tables], rows)

"""Training on global batches two ways, for tests that hold a job to one process: one
process on each whole batch (mean loss), or one rank of a job on its share of each."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from dlrmflow.features.batch import Batch


def train_whole(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[Batch]):
    """One process: a step on each global batch, its loss the mean over the batch."""
    for batch in batches:
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def train_share(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    rank: int,
    world: int,
    size: int,
) -> None:
    """Rank ``rank`` of a job: a step on rows ``rank*size:(rank+1)*size`` of each global
    batch, its loss summed and scaled so that DDP's mean over ranks is the global mean."""
    loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
    for batch in batches:
        mine = batch.take(torch.arange(rank * size, (rank + 1) * size))
        received = model.embeddings.start_input(mine.sparse).wait()
        logits = model.forward_received(mine.dense, received)
        loss = loss_fn(logits, mine.labels) * world / model.embeddings.input_rows(received)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

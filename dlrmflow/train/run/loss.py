"""The loss a rank backpropagates for its share of a step's global batch.

Every rank's loss is a sum over its own rows, scaled so that the gradient, once DDP and
the embeddings' backward have divided it by the world size, is that of the mean loss
over the global batch (all ranks' rows): the same at any number of ranks, however
unevenly the ranks' batches are sized, and zero from a rank whose batch is empty.

Without a weight column the mean is over rows: each rank's sum is divided by the global
batch's row count (which the sharded input exchange already knows). With one
(``FeatureSpec.weight``), each row's loss counts by its weight and the mean is over the
global batch's weights, sum(w * l) / sum(w): a row of weight 2 trains as two copies of it
would, and the step's size does not grow or shrink with the weights' scale. The sum of
weights is all-reduced in float64 (one scalar per step), so at any world size it holds
float32 weights' sum to a double's precision and the ranks divide by one value. A global
batch whose weights are all 0 trains nothing (a zero loss, never 0 / 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlrmflow.features.batch import Batch
from dlrmflow.train.run.rank import DistEnv


class StepLoss:
    """``loss(logits, batch, rows)``: this rank's share of the step's mean binary
    cross-entropy over the global batch, ready for ``backward``.

    ``weighted``: whether the dataset declares a weight column; then every batch carries
    ``sample_weights`` (an empty one too: ``Batch.empty(weighted=True)``) and every rank
    must call it at every step, as it takes part in an all-reduce. ``rows``: the global
    batch's rows (this rank's in one process).
    """

    def __init__(self, env: DistEnv, *, weighted: bool) -> None:
        self.env = env
        self.weighted = weighted
        self._unweighted = torch.nn.BCEWithLogitsLoss(reduction="sum")

    def __call__(self, logits: torch.Tensor, batch: Batch, rows: int) -> torch.Tensor:
        world = self.env.world_size
        if not self.weighted:
            return self._unweighted(logits, batch.labels) * (world / rows)
        weights = batch.sample_weights
        if weights is None:
            raise ValueError("a batch of a weighted run carries no sample weights")
        total = self.global_weight(weights)
        summed = F.binary_cross_entropy_with_logits(
            logits, batch.labels, weight=weights, reduction="sum"
        )
        return summed * (world / total if total > 0 else 0.0)

    def global_weight(self, weights: torch.Tensor) -> float:
        """The sum of the global batch's weights (every rank's), in float64."""
        total = weights.detach().double().sum().cpu().reshape(1)
        if self.env.distributed:
            dist.all_reduce(total)
        return float(total)

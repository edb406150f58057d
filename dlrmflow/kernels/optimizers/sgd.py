"""SGD on embedding rows: ``w -= lr * (g + weight_decay * w)``; no state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dlrmflow.kernels.optimizers.base import EmbeddingOptimizer, FusedRule, State, StepContext


@dataclass(frozen=True)
class SGD(EmbeddingOptimizer):
    lr: float
    weight_decay: float = 0.0

    fused_rule: ClassVar[FusedRule | None] = "sgd"

    def update(
        self, weights: torch.Tensor, grads: torch.Tensor, state: State, ctx: StepContext
    ) -> None:
        if self.weight_decay:
            grads = grads.add(weights, alpha=self.weight_decay)
        weights.add_(grads, alpha=-ctx.lr)

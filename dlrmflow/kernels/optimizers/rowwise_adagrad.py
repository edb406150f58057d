"""Row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``): one state value per row,
``s += mean(g'^2)`` over the row's elements with ``g' = g + weight_decay * w``, then
``w -= lr * g' / (sqrt(s) + eps)``. With dim 1 it is torch's sparse Adagrad."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dlrmflow.kernels.optimizers.base import (
    EmbeddingOptimizer,
    FusedRule,
    State,
    StatePart,
    StepContext,
)


@dataclass(frozen=True)
class RowWiseAdagrad(EmbeddingOptimizer):
    lr: float
    eps: float = 1e-8
    weight_decay: float = 0.0

    state_parts: ClassVar[tuple[StatePart, ...]] = (StatePart("sum_squares", per_row=True),)
    fused_rule: ClassVar[FusedRule | None] = "rowwise_adagrad"

    def update(
        self, weights: torch.Tensor, grads: torch.Tensor, state: State, ctx: StepContext
    ) -> None:
        if self.weight_decay:
            grads = grads.add(weights, alpha=self.weight_decay)
        s = state["sum_squares"].add_(ctx.mean_square(grads))
        weights.add_(grads / s.sqrt().add_(self.eps)[:, None], alpha=-ctx.lr)

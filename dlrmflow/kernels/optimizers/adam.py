"""Adam on embedding rows: per-element moments and torch's ``AdamW`` update (decoupled
weight decay, as FBGEMM's Adam), with bias correction by one global step count that every
update advances, as FBGEMM and ``torch.optim.SparseAdam`` do (a row first touched at step
100 is corrected with ``1 - beta ** 100``, not as if it were its first step)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from dlrmflow.kernels.optimizers.base import EmbeddingOptimizer, State, StatePart, StepContext


@dataclass(frozen=True)
class Adam(EmbeddingOptimizer):
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    state_parts: ClassVar[tuple[StatePart, ...]] = (
        StatePart("momentum1", per_row=False),
        StatePart("momentum2", per_row=False),
    )
    step_key: ClassVar[str | None] = "adam_step"

    def fbgemm_refusal(self) -> str | None:
        return "FBGEMM advances Adam's step count on every forward, ours on each update"

    def update(
        self, weights: torch.Tensor, grads: torch.Tensor, state: State, ctx: StepContext
    ) -> None:
        # torch's single-tensor AdamW, restricted to the touched rows.
        beta1, beta2 = self.betas
        m = state["momentum1"].lerp_(grads, 1 - beta1)
        v = state["momentum2"].mul_(beta2)
        v.addcmul_(grads, grads, value=1 - beta2)
        correction2_sqrt = math.sqrt(1 - beta2**ctx.step)
        weights.mul_(1 - ctx.lr * self.weight_decay)
        weights.addcdiv_(
            m, v.sqrt().div_(correction2_sqrt).add_(self.eps), value=-ctx.lr / (1 - beta1**ctx.step)
        )

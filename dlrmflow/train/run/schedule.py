"""The learning-rate schedule (``train.lr_schedule``): the share of the full rates each step
trains at, for the dense optimizer and the embeddings' fused optimizers alike.

A constant rate leaves the end of training as noisy as its middle: the last steps move the
output's bias and the top MLP by as much as any before them, and the model's mean
prediction lands wherever that noise leaves it (5-12% off the click rate on the demo's
data). Decaying the rates to a floor anneals it. The share is a function of the run's
position only (its step, its pass and the step the pass began after), which checkpoints
store, so a resumed run continues the schedule exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dlrmflow.config import LrScheduleConfig, RunConfig
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.kernels.tiered import TieredEmbeddingBag
from dlrmflow.train.run.progress import RunProgress


@dataclass(frozen=True)
class LrSchedule:
    """``train.lr_schedule`` over a run's passes (epochs, or days in day order).

    Each pass is a horizon of its own: the decay spans it and restarts with the next (the
    warm-up only at the run's first steps). So a pass's rates depend on nothing after it:
    a run continued for more epochs, or a line for a new day, trains its earlier passes
    exactly as before, and ``train.max_steps`` only stops a run early. ``horizons``: the
    steps each pass takes.
    """

    config: LrScheduleConfig
    horizons: tuple[int, ...]

    @classmethod
    def of(cls, config: RunConfig, pass_steps: Sequence[int]) -> LrSchedule:
        """The schedule of a run whose passes take ``pass_steps`` steps each."""
        return cls(config.train.lr_schedule, tuple(max(1, steps) for steps in pass_steps))

    def horizon(self, pass_index: int) -> int:
        """The steps the decay spans in pass ``pass_index`` (a pass past the listed ones, of
        a run continued by more epochs, spans the last one's)."""
        return self.horizons[min(pass_index, len(self.horizons) - 1)]

    def factor(self, step: int, pass_start: int = 0, pass_steps: int = 1) -> float:
        """The share of the full rates that step ``step`` (counted from 1) trains at, in a
        pass of ``pass_steps`` steps that began after step ``pass_start``."""
        cfg = self.config
        warm = min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        if cfg.decay == "constant":
            return warm
        position = step - 1 - pass_start  # steps of the pass before this one
        decay_from = cfg.decay_start * pass_steps
        if position < decay_from:
            return warm
        done = min(1.0, (position - decay_from) / max(pass_steps - decay_from, 1.0))
        if cfg.decay == "linear":
            share = 1.0 - (1.0 - cfg.floor) * done
        else:
            share = cfg.floor + (1.0 - cfg.floor) * (1.0 - done) ** cfg.power
        return warm * share


class LearningRates:
    """Sets a model's rates for each step: its dense optimizer's and every fused embedding
    optimizer's (in memory, sharded, replicated or on disk), from one schedule."""

    def __init__(
        self,
        schedule: LrSchedule,
        config: RunConfig,
        model: nn.Module,
        dense_optimizer: torch.optim.Optimizer,
    ) -> None:
        self.schedule = schedule
        self.dense_lr = config.train.lr
        self.embedding_lr = config.train.embedding_lr or config.train.lr
        self.optimizer = dense_optimizer
        self.bags = [
            m
            for m in model.modules()
            if isinstance(m, TableBatchedEmbeddingBag | TieredEmbeddingBag)
        ]
        self.share = 1.0

    def set_for(self, step: int, progress: RunProgress) -> None:
        """Set the rates step ``step`` trains at, in the pass ``progress`` stands in (whose
        steps are fixed, and recorded there, as it begins)."""
        if progress.pass_steps is None:
            progress.pass_steps = self.schedule.horizon(progress.epoch)
        self.share = self.schedule.factor(step, progress.pass_start, progress.pass_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = self.dense_lr * self.share
        for bag in self.bags:
            bag.set_learning_rate(self.embedding_lr * self.share)

    @property
    def dense(self) -> float:
        """The dense rate the last step trained at."""
        return self.dense_lr * self.share

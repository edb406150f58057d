"""The embedding optimizers, one module each (``sgd``, ``rowwise_adagrad``, ``adam``), and
what the rest of the embedding layer asks of them (``base.EmbeddingOptimizer``): the row
state's layout and checkpoint keys, the bytes it takes, the update rule, and which fused
kernels implement it."""

from __future__ import annotations

from dlrmflow.kernels.optimizers.adam import Adam
from dlrmflow.kernels.optimizers.base import (
    EmbeddingOptimizer,
    FusedRule,
    State,
    StatePart,
    StepContext,
    mean_of_squares,
)
from dlrmflow.kernels.optimizers.rowwise_adagrad import RowWiseAdagrad
from dlrmflow.kernels.optimizers.sgd import SGD

__all__ = [
    "SGD",
    "Adam",
    "EmbeddingOptimizer",
    "FusedRule",
    "RowWiseAdagrad",
    "State",
    "StatePart",
    "StepContext",
    "checked",
    "mean_of_squares",
]


def checked(optimizer: object) -> EmbeddingOptimizer:
    """``optimizer`` if it is an embedding optimizer with valid hyperparameters; else a
    ``TypeError``/``ValueError`` naming it."""
    if not isinstance(optimizer, EmbeddingOptimizer):
        raise TypeError(f"optimizer must be SGD, RowWiseAdagrad or Adam, got {optimizer!r}")
    optimizer.check()
    return optimizer

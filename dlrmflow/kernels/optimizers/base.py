"""What every part of the embedding layer asks of an embedding optimizer.

The optimizer of an embedding table runs inside the table's backward (the fused update),
so the bag in memory, the disk tier, the sharded collection, the FBGEMM adapter and the
planner all need to know its row state: which buffers it keeps (their checkpoint keys),
one float per row or one per element, whether it counts steps, and the update rule. Each
optimizer says so once, in its own module, and they ask it: none of them checks which
optimizer it holds, so a new optimizer (or a new kind of table) touches one module.

All rules are "lazy" as in FBGEMM: rows not looked up in a step are not touched at all, so
weight decay and moments decay only on touched rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

__all__ = ["EmbeddingOptimizer", "FusedRule", "StatePart", "StepContext", "mean_of_squares"]

# The update rules the fused kernels (compiled CPU, Triton, FBGEMM) implement.
FusedRule = Literal["sgd", "rowwise_adagrad"]
# An update's optimizer state: each part's gathered rows by name.
State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StatePart:
    """One buffer of an optimizer's row state: its name (the bag's buffer and the
    checkpoint key ``<table>.<name>``) and whether it holds one float per row or one per
    element of the row."""

    name: str
    per_row: bool

    def width(self, dim: int) -> int:
        """Floats per row of a table of ``dim`` columns."""
        return 1 if self.per_row else dim


def mean_of_squares(grads: torch.Tensor) -> torch.Tensor:
    """Each row's mean squared gradient over its columns (a whole row in one bag)."""
    return grads.square().mean(1)


@dataclass(frozen=True)
class StepContext:
    """What an update needs besides the rows: the learning rate, the global step count
    after this step's advance (0 for an optimizer that counts none), and how to get each
    row's mean squared gradient (a column shard's asks the other shards for their
    columns')."""

    lr: float
    step: int = 0
    mean_square: Callable[[torch.Tensor], torch.Tensor] = mean_of_squares


class EmbeddingOptimizer:
    """The base of the embedding optimizers (``SGD``, ``RowWiseAdagrad``, ``Adam``).

    Subclasses are frozen dataclasses of their hyperparameters (``lr`` first, then
    ``weight_decay`` among the others) and describe their state in class attributes:
    """

    # The row state beside the weights, in file and record order.
    state_parts: ClassVar[tuple[StatePart, ...]] = ()
    # The checkpoint key of a global step count that every update advances (the bags'
    # buffer ``step``); None: the optimizer counts no steps.
    step_key: ClassVar[str | None] = None
    # The rule the fused kernels implement for it; None: only the torch ops run it.
    fused_rule: ClassVar[FusedRule | None] = None

    lr: float
    weight_decay: float

    @classmethod
    def record_widths(cls, dim: int) -> list[int]:
        """Floats per row of each part of a row's record: the weights, then each state."""
        return [dim] + [part.width(dim) for part in cls.state_parts]

    @classmethod
    def state_bytes(cls) -> tuple[float, float]:
        """(bytes per row, bytes per element) of float32 state kept beside the weights:
        what the planner adds to a shard's memory."""
        per_row = sum((4.0 for part in cls.state_parts if part.per_row), 0.0)
        per_element = sum((4.0 for part in cls.state_parts if not part.per_row), 0.0)
        return per_row, per_element

    def check(self) -> None:
        """Refuse hyperparameters no rule takes, naming the optimizer."""
        if not self.lr >= 0 or not self.weight_decay >= 0:
            raise ValueError(f"{self!r}: lr and weight_decay must be >= 0")

    def fbgemm_refusal(self) -> str | None:
        """Why FBGEMM's fused backward cannot run this optimizer (None: it can)."""
        if self.fused_rule is None:
            return f"FBGEMM's fused update here covers SGD and row-wise Adagrad, not {self!r}"
        if self.weight_decay:
            return "FBGEMM's SGD has no weight decay and its row-wise Adagrad's differs"
        return None

    def update(
        self, weights: torch.Tensor, grads: torch.Tensor, state: State, ctx: StepContext
    ) -> None:
        """One step on gathered rows, in place: ``weights`` ``[n, cols]``, their summed
        ``grads`` and ``state`` (each part's rows: ``[n]`` per row, ``[n, cols]`` per
        element)."""
        raise NotImplementedError

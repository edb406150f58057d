"""The embedding optimizers each describe their state and rule once, and every part of the
embedding layer works from that description: an optimizer defined here, in this file
alone, trains in the in-memory bag and in the disk tier, checkpoints its state under its
own keys and is sized by the planner, with no other module knowing it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from dlrmflow.kernels.optimizers import (
    SGD,
    Adam,
    EmbeddingOptimizer,
    RowWiseAdagrad,
    StatePart,
    checked,
)
from dlrmflow.kernels.row_file import record_width
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.kernels.tiered import TieredEmbeddingBag
from dlrmflow.sparse import EmbeddingTable
from dlrmflow.train.planner.types import OptimizerState
from tests.kernels.batches import random_jagged

TABLES = [EmbeddingTable("a", 30, 4), EmbeddingTable("b", 20, 4), EmbeddingTable("c", 15, 2)]


@dataclass(frozen=True)
class Momentum(EmbeddingOptimizer):
    """Heavy-ball SGD with a per-element velocity and a per-row count of updates, and a
    global step count: one of each kind of state the layer supports."""

    lr: float
    mu: float = 0.5
    weight_decay: float = 0.0

    state_parts: ClassVar[tuple[StatePart, ...]] = (
        StatePart("velocity", per_row=False),
        StatePart("updates", per_row=True),
    )
    step_key: ClassVar[str | None] = "momentum_step"

    def update(self, weights, grads, state, ctx) -> None:
        velocity = state["velocity"].mul_(self.mu).add_(grads)
        state["updates"].add_(1.0)
        weights.add_(velocity, alpha=-ctx.lr)


def test_each_optimizer_states_its_row_layout_and_bytes():
    assert SGD.state_parts == () and SGD.record_widths(8) == [8]
    assert [p.name for p in RowWiseAdagrad.state_parts] == ["sum_squares"]
    assert RowWiseAdagrad.record_widths(8) == [8, 1]
    assert Adam.record_widths(8) == [8, 8, 8] and Adam.step_key == "adam_step"
    assert OptimizerState.of(RowWiseAdagrad) == OptimizerState(bytes_per_row=4.0)
    assert OptimizerState.of(Adam) == OptimizerState(bytes_per_element=8.0)
    assert OptimizerState.of(Momentum) == OptimizerState(4.0, 4.0)
    assert record_width(Momentum(lr=0.1), 4) == 4 + 4 + 1


def test_only_the_fused_rules_run_on_fbgemm():
    assert SGD(lr=0.1).fbgemm_refusal() is None
    assert RowWiseAdagrad(lr=0.1).fbgemm_refusal() is None
    assert "weight decay" in SGD(lr=0.1, weight_decay=0.1).fbgemm_refusal()
    assert "Adam" in Adam(lr=0.1).fbgemm_refusal()
    assert "Momentum" in Momentum(lr=0.1).fbgemm_refusal()


def test_bad_optimizers_are_refused_naming_them():
    with pytest.raises(TypeError, match="SGD, RowWiseAdagrad or Adam"):
        checked(torch.optim.SGD)
    with pytest.raises(ValueError, match=r"Momentum\(lr=-1"):
        TableBatchedEmbeddingBag(TABLES, Momentum(lr=-1.0))


def _reference_momentum(bag: TableBatchedEmbeddingBag, batches, grads, opt: Momentum):
    """Dense tables trained by hand: each step, every touched row's summed gradient."""
    weights = {t.name: bag.table(t.name).clone() for t in TABLES}
    velocity = {n: torch.zeros_like(w) for n, w in weights.items()}
    updates = {n: torch.zeros(w.shape[0]) for n, w in weights.items()}
    for kjt, grad in zip(batches, grads, strict=True):
        column = 0
        for t in TABLES:
            values, offsets = kjt.split_by_key()[t.name]
            table = weights[t.name].clone().requires_grad_()
            pooled = F.embedding_bag(values, table, offsets, mode="sum")
            pooled.backward(grad[:, column : column + t.embedding_dim])
            column += t.embedding_dim
            touched = values.unique()
            velocity[t.name][touched] = velocity[t.name][touched] * opt.mu + table.grad[touched]
            updates[t.name][touched] += 1
            weights[t.name][touched] -= opt.lr * velocity[t.name][touched]
    return weights, velocity, updates


def test_a_new_optimizer_trains_in_memory_and_on_disk_from_its_own_module(tmp_path):
    opt = Momentum(lr=0.3)
    batches = [random_jagged(seed, TABLES, 8, 3, False) for seed in range(6)]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(8, 10, generator=gen) for _ in batches]
    bag = TableBatchedEmbeddingBag(TABLES, opt, seed=1)
    tiered = TieredEmbeddingBag(TABLES, opt, tmp_path, cache_rows=40, seed=1)
    want = _reference_momentum(bag, batches, grads, opt)
    for kjt, grad in zip(batches, grads, strict=True):
        bag(kjt).backward(grad)
        tiered(kjt).backward(grad)
    assert int(bag.step) == len(batches) and tiered.step == len(batches)
    assert tiered.stats.evictions > 0  # the rows went to disk and came back
    for t in TABLES:
        for got in (bag, tiered):
            assert torch.allclose(got.table(t.name), want[0][t.name], atol=1e-6), t.name
            state = got.state(t.name)
            assert state.keys() == {"velocity", "updates"}
            assert torch.allclose(state["velocity"], want[1][t.name], atol=1e-6), t.name
            assert torch.equal(state["updates"], want[2][t.name]), t.name
        # The disk tier runs the bag's own update: bit for bit the in-memory result.
        assert torch.equal(bag.table(t.name), tiered.table(t.name))
    # The bag checkpoints each state part and the step count under the optimizer's names.
    keys = set(bag.state_dict())
    assert {"weight", "velocity", "updates", "step"} <= keys


def test_the_bag_checkpoints_only_the_state_its_optimizer_names():
    assert set(TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1)).state_dict()) == {"weight"}
    assert set(TableBatchedEmbeddingBag(TABLES, RowWiseAdagrad(lr=0.1)).state_dict()) == {
        "weight",
        "sum_squares",
    }
    assert set(TableBatchedEmbeddingBag(TABLES, Adam(lr=0.1)).state_dict()) == {
        "weight",
        "momentum1",
        "momentum2",
        "step",
    }

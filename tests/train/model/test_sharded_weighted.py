"""Example weights at two ranks train as one process does: the trainer's ``StepLoss``
(sum of weight x loss over the global batch's weights) on the sharded DLRM, against one
process taking the weighted mean over the global batch, as ``test_sharded.py`` checks the
unweighted loss. One step's weights are all 0, and in the uneven case a rank's batch is
empty for the last steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from dlrmflow.bench.spawn import run_spawned_job
from dlrmflow.features.batch import Batch
from dlrmflow.kernels.optimizers import RowWiseAdagrad
from dlrmflow.train.model.dlrm import DLRM
from dlrmflow.train.run.checkpoint import model_state
from dlrmflow.train.run.loss import StepLoss
from dlrmflow.train.run.rank import DistEnv
from tests.train.model.test_sharded import (
    COLLECTIVE_TIMEOUT,
    CONFIG,
    LR,
    SPEC,
    STEPS,
    assert_state_close,
    forced_plan,
    global_batch,
    load_single_process,
    local_batch,
)

ZERO_STEP = 2  # every weight of this step's global batch is 0: it must train nothing
CASES = [("row_wise", True, False), ("table_wise", False, True)]  # sharding, multi-hot, uneven


def weighted_global_batch(step: int, world: int, multi_hot: bool) -> Batch:
    """``test_sharded``'s global batch with weights 0, 0.5, 1 or 1.5 per row."""
    batch = global_batch(step, world, multi_hot)
    generator = torch.Generator().manual_seed(5000 + step)
    weights = torch.randint(0, 4, (len(batch),), generator=generator).float() / 2
    batch.sample_weights = weights * 0 if step == ZERO_STEP else weights
    return batch


def _train(rank: int, world: int, out_dir: str, sharding: str, multi_hot: bool, uneven: bool):
    from dlrmflow.train.model.parallelize import sharded_dlrm

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(CONFIG.train.seed)
    model = sharded_dlrm(SPEC, CONFIG, forced_plan(SPEC, world, sharding), RowWiseAdagrad(lr=LR))
    optimizer = torch.optim.Adagrad(model.dense_parameters(), lr=LR)
    loss_fn = StepLoss(DistEnv(rank, world, rank, world), weighted=True)
    for step in range(STEPS):
        batch = local_batch(
            weighted_global_batch(step, world, multi_hot), rank, world, step, uneven
        )
        received = model.embeddings.start_input_dist(batch.sparse).wait()
        logits = model.forward_received(batch.dense, received)
        loss = loss_fn(logits, batch, sum(received.batch_sizes))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path = Path(out_dir) / f"{sharding}-{multi_hot}-{uneven}"
    dcp.save(model_state(model, optimizer), checkpoint_id=str(path))
    return str(path)


def _train_cases(rank: int, world: int, out_dir: str) -> dict:
    return {case: _train(rank, world, out_dir, *case) for case in CASES}


def reference(multi_hot: bool, *, weighted: bool = True) -> dict:
    """One process on the global batches: the weighted mean loss (or the plain mean)."""
    torch.manual_seed(CONFIG.train.seed)
    model = DLRM(SPEC, CONFIG.model, RowWiseAdagrad(lr=LR), seed=CONFIG.train.seed)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR)
    for step in range(STEPS):
        batch = weighted_global_batch(step, 2, multi_hot)
        logits = model(batch.dense, batch.sparse)
        if weighted:
            w = batch.sample_weights
            total = float(w.sum())
            loss = F.binary_cross_entropy_with_logits(
                logits, batch.labels, weight=w, reduction="sum"
            )
            loss = loss / total if total > 0 else loss * 0
        else:
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("weighted2")
    ranks = run_spawned_job(_train_cases, 2, str(tmp), threads=1, timeout=COLLECTIVE_TIMEOUT)
    return {case: load_single_process(path)[0] for case, path in ranks[0].result.items()}


def test_weighted_loss_at_two_ranks_trains_as_one_process(two_ranks: dict) -> None:
    for case in CASES:
        want = reference(multi_hot=case[1])
        assert_state_close(two_ranks[case], want, atol=2e-5, case=case)
        # ... and the weights matter: the plain mean trains elsewhere.
        plain = reference(multi_hot=case[1], weighted=False)
        moved = max(float((plain[k] - want[k]).abs().max()) for k in want if want[k].numel())
        assert moved > 1e-3, (case, moved)

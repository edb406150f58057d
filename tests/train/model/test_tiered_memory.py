"""Shards on disk stay on disk: a rank's resident set does not grow with them.

One rank's shard on disk, a 256 MiB table (2M rows x 32 floats plus row-wise Adagrad
state), is trained on batches that touch rows all over it, then checkpointed and restored
into another model through ``dlrmflow.train.run.checkpoint``, in checkpoint items of 2**16
rows (8 MiB), with 16 MiB of the file's pages allowed mapped at once. Pages of a shared
file mapping count in the resident set once touched, so without unmapping them a save
alone would add the whole table (and a copy of a table whose rows and state were
interleaved, twice that). The bound checked is a quarter of the table. How far random
training steps map the file without the allowance is measured in
tests/kernels/test_tiered.py.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from dlrmflow.bench.spawn import run_spawned_job
from dlrmflow.config import build_config
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.kernels.optimizers import RowWiseAdagrad
from dlrmflow.kernels.row_cache import SLOT_BOOKKEEPING_BYTES
from dlrmflow.memory import peak_rss_bytes, reset_peak_rss
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.sharded.tiers import TierStorage
from dlrmflow.train.planner import cpu_topology, plan_sharding, tables_from_spec
from dlrmflow.train.run.checkpoint import find_checkpoint, restore, save_checkpoint

ROWS, DIM = 2_000_000, 32
TABLE_BYTES = 4 * ROWS * (DIM + 1)
CACHE_ROWS = 20_000
BATCH = 4096
SPEC = FeatureSpec(dense=("I1",), sparse=(SparseFeature("C1", ROWS, DIM),))
CONFIG = build_config(
    {"model": {"embedding_dim": DIM, "bottom_mlp": [DIM], "top_mlp": [8]}, "train": {"lr": 0.1}}
)


def _model(directory: Path):
    """One rank's sharded model with its one table on disk behind a small cache."""
    from dlrmflow.train.model.parallelize import sharded_dlrm

    plan = plan_sharding(tables_from_spec(SPEC), cpu_topology(1, 1), BATCH)
    plan = dataclasses.replace(
        plan,
        tables=tuple(
            dataclasses.replace(
                t, shards=tuple(dataclasses.replace(s, tier="ssd") for s in t.shards)
            )
            for t in plan.tables
        ),
    )
    budget = CACHE_ROWS * (4 * (DIM + 1) + SLOT_BOOKKEEPING_BYTES)
    tiers = TierStorage(directory, budget)
    model = sharded_dlrm(SPEC, CONFIG, plan, RowWiseAdagrad(lr=0.1), tiers=tiers)
    return model, plan


def _train(model, steps: int, seed: int) -> None:
    optimizer = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (BATCH, 1), generator=generator)
        received = model.embeddings.start_input_dist(
            KeyedJaggedTensor.from_one_hot(["C1"], ids)
        ).wait()
        logits = model.forward_received(torch.randn(BATCH, 1, generator=generator), received)
        labels = torch.rand(BATCH, generator=generator).round()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _growth(action) -> int:
    """How far the peak resident set rose above the current one while ``action`` ran."""
    reset_peak_rss()
    before = peak_rss_bytes()
    action()
    return peak_rss_bytes() - before


def _digest(model) -> list[list[float]]:
    """Per-column sums of the table and its state in 8 row blocks, in float64."""
    bag = model.embeddings.tiered
    parts = [bag.table("C1"), bag.state("C1")["sum_squares"][:, None]]
    return [block.double().sum(0).tolist() for part in parts for block in part.split(ROWS // 8)]


def _job(rank: int, world: int, out: str) -> dict:
    from dlrmflow.kernels import row_file
    from dlrmflow.train.model.sharded import checkpoint as sharded

    sharded.CHECKPOINT_CHUNK_ROWS = 1 << 16
    row_file.MAPPED_ALLOWANCE_BYTES = 16 << 20  # below the table: training must unmap
    out_dir = Path(out)
    model, plan = _model(out_dir / "bag")
    _train(model, 2, seed=0)  # the cache and the allocator's buffers reach their size
    growth = {"train": _growth(lambda: _train(model, 24, seed=1))}
    optimizer = torch.optim.SGD(model.dense_parameters(), lr=0.1)

    def save() -> None:
        save_checkpoint(
            out_dir / "run",
            model=model,
            optimizer=optimizer,
            config=CONFIG,
            spec=SPEC,
            progress={"step": 26, "rows": 26 * BATCH, "epoch": 0},
            loader_state={},
            plan=plan.to_dict(),
        )

    growth["save"] = _growth(save)
    other, _ = _model(out_dir / "other")
    info = find_checkpoint(out_dir / "run")
    growth["restore"] = _growth(lambda: restore(info, other, None))
    return {"growth": growth, "same": _digest(model) == _digest(other)}


def test_training_and_checkpoints_keep_the_shards_on_disk_out_of_memory(tmp_path: Path) -> None:
    if not reset_peak_rss():
        pytest.skip("the peak resident set cannot be reset here (/proc/self/clear_refs)")
    (rank,) = run_spawned_job(_job, 1, str(tmp_path), threads=1, timeout=timedelta(seconds=120))
    result = rank.result
    assert result["same"], "the restored shard differs from the saved one"
    growth = result["growth"]
    assert all(g < TABLE_BYTES // 4 for g in growth.values()), (growth, TABLE_BYTES)

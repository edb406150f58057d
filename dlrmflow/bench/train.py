"""Training benchmark: samples/s of the sharded trainer per sharding type and codec.

The comparison config of the sharded-trainer issue: 13 dense features, 26 one-hot sparse
features of 100k rows each, dim 64, bottom MLP 512-256-64, top MLP 512-256-1, dot
interaction, batch 4096 per rank, row-wise Adagrad for the embeddings. Each rank trains on
a few pre-built batches of Zipf(1.1) IDs in turn, so the figures are the trainer's own
(the reader has its benchmark); one thread per rank, ranks on this host, gloo.

Baseline: the single-process ``DLRM`` (one table-batched bag, no communication) on the
same batches and thread count. Every mode's ratio is its global samples/s over the
baseline's, measured in the same run. World size 1 runs the sharded model in a
one-rank job (the cost of the distribution layer alone); world size 2 splits the work
over two ranks, so on a machine with two cores its ideal ratio is 2.

Bytes per step: what one rank sent, by kind (``dlrmflow.train.comms.CommStats``).
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dlrmflow.bench.kernels import zipf_ids
from dlrmflow.bench.machine import describe_machine
from dlrmflow.config import RunConfig
from dlrmflow.features.batch import Batch, KeyedJaggedTensor
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.ingest.schema import DENSE, SPARSE
from dlrmflow.train.distributed import exit_without_teardown, join_spawned_job
from dlrmflow.train.model import DLRM, embedding_optimizer
from dlrmflow.train.sharding import SHARDING_TYPES

BASELINE = "single-process DLRM (one table-batched bag, no communication), same batches and threads"
FULL = {"rows": 100_000, "dim": 64, "bottom": [512, 256, 64], "top": [512, 256], "batch": 4096}
QUICK = {"rows": 1_000, "dim": 8, "bottom": [16, 8], "top": [16], "batch": 128}
CODECS = ("fp16", "bf16", "fp8", "int8")
DISTINCT_BATCHES = 3
# A rank stuck in a collective fails the benchmark after this, rather than hanging it.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def bench_config(size: dict, sharding: str | None, comms: str, pipeline: bool) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {
                "embedding_dim": size["dim"],
                "bottom_mlp": size["bottom"],
                "top_mlp": size["top"],
            },
            "train": {"batch_size": size["batch"], "optimizer": "adagrad", "lr": 0.01},
            "distributed": {"sharding": sharding, "comms": comms, "pipeline": pipeline},
        }
    )


def bench_spec(size: dict) -> FeatureSpec:
    return FeatureSpec(
        dense=DENSE,
        sparse=tuple(SparseFeature(name, size["rows"], size["dim"]) for name in SPARSE),
    )


def make_batches(size: dict, rank: int) -> list[Batch]:
    """A few one-hot batches of Zipf IDs for one rank (different ranks, different data)."""
    rng = np.random.default_rng(1000 + rank)
    batches = []
    for _ in range(DISTINCT_BATCHES):
        n = size["batch"]
        ids = np.stack([zipf_ids(rng, size["rows"], n) for _ in SPARSE], axis=1)
        dense = torch.from_numpy(rng.random((n, len(DENSE)), dtype=np.float32))
        labels = torch.from_numpy((rng.random(n) < 0.25).astype(np.float32))
        sparse = KeyedJaggedTensor.from_one_hot(list(SPARSE), torch.from_numpy(ids))
        batches.append(Batch(dense, sparse, labels))
    return batches


def _time_steps(step, batches: list[Batch], warmup: int, steps: int, at_start=None) -> float:
    """Seconds for ``steps`` steps after ``warmup`` untimed ones; ``step(batch, next)``."""
    start = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            if at_start is not None:
                at_start()
            start = time.perf_counter()
        step(batches[i % len(batches)], batches[(i + 1) % len(batches)])
    return time.perf_counter() - start


def run_baseline(size: dict, warmup: int, steps: int) -> dict:
    """The single-process DLRM: what every mode is divided by."""
    torch.set_num_threads(1)
    config = bench_config(size, None, "fp32", True)
    torch.manual_seed(0)
    model = DLRM(bench_spec(size), config.model, embedding_optimizer(config.train))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=config.train.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    batches = make_batches(size, 0)

    def step(batch: Batch, _next: Batch) -> None:
        loss = loss_fn(model(batch.dense, batch.sparse), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    seconds = _time_steps(step, batches, warmup, steps)
    return {"samples_per_s": steps * size["batch"] / seconds, "step_s": seconds / steps}


def run_sharded_mode(size: dict, mode: dict, warmup: int, steps: int) -> dict:
    """One mode on the current job (every rank calls this): global samples/s, bytes/step."""
    from dlrmflow.train.distributed import ShardedDLRM
    from dlrmflow.train.planner import plan_for_config

    config = bench_config(size, mode["sharding"], mode["comms"], mode["pipeline"])
    spec = bench_spec(size)
    world = dist.get_world_size()
    plan = plan_for_config(config, spec, world, world)
    torch.manual_seed(0)
    model = ShardedDLRM(spec, config, plan, embedding_optimizer(config.train))
    optimizer = torch.optim.Adagrad(model.dense_parameters(), lr=config.train.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    batches = make_batches(size, dist.get_rank())
    state = {"pending": model.start_input_dist(batches[0].sparse)}

    def step(batch: Batch, following: Batch) -> None:
        received = state["pending"].wait()
        if mode["pipeline"]:
            state["pending"] = model.start_input_dist(following.sparse, async_op=True)
        loss = loss_fn(model.forward_received(batch.dense, received), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if not mode["pipeline"]:
            state["pending"] = model.start_input_dist(following.sparse)

    def at_start() -> None:
        model.stats.reset()
        dist.barrier()

    seconds = _time_steps(step, batches, warmup, steps, at_start)
    state["pending"].wait()
    # The job is as fast as its slowest rank.
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds = float(slowest)
    bytes_per_step = {k: v // steps for k, v in model.stats.snapshot().items()}
    return {
        "samples_per_s": steps * size["batch"] * world / seconds,
        "step_s": seconds / steps,
        "bytes_per_step": bytes_per_step,
        "shardings": sorted({t.sharding for t in plan.tables}),
    }


def _worker(rank: int, world: int, store: str, out: str, size: dict, modes: list, warmup, steps):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    join_spawned_job(store, rank, world, COLLECTIVE_TIMEOUT)
    results = {}
    for mode in modes:
        results[mode["name"]] = run_sharded_mode(size, mode, warmup, steps)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    exit_without_teardown()


def run_spawned_job(worker, world: int, *args) -> object:
    """Run ``worker(rank, world, store, out, *args)`` in ``world`` spawned processes on
    this host (they meet through the file ``store``; see ``join_spawned_job``) and return
    what rank 0 saved to ``out`` with ``torch.save``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.pt"
        mp.spawn(
            worker, args=(world, str(Path(tmp) / "store"), str(out), *args), nprocs=world, join=True
        )
        return torch.load(out, weights_only=False)


def _run_job(world: int, size: dict, modes: list[dict], warmup: int, steps: int) -> dict:
    return run_spawned_job(_worker, world, size, modes, warmup, steps)


def comparison_config(size: dict) -> dict:
    """The benchmark config as its records show it."""
    return {**size, "tables": len(SPARSE), "dense": len(DENSE), "optimizer": "rowwise_adagrad"}


def benchmark_modes(world: int) -> list[dict]:
    """Every sharding type in fp32 with the pipeline; at world size 2 also every codec
    (row-wise, whose partial sums the codec touches) and the pipeline switched off."""
    modes = [
        {"name": f"w{world}_{s}_fp32", "sharding": s, "comms": "fp32", "pipeline": True}
        for s in SHARDING_TYPES
    ]
    if world > 1:
        modes += [
            {"name": f"w{world}_row_wise_{c}", "sharding": "row_wise", "comms": c, "pipeline": True}
            for c in CODECS
        ]
        modes.append(
            {
                "name": f"w{world}_row_wise_fp32_no_pipeline",
                "sharding": "row_wise",
                "comms": "fp32",
                "pipeline": False,
            }
        )
    return modes


def run_train_benchmark(quick: bool = False, steps: int | None = None) -> dict:
    """The benchmark record: baseline, every mode's samples/s and bytes, and ratios."""
    size = QUICK if quick else FULL
    steps = steps or (3 if quick else 8)
    warmup = 1 if quick else 2
    baseline = run_baseline(size, warmup, steps)
    results: dict[str, dict] = {}
    for world in (1, 2):
        results.update(_run_job(world, size, benchmark_modes(world), warmup, steps))
    return {
        "benchmark": "train",
        "baseline": BASELINE,
        "config": comparison_config(size),
        "steps": steps,
        "threads_per_rank": 1,
        "baseline_result": baseline,
        "results": results,
        "ratios": {
            name: r["samples_per_s"] / baseline["samples_per_s"] for name, r in results.items()
        },
        "machine": describe_machine(),
    }

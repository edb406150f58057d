"""Training benchmark: samples/s of the sharded trainer per sharding type and codec.

The comparison config of the sharded-trainer issue: 13 dense features, 26 one-hot sparse
features of 100k rows each, dim 64, bottom MLP 512-256-64, top MLP 512-256-1, dot
interaction, batch 4096 per rank, row-wise Adagrad for the embeddings. Each rank trains on
a few pre-built batches of Zipf(1.1) IDs in turn, so the figures are the trainer's own
(the reader has its benchmark); ranks on this host, gloo.

Baseline: the single-process ``DLRM`` (one table-batched bag, no communication) on the
same batches, warm-up and step count. Every mode's ratio is its global samples/s over the
baseline's, measured in the same run. World size 1 runs the sharded model in a one-rank
job (the cost of the distribution layer alone); world size 2 splits the work over two
ranks. In every job, each case (the baseline too) is timed after a round in which every
case of that job ran once untimed.

Every side gets the same cores in total (``thread_budget``): the baseline runs with all
of them as torch threads, a job of N ranks with a 1/N share each, so a ratio above 1 at
world size 2 is what splitting the work gains over one process using the whole machine.
The baseline runs in the world-size-1 job's process, so that it, too, is a freshly
spawned process; every rank (the baseline's included) applies ``runtime.glibc_malloc``'s
allocator setting, and the record lists each process's threads and setting.

Bytes per step: what one rank sent, by kind (``dlrmflow.train.model.comms.CommStats``).
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dlrmflow.bench.kernels import zipf_ids
from dlrmflow.bench.machine import available_cores, describe_machine, thread_budget
from dlrmflow.bench.spawn import RankResult, run_spawned_job
from dlrmflow.bench.turns import best_of_turns
from dlrmflow.config import RunConfig
from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.ingest.schema import DENSE, SPARSE
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.dlrm import DLRM, embedding_optimizer
from dlrmflow.train.model.plan import SHARDING_TYPES

BASELINE = (
    "single-process DLRM (one table-batched bag, no communication) on the same batches, "
    "warm-up and steps, with as many torch threads as every job has in total"
)
BASELINE_KEY = "single_process"
WORLD_SIZES = (1, 2)
FULL = {"rows": 100_000, "dim": 64, "bottom": [512, 256, 64], "top": [512, 256], "batch": 4096}
QUICK = {"rows": 1_000, "dim": 8, "bottom": [16, 8], "top": [16], "batch": 128}
CODECS = ("fp16", "bf16", "fp8", "int8")
DISTINCT_BATCHES = 3


def bench_config(size: dict, sharding: str | None, comms: str, pipeline: bool) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {
                "embedding_dim": size["dim"],
                "bottom_mlp": size["bottom"],
                "top_mlp": size["top"],
            },
            # TorchRec's side: row-wise Adagrad for the embeddings, Adagrad for the MLPs.
            "train": {
                "batch_size": size["batch"],
                "optimizer": "adagrad",
                "dense_optimizer": "adagrad",
                "lr": 0.01,
            },
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
    """The single-process DLRM, with this process's torch threads: what every mode is
    divided by."""
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
    return {
        "samples_per_s": steps * size["batch"] / seconds,
        "step_s": seconds / steps,
        "torch_threads": torch.get_num_threads(),
    }


def run_sharded_mode(size: dict, mode: dict, warmup: int, steps: int) -> dict:
    """One mode on the current job (every rank calls this): global samples/s, bytes/step."""
    from dlrmflow.train.model.parallelize import sharded_dlrm
    from dlrmflow.train.planner.jobs import plan_for_config

    config = bench_config(size, mode["sharding"], mode["comms"], mode["pipeline"])
    spec = bench_spec(size)
    world = dist.get_world_size()
    plan = plan_for_config(config, spec, world, world)
    torch.manual_seed(0)
    model = sharded_dlrm(spec, config, plan, embedding_optimizer(config.train))
    optimizer = torch.optim.Adagrad(model.dense_parameters(), lr=config.train.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    batches = make_batches(size, dist.get_rank())
    state = {"pending": model.embeddings.start_input_dist(batches[0].sparse)}

    def step(batch: Batch, following: Batch) -> None:
        received = state["pending"].wait()
        if mode["pipeline"]:
            state["pending"] = model.embeddings.start_input_dist(following.sparse, async_op=True)
        loss = loss_fn(model.forward_received(batch.dense, received), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if not mode["pipeline"]:
            state["pending"] = model.embeddings.start_input_dist(following.sparse)

    def at_start() -> None:
        model.embeddings.stats.reset()
        dist.barrier()

    seconds = _time_steps(step, batches, warmup, steps, at_start)
    state["pending"].wait()
    # The job is as fast as its slowest rank.
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds = float(slowest)
    bytes_per_step = {k: v // steps for k, v in model.embeddings.stats.snapshot().items()}
    return {
        "samples_per_s": steps * size["batch"] * world / seconds,
        "step_s": seconds / steps,
        "bytes_per_step": bytes_per_step,
        "shardings": sorted({t.sharding for t in plan.tables}),
    }


def _rank_modes(rank: int, world: int, size: dict, modes: list, warmup: int, steps: int):
    """Every mode on this job (every rank runs this), and in the world-size-1 job's one
    process the baseline as well.

    One untimed round of every case first: a fresh process pays once for what its first
    case touches (thread pools, heap growth, kernels loaded), which would otherwise fall on
    whichever case came first, the baseline included.
    """
    cases = {mode["name"]: partial(run_sharded_mode, size, mode, warmup, steps) for mode in modes}
    if world == 1:
        cases = {BASELINE_KEY: partial(run_baseline, size, warmup, steps), **cases}
    return best_of_turns(cases, 1, key=lambda r: r["samples_per_s"], warmup_rounds=1)


def _run_job(
    world: int, size: dict, modes: list[dict], warmup: int, steps: int, threads: int
) -> list[RankResult]:
    """The modes at world size ``world``, ``threads`` torch threads per rank (and at world
    size 1 the baseline as well); every rank's result and settings."""
    return run_spawned_job(_rank_modes, world, size, modes, warmup, steps, threads=threads)


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
    budget = thread_budget(WORLD_SIZES)
    results: dict[str, dict] = {}
    processes: list[dict] = []
    for world in WORLD_SIZES:
        ranks = _run_job(world, size, benchmark_modes(world), warmup, steps, budget // world)
        results.update(ranks[0].result)  # the figures are the job's (slowest rank's) own
        processes += [{"world": world, **r.settings()} for r in ranks]
    baseline = results.pop(BASELINE_KEY)
    return {
        "benchmark": "train",
        "baseline": BASELINE,
        "config": comparison_config(size),
        "steps": steps,
        "warmup_steps": warmup,
        "warmup_rounds": 1,
        "threads": {
            "cores": available_cores(),
            "total_per_job": budget,
            "baseline": baseline["torch_threads"],
            "per_rank": {f"w{world}": budget // world for world in WORLD_SIZES},
        },
        # Each process that measured: its world size, rank, torch threads and allocator
        # setting (the baseline's is the world-size-1 process).
        "processes": processes,
        "baseline_result": baseline,
        "results": results,
        "ratios": {
            name: r["samples_per_s"] / baseline["samples_per_s"] for name, r in results.items()
        },
        "machine": describe_machine(),
    }

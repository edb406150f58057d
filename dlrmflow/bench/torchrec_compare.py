"""Our DLRM against TorchRec's, on the training benchmark's config and batches.

TorchRec is an optional extra (``pip install 'dlrmflow[torchrec]'``: torchrec and FBGEMM's
CPU build); ``torchrec_missing`` says why it cannot be imported, and the report then skips
this comparison and says so.

Both sides train the config of ``dlrmflow.bench.train`` (26 one-hot tables, the same MLPs,
batch per rank, Zipf IDs) on the very same pre-built batches, gloo:

- ours: the sharded DLRM with its pipelined input exchange (``dlrmflow.bench.train``'s
  modes), and at world size 1 also the plain one-process ``DLRM`` (no distribution layer);
- TorchRec: ``torchrec.models.dlrm.DLRM`` over an ``EmbeddingBagCollection``, sharded by
  ``DistributedModelParallel`` with FBGEMM's fused ``EXACT_ROWWISE_ADAGRAD`` (the optimizer
  ours fuses, same lr and eps) and ``TrainPipelineSparseDist``, which overlaps the next
  batch's input distribution with this one's compute as ours does. Its planner is
  constrained to the sharding type under test. TorchRec's sharder offers row-wise sharding
  on CUDA only; its CPU kernels run it, so the comparison's sharder adds it. At world size
  1 this is how TorchRec trains in one process, so both of our world-size-1 models are
  compared with it: the plain one (what a user of ours runs in one process) and the
  sharded one (the same distribution layer as TorchRec's).

Both sides run in the same spawned processes (``dlrmflow.bench.spawn``: the same
allocator setting, recorded per process) with the same torch threads: at world size 1 all
of the machine's cores, at world size N a 1/N share per rank. Inside each job the sides
take turns, case by case, for ``rounds`` rounds of ``steps`` timed steps after the same
warm-up, and each case's best round counts (``dlrmflow.bench.turns``), so that a noisy
neighbour hurts both alike. Ratios are our samples/s over TorchRec's (> 1: ours faster).
"""

from __future__ import annotations

import logging
import time
from importlib.metadata import PackageNotFoundError, version
from typing import NamedTuple

import torch
import torch.distributed as dist

from dlrmflow.bench.machine import available_cores, describe_machine
from dlrmflow.bench.spawn import run_spawned_job
from dlrmflow.bench.train import (
    FULL,
    QUICK,
    comparison_config,
    make_batches,
    run_baseline,
    run_sharded_mode,
)
from dlrmflow.bench.turns import best_of_turns
from dlrmflow.features.batch import Batch
from dlrmflow.ingest.schema import DENSE, SPARSE

LR = 0.01  # the training benchmark's (bench_config)
EPS = 1e-8  # our RowWiseAdagrad's default


class Mode(NamedTuple):
    """One row of the comparison: TorchRec's ``sharding`` at ``world``, against ours."""

    world: int
    sharding: str
    ours: str  # "plain": our one-process DLRM; "sharded": our DLRM sharded, ``sharding``


MODES: dict[str, Mode] = {
    "w1_plain": Mode(1, "table_wise", "plain"),
    "w1_table_wise": Mode(1, "table_wise", "sharded"),
    "w2_table_wise": Mode(2, "table_wise", "sharded"),
    "w2_row_wise": Mode(2, "row_wise", "sharded"),
}
OURS = {
    "plain": "DLRM: one process, one table-batched bag, no distribution layer",
    "sharded": "DLRM with sharded embeddings and the pipelined input exchange",
}
WORLD_SIZES = tuple(sorted({m.world for m in MODES.values()}))
BASELINE = (
    "TorchRec DLRM (EmbeddingBagCollection, DistributedModelParallel, gloo, FBGEMM fused "
    "EXACT_ROWWISE_ADAGRAD, TrainPipelineSparseDist) on the same config, batches, threads "
    "and allocator setting, in the same processes; at world size 1 DistributedModelParallel "
    "runs one rank. Ratios are our samples/s / TorchRec's, each side's best round"
)


def torchrec_missing() -> str | None:
    """Why TorchRec cannot be used here, or None when it imports."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:  # FBGEMM's library may fail to load
        return f"{type(e).__name__}: {e}"
    return None


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for package in ("torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            continue
    return out


def _torchrec_batches(batches: list[Batch]) -> list:
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch as TorchRecBatch

    return [
        TorchRecBatch(
            dense_features=b.dense,
            sparse_features=KeyedJaggedTensor(
                keys=list(SPARSE), values=b.sparse.values, lengths=b.sparse.lengths
            ),
            labels=b.labels,
        )
        for b in batches
    ]


def _torchrec_mode(size: dict, sharding: str, warmup: int, steps: int) -> dict:
    """TorchRec's DLRM on the current job (every rank calls this): global samples/s."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.types import Topology
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    class CpuRowWiseSharder(EmbeddingBagCollectionSharder):
        """TorchRec lists row-wise for CUDA only; its CPU kernels and gloo run it."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = super().sharding_types(compute_device_type)
            return [*types, ShardingType.ROW_WISE.value] if sharding == "row_wise" else types

    world = dist.get_world_size()
    tables = [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=size["dim"],
            num_embeddings=size["rows"],
            feature_names=[name],
        )
        for name in SPARSE
    ]
    torch.manual_seed(0)
    model = DLRMTrain(
        DLRM(
            EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=len(DENSE),
            dense_arch_layer_sizes=size["bottom"],
            over_arch_layer_sizes=[*size["top"], 1],
        )
    )
    sharder = CpuRowWiseSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": LR,
            "eps": EPS,
        }
    )
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[sharding], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
        )
        for t in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=LR),
    )
    pipeline = TrainPipelineSparseDist(
        dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), torch.device("cpu")
    )
    batches = _torchrec_batches(make_batches(size, dist.get_rank()))

    def stream():
        step = 0
        while True:
            yield batches[step % len(batches)]
            step += 1

    source = stream()
    for _ in range(warmup):
        pipeline.progress(source)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        loss, _, _ = pipeline.progress(source)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the job is as fast as its slowest rank
    shardings = {s.sharding_type for m in plan.plan.values() for s in m.values()}
    return {
        "samples_per_s": steps * size["batch"] * world / float(seconds),
        "step_s": float(seconds) / steps,
        "loss": float(loss),
        "shardings": sorted(shardings),
    }


def _ours(size: dict, mode: Mode, warmup: int, steps: int) -> dict:
    if mode.ours == "plain":
        return run_baseline(size, warmup, steps)
    run = {"name": mode.sharding, "sharding": mode.sharding, "comms": "fp32", "pipeline": True}
    return run_sharded_mode(size, run, warmup, steps)


def _rank_comparison(
    rank: int, world: int, size: dict, names: list[str], warmup: int, steps: int, rounds: int
) -> dict[str, dict]:
    """Both sides of every mode of this world size, in turn (every rank runs this); TorchRec
    runs once per sharding type, however many of our models face it."""
    # The planner's advice on topologies and dry runs is for GPU fleets; keep the JSON clean.
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    cases = {("ours", name): lambda m=MODES[name]: _ours(size, m, warmup, steps) for name in names}
    for sharding in dict.fromkeys(MODES[name].sharding for name in names):
        cases["torchrec", sharding] = lambda s=sharding: _torchrec_mode(size, s, warmup, steps)
    best = best_of_turns(cases, rounds, key=lambda r: r["samples_per_s"])
    return {
        name: {
            "ours_model": OURS[MODES[name].ours],
            "ours": best["ours", name],
            "torchrec": best["torchrec", MODES[name].sharding],
        }
        for name in names
    }


def run_torchrec_comparison(
    quick: bool = False, steps: int | None = None, rounds: int | None = None
) -> dict:
    """The comparison record: each mode's samples/s on both sides and our/TorchRec ratio.

    ``quick`` uses the training benchmark's tiny sizes (checks that it runs, not speed).
    Raises ``ModuleNotFoundError`` when TorchRec is not installed.
    """
    missing = torchrec_missing()
    if missing is not None:
        raise ModuleNotFoundError(f"TorchRec comparison needs the torchrec extra: {missing}")
    size = QUICK if quick else FULL
    steps = steps or (3 if quick else 20)
    rounds = rounds or (1 if quick else 3)
    warmup = 1 if quick else 2
    # Each comparison is within one world size, so the world sizes need not share a budget:
    # one process gets every core, as torch's default gives it.
    threads = {world: max(1, available_cores() // world) for world in WORLD_SIZES}
    results: dict[str, dict] = {}
    processes: list[dict] = []
    for world in WORLD_SIZES:
        names = [name for name, mode in MODES.items() if mode.world == world]
        ranks = run_spawned_job(
            _rank_comparison, world, size, names, warmup, steps, rounds, threads=threads[world]
        )
        results.update(ranks[0].result)  # the figures are the job's (slowest rank's) own
        processes += [{"world": world, **r.settings()} for r in ranks]
    return {
        "benchmark": "torchrec",
        "baseline": BASELINE,
        "config": comparison_config(size),
        "steps": steps,
        "warmup_steps": warmup,
        "rounds": rounds,
        "pick": "best round of each side",
        "threads": {
            "cores": available_cores(),
            "per_rank": {f"w{world}": n for world, n in threads.items()},
        },
        # Each process that measured (both sides ran in each): world size, rank, torch
        # threads and allocator setting.
        "processes": processes,
        "versions": _versions(),
        "results": results,
        "ratios": {
            name: r["ours"]["samples_per_s"] / r["torchrec"]["samples_per_s"]
            for name, r in results.items()
        },
        "machine": describe_machine(),
    }

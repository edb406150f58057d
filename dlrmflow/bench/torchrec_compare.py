"""Our DLRM against TorchRec's, on the training benchmark's config and batches.

TorchRec is an optional extra (``pip install 'dlrmflow[torchrec]'``: torchrec and FBGEMM's
CPU build); ``torchrec_missing`` says why it cannot be imported, and the report then skips
this comparison and says so.

Both sides train the config of ``dlrmflow.bench.train`` (26 one-hot tables, the same MLPs,
batch per rank, Zipf IDs) on the very same pre-built batches, one thread per rank, gloo:

- ours: the single-process ``DLRM``, or the sharded DLRM with its pipelined input exchange
  (``dlrmflow.bench.train``'s modes);
- TorchRec: ``torchrec.models.dlrm.DLRM`` over an ``EmbeddingBagCollection``, sharded by
  ``DistributedModelParallel`` with FBGEMM's fused ``EXACT_ROWWISE_ADAGRAD`` (the optimizer
  ours fuses, same lr and eps) and ``TrainPipelineSparseDist``, which overlaps the next
  batch's input distribution with this one's compute as ours does. Its planner is
  constrained to the sharding type under test. TorchRec's sharder offers row-wise sharding
  on CUDA only; its CPU kernels run it, so the comparison's sharder adds it.

Inside each job the two sides take turns, mode by mode, for ``rounds`` rounds, and the
best round counts, so that a noisy neighbour hurts both alike. Ratios are our samples/s
over TorchRec's (> 1: ours faster). "single_process" compares our one-process DLRM (no
communication at all) with TorchRec's model-parallel DLRM at world size 1.
"""

from __future__ import annotations

import logging
import os
import time
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist

from dlrmflow.bench.machine import describe_machine
from dlrmflow.bench.train import (
    COLLECTIVE_TIMEOUT,
    FULL,
    QUICK,
    comparison_config,
    make_batches,
    run_baseline,
    run_sharded_mode,
    run_spawned_job,
)
from dlrmflow.features.batch import Batch
from dlrmflow.ingest.schema import DENSE, SPARSE
from dlrmflow.train.distributed import exit_without_teardown, join_spawned_job

LR = 0.01  # the training benchmark's (bench_config)
EPS = 1e-8  # our RowWiseAdagrad's default
# Mode name -> (world size, sharding type; None: our single-process DLRM).
MODES: dict[str, tuple[int, str | None]] = {
    "single_process": (1, None),
    "w2_table_wise": (2, "table_wise"),
    "w2_row_wise": (2, "row_wise"),
}
BASELINE = (
    "TorchRec DLRM (EmbeddingBagCollection, DistributedModelParallel, gloo, FBGEMM fused "
    "EXACT_ROWWISE_ADAGRAD, TrainPipelineSparseDist) on the same config, batches and threads; "
    "ratios are our samples/s / TorchRec's"
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


def _ours(size: dict, sharding: str | None, warmup: int, steps: int) -> dict:
    if sharding is None:
        return run_baseline(size, warmup, steps)
    mode = {"name": sharding, "sharding": sharding, "comms": "fp32", "pipeline": True}
    return run_sharded_mode(size, mode, warmup, steps)


def _worker(rank: int, world: int, store: str, out: str, size: dict, modes, warmup, steps, rounds):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # The planner's advice on topologies and dry runs is for GPU fleets; keep the JSON clean.
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    join_spawned_job(store, rank, world, COLLECTIVE_TIMEOUT)
    results: dict[str, dict] = {}
    for _ in range(rounds):
        for name, sharding in modes:
            ours = _ours(size, sharding, warmup, steps)
            theirs = _torchrec_mode(size, sharding or "table_wise", warmup, steps)
            best = results.setdefault(name, {"ours": ours, "torchrec": theirs})
            if ours["samples_per_s"] > best["ours"]["samples_per_s"]:
                best["ours"] = ours
            if theirs["samples_per_s"] > best["torchrec"]["samples_per_s"]:
                best["torchrec"] = theirs
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    exit_without_teardown()


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
    steps = steps or (3 if quick else 8)
    rounds = rounds or (1 if quick else 2)
    warmup = 1 if quick else 2
    results: dict[str, dict] = {}
    for world in sorted({w for w, _ in MODES.values()}):
        modes = [(name, sharding) for name, (w, sharding) in MODES.items() if w == world]
        results.update(run_spawned_job(_worker, world, size, modes, warmup, steps, rounds))
    return {
        "benchmark": "torchrec",
        "baseline": BASELINE,
        "config": comparison_config(size),
        "steps": steps,
        "rounds": rounds,
        "threads_per_rank": 1,
        "versions": _versions(),
        "results": results,
        "ratios": {
            name: r["ours"]["samples_per_s"] / r["torchrec"]["samples_per_s"]
            for name, r in results.items()
        },
        "machine": describe_machine(),
    }

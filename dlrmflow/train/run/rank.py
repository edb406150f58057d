"""A process's place in a job and the job's process group.

``init_distributed`` joins the job torchrun started (gloo on CPU; NCCL for CUDA tensors
and gloo for the host's control values on GPU, see ``dlrmflow.train.model.device``) with a
collective timeout, so a dead peer ends the job instead of hanging it. The model of a job
is the plain ``DLRM`` with sharded embeddings and DDP applied by
``dlrmflow.train.model.parallelize``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dlrmflow.config import RunConfig
from dlrmflow.memory import peak_rss_bytes
from dlrmflow.train.model.device import process_group_backend


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> DistEnv:
        """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), or a
        single process when it is absent."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )


def join_spawned_job(
    store: str, rank: int, world_size: int, timeout: timedelta = timedelta(minutes=10)
) -> None:
    """Join a gloo job of processes spawned on this host (``torch.multiprocessing``), which
    meet through the file ``store``; a rank stuck in a collective fails after ``timeout``.
    Benchmarks and tests start jobs this way, without torchrun's start-up cost."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timeout
    )


def init_distributed(
    config: RunConfig, topology: DistEnv, device: torch.device | None = None
) -> None:
    """Join the process group torchrun set up (env:// rendezvous), once per process, with
    the backends ``device`` needs (the CPU's when not given)."""
    if dist.is_initialized() or not topology.distributed:
        return
    backend = process_group_backend(device or torch.device("cpu"))
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=config.distributed.timeout_s),
        rank=topology.rank,
        world_size=topology.world_size,
    )


def compute_threads(config: RunConfig, env: DistEnv | None = None) -> int:
    """torch's intra-op threads: ``train.threads``, else the cores the readers leave free.

    Oversubscribed cores are far worse than idle ones: OpenMP threads that spin while a
    reader holds their core slowed training twentyfold in measurements on 2 cores. The
    ranks of one host share its cores.
    """
    if config.train.threads is not None:
        return config.train.threads
    ranks = env.local_world_size if env is not None else 1
    cores = max(1, (os.cpu_count() or 1) // ranks)
    return max(1, cores - config.train.num_workers)


def gather_peak_rss(env: DistEnv) -> list[int]:
    """Every rank's peak resident set in bytes, by rank (a collective in a job)."""
    mine = torch.tensor([peak_rss_bytes()], dtype=torch.int64, device="cpu")
    if not env.distributed:
        return mine.tolist()
    every = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(every, mine)  # host values: the gloo group (cpu:gloo on a GPU)
    return [int(t) for t in every]


def seed_everything(seed: int, threads: int) -> None:
    """Same seed, data and thread count -> bitwise-identical weights."""
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)

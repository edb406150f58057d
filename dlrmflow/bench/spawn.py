"""Jobs of spawned processes on this host: how benchmarks and tests run a gloo job.

Every rank sets its torch threads and the allocator setting of ``runtime.glibc_malloc`` before
any work: ``mallopt`` acts on one process only, so a spawned rank would otherwise run with
glibc's defaults while the parent runs tuned (the environment variable that chooses the
setting is inherited; the setting itself is not). It then joins the job through a file
store (no torchrun start-up cost), runs the function, and sends rank 0 its result with the
threads and allocator setting it ran with, so that a benchmark records what each process
actually did rather than what it was asked to do.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dlrmflow.runtime.glibc_malloc import applied_threshold, tune_allocator
from dlrmflow.runtime.teardown import exit_without_teardown
from dlrmflow.train.run.rank import join_spawned_job

# A rank stuck in a collective fails the job after this, rather than hanging it.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankResult:
    """What one rank returned, and the settings it ran under."""

    rank: int
    result: Any
    torch_threads: int
    malloc_mmap_threshold: int | None

    def settings(self) -> dict[str, int | None]:
        """The rank's settings as a benchmark record shows them (without the result)."""
        record = asdict(self)
        del record["result"]
        return record


def run_spawned_job(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    threads: int | None,
    timeout: timedelta = COLLECTIVE_TIMEOUT,
) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` on each rank of a ``world``-process gloo job on this
    host; return every rank's result, in rank order.

    ``threads``: torch's intra-op threads per rank (None: torch's default). ``fn`` and
    ``args`` must pickle (a module-level function). A rank that raises fails the job and
    ``mp.spawn`` re-raises its error here.
    """
    with tempfile.TemporaryDirectory(prefix="dlrmflow-job-") as tmp:
        out = Path(tmp) / "results.pt"
        mp.spawn(
            _rank_main,
            args=(world, str(Path(tmp) / "store"), str(out), threads, timeout, fn, args),
            nprocs=world,
            join=True,
        )
        return torch.load(out, weights_only=False)


def _rank_main(
    rank: int,
    world: int,
    store: str,
    out: str,
    threads: int | None,
    timeout: timedelta,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    tune_allocator()  # first: threads started from here on share the main arena
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the job never leaves this host
    if threads is not None:
        torch.set_num_threads(threads)
    join_spawned_job(store, rank, world, timeout)
    mine = RankResult(rank, fn(rank, world, *args), torch.get_num_threads(), applied_threshold())
    gathered: list[RankResult | None] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        torch.save(gathered, out)
    dist.barrier()
    exit_without_teardown()

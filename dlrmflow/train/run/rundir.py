"""One writer per run directory: an exclusive lock held while a run writes into it.

Two trainings in one run directory would interleave their metrics, prune each other's
checkpoints and resume each other's state, so ``train``, ``evaluate`` and the flows take
``RUN_DIR/.lock`` first and a second writer fails at once, naming the holder. How the lock
holds, passes to a job's ranks and goes with its last holder: ``dlrmflow.locks``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from dlrmflow.locks import HELD_ENV, HOLDER_FILE, LOCK_FILE, DirectoryBusy, directory_lock

__all__ = ["HELD_ENV", "HOLDER_FILE", "LOCK_FILE", "RunDirBusy", "rank0_lock", "run_dir_lock"]


class RunDirBusy(DirectoryBusy):
    """Another process is writing into the run directory."""


@contextlib.contextmanager
def run_dir_lock(run_dir: str | Path, command: str) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block (``dlrmflow.locks.directory_lock``);
    ``RunDirBusy`` at once if another has it."""
    with directory_lock(
        run_dir, command, RunDirBusy, "wait for it, stop it, or use another --run-dir"
    ):
        yield


@contextlib.contextmanager
def rank0_lock(run_dir: str | Path, command: str, rank: int, distributed: bool) -> Iterator[None]:
    """``run_dir_lock`` taken by rank 0 of a job (alone: by this process); when rank 0
    cannot have it, every rank raises the same ``RunDirBusy`` instead of waiting for it."""
    if not distributed:
        with run_dir_lock(run_dir, command):
            yield
        return
    import torch.distributed as dist

    with contextlib.ExitStack() as stack:
        problem: list[str | None] = [None]
        if rank == 0:
            try:
                stack.enter_context(run_dir_lock(run_dir, command))
            except RunDirBusy as e:
                problem[0] = str(e)
        dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise RunDirBusy(problem[0])
        yield

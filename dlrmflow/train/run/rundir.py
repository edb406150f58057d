"""One writer per run directory: an exclusive lock held while a run writes into it.

Two trainings in one run directory would interleave their metrics, prune each other's
checkpoints and resume each other's state, so ``train``, ``evaluate`` and the flows take
``RUN_DIR/.lock`` first and a second writer fails at once, naming the holder. The lock is
the kernel's (``flock``): it goes with the last process that holds its file open, so a
run killed by SIGKILL or a lost machine never leaves a stale lock behind. The holder's
host, pid and start time sit in ``RUN_DIR/.lock.json`` for the error message only.

The launcher of a ``--nproc`` job hands the open lock file to its agent (``held_lock_fds``):
a command killed by SIGKILL then leaves the directory locked until the agent, which
stops its ranks before it exits, is gone, never while a rank of the job still writes.
Releasing is closing the file, never unlocking it, which would unlock it for the agent too.

A process that holds the lock passes it on to the processes it launches (the ranks of a
``--nproc`` job, a Prefect flow calling ``train`` in-process) through the environment:
they work under their parent's lock instead of fighting it for the same file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dlrmflow.errors import DlrmflowError

LOCK_FILE = ".lock"
HOLDER_FILE = ".lock.json"
# The run directories held by this process or an ancestor (absolute paths separated by
# os.pathsep), inherited by every process launched while the lock is held.
HELD_ENV = "DLRMFLOW_HELD_RUN_DIRS"

_held_fds: dict[str, int] = {}  # run directory -> the open lock file, in this process


def held_lock_fds() -> list[int]:
    """The open lock files of the run directories this process holds: a launcher passes
    them on to its job, whose processes then keep the directories locked."""
    return list(_held_fds.values())


class RunDirBusy(DlrmflowError):
    """Another process is writing into the run directory."""


def _held() -> list[str]:
    return [p for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p]


def _holder(run_dir: Path) -> str:
    try:
        info = json.loads((run_dir / HOLDER_FILE).read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        holder = f"pid {info['pid']} on {info['host']} since {since} ({info['command']})"
    except (OSError, ValueError, KeyError):
        return "another process (its details are not readable)"
    if info["host"] == socket.gethostname() and not Path(f"/proc/{info['pid']}").exists():
        holder += ", which was killed: its job's processes are still stopping"
    return holder


@contextlib.contextmanager
def run_dir_lock(run_dir: str | Path, command: str) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block; ``RunDirBusy`` at once if another has it.

    ``command`` ("train", "evaluate", a flow's name) is shown to a second writer. Re-entrant
    within a process and its children: a flow's tasks (in any of its threads), the ranks
    a launcher starts and in-process callees run under the lock they were started under.
    """
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _held():
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirBusy(
            f"{run_dir} is in use by {_holder(run_dir)}; wait for it, stop it, or use "
            "another --run-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    _held_fds[key] = fd
    previous = os.environ.get(HELD_ENV)
    try:
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.time(),
            "command": command,
        }
        (run_dir / HOLDER_FILE).write_text(json.dumps(holder) + "\n")
        os.environ[HELD_ENV] = os.pathsep.join([*_held(), key])
        yield
    finally:
        if previous is None:
            os.environ.pop(HELD_ENV, None)
        else:
            os.environ[HELD_ENV] = previous
        with contextlib.suppress(OSError):
            (run_dir / HOLDER_FILE).unlink()
        del _held_fds[key]
        os.close(fd)


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

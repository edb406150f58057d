"""One writer per directory: an exclusive lock held while a command writes into it.

Two writers in one directory (two trainings in a run directory, two ``generate`` into one
dataset) would interleave and remove each other's files, so a writer takes ``DIR/.lock``
first and a second fails at once, naming the holder. The lock is the kernel's (``flock``):
it goes with the last process that holds its file open, so a writer killed by SIGKILL or a
lost machine never leaves a stale lock behind. The holder's host, pid and start time sit
in ``DIR/.lock.json`` for the error message only.

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
# The directories held by this process or an ancestor (absolute paths separated by
# os.pathsep), inherited by every process launched while the lock is held.
HELD_ENV = "DLRMFLOW_HELD_RUN_DIRS"

_held_fds: dict[str, int] = {}  # directory -> the open lock file, in this process


def held_lock_fds() -> list[int]:
    """The open lock files of the directories this process holds: a launcher passes
    them on to its job, whose processes then keep the directories locked."""
    return list(_held_fds.values())


class DirectoryBusy(DlrmflowError):
    """Another process is writing into the directory."""


def _held() -> list[str]:
    return [p for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p]


def _holder(directory: Path) -> str:
    try:
        info = json.loads((directory / HOLDER_FILE).read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        holder = f"pid {info['pid']} on {info['host']} since {since} ({info['command']})"
    except (OSError, ValueError, KeyError):
        return "another process (its details are not readable)"
    if info["host"] == socket.gethostname() and not Path(f"/proc/{info['pid']}").exists():
        holder += ", which was killed: its job's processes are still stopping"
    return holder


@contextlib.contextmanager
def directory_lock(
    directory: str | Path,
    command: str,
    busy: type[DirectoryBusy] = DirectoryBusy,
    advice: str = "wait for it or stop it",
) -> Iterator[None]:
    """Hold ``directory``'s lock for the block; ``busy`` at once if another has it, its
    message naming the holder and ending with ``advice``.

    ``command`` ("train", "generate", a flow's name) is shown to a second writer. Re-entrant
    within a process and its children: a flow's tasks (in any of its threads), the ranks
    a launcher starts and in-process callees run under the lock they were started under.
    """
    run_dir = Path(directory)
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
        raise busy(f"{run_dir} is in use by {_holder(run_dir)}; {advice}") from None
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

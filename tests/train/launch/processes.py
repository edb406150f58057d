"""The live processes of a job, found by its run directory: what the tests of a stopped job
check is gone."""

from __future__ import annotations

import os
from pathlib import Path


def job_processes(run_dir: Path) -> list[int]:
    """Every live process (zombies aside) whose command line or environment names
    ``run_dir``, other than this one."""
    key = str(run_dir).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rpartition(")")[2].split()[0] in "ZX":
                continue
            if key in (entry / "cmdline").read_bytes() or key in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def cmdline(pid: int) -> bytes:
    """``pid``'s command line, arguments NUL-separated; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def described(pids: list[int]) -> list[str]:
    """``pid: command line`` of each of ``pids``, for a failing assertion's message."""
    lines = (cmdline(pid).replace(b"\0", b" ").decode(errors="replace") for pid in pids)
    return [f"{pid}: {line}" for pid, line in zip(pids, lines, strict=True)]

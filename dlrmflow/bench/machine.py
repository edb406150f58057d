"""A description of the machine a benchmark ran on, stored beside its figures, and the
share of its cores each process of a comparison gets."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence

import pyarrow
import torch

from dlrmflow.runtime.glibc_malloc import applied_threshold


def describe_machine() -> dict[str, object]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "available_cores": available_cores(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyarrow": pyarrow.__version__,
        # Other processes' load skews every figure (spinning OpenMP threads most of all).
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        # The setting of the process that wrote this record; benchmarks that spawn ranks
        # record each rank's own beside their figures.
        "malloc_mmap_threshold": applied_threshold(),
    }


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_budget(world_sizes: Sequence[int]) -> int:
    """torch threads that every job of a comparison shares out among its ranks.

    This machine's cores, rounded down to a number that every world size in
    ``world_sizes`` divides, so that a one-process baseline and a job of N ranks with
    ``budget // N`` threads each use the same cores in total; never less than one thread
    per rank of the largest job.
    """
    step = math.lcm(*world_sizes)
    return max(step, available_cores() // step * step)

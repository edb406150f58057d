"""A description of the machine a benchmark ran on, stored beside its figures."""

from __future__ import annotations

import os
import platform

import pyarrow
import torch

from dlrmflow.memory import applied_threshold


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
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyarrow": pyarrow.__version__,
        # Both sides of every comparison run in this one process, under this setting.
        "malloc_mmap_threshold": applied_threshold(),
    }

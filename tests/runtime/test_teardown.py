"""Ending a gloo job's process without Python's teardown (``runtime.teardown``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dlrmflow

REPO = Path(dlrmflow.__file__).resolve().parent.parent

RANK = """
import atexit, sys
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from dlrmflow.runtime.teardown import exit_without_teardown
store, rank, marker = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
atexit.register(lambda: marker.write_text("teardown ran"))
dist.init_process_group(
    "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
)
gathered = [None, None] if rank == 0 else None
dist.gather_object({"rank": rank, "rows": list(range(1000))}, gathered, dst=0)
t = torch.ones(8)
dist.all_reduce(t)
print(f"rank {rank} summed {int(t.sum())}", end="")  # no newline: only a flush shows it
exit_without_teardown(3 + rank)
"""


def test_a_gloo_job_ends_flushed_with_its_code_and_without_teardown(tmp_path: Path) -> None:
    for job in range(3):
        store = tmp_path / f"store-{job}"
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(store), str(r), str(tmp_path / f"{job}-{r}")],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        for r, process in enumerate(ranks):
            out, err = process.communicate(timeout=120)
            assert process.returncode == 3 + r, err[-2000:]
            assert out == f"rank {r} summed 16"
            assert not (tmp_path / f"{job}-{r}").exists()  # atexit never ran

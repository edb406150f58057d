"""``make gpu-check`` (scripts/gpu_check.py) where torch sees no GPU: it says so and stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make gpu-check")
def test_without_a_gpu_the_check_runs_nothing_and_fails_saying_why(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.strip() == "gpu-check: torch sees no CUDA device here; nothing was run"
    report = json.loads(out.read_text())
    assert report["steps"] == {} and report["machine"]["torch"] == torch.__version__

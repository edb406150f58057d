"""The rank entry point under a launcher that is not dlrmflow's: ``torchrun -m
dlrmflow.train --config FILE`` (what PyTorchJob and hand-made scripts run) trains as one
rank each, bitwise as ``dlrmflow train --nproc 2``, and evaluates (``--evaluate``); rank 0
holds the run directory's lock, and a failing rank says why in one line naming itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from dlrmflow.train.launch.job import ONE_HOST
from dlrmflow.train.run.rundir import HELD_ENV, run_dir_lock
from tests.conftest import same_weights, tiny_run_config

BIN = Path(sys.executable).parent


def _config(tmp_path: Path, data: str, name: str) -> Path:
    config = tiny_run_config(data, tmp_path / name, max_steps=6).model_dump()
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _torchrun(config: Path | None, *args: str) -> subprocess.CompletedProcess:
    # Started as another launcher would: without word of the locks this process holds.
    env = {k: v for k, v in os.environ.items() if k != HELD_ENV}
    given = ["--config", str(config)] if config is not None else []
    return subprocess.run(
        [BIN / "torchrun", "--nproc_per_node", "2", *ONE_HOST, "-m", "dlrmflow.train",
         *given, *args],
        capture_output=True, text=True, timeout=300,
        env={**env, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
    )  # fmt: skip


def test_torchrun_ranks_train_as_dlrmflows_own_job(tiny_dataset, tmp_path):
    started = _torchrun(_config(tmp_path, tiny_dataset, "torchrun"))
    assert started.returncode == 0, started.stderr[-3000:]
    own = subprocess.run(
        [BIN / "dlrmflow", "train", "--config", str(_config(tmp_path, tiny_dataset, "own")),
         "--nproc", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert own.returncode == 0, own.stderr[-3000:]
    same_weights(tmp_path / "torchrun", tmp_path / "own")
    # --evaluate: the ranks score the run's checkpoint on its test day.
    scored = _torchrun(None, "--evaluate", str(tmp_path / "torchrun"))
    assert scored.returncode == 0, scored.stderr[-3000:]
    metrics = json.loads((tmp_path / "torchrun" / "eval.json").read_text())
    assert metrics["world_size"] == 2 and 0.5 < metrics["auc"] <= 1.0


def test_a_failing_rank_under_torchrun_says_why_in_one_line(tmp_path):
    config = tiny_run_config(str(tmp_path / "missing"), tmp_path / "run").model_dump()
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    failed = _torchrun(path)
    assert failed.returncode != 0
    ours = [line for line in failed.stderr.splitlines() if line.startswith("error: rank ")]
    assert ours, failed.stderr[-3000:]
    assert all(
        line.endswith(f"{tmp_path / 'missing'}/manifest.json: no manifest; create the dataset "
                      "with `dlrmflow generate` or `dlrmflow convert`")
        for line in ours
    ), ours  # fmt: skip


def test_rank_0_takes_the_run_directorys_lock_and_every_rank_says_who_holds_it(
    tiny_dataset, tmp_path
):
    config = _config(tmp_path, tiny_dataset, "held")
    (tmp_path / "held").mkdir()
    with run_dir_lock(str(tmp_path / "held"), "another dlrmflow train"):
        refused = _torchrun(config)
    assert refused.returncode != 0
    ours = [line for line in refused.stderr.splitlines() if line.startswith("error: rank ")]
    assert ours and all("another dlrmflow train" in line for line in ours), refused.stderr[-3000:]
    assert not (tmp_path / "held" / "checkpoints").exists()

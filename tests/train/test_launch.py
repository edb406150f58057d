"""``dlrmflow train --nproc 2``: torchrun, sharded embeddings, a checkpoint that evaluates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dlrmflow.train.checkpoint import load_checkpoint
from dlrmflow.train.evaluate import evaluate
from dlrmflow.train.launch import (
    TrainingFailed,
    free_port,
    launch_command,
    launch_evaluation,
    launch_training,
    ranks_of,
    stop_job,
)
from tests.conftest import tiny_run_config


def test_two_ranks_from_the_cli_train_shard_and_evaluate(tiny_dataset: str, tmp_path: Path):
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", max_steps=12)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump()))
    env = {**os.environ, "DLRMFLOW_DEBUG": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "train", "--config", str(config_file)]
        + ["--nproc", "2", "--sharding", "row_wise", "--comms", "bf16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["world_size"] == 2 and result["steps"] == 12
    # Each rank read 3 of the 6 row groups of 2000 rows: 12 batches of 512 (the last
    # partial) each, so 12 steps cover both training days once; rows count both ranks.
    assert result["rows"] == 2 * 6000
    assert result["comm_bytes_per_step"]["forward"] > 0
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert {t["sharding"] for t in plan["tables"]} == {"row_wise"}
    assert all(len(t["shards"]) == 2 for t in plan["tables"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [5, 10, 12]
    # The sharded run's checkpoint evaluates in one process and on two ranks alike.
    assert load_checkpoint(tmp_path / "run").step == 12
    alone = evaluate(tmp_path / "run")
    assert 0.5 < alone["auc"] <= 1.0 and alone["rows"] == 6000
    both = launch_evaluation(tmp_path / "run", 2)
    assert both["world_size"] == 2 and both["rows"] == 6000
    # Partial sums add up in another order on two ranks: equal to float rounding.
    assert abs(both["auc"] - alone["auc"]) < 1e-4
    assert abs(both["logloss"] - alone["logloss"]) < 1e-5


def test_a_failing_job_raises_with_the_ranks_error(tmp_path: Path) -> None:
    cfg = tiny_run_config(str(tmp_path / "no-such-data"), tmp_path / "run")
    cfg.distributed.nproc = 2
    with pytest.raises(TrainingFailed, match="no-such-data"):
        launch_training(cfg)


def test_stopping_a_job_takes_every_rank_down(tiny_dataset: str, tmp_path: Path) -> None:
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", epochs=1000)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump()))
    job = subprocess.Popen(
        launch_command(run_dir / "config.json", 2, free_port()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").is_file():
        assert time.monotonic() < deadline and job.poll() is None, "training never started"
        time.sleep(0.05)
    ranks = ranks_of(job.pid)
    assert len(ranks) == 2
    stop_job(job, grace_s=5)
    time.sleep(0.5)
    for pid in ranks:
        assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), pid


def _state(pid: int) -> str:
    """A process's state letter (Z: a zombie, already dead)."""
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]

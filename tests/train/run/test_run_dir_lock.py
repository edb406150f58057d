"""One writer per run directory: a second writer fails at once naming the holder, a lock
left by a killed process blocks nothing, and concurrent runs never mix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.rundir import RunDirBusy
from dlrmflow.train.run.trainer import train
from tests.conftest import tiny_run_config

HOLD = """
import sys, time
from dlrmflow.train.run.rundir import run_dir_lock
with run_dir_lock(sys.argv[1], "test holder"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process holding ``run_dir``'s lock until killed."""
    env = {k: v for k, v in os.environ.items() if k != "DLRMFLOW_HELD_RUN_DIRS"}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DLRMFLOW_HELD_RUN_DIRS"}
    command = [sys.executable, "-m", "dlrmflow", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def _train_args(data: str, run_dir: Path, *extra: str) -> list[str]:
    sets = [
        "model.embedding_dim=8",
        "model.bottom_mlp=[16,8]",
        "model.top_mlp=[32]",
        "train.batch_size=512",
        "train.num_workers=0",
        "train.log_every=1",
        *extra,
    ]
    return ["train", "--data", data, "--run-dir", str(run_dir)] + [
        arg for s in sets for arg in ("--set", s)
    ]


def test_a_second_writer_fails_at_once_naming_the_holder(tiny_dataset: str, tmp_path: Path):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        started = time.monotonic()
        with pytest.raises(RunDirBusy, match=rf"in use by pid {holder.pid} on .* since .*"):
            train(tiny_run_config(tiny_dataset, run_dir, max_steps=2))
        with pytest.raises(RunDirBusy, match="test holder"):
            evaluate(run_dir)
        assert time.monotonic() - started < 30
        # From the command line: one line, exit 1, nothing trained.
        done = _cli(*_train_args(tiny_dataset, run_dir, "train.max_steps=2"))
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [done.stderr.strip()]
        assert f"pid {holder.pid}" in done.stderr and "Traceback" not in done.stderr
        assert not (run_dir / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_process_does_not_block(tiny_dataset: str, tmp_path: Path):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    result = train(tiny_run_config(tiny_dataset, run_dir, max_steps=2))
    assert result.steps == 2


@pytest.mark.parametrize("nproc", [1, 2])
def test_two_trainings_started_together_never_mix(tiny_dataset: str, tmp_path: Path, nproc):
    """Whichever gets the directory trains; the other fails naming it, or (when the first
    had already finished) finds the run done and trains nothing."""
    run_dir = tmp_path / "run"
    args = _train_args(tiny_dataset, run_dir, "train.max_steps=6", f"distributed.nproc={nproc}")
    env = {k: v for k, v in os.environ.items() if k != "DLRMFLOW_HELD_RUN_DIRS"}
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", "dlrmflow", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outcomes = [(job.wait(timeout=300), *job.communicate()) for job in jobs]
    trained = 0
    for code, out, err in outcomes:
        if code == 0:
            trained += json.loads(out)["trained_steps"]
        else:
            assert code == 1 and "is in use by pid" in err, err
            assert err.strip().splitlines() == [err.strip()]
    assert trained == 6
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4, 5, 6]

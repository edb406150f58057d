"""``dlrmflow train --nproc 2``: torchrun, sharded embeddings, a checkpoint that evaluates."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dlrmflow.errors import DlrmflowError
from dlrmflow.supervise import Job, children_of
from dlrmflow.train.launch.job import (
    TrainingFailed,
    first_failure,
    launch_command,
    launch_evaluation,
    launch_training,
)
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.evaluate import evaluate
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
    # Both ranks fail alike; the first error to arrive is the one reported, in one line.
    with pytest.raises(TrainingFailed) as failed:
        launch_training(cfg)
    message = str(failed.value)
    assert re.match(r"training with 2 ranks failed: rank [01]: \w+: .*no-such-data", message)
    assert "\n" not in message and isinstance(failed.value, DlrmflowError)


RESET = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
    "Read error [127.0.0.1]:48543: Connection reset by peer. This is typically caused by a "
    "remote worker hanging or bugs in the application."
)
BAD_DATA = "DataError: d/part-0.parquet, row group 3: column I5: 1 infinite value(s)"
TIMEOUT = "DistBackendError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms"


def _failed(exitcode: int, signal_name: str | None = None, stopped: bool = False) -> dict:
    return {"exitcode": exitcode, "signal": signal_name, "stopped": stopped}


@pytest.mark.parametrize(
    ("errors", "failures", "cause"),
    [
        # Bad data on rank 1; rank 0 then lost its connection to it.
        ([(1, BAD_DATA), (0, RESET)], {0: _failed(1), 1: _failed(1)}, f"rank 1: {BAD_DATA}"),
        ([(0, RESET), (1, BAD_DATA)], {0: _failed(1), 1: _failed(1)}, f"rank 1: {BAD_DATA}"),
        # Rank 1 killed: rank 0 lost it, or torchrun stopped rank 0 first, or rank 0 died
        # without its one-line error (a traceback, under DLRMFLOW_DEBUG).
        ([(0, RESET)], {0: _failed(1), 1: _failed(-9, "SIGKILL")}, "rank 1 was killed by SIGKILL"),
        (
            [],
            {1: _failed(-9, "SIGKILL"), 0: _failed(-15, "SIGTERM", stopped=True)},
            "rank 1 was killed by SIGKILL",
        ),
        ([], {0: _failed(1), 1: _failed(-6, "SIGABRT")}, "rank 1 was killed by SIGABRT"),
        (
            [],
            {1: _failed(3), 0: _failed(-15, "SIGTERM", stopped=True)},
            "rank 1 exited with code 3 without an error message",
        ),
        # A time-out with no other rank to blame (one hung, and torchrun stopped it).
        (
            [(0, TIMEOUT)],
            {0: _failed(1), 1: _failed(-15, "SIGTERM", stopped=True)},
            f"rank 0: {TIMEOUT}",
        ),
        ([], {}, None),
    ],
)
def test_the_first_failure_is_the_cause_never_a_lost_peer(errors, failures, cause) -> None:
    assert first_failure(errors, failures) == cause


def test_a_rank_killed_by_a_signal_is_named_not_the_rank_that_lost_it(
    tiny_dataset: str, tmp_path: Path
) -> None:
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", epochs=1000, log_every=1)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump()))
    cli = subprocess.Popen(
        [sys.executable, "-m", "dlrmflow", "train", "--config", str(config_file), "--nproc", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics.jsonl").is_file():  # both ranks train
            assert time.monotonic() < deadline and cli.poll() is None, "training never started"
            time.sleep(0.05)
        # The command's children: its launcher agent and its guard (dlrmflow.guard).
        children = children_of(cli.pid)
        [launcher] = [
            p for p in children if b"train.launch.agent" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        [rank1] = [pid for pid in children_of(launcher) if _environ(pid).get("RANK") == "1"]
        os.kill(rank1, signal.SIGKILL)
        _, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            for pid in [p for child in children_of(cli.pid) for p in [child, *children_of(child)]]:
                os.kill(pid, signal.SIGKILL)
            cli.kill()
            cli.wait()
    assert cli.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == "error: training with 2 ranks failed: rank 1 was killed by SIGKILL"
    assert "Traceback" not in err and "onnection" not in err, err[-3000:]


def _environ(pid: int) -> dict[str, str]:
    """A process's environment, read from /proc."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in entries if b"=" in e)


def test_stopping_a_job_takes_every_rank_down(tiny_dataset: str, tmp_path: Path) -> None:
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", epochs=1000)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump()))
    (tmp_path / "beats").mkdir()
    job = Job(
        launch_command(run_dir / "config.json", 2, None),
        dict(os.environ),
        heartbeats=tmp_path / "beats",
        timeout_s=60,
        grace_s=5,
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").is_file():
        assert time.monotonic() < deadline and job.proc.poll() is None, "training never started"
        time.sleep(0.05)
    ranks = children_of(job.proc.pid)
    assert len(ranks) == 2
    job.stop()
    for _ in job.lines():
        pass
    job.wait()
    for pid in [job.proc.pid, *ranks]:
        assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), pid


def _state(pid: int) -> str:
    """A process's state letter (Z: a zombie, already dead)."""
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]

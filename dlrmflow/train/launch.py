"""Launch a training job of ``distributed.nproc`` ranks on this host with torch's elastic
launcher (torchrun), as its own process group, streaming its output line by line.

The launcher runs in a child process in a new session, so that stopping the job (Ctrl-C,
a Prefect cancellation, a failed rank) takes every rank down with it; a rank that dies
makes the others fail within ``distributed.timeout_s`` (the collective timeout) and
torchrun then exits non-zero, which raises ``TrainingFailed`` with the ranks' errors (or
the output's tail). Rank 0 prints its result as one ``result`` JSON line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dlrmflow.config import RunConfig
from dlrmflow.train.evaluate import evaluate
from dlrmflow.train.trainer import TrainResult, train

CONFIG_FILE = "config.json"


class TrainingFailed(RuntimeError):
    """The distributed job exited non-zero; the message carries its last lines."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(config_path: Path | None, nproc: int, port: int, *args: str) -> list[str]:
    """The torchrun command line of a one-host job (what ``dlrmflow train --nproc`` runs);
    ``args`` go to ``python -m dlrmflow.train`` after the config."""
    config = ["--config", str(config_path)] if config_path is not None else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "-m",
        "dlrmflow.train",
        *config,
        *args,
    ]


def ranks_of(pid: int) -> list[int]:
    """The child processes of torchrun: its ranks (each in a session of its own)."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    return children


def stop_job(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a torchrun job and every rank: SIGTERM, then SIGKILL after ``grace_s``.

    The ranks are signalled directly too: one blocked inside a collective does not run
    torchrun's forwarded SIGTERM handler, and would outlive a killed torchrun.
    """
    ranks = ranks_of(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _run_job(
    command: list[str],
    nproc: int,
    what: str,
    on_line: Callable[[str], None] | None,
    on_record: Callable[[dict], None] | None = None,
) -> dict:
    """Run a torchrun job in a session of its own and return rank 0's ``result`` line."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    tail: deque[str] = deque(maxlen=30)
    errors: list[str] = []
    result: dict | None = None
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            tail.append(line)
            if line.startswith("error: rank "):
                errors.append(line.removeprefix("error: "))
            if line.startswith("result "):
                result = json.loads(line.removeprefix("result "))
            elif on_record is not None and line.startswith("metrics "):
                on_record(json.loads(line.removeprefix("metrics ")))
            elif on_line is not None:
                on_line(line)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            stop_job(proc)
    if code != 0 or result is None:
        lines = "\n".join(errors or [line for line in tail if not line.startswith("metrics ")])
        raise TrainingFailed(f"{what} with {nproc} ranks failed (exit {code}):\n{lines}")
    return result


def launch_training(
    config: RunConfig,
    on_line: Callable[[str], None] | None = None,
    on_record: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train with ``config.distributed.nproc`` ranks (in this process when it is 1).

    ``on_line`` gets every output line of every rank; ``on_record`` each metrics record
    rank 0 prints. The resolved configuration is written to ``RUN_DIR/config.json`` first,
    so the job runs exactly what was validated here.
    """
    nproc = config.distributed.nproc
    if nproc == 1:
        return train(config, progress=on_record)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / CONFIG_FILE
    config_path.write_text(json.dumps(config.model_dump(), indent=1))
    command = launch_command(config_path, nproc, free_port())
    return TrainResult(**_run_job(command, nproc, "training", on_line, on_record))


def launch_evaluation(
    run_dir: str | Path,
    nproc: int,
    *,
    data_url: str | None = None,
    checkpoint: str | None = None,
    max_rows: int | None = None,
    on_line: Callable[[str], None] | None = None,
) -> dict:
    """Score a run's checkpoint on ``nproc`` ranks (loaded resharded to that world size);
    in this process when ``nproc`` is 1."""
    if nproc == 1:
        return evaluate(run_dir, data_url=data_url, checkpoint=checkpoint, max_rows=max_rows)
    args = ["--evaluate", str(run_dir)]
    for flag, value in (
        ("--data", data_url),
        ("--checkpoint", checkpoint),
        ("--max-rows", max_rows),
    ):
        if value is not None:
            args += [flag, str(value)]
    command = launch_command(None, nproc, free_port(), *args)
    return _run_job(command, nproc, "evaluation", on_line)

"""Launch a training job of ``distributed.nproc`` ranks on this host with torch's elastic
launcher (torchrun), as its own process group, streaming its output line by line.

The launcher runs in a child process in a new session, so that stopping the job (Ctrl-C,
a Prefect cancellation, a failed rank) takes every rank down with it. Rank 0 prints its
result as one ``result`` JSON line; a rank that fails prints one ``error: rank N: ...``
line. A rank that dies makes the others fail (their connections to it break, or a
collective times out after ``distributed.timeout_s``) and torchrun stops the rest. The
child runs torchrun through this module (``python -m dlrmflow.train.launch``), which
reports each failed rank's exit code or signal as one ``failures`` JSON line in place of
torchrun's report; ``TrainingFailed`` then names the rank that failed first and how: its
own error, else the signal that killed it or its exit code, never another rank's lost
connection to it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dlrmflow.config import RunConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.train.evaluate import evaluate
from dlrmflow.train.trainer import TrainResult, train

CONFIG_FILE = "config.json"
FAILURES = "failures "  # the prefix of the launcher's line about failed ranks

# A rank's one-line failure (``python -m dlrmflow.train``): "error: rank N: Type: message".
_RANK_ERROR = re.compile(r"error: rank (\d+): (.*)")
# What a rank reports when another one died first: its connections to that rank break, or
# a collective waits for it in vain. Such an error is a consequence, not the cause.
_PEER_LOST_TYPES = ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError")
_PEER_LOST = re.compile(
    r"connection (reset|closed|refused)|broken pipe|timed out|timeout|socket closed"
    r"|end of file|communicator was aborted",
    re.IGNORECASE,
)


class TrainingFailed(DlrmflowError, RuntimeError):
    """The distributed job failed; the message names the rank that failed first and how."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(config_path: Path | None, nproc: int, port: int, *args: str) -> list[str]:
    """The torchrun command line of a one-host job (what ``dlrmflow train --nproc`` runs,
    torchrun's arguments run through ``torchrun_main``); ``args`` go to
    ``python -m dlrmflow.train`` after the config, which is a resolved one (environment
    variables already applied)."""
    config = ["--config", str(config_path), "--resolved"] if config_path is not None else []
    return [
        sys.executable,
        "-m",
        "dlrmflow.train.launch",
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
    """Run a torchrun job in a session of its own and return rank 0's ``result`` line.

    The ranks' error lines and the launcher's ``failures`` line make up ``TrainingFailed``
    rather than going to ``on_line`` (they do too with ``DLRMFLOW_DEBUG``).
    """
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    debug = bool(os.environ.get("DLRMFLOW_DEBUG"))
    tail: deque[str] = deque(maxlen=30)
    errors: list[tuple[int, str]] = []  # (rank, "Type: message"), in the order they came
    failures: dict[int, dict] = {}
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
            error = _RANK_ERROR.fullmatch(line)
            if error is not None or line.startswith(FAILURES):
                if error is not None:
                    errors.append((int(error[1]), error[2]))
                else:
                    failures = {int(r): f for r, f in json.loads(line[len(FAILURES) :]).items()}
                if debug and on_line is not None:
                    on_line(line)
                continue
            tail.append(line)
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
        cause = first_failure(errors, failures)
        if cause is None:
            lines = [line for line in tail if not line.startswith("metrics ")]
            cause = f"exit {code}" + "".join(f"\n{line}" for line in lines)
        raise TrainingFailed(f"{what} with {nproc} ranks failed: {cause}")
    return result


def _peer_lost(message: str) -> bool:
    """Whether a rank's error ("Type: message") is the loss of another rank."""
    kind, _, text = message.partition(": ")
    return kind in _PEER_LOST_TYPES and _PEER_LOST.search(text) is not None


def first_failure(errors: list[tuple[int, str]], failures: dict[int, dict]) -> str | None:
    """The rank that failed first and how, from the ranks' errors in the order they came
    and the launcher's ``failures`` (rank -> exit code, signal, whether torchrun stopped it).

    A rank prints its error before it exits, so the first error to come is the first
    failure, unless it is a lost connection to a rank that died without a word: then that
    rank is the cause, one killed by a signal before one that exited with a code (whose
    exit may itself follow the loss of the other). Ranks torchrun stopped after the first
    failure are never the cause.
    """
    for rank, message in errors:
        if not _peer_lost(message):
            return f"rank {rank}: {message}"
    spoke = {rank for rank, _ in errors}
    silent = [
        (rank, failure)
        for rank, failure in failures.items()
        if not failure["stopped"] and rank not in spoke
    ]
    for rank, failure in sorted(silent, key=lambda item: item[1]["signal"] is None):
        if failure["signal"] is not None:
            return f"rank {rank} was killed by {failure['signal']}"
        return f"rank {rank} exited with code {failure['exitcode']} without an error message"
    if errors:
        rank, message = errors[0]
        return f"rank {rank}: {message}"
    return None


def launch_training(
    config: RunConfig,
    on_line: Callable[[str], None] | None = None,
    on_record: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train with ``config.distributed.nproc`` ranks (in this process when it is 1).

    ``on_line`` gets every output line of every rank but their errors (which make up
    ``TrainingFailed``); ``on_record`` each metrics record rank 0 prints. The resolved
    configuration is written to ``RUN_DIR/config.json`` first, so the job runs exactly what
    was validated here.
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


class _StoppedRanks(logging.Filter):
    """Notes the ranks torchrun stops itself once another failed (and keeps torchrun's
    lines about them out of the output unless ``DLRMFLOW_DEBUG`` is set).

    torchrun's agent logs "Sending process PID closing signal SIG" for each one; its
    failure records alone cannot tell them from a rank killed by someone else.
    """

    STOPPING = "Sending process %s closing signal %s"
    FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"

    def __init__(self) -> None:
        super().__init__()
        self.pids: set[int] = set()
        self.quiet = not os.environ.get("DLRMFLOW_DEBUG")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == self.STOPPING and record.args:
            self.pids.add(int(record.args[0]))  # type: ignore[index]
            return not self.quiet
        return not (self.quiet and record.msg == self.FAILED)


def torchrun_main(argv: list[str]) -> int:
    """torchrun (``torch.distributed.run``) with ``argv``. When ranks fail, it prints one
    ``failures`` JSON line instead of torchrun's report and traceback: each failed rank's
    exit code, signal name (killed by one) and whether torchrun stopped it because another
    rank had failed. Returns the exit code: 0, or 1 when ranks failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    stopped = _StoppedRanks()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(stopped)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        failures = {
            rank: {
                "exitcode": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "stopped": f.pid in stopped.pids,
            }
            for rank, f in e.failures.items()  # the ranks torchrun saw fail first come first
        }
        print(FAILURES + json.dumps(failures), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))

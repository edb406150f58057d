"""Launch a training job of ``distributed.nproc`` ranks on this host with torch's elastic
launcher (torchrun), as its own process group, streaming its output line by line; with
``distributed.nnodes`` > 1, this host's part of a job that spans hosts (``multihost``).

The launcher runs in a child process in a new session, supervised
(``dlrmflow.supervise``): a signal that stops this process (Ctrl-C, SIGTERM from a
scheduler) stops the job first and ends in ``JobStopped``, every process of the job dies
with its parent even when that is killed outright, the run directory stays locked until
none is left, and a rank that makes no progress is named and the job stopped.

Rank 0 prints its result as one ``result`` JSON line; a rank that fails prints one ``error:
rank N: ...`` line. A rank that dies makes the others fail (their connections to it break,
or a collective times out after ``distributed.timeout_s``) and torchrun stops the rest. The
child runs torchrun through ``python -m dlrmflow.train.launch.agent``, which reports each failed
rank's exit code or signal as one ``failures`` JSON line in place of torchrun's report;
``TrainingFailed`` then names the rank that failed first and how: its own error, else the
signal that killed it or its exit code, never another rank's lost connection to it. A job of
several hosts that cannot start prints one ``startup-failed`` line instead
(``StartupFailed``), naming the host or address at fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dlrmflow.config import DistributedConfig, RunConfig
from dlrmflow.days import Window, window_text
from dlrmflow.errors import DlrmflowError
from dlrmflow.locks import held_lock_fds
from dlrmflow.supervise import (
    Job,
    JobStopped,
    interrupt_on_signals,
    stop_on_signals,
)
from dlrmflow.train.launch.agent import FAILURES, STARTUP_FAILED
from dlrmflow.train.launch.multihost import Hosts, StartupFailed
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.trainer import TrainResult, train

CONFIG_FILE = "config.json"

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


# torchrun's rendezvous of a job on this host alone: its agent binds port 0 itself, so no
# port is chosen first and taken by another process before the agent binds it (which
# failed a job in one line, EADDRINUSE, while other jobs started beside it).
ONE_HOST = ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]


def free_port() -> int:
    """A port nothing listens on now (not reserved: another process may take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(
    config_path: Path | None,
    nproc: int,
    where: Hosts | None,
    *args: str,
    module: str = "dlrmflow.train",
) -> list[str]:
    """The torchrun command line of a job (what ``dlrmflow train --nproc`` runs, torchrun
    run by ``dlrmflow.train.launch.agent``): on this host alone (``where`` None), or this
    host's part of ``where``'s hosts. ``args`` go to ``python -m module`` (the rank entry
    point, or score's workers) after the config, which is a resolved one (environment
    variables already applied)."""
    config = ["--config", str(config_path), "--resolved"] if config_path is not None else []
    join = ONE_HOST if where is None else where.torchrun_args()
    return [
        sys.executable,
        "-m",
        "dlrmflow.train.launch.agent",
        f"--nproc_per_node={nproc}",
        *join,
        "-m",
        module,
        *config,
        *args,
    ]


def run_job(
    command: list[str],
    hosts: Hosts | None,
    what: str,
    on_line: Callable[[str], None] | None,
    on_record: Callable[[dict], None] | None = None,
    timeout_s: float = 300.0,
) -> dict | None:
    """Run a torchrun job in a session of its own and return rank 0's ``result`` line (None
    on a host other than node 0 of ``hosts``, where rank 0 does not run).

    The ranks' error lines and the launcher's ``failures`` and ``startup-failed`` lines make
    up ``TrainingFailed`` (``StartupFailed``) rather than going to ``on_line`` (they do too
    with ``DLRMFLOW_DEBUG``). The job is supervised (``dlrmflow.supervise``): SIGTERM,
    SIGINT or SIGHUP to this process stop it and raise ``JobStopped``; a rank that makes no
    progress for ``timeout_s`` (``distributed.timeout_s``) stops it and is named; either
    way this returns only once no process of the job is left.
    """
    env = dict(os.environ)
    if hosts is None:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the job never leaves this host
    else:
        env.update(hosts.env(env))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    debug = bool(os.environ.get("DLRMFLOW_DEBUG"))
    tail: deque[str] = deque(maxlen=30)
    errors: list[tuple[int, str]] = []  # (rank, "Type: message"), in the order they came
    failures: dict[int, dict] = {}
    startup: str | None = None
    result: dict | None = None
    with (
        tempfile.TemporaryDirectory(prefix="dlrmflow-job-") as heartbeats,
        contextlib.ExitStack() as stack,
    ):
        job = Job(
            command,
            env,
            heartbeats=Path(heartbeats),
            timeout_s=timeout_s,
            pass_fds=held_lock_fds(),
        )
        stack.callback(job.reap)  # whatever happens here, no process of the job is left
        with stop_on_signals(job.stop):
            for line in job.lines():
                if job.stopping and not debug:
                    continue  # what a job says while it is being stopped is noise
                error = _RANK_ERROR.fullmatch(line)
                if error is not None or line.startswith((FAILURES, STARTUP_FAILED)):
                    if error is not None:
                        errors.append((int(error[1]), error[2]))
                        if _peer_lost(error[2]):
                            job.blame(int(error[1]))
                    elif line.startswith(STARTUP_FAILED):
                        startup = line.removeprefix(STARTUP_FAILED)
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
            code = job.wait()
    if job.signum is not None:
        raise JobStopped(what, job.signum)
    if startup is not None:
        raise StartupFailed(f"{what} could not start: {startup}")
    rank0_here = hosts is None or hosts.node_rank == 0
    if code != 0 or (result is None and rank0_here) or job.verdict is not None:
        cause = first_failure(errors, failures)
        if job.verdict is not None and all(_peer_lost(message) for _, message in errors):
            cause = job.verdict  # the others' errors are about the rank that was stuck
        if cause is None and code < 0:
            cause = f"the launcher agent was killed by {signal.Signals(-code).name}"
        if cause is None:
            lines = [line for line in tail if not line.startswith("metrics ")]
            cause = f"exit {code}" + "".join(f"\n{line}" for line in lines)
        raise TrainingFailed(f"{what} failed: {cause}")
    return result


def _job_name(what: str, nproc: int, hosts: Hosts | None) -> str:
    """How the job's error messages begin: "training with 2 ranks", or "training on node 1
    of 2 hosts x 2 ranks"."""
    if hosts is None:
        return f"{what} with {nproc} ranks"
    return f"{what} on node {hosts.node_rank} of {hosts.nnodes} hosts x {nproc} ranks"


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
) -> TrainResult | None:
    """Train with ``config.distributed.nproc`` ranks (in this process when it is 1 and the
    job has one host), or this host's ranks of a job of ``distributed.nnodes`` hosts.

    ``on_line`` gets every output line of every rank but their errors (which make up
    ``TrainingFailed``); ``on_record`` each metrics record rank 0 prints. The result is
    rank 0's, so None on a host other than node 0. The resolved configuration is written
    to ``RUN_DIR/config.json`` first (by node 0; another host writes its own to a
    temporary file: the run directory is shared), so the job runs exactly what was
    validated here.
    """
    nproc = config.distributed.nproc
    hosts = Hosts.from_config(config.distributed)
    if nproc == 1 and hosts is None:
        with interrupt_on_signals("training"):
            return train(config, progress=on_record)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    what = _job_name("training", nproc, hosts)
    with tempfile.TemporaryDirectory(prefix="dlrmflow-") as scratch:
        node0 = hosts is None or hosts.node_rank == 0
        config_path = (run_dir if node0 else Path(scratch)) / CONFIG_FILE
        config_path.write_text(json.dumps(config.model_dump(), indent=1))
        command = launch_command(config_path, nproc, hosts)
        result = run_job(command, hosts, what, on_line, on_record, config.distributed.timeout_s)
    return None if result is None else TrainResult(**result)


def launch_evaluation(
    run_dir: str | Path,
    nproc: int,
    *,
    data_url: str | None = None,
    checkpoint: str | None = None,
    max_rows: int | None = None,
    on_line: Callable[[str], None] | None = None,
    distributed: DistributedConfig | None = None,
    device: str = "auto",
    kernels: str = "auto",
    batch_size: int | None = None,
    eval_days: Window = None,
    recalibrate: float | None = None,
    recalibrate_rows: str = "spread",
) -> dict | None:
    """Score a run's checkpoint on ``nproc`` ranks (loaded resharded to that world size);
    in this process when ``nproc`` is 1; on ``device`` with ``kernels``, each rank in
    batches of ``batch_size`` (the run's ``eval.batch_size`` when None), on the days of
    window ``eval_days`` (the run's ``data.eval_days`` when None; see ``evaluate``), fitting
    a recalibration on the ``recalibrate`` share of the day's rows where given (which rows:
    ``recalibrate_rows``, ``train.run.recalibration.FIT_ROWS``).
    With ``distributed`` (its ``nnodes``, ``node_rank``, ``rdzv_endpoint``, ``local_addr``,
    ``connect_timeout_s``), this host's ranks of a job that spans hosts: the metrics come
    back on node 0, None elsewhere."""
    joined = Hosts.from_config(distributed) if distributed is not None else None
    if nproc == 1 and joined is None:
        with interrupt_on_signals("evaluation"):
            return evaluate(
                run_dir,
                data_url=data_url,
                checkpoint=checkpoint,
                max_rows=max_rows,
                device=device,
                kernels=kernels,
                batch_size=batch_size,
                eval_days=eval_days,
                recalibrate=recalibrate,
                recalibrate_rows=recalibrate_rows,
            )
    args = ["--evaluate", str(run_dir)]
    for flag, value in (
        ("--data", data_url),
        ("--checkpoint", checkpoint),
        ("--max-rows", max_rows),
        ("--batch-size", batch_size),
        ("--eval-days", window_text(eval_days) if eval_days is not None else None),
        ("--device", device),
        ("--kernels", kernels),
        ("--recalibrate", recalibrate),
        ("--recalibrate-rows", recalibrate_rows if recalibrate is not None else None),
    ):
        if value is not None:
            args += [flag, str(value)]
    command = launch_command(None, nproc, joined, *args)
    what = _job_name("evaluation", nproc, joined)
    timeout_s = (distributed or DistributedConfig()).timeout_s
    return run_job(command, joined, what, on_line, timeout_s=timeout_s)

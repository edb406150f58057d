"""A training job as a Slurm batch script: ``sbatch`` places the hosts, the script starts
``dlrmflow train`` once on each, with the node rank and node 0's address taken from Slurm.

The script asks for ``nodes`` nodes of one task each; its ``srun`` step runs, on every
node, the launcher of a job started by hand (``--nproc`` ranks, ``--nnodes``, the node's
``SLURM_NODEID`` as ``--node-rank``, and ``--rdzv-endpoint`` on the job's first node), so
a Slurm job keeps dlrmflow's supervision: the watchdog, the one-line failures, node 0
holding the run directory's lock. ``scancel`` sends SIGTERM to every node's launcher,
which stops its ranks and ends in one line (``JobStopped``); ``--kill-on-bad-exit`` stops
every node when one fails. Submitted again, the job continues from the run directory's
newest checkpoint (``train.resume: auto``), as any run does.

Node 0's address is the one Slurm reaches it by (its ``NodeAddr``, which is its name on
most clusters), and the rendezvous port is derived from the job id unless given, so that
two jobs sharing a node do not collide. The configuration file, the data and the run
directory must be on storage every node reads (a shared file system or an object store).
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dlrmflow.errors import DlrmflowError

__all__ = ["SlurmJob", "SubmitFailed", "sbatch_script", "submit"]


class SubmitFailed(DlrmflowError):
    """``sbatch`` refused the script or could not be run; the message says why."""


@dataclass(frozen=True)
class SlurmJob:
    """What the batch script runs: ``dlrmflow train --config config`` with ``overrides``
    (``--set``) on ``nodes`` nodes of ``nproc`` ranks each, its output in ``output``
    (``%j``: the job id), and any further ``#SBATCH`` options (``sbatch_options``, e.g.
    ``--partition=gpu``, ``--time=04:00:00``, ``--gpus-per-node=8``)."""

    config: Path
    nodes: int
    nproc: int
    output: Path
    overrides: tuple[str, ...] = ()
    port: int | None = None
    job_name: str = "dlrmflow-train"
    sbatch_options: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc < 1:
            raise ValueError(f"nodes and nproc must be at least 1, got {self.nodes}, {self.nproc}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for option in self.sbatch_options:
            if not option.startswith("--") or "\n" in option:
                raise ValueError(f"sbatch option {option!r}: give it as --name=value")


def sbatch_script(job: SlurmJob) -> str:
    """The batch script of ``job`` (see the module docstring)."""
    command = ["dlrmflow", "train", "--config", str(job.config)]
    for override in job.overrides:
        command += ["--set", override]
    command += ["--nproc", str(job.nproc)]
    port = "$((20000 + SLURM_JOB_ID % 20000))" if job.port is None else str(job.port)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={job.output}",
        *(f"#SBATCH {option}" for option in job.sbatch_options),
        "# Written by `dlrmflow launch slurm`: one `dlrmflow train` a node, each starting",
        "# its ranks; node 0 (the job's first node) serves the rendezvous.",
        "set -euo pipefail",
        "cmd=(" + " ".join(shlex.quote(part) for part in command) + ")",
    ]
    if job.nodes > 1:
        lines += [
            # Every reader takes its whole input: an early exit would be a SIGPIPE to
            # the writer, which pipefail makes the script's failure.
            'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
            "addr=$(scontrol show node \"$first\" | tr ' ' '\\n' "
            "| sed -n 's/^NodeAddr=//p' | sed -n 1p)",
            f"port={port}",
            f'cmd+=(--nnodes {job.nodes} --rdzv-endpoint "${{addr:-$first}}:$port")',
            "# Each node's task adds its own node rank.",
            "exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 "
            'bash -c \'exec "$@" --node-rank "$SLURM_NODEID"\' bash "${cmd[@]}"',
        ]
    else:
        lines += ['exec srun --ntasks-per-node=1 "${cmd[@]}"']
    return "\n".join(lines) + "\n"


def submit(script: Path, env: dict[str, str] | None = None, sbatch: Sequence[str] = ()) -> int:
    """Submit ``script`` with ``sbatch`` (``sbatch``: options before it); the job's id.
    A refusal is ``SubmitFailed`` with sbatch's own words."""
    try:
        done = subprocess.run(
            ["sbatch", "--parsable", *sbatch, str(script)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    except FileNotFoundError as e:
        raise SubmitFailed("sbatch: not found; is Slurm's client installed here?") from e
    if done.returncode != 0:
        why = " ".join(done.stderr.split()) or f"exit {done.returncode}"
        raise SubmitFailed(f"sbatch {script}: {why}")
    return int(done.stdout.strip().split(";")[0])

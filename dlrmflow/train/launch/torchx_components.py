"""TorchX components: a dlrmflow job on whatever scheduler TorchX speaks to (``local_cwd``,
``slurm``, ``kubernetes``, ``aws_batch``...), with the hosts, node ranks and rendezvous
taken from it.

``torchx run -s SCHEDULER $(dlrmflow launch torchx):train -j 2x4 --config cfg.yaml``
runs ``dlrmflow train`` once per host (TorchX's replica), each starting its 4 ranks: the
same supervised launcher as a job started by hand (a stuck rank found by the watchdog, a
failure in one line, the run directory locked by node 0), given its ``--node-rank`` from
the replica's id and node 0's ``--rdzv-endpoint`` from the address the scheduler gives
every replica (TorchX's ``rank0_env``). TorchX's own ``dist.ddp`` runs torchrun on each
host instead, which would leave the ranks without that supervision.

TorchX reads a component's signature from its source: hence ``Optional``, ``Dict`` and
``List`` here rather than the newer spellings. The file imports nothing of dlrmflow:
TorchX loads a component file by its path, in the process of ``torchx run``, and the
job's hosts need only ``dlrmflow`` on their ``PATH`` (the image, or the environment
``local_cwd`` runs in). The run directory and the data must be reachable from every host
(a shared file system or an object store), as for any job of several hosts.
"""

import re
import shlex
from typing import Dict, List, Optional

from torchx import specs

__all__ = ["evaluate", "train"]

# Node 0's rendezvous port, unless ``rdzv_port`` says another.
RDZV_PORT = 29500


def _host_command(command: list[str], j: str, rdzv_port: int) -> tuple[int, str]:
    """(hosts, the shell command each runs): ``command`` with the host flags of ``j``
    (``HOSTSxRANKS``), the node rank and node 0's address left to the scheduler."""
    shape = re.fullmatch(r"(?:([1-9][0-9]*)x)?([1-9][0-9]*)", j)
    if shape is None:
        raise ValueError(f"-j {j!r}: give HOSTSxRANKS (2x4) or RANKS (4, on one host)")
    hosts, ranks = int(shape.group(1) or 1), int(shape.group(2))
    line = [*command, "--nproc", str(ranks)]
    text = " ".join(shlex.quote(part) for part in line)
    if hosts > 1:
        # TorchX fills in the replica id and the name of the variable holding node 0's
        # address ("$$": a literal "$" to it), which the host's shell then expands
        # (localhost where the scheduler exports none).
        endpoint = f'"$${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port}"'
        text += (
            f" --nnodes {hosts} --node-rank {specs.macros.replica_id} --rdzv-endpoint {endpoint}"
        )
    return hosts, text


def _app(
    name: str,
    command: list[str],
    *,
    j: str,
    image: str,
    rdzv_port: int,
    cpu: int,
    gpu: int,
    memMB: int,
    h: Optional[str],
    env: Optional[Dict[str, str]],
    mounts: Optional[List[str]],
) -> specs.AppDef:
    hosts, text = _host_command(command, j, rdzv_port)
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name=name,
                image=image,
                entrypoint="bash",
                args=["-c", text],
                num_replicas=hosts,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
                env=dict(env or {}),
                port_map={"rendezvous": rdzv_port},
                # A retried host would join a rendezvous its peers have left; the job is
                # resumed by running it again (its run directory continues).
                max_retries=0,
                mounts=specs.parse_mounts(mounts) if mounts else [],
            )
        ],
    )


def train(
    *overrides: str,
    config: str,
    j: str = "1x2",
    image: str = "dlrmflow",
    rdzv_port: int = RDZV_PORT,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 8192,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
) -> specs.AppDef:
    """Train a DLRM: ``dlrmflow train --config`` on every host, each with its ranks.

    Args:
        overrides: config overrides KEY=VALUE (``--set``), e.g. train.lr=0.1
        config: the run configuration file (YAML, JSON or TOML), readable on every host
        j: HOSTSxRANKS, e.g. 2x4: two hosts of four ranks each
        image: the image (container schedulers) or directory (local ones) to run in
        rdzv_port: node 0's rendezvous port
        cpu: CPUs of each host
        gpu: GPUs of each host
        memMB: memory of each host in MB
        h: a named resource of the scheduler instead of cpu, gpu and memMB
        env: environment variables for every host
        mounts: mounts on every host (type=bind,src=/shared,dst=/shared)
    """
    command = ["dlrmflow", "train", "--config", config]
    for override in overrides:
        command += ["--set", override]
    return _app(
        "dlrmflow-train", command, j=j, image=image, rdzv_port=rdzv_port, cpu=cpu,
        gpu=gpu, memMB=memMB, h=h, env=env, mounts=mounts,
    )  # fmt: skip


# TorchX builds each component's command line from that function's own signature and
# docstring, so the two components repeat their arguments rather than share them.
def evaluate(
    *overrides: str,
    run_dir: str,
    j: str = "1x2",
    image: str = "dlrmflow",
    rdzv_port: int = RDZV_PORT,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 8192,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
) -> specs.AppDef:
    """Evaluate a run's checkpoint on its test day: ``dlrmflow evaluate`` on every host.

    Args:
        overrides: config overrides KEY=VALUE (``--set``)
        run_dir: the run directory, readable on every host
        j: HOSTSxRANKS, e.g. 2x4: two hosts of four ranks each
        image: the image (container schedulers) or directory (local ones) to run in
        rdzv_port: node 0's rendezvous port
        cpu: CPUs of each host
        gpu: GPUs of each host
        memMB: memory of each host in MB
        h: a named resource of the scheduler instead of cpu, gpu and memMB
        env: environment variables for every host
        mounts: mounts on every host (type=bind,src=/shared,dst=/shared)
    """
    command = ["dlrmflow", "evaluate", "--run-dir", run_dir]
    for override in overrides:
        command += ["--set", override]
    return _app(
        "dlrmflow-evaluate", command, j=j, image=image, rdzv_port=rdzv_port, cpu=cpu,
        gpu=gpu, memMB=memMB, h=h, env=env, mounts=mounts,
    )  # fmt: skip

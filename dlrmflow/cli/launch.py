"""``launch``: a job started by the cluster scheduler a team already runs (TorchX, Slurm,
Kubernetes)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.cli.options import SetOpt, echo_json, resolve

launch_app = typer.Typer(
    help="Start jobs through a cluster's scheduler: the hosts, node ranks and rendezvous "
    "come from it."
)


@launch_app.command("torchx")
def torchx() -> None:
    """Print the path of dlrmflow's TorchX components file (train, evaluate).

    Run a job of 2 hosts of 4 ranks on any TorchX scheduler:
    torchx run -s SCHEDULER $(dlrmflow launch torchx):train -j 2x4 --config cfg.yaml
    """
    import importlib.util

    # Found, not imported: TorchX itself loads the file, and may be installed only where
    # `torchx run` is.
    spec = importlib.util.find_spec("dlrmflow.train.launch.torchx_components")
    assert spec is not None and spec.origin is not None
    typer.echo(spec.origin)


@launch_app.command("slurm")
def slurm(
    config: Annotated[
        Path,
        typer.Option("--config", "-c", help="The run configuration, on storage every node reads."),
    ],
    nodes: Annotated[int, typer.Option(help="Nodes (hosts) in the job.")] = 1,
    nproc: Annotated[int, typer.Option(help="Ranks on each node.")] = 1,
    script: Annotated[
        Path | None,
        typer.Option(help="Where to write the batch script (default: RUN_DIR/slurm/train.sbatch)."),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(help="Node 0's rendezvous port (default: one derived from the job id)."),
    ] = None,
    sbatch: Annotated[
        list[str] | None,
        typer.Option(help="A further #SBATCH option, e.g. --sbatch=--partition=gpu (repeatable)."),
    ] = None,
    submit: Annotated[bool, typer.Option(help="Submit it with sbatch too.")] = False,
    set_: SetOpt = None,
) -> None:
    """Write (and with --submit, submit) a Slurm batch script that trains on --nodes nodes.

    Each node runs `dlrmflow train` with --nproc ranks, its node rank and node 0's address
    from Slurm; `scancel` stops it in one line, and submitting it again resumes the run.
    Its output goes beside the script, SLURM_JOB_ID.out.
    """
    from dlrmflow.train.launch.slurm import SlurmJob, sbatch_script
    from dlrmflow.train.launch.slurm import submit as submit_script

    cfg = resolve(config, set_)  # refuses a bad file or override here, not on the cluster
    path = script if script is not None else Path(cfg.run_dir) / "slurm" / "train.sbatch"
    path = path.absolute()
    job = SlurmJob(
        config.absolute(),
        nodes,
        nproc,
        path.parent / "%j.out",
        overrides=tuple(set_ or ()),
        port=port,
        sbatch_options=tuple(sbatch or ()),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, sbatch_script(job))
    result: dict[str, object] = {"script": str(path), "nodes": nodes, "nproc": nproc}
    if submit:
        result["job_id"] = submit_script(path)
    echo_json(result)


@launch_app.command("kubernetes")
def kubernetes(
    config: Annotated[
        str,
        typer.Option("--config", "-c", help="The run configuration's path inside every pod."),
    ],
    image: Annotated[str, typer.Option(help="The container image holding dlrmflow.")],
    nodes: Annotated[int, typer.Option(help="Pods (hosts) in the job.")] = 1,
    nproc: Annotated[int, typer.Option(help="Ranks in each pod.")] = 1,
    name: Annotated[str, typer.Option(help="The TrainJob's name.")] = "dlrmflow-train",
    runtime: Annotated[
        str, typer.Option(help="The Kubeflow Trainer runtime that places the pods.")
    ] = "torch-distributed",
    volume: Annotated[
        str | None,
        typer.Option(help="CLAIM:/mount/path: a PersistentVolumeClaim mounted in every pod."),
    ] = None,
    resource: Annotated[
        list[str] | None,
        typer.Option(help="NAME=AMOUNT each pod requests, e.g. cpu=8, memory=32Gi (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Write the manifest here (default: standard output).")
    ] = None,
    set_: SetOpt = None,
) -> None:
    """Print (or write) a Kubeflow Trainer TrainJob manifest that trains on --nodes pods.

    Each pod runs `dlrmflow train` with --nproc ranks, its node rank and node 0's address
    from the runtime; apply it with `kubectl apply -f`. Not run on a cluster here: it is
    checked against the TrainJob schema only.
    """
    import yaml

    from dlrmflow.config import ConfigError
    from dlrmflow.train.launch.kubernetes import TrainJob, train_job_manifest

    amounts = []
    for item in resource or ():
        key, sep, amount = item.partition("=")
        if not sep or not key or not amount:
            raise ConfigError(f"--resource {item!r}: give NAME=AMOUNT, e.g. cpu=8")
        amounts.append((key, amount))
    # A setting TrainJob refuses is a ValueError: one line, exit 1, as every command's.
    job = TrainJob(
        name, config, nodes, nproc, image, runtime, tuple(set_ or ()), volume, tuple(amounts)
    )
    text = yaml.safe_dump(train_job_manifest(job), sort_keys=False)
    if out is None:
        typer.echo(text, nl=False)
    else:
        write_atomic(out, text)
        echo_json({"manifest": str(out), "nodes": nodes, "nproc": nproc})

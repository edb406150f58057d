"""``launch``: a job started by the cluster scheduler a team already runs (TorchX)."""

from __future__ import annotations

import typer

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

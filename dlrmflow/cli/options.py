"""What the commands share: option types, the configuration they resolve, a progress bar
and JSON output.

Kept apart from the commands so that each command module reads as its commands alone, and
every command spells a shared option (``--config``, ``--set``, the multi-host flags) the
same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from dlrmflow.config import RunConfig

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML, JSON or TOML run configuration.")
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the JSON result here.")]
QuickOpt = Annotated[
    bool, typer.Option(help="Tiny tables and batch: checks the benchmark runs, in seconds.")
]
# The schedule of `serve` and `deploy`.
CronOpt = Annotated[str | None, typer.Option(help='Schedule the flow with cron, e.g. "0 3 * * *".')]
IntervalOpt = Annotated[
    float | None, typer.Option(help="Schedule the flow every this many seconds.")
]
ScheduledFlowOpt = Annotated[
    str,
    typer.Option(
        help="The flow the schedule runs: ingest, train, evaluate, end_to_end or recurring "
        "(a model line's day, see --line)."
    ),
]
LineOpt = Annotated[
    str,
    typer.Option(
        "--line", help="The recurring flow's model line directory (relative: in the run's cwd)."
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config key, e.g. --set train.lr=0.1."),
]
# Joining a job of several hosts (`train` and `evaluate`): distributed.nnodes and the rest.
NnodesOpt = Annotated[
    int | None,
    typer.Option(help="Hosts in the job (>1: the same command on each, with its --node-rank)."),
]
NodeRankOpt = Annotated[
    int | None,
    typer.Option(help="This host's place, 0..nnodes-1; node 0 serves the rendezvous, rank 0."),
]
RdzvEndpointOpt = Annotated[
    str | None,
    typer.Option(help="HOST:PORT of node 0's rendezvous, reachable from every host."),
]
LocalAddrOpt = Annotated[
    str | None,
    typer.Option(
        help="The address this host advertises (default: its address on the route to "
        "--rdzv-endpoint)."
    ),
]
ConnectTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--connect-timeout",
        help="Seconds each start-up wait (the endpoint, the hosts, their addresses) may take.",
    ),
]


def host_flags(
    nnodes: int | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    local_addr: str | None,
    connect_timeout: float | None,
) -> dict[str, Any]:
    """The multi-host flags as ``distributed.*`` overrides (None: not given)."""
    return {
        "distributed.nnodes": nnodes,
        "distributed.node_rank": node_rank,
        "distributed.rdzv_endpoint": rdzv_endpoint,
        "distributed.local_addr": local_addr,
        "distributed.connect_timeout_s": connect_timeout,
    }


def host_result(node_rank: int, joined: dict[str, Any] | None) -> dict[str, Any]:
    """What a command prints: rank 0's result on node 0; elsewhere, that this host's ranks
    finished (rank 0 prints the result on node 0)."""
    return joined if joined is not None else {"node_rank": node_rank, "finished": True}


def resolve(path: Path | None, sets: list[str] | None, **flags: Any) -> RunConfig:
    """Defaults, then ``path``, then DLRMFLOW_SECTION__KEY variables, then ``sets``, then
    the command's flags (``{"section.key": value}``, None when not given)."""
    from dlrmflow.config import resolve_config

    return resolve_config(path, sets, flags).config


class Progress:
    """A tqdm bar that stays silent when stderr is not a terminal (CI, Prefect workers)."""

    def __init__(self, total: int | None, desc: str, unit: str = "rows") -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=None)

    def __call__(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def echo_json(data: dict[str, Any]) -> None:
    """Print a command's result as indented JSON, the one thing it writes to stdout."""
    typer.echo(json.dumps(data, indent=2))


def emit_benchmark(result: dict[str, Any], json_out: Path | None) -> None:
    """Print a benchmark's record, and also write it to ``json_out`` when given."""
    echo_json(result)
    if json_out is not None:
        from dlrmflow.atomic_writes import write_atomic

        write_atomic(json_out, json.dumps(result, indent=2) + "\n")

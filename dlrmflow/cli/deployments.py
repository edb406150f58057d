"""The flows as Prefect deployments: ``serve`` runs them from this process, ``deploy``
registers them to a work pool for ``prefect worker start`` processes."""

from __future__ import annotations

from typing import Annotated

import typer

from dlrmflow.cli.options import (
    ConfigOpt,
    CronOpt,
    IntervalOpt,
    LineOpt,
    ScheduledFlowOpt,
    SetOpt,
    echo_json,
    resolve,
)
from dlrmflow.config import ConfigError


def serve(
    cron: CronOpt = None,
    interval: IntervalOpt = None,
    flow: ScheduledFlowOpt = "end_to_end",
    limit: Annotated[int, typer.Option(help="Flow runs executing at once.")] = 1,
    line: LineOpt = "line",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Serve the flows as Prefect deployments (on PREFECT_API_URL's server, or locally)."""
    from dlrmflow.flows.deployments import serve_flows

    if cron is not None and interval is not None:
        raise ConfigError("give --cron or --interval, not both")
    serve_flows(
        resolve(config, set_), cron=cron, interval=interval, scheduled=flow, limit=limit, line=line
    )


def deploy(
    pool: Annotated[
        str, typer.Option(help="The process work pool (created when missing) workers serve.")
    ],
    cron: CronOpt = None,
    interval: IntervalOpt = None,
    flow: ScheduledFlowOpt = "end_to_end",
    working_dir: Annotated[
        str | None,
        typer.Option(help="Where workers start runs (relative paths resolve there); default: cwd."),
    ] = None,
    line: LineOpt = "line",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Deploy the flows to a work pool on PREFECT_API_URL's server, for `prefect worker start`.

    Runs import dlrmflow from each worker's environment: install it on every worker host.
    """
    from dlrmflow.flows.deploy import deploy_flows

    if cron is not None and interval is not None:
        raise ConfigError("give --cron or --interval, not both")
    result = deploy_flows(
        pool,
        resolve(config, set_),
        cron=cron,
        interval=interval,
        scheduled=flow,
        working_dir=working_dir,
        line=line,
    )
    echo_json(result)

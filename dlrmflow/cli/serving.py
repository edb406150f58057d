"""Commands that keep running for others: ``serve`` and ``deploy`` (the flows as Prefect
deployments) and ``readers serve`` (preprocessed batches for remote trainers)."""

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

readers_app = typer.Typer(help="Reader services that preprocess batches for remote trainers.")


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
    from dlrmflow.flows.serve import serve_flows

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


@readers_app.command("serve")
def readers_serve(
    listen: Annotated[
        str,
        typer.Option(
            help="HOST:PORT to serve on (port 0: any free port). Another host's reach "
            "(0.0.0.0, a public address) needs distributed.reader_security's TLS and a secret."
        ),
    ] = "127.0.0.1:8815",
    data: Annotated[str | None, typer.Option(help="Dataset URL (default: data.url).")] = None,
    workers: Annotated[int, typer.Option(help="Row groups preprocessed at once.")] = 2,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Serve an address other hosts reach without TLS or a secret: anyone "
            "reaching the port can read the data.",
        ),
    ] = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Serve preprocessed batches over Arrow Flight until SIGINT/SIGTERM.

    Use the trainers' configuration (the same features and batch size); trainers connect
    with `dlrmflow train --readers HOST:PORT,...`. distributed.reader_security sets TLS
    (cert_file, key_file; trainers check it with ca_file) and the file of the secret every
    call must carry (secret_file, or the environment's DLRMFLOW_READER_SECRET): never the
    secret on a command line, where ps shows it.
    """
    import logging

    from dlrmflow.train.launch.reader_servers import serve_readers

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = resolve(config, set_, **{"data.url": data})
    serve_readers(cfg, listen, workers, insecure=insecure)

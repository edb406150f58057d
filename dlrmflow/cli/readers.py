"""``readers serve``: reader services that preprocess batches for remote trainers."""

from __future__ import annotations

from typing import Annotated

import typer

from dlrmflow.cli.options import ConfigOpt, SetOpt, resolve

readers_app = typer.Typer(help="Reader services that preprocess batches for remote trainers.")


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

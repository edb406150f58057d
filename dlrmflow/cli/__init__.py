"""The ``dlrmflow`` command: one sub-command per stage, plus the demo and benchmarks.

Grouped by what a user does: ``data`` (generate, convert, schema, register, stats),
``run`` (config, train, plan, evaluate, export, demo), ``score`` (a model's predictions
as Parquet), ``line`` (line, backfill: a model line on the days its dataset gained),
``deployments`` (serve, deploy), ``readers`` (readers serve), ``launch`` (a job through
a cluster's scheduler) and ``bench`` (the one module that imports the benchmarks);
``options`` holds what they share. Commands only parse and print: the work is the
library's. ``app`` below lists every command, in the order ``dlrmflow --help`` shows
them, and ``main`` turns expected failures into one line.

Every command that trains or reads data resolves the same ``RunConfig``: defaults, then
``--config FILE``, then ``--set section.key=value`` overrides, then the command's own flags.
Heavy imports (torch, pyarrow, prefect) happen inside the commands so ``--help`` is quick.
"""

from __future__ import annotations

import os
import sys

import typer

from dlrmflow.cli import bench, data, deployments, launch, line, readers, run, score
from dlrmflow.config import env_overrides
from dlrmflow.runtime.glibc_malloc import tune_allocator

__all__ = ["app", "main"]

app = typer.Typer(
    help="Train DLRM recommendation models end to end: Parquet -> features -> DLRM -> eval.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(bench.app, name="bench")
app.add_typer(readers.readers_app, name="readers")
app.add_typer(launch.launch_app, name="launch")
for _name, _command in (
    ("config", run.config),
    ("generate", data.generate),
    ("convert", data.convert),
    ("schema", data.schema),
    ("register", data.register),
    ("train", run.train),
    ("line", line.line),
    ("backfill", line.backfill),
    ("plan", run.plan),
    ("evaluate", run.evaluate),
    ("export", run.export),
    ("score", score.score),
    ("demo", run.demo),
    ("serve", deployments.serve),
    ("deploy", deployments.deploy),
    ("stats", data.stats),
):
    app.command(_name)(_command)


def _one_line(error: BaseException) -> str:
    """The message of an expected failure as one line (nested causes joined by ': ')."""
    text = str(error) or type(error).__name__
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        text = f"{error.filename}: {error.strerror}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def main() -> None:
    """Entry point: turns expected failures (bad config, bad data, a busy or full disk, a
    failed rank) into one line and exit 1 (130 or 143 for a job stopped by SIGINT or
    SIGTERM); ``DLRMFLOW_DEBUG=1`` shows the traceback."""
    import warnings

    from dlrmflow.errors import DlrmflowError

    # A warning is one line too (the run record keeps it where it matters).
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    from dlrmflow.guard import guard_descendants, signals_end_the_command

    command = " ".join(["dlrmflow", *[a for a in sys.argv[1:3] if not a.startswith("-")]][:2])
    try:
        env_overrides()  # a DLRMFLOW_ variable naming no key fails every command, not some
        tune_allocator()
        guard_descendants()  # what it starts (Prefect's server, Dask) dies with it
        with signals_end_the_command(command):  # one line, and 130 or 143, in bounded time
            app()
    except (DlrmflowError, ValueError, OSError) as e:
        # The message names the key, file, row group, column, step or rank; a traceback
        # would only bury it.
        if os.environ.get("DLRMFLOW_DEBUG"):
            raise
        typer.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(e.exit_code if isinstance(e, DlrmflowError) else 1)
    except Exception as e:
        # Prefect's client fails with a chain of tracebacks when its API does not answer;
        # any command whose flows talk to one says so in a line.
        unreachable = _prefect_unreachable(e) or _object_store_failure(e)
        if unreachable is None or os.environ.get("DLRMFLOW_DEBUG"):
            raise
        typer.echo(f"error: {_one_line(unreachable)}", err=True)
        sys.exit(1)


def _object_store_failure(error: BaseException) -> Exception | None:
    """The one-line error when ``error`` is botocore's own (no endpoint answering, no
    credentials found): s3fs turns the store's refusals into ``OSError`` but lets these
    through, and they are the settings' fault, not the data's."""
    if "botocore" not in sys.modules:
        return None
    from botocore.exceptions import BotoCoreError, NoCredentialsError

    if isinstance(error, NoCredentialsError):
        return OSError(
            f"object store: {error} (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE)"
        )
    return OSError(f"object store: {error}") if isinstance(error, BotoCoreError) else None


def _prefect_unreachable(error: BaseException) -> Exception | None:
    """The one-line error when ``error`` is Prefect's API not answering (only a command
    that imported Prefect can have met it)."""
    if "prefect" not in sys.modules:
        return None
    from dlrmflow.flows.api import unreachable_api

    return unreachable_api(error)

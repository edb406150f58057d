"""``dlrmflow line`` and ``dlrmflow backfill``: train a model line on the days its dataset
has gained, directly or as the recurring flow's runs."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from dlrmflow.cli.options import ConfigOpt, SetOpt, echo_json, resolve
from dlrmflow.config import RunConfig

LineDirOpt = Annotated[str, typer.Option("--line", help="The line's directory.")]
DataOpt = Annotated[str | None, typer.Option(help="Dataset URL (when the line starts).")]


def line(
    line_dir: LineDirOpt,
    data: DataOpt = None,
    through: Annotated[
        int | None,
        typer.Option(
            help="Train through this day at most (default: the dataset's last); a day the "
            "dataset lacks yet waits for a later call, and one trained already is no error."
        ),
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Train a model line a day at a time: each day its dataset has gained (each raw
    file that landed in data.landing, each day partition new under a registered
    dataset, registered first), the newest version is scored on the day (next-day
    validation), continued on it, and kept as the next version under LINE/versions/; a
    version that passes the gate (gate.*) against the champion on the next day is
    published under LINE/models/. The first call starts the line with its configuration;
    later calls need none, and train nothing when no day is new."""
    from dlrmflow.train.line.line import train_line

    run = train_line(line_dir, _config(line_dir, data, config, set_), through=through)
    report = _report(line_dir, {"trained": [asdict(v) for v in run.made]})  # may fail: first
    if not run.made:
        typer.echo(f"{line_dir}: no new day to train on", err=True)
    echo_json(report)


def backfill(
    line_dir: LineDirOpt,
    through: Annotated[
        int | None,
        typer.Option(
            help="Train through this day at most (default: the dataset's last); a day the "
            "dataset lacks yet waits for a later call, and one trained already is no error."
        ),
    ] = None,
    data: DataOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run the recurring flow once per day the line has not trained on, through --through,
    as a daily schedule would have: each run lands what arrived, validates, gates and
    trains one day. Idempotent (trained days are skipped) and resumable (a killed run
    continues from its checkpoints)."""
    from dlrmflow.flows.recurring import backfill as run_backfill

    states = run_backfill(line_dir, _config(line_dir, data, config, set_), through=through)
    runs = [{"state": s.name, "message": s.message} for s in states]
    for state in states:
        if not state.is_completed():
            typer.echo(f"warning: {state.message}", err=True)
    echo_json(_report(line_dir, {"runs": runs}))


def _config(
    line_dir: str, data: str | None, config: Path | None, set_: list[str] | None
) -> RunConfig | None:
    """The configuration given on the command line, or None for a started line given
    none (it runs as recorded). On a started line, --set and --data apply to its own."""
    from dlrmflow.train.line.line import LINE_FILE

    recorded = Path(line_dir) / LINE_FILE
    started = recorded.is_file()
    if started and config is None and not set_ and data is None:
        return None
    base = config if config is not None or not started else recorded
    return resolve(base, set_, **{"data.url": data})


def _report(line_dir: str, extra: dict[str, Any]) -> dict[str, Any]:
    from dlrmflow.train.line.gate import champion
    from dlrmflow.train.line.line import history, verdicts, versions

    path = Path(line_dir)
    return {
        "line": line_dir,
        **extra,
        "versions": len(versions(path)),
        "history": history(path),
        "champion": champion(path),
        "verdicts": [asdict(v) for v in verdicts(path)],
    }

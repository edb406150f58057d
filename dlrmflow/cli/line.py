"""``dlrmflow line``: train a model line on the days its dataset has gained."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from dlrmflow.cli.options import ConfigOpt, SetOpt, echo_json, resolve


def line(
    line_dir: Annotated[str, typer.Option("--line", help="The line's directory.")],
    data: Annotated[str | None, typer.Option(help="Dataset URL (when the line starts).")] = None,
    through: Annotated[
        int | None, typer.Option(help="Train through this day at most (default: the last).")
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Train a model line a day at a time: each day its dataset has gained, the newest
    version is scored on the day (next-day validation), continued on it, and kept as the
    next version under LINE/versions/; a version that passes the gate (gate.*) against the
    champion on the next day is published under LINE/models/. The first call starts the
    line with its configuration; later calls need none, and train nothing when no day is
    new."""
    from dlrmflow.train.line.gate import champion
    from dlrmflow.train.line.line import LINE_FILE, history, train_line, verdicts, versions

    recorded = Path(line_dir) / LINE_FILE
    started = recorded.is_file()
    given = config is not None or bool(set_) or data is not None
    run_config = None
    if given or not started:
        # On a started line, --set and --data apply to its own configuration.
        base = config if config is not None or not started else recorded
        run_config = resolve(base, set_, **{"data.url": data})
    made = train_line(line_dir, run_config, through=through)
    if not made:
        typer.echo(f"{line_dir}: no new day to train on", err=True)
    echo_json(
        {
            "line": line_dir,
            "trained": [asdict(v) for v in made],
            "versions": len(versions(Path(line_dir))),
            "history": history(Path(line_dir)),
            "champion": champion(Path(line_dir)),
            "verdicts": [asdict(v) for v in verdicts(Path(line_dir))],
        }
    )

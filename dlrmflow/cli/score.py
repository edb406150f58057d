"""The ``score`` command: a trained model's predictions for days of a dataset, as Parquet.

It parses its flags and prints what ``dlrmflow.score.score.score_dataset`` returns; the
checks, the resumption and the processes are the library's, which the flow runs too.
"""

from __future__ import annotations

from typing import Annotated, get_args

import typer

from dlrmflow.cli.options import Progress, echo_json
from dlrmflow.config import DeviceType, KernelsType


def score(
    model: Annotated[
        str,
        typer.Option(
            help="A run directory (its newest intact checkpoint), a checkpoint directory, "
            "or a servable export (`dlrmflow export --format torch-export`)."
        ),
    ],
    data: Annotated[str, typer.Option(help="Dataset URL (a dlrmflow dataset's directory).")],
    out: Annotated[
        str,
        typer.Option(
            help="Directory of the predictions: day-D/part-S-of-N.parquet and _scores.json "
            "(a path or file:// URL)."
        ),
    ],
    days: Annotated[
        str | None,
        typer.Option(
            help="The days to score, as a window: 5, 0-22, last, last 3, ... (default: all).",
            show_default=False,
        ),
    ] = None,
    nproc: Annotated[
        int, typer.Option(help="Processes, each scoring its share of every day's row groups.")
    ] = 1,
    batch_size: Annotated[
        int | None,
        typer.Option(
            help="Rows per batch (default: the run's eval.batch_size).", show_default=False
        ),
    ] = None,
    max_rows: Annotated[
        int | None,
        typer.Option(help="Score at most this many rows of each day.", show_default=False),
    ] = None,
    device: Annotated[
        str,
        typer.Option(
            help=f"{', '.join(get_args(DeviceType)[:-1])} or {get_args(DeviceType)[-1]} "
            "(auto: CUDA when present), whatever trained it."
        ),
    ] = "auto",
    kernels: Annotated[
        str,
        typer.Option(
            help=f"{', '.join(get_args(KernelsType)[:-1])} or {get_args(KernelsType)[-1]}, "
            "as model.kernels."
        ),
    ] = "auto",
    overwrite: Annotated[
        bool,
        typer.Option(help="Replace the predictions of another model or dataset in --out."),
    ] = False,
    keys: Annotated[
        str | None,
        typer.Option(
            help="Columns of the data copied beside each prediction, comma-separated, with "
            "their own types ('' for none; default: the dataset schema's keys).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Write a model's predictions (day, row, label, prediction) for days of a dataset.

    Each row is keyed by its day and its index within the day (through the day's files in
    the manifest's order), and by the key columns the dataset's schema declares or
    --keys names. A rerun into the same --out finishes what a stopped run left;
    predictions of another model there are refused unless --overwrite.
    """
    from dlrmflow.score.score import score_dataset

    bar = Progress(None, "score")

    def plan(total: int) -> None:
        bar.bar.total = total
        bar.bar.refresh()

    try:
        result = score_dataset(
            model,
            data,
            out,
            days=days,
            nproc=nproc,
            batch_size=batch_size,
            max_rows=max_rows,
            device=device,
            kernels=kernels,
            overwrite=overwrite,
            keys=keys,
            progress=bar,
            on_line=lambda line: typer.echo(line, err=True),
            on_plan=plan,
        )
    finally:
        bar.close()
    echo_json(result)

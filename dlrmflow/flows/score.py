"""The ``score`` flow: a trained model's predictions for days of a dataset, as Parquet.

One task runs ``dlrmflow.score.score.score_dataset``, as ``dlrmflow score`` does, so the
flow writes exactly what the command writes. Scoring resumes by construction (complete
parts are kept, see ``dlrmflow.score.output``), so the task retries what may be
transient (a lost mount, a killed worker) and a retry only scores the parts still
missing; it never retries bad input. A progress artifact follows the rows, and the
summary is published as a table.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from dlrmflow.flows.artifacts import publish_metrics
from dlrmflow.flows.policies import retry_unless_bad_input
from dlrmflow.flows.progress import ProgressReporter
from dlrmflow.score.score import planned_total, score_dataset

PROGRESS_KEY = "dlrmflow-score-progress"
SCORES_KEY = "dlrmflow-scores"
# A hang guard, as for evaluation: scoring days takes hours at most; more is a stall.
SCORE_TIMEOUT_S = 24 * 3600


@task(
    name="score",
    retries=1,
    retry_delay_seconds=30,
    retry_condition_fn=retry_unless_bad_input,
    timeout_seconds=SCORE_TIMEOUT_S,
    # The output directory, not Prefect's cache, says what is done (a rerun resumes).
    cache_policy=NO_CACHE,
)
def score_task(
    model: str,
    data: str,
    out: str,
    days: str | list[int] | None,
    nproc: int,
    batch_size: int | None,
    max_rows: int | None,
    overwrite: bool,
    reporter: ProgressReporter,
    keys: str | list[str] | None = None,
) -> dict[str, Any]:
    """``score_dataset`` with these arguments, its progress to ``reporter`` (which the
    flow owns, so that a retry moves the same artifact) and workers' lines to the log."""
    logger = get_run_logger()
    done = [0]

    def progress(rows: int) -> None:
        done[0] += rows
        reporter.update(done[0])

    result = score_dataset(
        model,
        data,
        out,
        days=days,
        nproc=nproc,
        batch_size=batch_size,
        max_rows=max_rows,
        overwrite=overwrite,
        keys=keys,
        progress=progress,
        on_line=logger.info,
    )
    reporter.finish()
    logger.info(
        "%d rows of days %s in %s: %d scored now, %d parts kept from an earlier run",
        result["rows"],
        result["days"],
        result["out"],
        result["rows_scored"],
        result["parts_kept"],
    )
    return result


def summary_table(result: dict[str, Any]) -> dict[str, Any]:
    """The result as flat metrics (the table artifact's rows)."""
    model = result["model"]
    flat = {k: v for k, v in result.items() if k != "model"}
    flat["days"] = ", ".join(str(d) for d in result["days"])
    if "keys" in flat:
        flat["keys"] = ", ".join(flat["keys"])
    return {
        "model_path": model["path"],
        "model_step": model["step"],
        "model_digest": model["digest"],
        **flat,
    }


@flow(name="score", validate_parameters=True)
def score_flow(
    model: str,
    data: str,
    out: str,
    days: str | list[int] | None = None,
    nproc: int = 1,
    batch_size: int | None = None,
    max_rows: int | None = None,
    overwrite: bool = False,
    keys: str | list[str] | None = None,
) -> dict[str, Any]:
    """Write ``model``'s predictions for ``days`` (a window; all by default) of the
    dataset at ``data`` under ``out``, as ``dlrmflow score`` does, and publish the
    summary. ``keys``: the columns copied beside each prediction (None: the schema's
    ``keys``; ``score --keys``). Returns what the command prints."""
    reporter = ProgressReporter(
        max(1, planned_total(data, days, max_rows, nproc)),
        key=PROGRESS_KEY,
        description=f"Rows of {data} scored into {out}",
    )
    result = score_task(
        model, data, out, days, nproc, batch_size, max_rows, overwrite, reporter, keys
    )
    publish_metrics(
        summary_table(result), key=SCORES_KEY, description=f"Predictions of {model} in {out}"
    )
    return result

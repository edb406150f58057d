"""The ``recurring`` flow: one scheduled run of a model line (``dlrmflow.train.line``).

Each run is the line's one driver, ``train_line``, as ``dlrmflow line`` runs it, with its
two steps run as Prefect tasks (``FlowSteps``): it ingests the days that landed since the
last run (the ``land`` subflow: raw files in ``data.landing``, or new day partitions
under a registered dataset; otherwise the dataset at ``data.url`` grows by other means,
e.g. ``dlrmflow generate`` with a day more), then, for every day the line has not trained
on, scores the newest version on it (next-day validation), judges that version against
the champion there (the gate, publishing it when it passes) and continues it on the day:
a version a day, each a ``day-N`` task. A run that finds no new day trains nothing and
says so.

What a user watches in Prefect: a ``day-N`` task per day, the history of next-day metrics
as a table and a plot, and the gate's verdicts. A run in which the gate held a version
back ends ``Failed`` under the name ``HeldBack``, with the reasons as its message: the
versions are kept and the line goes on (the next run continues it), but the model serving
did not change, and that should not look like a normal day.

``backfill`` runs the flow a day at a time through a given day, as a schedule would have.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State

from dlrmflow.config import RunConfig
from dlrmflow.flows.artifacts import image_markdown, publish_stats
from dlrmflow.flows.ingest import merge_stats_task, stats_task
from dlrmflow.flows.policies import retry_unless_bad_input
from dlrmflow.flows.storage import shared_results
from dlrmflow.ingest.criteo.landing import convert_landed
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.registered_days import register_new_days
from dlrmflow.ingest.stats.results import DatasetStats, read_stats
from dlrmflow.train.line.gate import champion
from dlrmflow.train.line.line import (
    Line,
    LineError,
    LineRun,
    LineSteps,
    Version,
    history,
    line_config,
    train_line,
    versions,
)

HISTORY_KEY = "dlrmflow-line-history"
GATE_KEY = "dlrmflow-line-gate"
HELD_BACK = "HeldBack"
DEFAULT_LINE = "line"


class HeldBack(LineError):
    """The gate kept a version back: the model serving did not change."""


@task(
    name="day",
    retries=2,
    retry_delay_seconds=[30, 120],
    retry_condition_fn=retry_unless_bad_input,
    # A day is trained once: the line itself knows which days it has (a retry resumes).
    cache_policy=NO_CACHE,
)
def day_task(line: Line, day: int) -> Version:
    """Validate the newest version on ``day``, judge it, and train the next one on it."""
    logger = get_run_logger()
    version = line.advance(day)
    if version.validation is not None:
        v = version.validation
        logger.info(
            "day %d: the version before scored AUC %.4f, NE %.4f, calibration %.3f",
            day, v["auc"], v["ne"], v["calibration"],
        )  # fmt: skip
    logger.info(
        "day %d: version %s trained (%d steps, %d rows, final loss %.4f)",
        day, version.name, version.steps, version.rows, version.final_loss,
    )  # fmt: skip
    return version


@task(
    name="convert",
    retries=1,
    retry_delay_seconds=10,
    retry_condition_fn=retry_unless_bad_input,
    # What landed is the line's own record (the manifest's): a rerun converts only the new.
    cache_policy=NO_CACHE,
)
def convert_task(config: RunConfig) -> dict[str, Any]:
    """Convert the files that landed since the last run into the line's days."""
    data = config.data
    assert data.landing is not None
    result = convert_landed(data.landing, data.url, row_group_size=data.row_group_size)
    get_run_logger().info(
        "landed day(s) %s from %s: %d days, %d rows",
        result.written_days or "none", data.landing, result.manifest.days, result.rows,
    )  # fmt: skip
    return {"written_days": result.written_days, "days": result.manifest.days}


@task(
    name="register",
    retries=1,
    retry_delay_seconds=10,
    retry_condition_fn=retry_unless_bad_input,
    # The manifest records what was registered: a rerun registers only the new partitions.
    cache_policy=NO_CACHE,
)
def register_task(config: RunConfig) -> dict[str, Any]:
    """Register the day partitions that landed under the line's registered dataset."""
    url = config.data.url
    result = register_new_days(url)
    get_run_logger().info(
        "registered day(s) %s under %s: %d days, %d rows",
        result.new_days or "none", url, result.manifest.days, result.manifest.rows,
    )  # fmt: skip
    return {"written_days": result.new_days, "days": result.manifest.days}


@flow(name="land", validate_parameters=True)
def land_flow(config: RunConfig) -> dict[str, Any]:
    """The ingest of a line: the files that landed in ``data.landing`` become its next
    days (``convert_landed``: a converted day keeps its number and file for good, whatever
    becomes of its raw file), then every day's feature statistics (the ingest flow's
    cached ``stats`` tasks: a new day scans only that day) are merged into ``stats.json``.
    Without a landing folder the dataset is a registered one: the day partitions new
    under it are registered (``register_new_days``, which writes its statistics too)."""
    if config.data.landing is None:
        landed = register_task(config)
        publish_stats(read_stats(config.data.url))
        return landed
    landed = convert_task(config)
    url = config.data.url
    manifest = read_manifest(url)
    scan = stats_task.with_options(**shared_results(config))
    days = [scan.submit(path, manifest.multi_hot) for path in manifest.day_paths(url)]
    stats = DatasetStats.from_dict(merge_stats_task(url, manifest.multi_hot, days))
    publish_stats(stats)
    return landed


class FlowSteps(LineSteps):
    """The line's steps as the recurring flow runs them: what landed through the ``land``
    subflow (which merges and publishes the statistics too), each day as a ``day-N``
    task, retried unless the input is bad. The sequence around them is ``train_line``'s."""

    def land(self, line: Line) -> list[int]:
        return land_flow(line.config)["written_days"]

    def day(self, line: Line, day: int) -> Version:
        return day_task.with_options(name=f"day-{day}")(line, day)


@flow(name="recurring", validate_parameters=True)
def recurring_flow(
    line: str = DEFAULT_LINE,
    config: RunConfig | None = None,
    through: int | None = None,
    max_days: int | None = None,
) -> State:
    """Bring the line at ``line`` up to date: ingest what landed, then a version for each
    new day (at most ``max_days``, through day ``through``). ``config`` starts the line
    and afterwards must be the same run (see ``line_config``). Completed when every
    version judged in this run was promoted (or there was nothing to judge); ``Failed``
    named ``HeldBack`` when the gate kept one back."""
    logger = get_run_logger()
    run = train_line(line, config, through=through, max_days=max_days, steps=FlowSteps())
    summary = _summary(run)
    if not run.made:
        trained = [v.day for v in versions(run.dir)]
        seen = f"days {trained[0]}-{trained[-1]}" if trained else "no day"
        message = f"no new day in {run.config.data.url} (the line has trained {seen})"
        logger.info(message)
        return Completed(message=message, data=summary)
    _publish(run.dir, run.plot, run.judged)
    held = [v for v in run.judged if not v.promoted]
    if held:
        message = "; ".join(
            f"version {v.version:04d} held back on day {v.day}: {'; '.join(v.reasons)}"
            for v in held
        )
        logger.warning(message)
        return Failed(name=HELD_BACK, message=message, data=HeldBack(message))
    return Completed(
        message=f"trained day(s) {', '.join(str(v.day) for v in run.made)}", data=summary
    )


def _summary(run: LineRun) -> dict[str, Any]:
    return {
        "line": str(run.dir),
        "trained": [asdict(v) for v in run.made],
        "left": run.left,
        "versions": len(versions(run.dir)),
        "champion": champion(run.dir),
    }


def _publish(line_dir: Path, plot: Path | None, judged: list[Any]) -> None:
    """The next-day history (a table and its plot, ``plot_history``'s) and this run's
    verdicts."""
    records = history(line_dir)
    if records:
        create_table_artifact(
            key=HISTORY_KEY,
            table=[{k: r.get(k) for k in ("day", "auc", "logloss", "ne", "calibration",
                                          "unseen_ids", "rows")} for r in records],
            description=f"Next-day validation of the line {line_dir}: each day, the model "
            "trained on the days before it",
        )  # fmt: skip
        if plot is not None:
            create_markdown_artifact(
                key=f"{HISTORY_KEY}-plot",
                markdown=image_markdown("Next-day metrics", plot),
                description=f"Next-day metrics of the line {line_dir} against the day",
            )
    if judged:
        lines = [f"# Promotion gate of {line_dir}", ""]
        for v in judged:
            if v.promoted:
                lines.append(f"- version {v.version:04d} **promoted** on day {v.day}")
            else:
                lines.append(f"- version {v.version:04d} **held back** on day {v.day}:")
                lines.extend(f"  - {reason}" for reason in v.reasons)
        serving = champion(line_dir)
        lines += ["", f"Serving: {'none' if serving is None else f'version {serving:04d}'}"]
        create_markdown_artifact(
            key=GATE_KEY,
            markdown="\n".join(lines) + "\n",
            description=f"The gate's verdicts in this run of {line_dir}",
        )


def backfill(
    line: str | Path,
    config: RunConfig | None = None,
    *,
    through: int | None = None,
) -> list[State]:
    """Run the recurring flow a day at a time until the line has trained through
    ``through`` (default: the dataset's last day), as a daily schedule would have: one
    flow run per day, each resumable; days already trained are not run again. Returns
    each run's final state (a ``HeldBack`` run does not stop the backfill; any other
    failure raises its error)."""
    states: list[State] = []
    while True:
        before = len(versions(Path(line)))
        state = recurring_flow(str(line), config, through, max_days=1, return_state=True)
        states.append(state)
        result = state.result(raise_on_failure=False)
        if isinstance(result, BaseException) and not isinstance(result, HeldBack):
            raise result
        if len(versions(Path(line))) == before or not _untrained(Path(line), through):
            return states


def _untrained(line_dir: Path, through: int | None) -> list[int]:
    """The days of the line's dataset (through ``through``) it has not trained on: read
    only, so the line need not be locked."""
    return Line(line_dir, line_config(line_dir, None)).pending(through)

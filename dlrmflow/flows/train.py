"""The ``train`` flow: train a DLRM on the dataset's training days, then publish its artifacts.

The train task retries, since a long run on shared machines fails for reasons that go away
(a preempted host, a storage hiccup); it never retries bad data or configuration. While it
runs, a progress artifact follows the steps. Afterwards the flow publishes the training
metrics, the training curve and, for a sharded run, the sharding plan.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import RunConfig
from dlrmflow.flows.artifacts import (
    TRAIN_METRICS_KEY,
    publish_metrics,
    publish_plan,
    publish_training_curve,
)
from dlrmflow.flows.policies import retry_unless_bad_input
from dlrmflow.flows.progress import ProgressReporter
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.train.launch.job import CONFIG_FILE, launch_training
from dlrmflow.train.run.data import day_windows
from dlrmflow.train.run.rundir import run_dir_lock

PROGRESS_KEY = "dlrmflow-train-progress"
# A hang guard, not a budget: far beyond any run these machines make, short enough that a
# stalled job (a dead peer past the collective timeout, a hung mount) frees its worker.
TRAIN_TIMEOUT_S = 72 * 3600


def planned_steps(config: RunConfig) -> int:
    """The steps the run will take: ``train.max_steps``, or every training row ``epochs``
    times in steps of ``train.batch_size`` rows on each of the ``distributed.nproc`` ranks
    (the last step of an epoch may be partial).

    An estimate when the rows do not split evenly: each reader thread's last batch may be
    partial, and ranks deal row groups, not rows, so a run may take a few more steps.
    """
    manifest = read_manifest(config.data.url)
    train_days, _ = day_windows(config, manifest)
    rows_per_step = config.train.batch_size * config.distributed.nproc
    if config.train.order == "days":  # a partial step at each day's end
        days = [sum(f.rows for f in manifest.files if f.day == day) for day in train_days]
        steps = sum(max(1, math.ceil(rows / rows_per_step)) for rows in days)
    else:
        rows = sum(f.rows for f in manifest.files if f.day in train_days)
        steps = config.train.epochs * max(1, math.ceil(rows / rows_per_step))
    if config.train.max_steps is not None:
        steps = min(steps, config.train.max_steps)
    return steps


def task_attempt() -> int:
    """1 on a task run's first try, 2 on its first retry, and so on (1 outside a task)."""
    context = TaskRunContext.get()
    return context.task_run.run_count if context is not None else 1


@task(
    name="train",
    retries=2,
    retry_delay_seconds=[30, 120],
    retry_condition_fn=retry_unless_bad_input,
    timeout_seconds=TRAIN_TIMEOUT_S,
    # Never skip training because an earlier run had the same inputs: a run asks for it.
    cache_policy=NO_CACHE,
)
def train_task(config: RunConfig, reporter: ProgressReporter) -> dict[str, Any]:
    """Train, reporting each metrics record to the run log and to ``reporter``, which the
    flow owns so that every attempt moves the same progress artifact.

    Returns the ``TrainResult`` fields plus ``attempts`` (1 unless the task was retried).
    """
    logger = get_run_logger()
    attempt = task_attempt()
    if attempt > 1:
        # RESUME: with train.resume "auto" (the default) a retry continues from the run
        # dir's newest complete checkpoint, losing at most train.checkpoint_every steps. To
        # resume whatever the config says, this is the line:
        #     config = apply_overrides(config, {"train.resume": "auto"})
        logger.warning("attempt %d, continuing per train.resume=%s", attempt, config.train.resume)

    def on_record(record: dict) -> None:
        logger.info(
            "step %d rows %d loss %.4f %.0f samples/s",
            record["step"],
            record["rows"],
            record["loss"],
            record["samples_per_s"],
        )
        reporter.update(record["step"])

    # One process trains here; more go through torch's elastic launcher, whose output lines
    # (every rank's) go to the run log.
    result = launch_training(config, on_line=logger.info, on_record=on_record)
    reporter.finish()
    logger.info("kernels: %s (%s)", result.kernels, result.kernels_reason)
    return {**result.to_dict(), "attempts": attempt}


@flow(name="train", validate_parameters=True)
def train_flow(config: RunConfig) -> dict[str, Any]:
    """Train a DLRM into ``config.run_dir`` and publish its metrics, curve and plan.

    Writes ``RUN_DIR/config.json`` first, so the run directory says what produced it even
    if training fails. Returns the train task's result.
    """
    run_dir = Path(config.run_dir)
    with run_dir_lock(run_dir, "train flow"):
        write_atomic(run_dir / CONFIG_FILE, config.model_dump_json(indent=2) + "\n")
        reporter = ProgressReporter(
            planned_steps(config), key=PROGRESS_KEY, description=f"Training steps of {run_dir}"
        )
        trained = train_task(config, reporter)
    publish_metrics(trained, key=TRAIN_METRICS_KEY, description=f"Training run in {config.run_dir}")
    publish_training_curve(run_dir)
    publish_plan(run_dir)
    return trained

"""The ``evaluate`` flow: score a run's checkpoint on the held-out test day."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from dlrmflow.config import RunConfig
from dlrmflow.flows.artifacts import publish_evaluation
from dlrmflow.flows.policies import retry_unless_bad_input
from dlrmflow.train.run.evaluate import check_run_dir, evaluate
from dlrmflow.train.run.rundir import run_dir_lock

# A hang guard: scoring a test day takes minutes; hours means a stalled read.
EVAL_TIMEOUT_S = 6 * 3600


@task(
    name="evaluate",
    retries=1,
    retry_delay_seconds=30,
    retry_condition_fn=retry_unless_bad_input,
    timeout_seconds=EVAL_TIMEOUT_S,
)
def evaluate_task(run_dir: str, data_url: str, max_rows: int | None) -> dict[str, Any]:
    """Metrics of the checkpoint in ``run_dir`` on the test day of ``data_url``."""
    metrics = evaluate(run_dir, data_url=data_url, max_rows=max_rows)
    get_run_logger().info(
        "test-day AUC %.4f, log loss %.4f, calibration %.4f over %d rows",
        metrics["auc"],
        metrics["logloss"],
        metrics["calibration"],
        metrics["rows"],
    )
    return metrics


@flow(name="evaluate", validate_parameters=True)
def evaluate_flow(config: RunConfig) -> dict[str, Any]:
    """Evaluate ``config.run_dir``'s checkpoint on ``config.data.url``'s test day, write
    ``RUN_DIR/eval.json`` and publish the metrics as a table artifact."""
    check_run_dir(config.run_dir)  # the lock would create a missing directory
    with run_dir_lock(config.run_dir, "evaluate flow"):
        metrics = evaluate_task(config.run_dir, config.data.url, config.eval.max_rows)
    publish_evaluation(
        metrics, config.run_dir, f"Test-day metrics of {config.run_dir} on {config.data.url}"
    )
    return metrics

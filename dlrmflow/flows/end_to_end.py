"""The ``end_to_end`` flow: ingest -> train -> evaluate -> report, as subflows.

Each stage is a flow of its own (usable alone, and its own deployment), so a run in the
Prefect UI shows one subflow per stage with its tasks and artifacts. The report task writes
``RUN_DIR/summary.json`` and publishes it as a markdown artifact, so a run can be judged
without reading logs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from dlrmflow.config import RunConfig
from dlrmflow.flows.evaluate import evaluate_flow
from dlrmflow.flows.ingest import run_ingest
from dlrmflow.flows.train import train_flow
from dlrmflow.outputs import write_atomic
from dlrmflow.train.rundir import run_dir_lock
from dlrmflow.train.trainer import END_TO_END_KIND, claim_run_dir

SUMMARY_FILE = "summary.json"
SUMMARY_KEY = "dlrmflow-summary"


def build_summary(
    ingested: dict[str, Any],
    trained: dict[str, Any],
    metrics: dict[str, Any],
) -> dict[str, Any]:
    """The fields of ``summary.json``. ``ingest_rows_per_s`` is the generate (or convert)
    and write rate; the Bayes fields are None for real data, whose optimum is unknown."""
    bayes_auc = ingested["bayes_auc"]
    return {
        "auc": metrics["auc"],
        "logloss": metrics["logloss"],
        "ne": metrics["ne"],
        "calibration": metrics["calibration"],
        "bayes_auc": bayes_auc,
        "bayes_logloss": ingested["bayes_logloss"],
        "auc_gap_to_bayes": None if bayes_auc is None else bayes_auc - metrics["auc"],
        "rows_generated": ingested["rows"],
        "rows_trained": trained["rows"],
        "rows_evaluated": metrics["rows"],
        "steps": trained["steps"],
        "train_seconds": trained["seconds"],
        "train_samples_per_s": trained["samples_per_s"],
        "ingest_rows_per_s": ingested["ingest_rows_per_s"],
        "world_size": trained["world_size"],
        "checkpoint": trained["checkpoint"],
        # A run dir that already held a checkpoint continues from it (train.resume "auto"),
        # so the rows and rates above may cover only the steps after it.
        "resumed_from_step": trained["resumed_from_step"],
        "train_attempts": trained["attempts"],
    }


def summary_markdown(summary: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |"
        for key, value in summary.items()
    )
    return f"# dlrmflow run summary\n\n| metric | value |\n|---|---|\n{rows}\n"


@task(name="report", retries=1, retry_delay_seconds=5)
def report_task(
    config: RunConfig,
    ingested: dict[str, Any],
    trained: dict[str, Any],
    metrics: dict[str, Any],
) -> dict[str, Any]:
    summary = build_summary(ingested, trained, metrics)
    path = Path(config.run_dir) / SUMMARY_FILE
    write_atomic(path, json.dumps(summary, indent=2) + "\n")
    create_markdown_artifact(
        key=SUMMARY_KEY,
        markdown=summary_markdown(summary),
        description=f"dlrmflow end-to-end run in {config.run_dir}",
    )
    return summary


@flow(name="end_to_end", validate_parameters=True)
def end_to_end(config: RunConfig, raw_inputs: list[str] | None = None) -> dict[str, Any]:
    """Ingest (generate synthetic data, or convert ``raw_inputs``), train a DLRM, evaluate
    it on the test day and report; returns the summary written to ``RUN_DIR/summary.json``.

    A run directory holding another kind of run (a ``dlrmflow train`` run) is refused
    unless ``train.resume`` is "never" (see ``claim_run_dir``).
    """
    with run_dir_lock(config.run_dir, "end_to_end flow"):
        replace = config.train.resume == "never"
        claim_run_dir(
            Path(config.run_dir), END_TO_END_KIND, replace=replace, command="the end_to_end flow"
        )
        # Ingest's per-day tasks run where config.orchestration says (threads or Dask).
        ingested = run_ingest(config, raw_inputs)
        trained = train_flow(config)
        metrics = evaluate_flow(config)
        return report_task(config, ingested, trained, metrics)

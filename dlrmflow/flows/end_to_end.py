"""The ``end_to_end`` flow: generate -> train -> evaluate -> report.

Tasks only call the stages' public functions; everything they need travels in the typed
``RunConfig``. The report task writes ``RUN_DIR/summary.json`` and publishes the metrics as
a markdown artifact, so a run can be judged from the Prefect UI without reading logs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from dlrmflow.config import RunConfig
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.evaluate import evaluate
from dlrmflow.train.trainer import train

SUMMARY_FILE = "summary.json"


@task(name="generate")
def generate_task(config: RunConfig) -> dict[str, Any]:
    """Write the synthetic dataset and return its manifest plus the ingest rate."""
    start = time.perf_counter()
    manifest = generate_dataset(config.data)
    seconds = time.perf_counter() - start
    get_run_logger().info(
        "generated %d rows over %d days in %.1f s", manifest.rows, manifest.days, seconds
    )
    return {
        "rows": manifest.rows,
        "bayes_auc": manifest.bayes_auc,
        "bayes_logloss": manifest.bayes_logloss,
        "positive_rate": manifest.positive_rate,
        "ingest_rows_per_s": manifest.rows / seconds,
    }


@task(name="train")
def train_task(config: RunConfig) -> dict[str, Any]:
    logger = get_run_logger()

    def log(record: dict) -> None:
        logger.info(
            "step %d rows %d loss %.4f %.0f samples/s",
            record["step"],
            record["rows"],
            record["loss"],
            record["samples_per_s"],
        )

    return train(config, progress=log).to_dict()


@task(name="evaluate")
def evaluate_task(config: RunConfig) -> dict[str, Any]:
    metrics = evaluate(config.run_dir)
    get_run_logger().info("test-day AUC %.4f, log loss %.4f", metrics["auc"], metrics["logloss"])
    return metrics


def build_summary(
    generated: dict[str, Any], trained: dict[str, Any], metrics: dict[str, Any]
) -> dict[str, Any]:
    """The fields of ``summary.json``; ``ingest_rows_per_s`` is the generate-and-write rate."""
    return {
        "auc": metrics["auc"],
        "logloss": metrics["logloss"],
        "ne": metrics["ne"],
        "calibration": metrics["calibration"],
        "bayes_auc": generated["bayes_auc"],
        "bayes_logloss": generated["bayes_logloss"],
        "auc_gap_to_bayes": generated["bayes_auc"] - metrics["auc"],
        "rows_generated": generated["rows"],
        "rows_trained": trained["rows"],
        "rows_evaluated": metrics["rows"],
        "steps": trained["steps"],
        "train_seconds": trained["seconds"],
        "train_samples_per_s": trained["samples_per_s"],
        "ingest_rows_per_s": generated["ingest_rows_per_s"],
        "world_size": 1,
        "checkpoint": trained["checkpoint"],
    }


def summary_markdown(summary: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |"
        for key, value in summary.items()
    )
    return f"# dlrmflow run summary\n\n| metric | value |\n|---|---|\n{rows}\n"


@task(name="report")
def report_task(
    config: RunConfig,
    generated: dict[str, Any],
    trained: dict[str, Any],
    metrics: dict[str, Any],
) -> dict[str, Any]:
    summary = build_summary(generated, trained, metrics)
    path = Path(config.run_dir) / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=2) + "\n")
    create_markdown_artifact(
        key="dlrmflow-summary",
        markdown=summary_markdown(summary),
        description=f"dlrmflow end-to-end run in {config.run_dir}",
    )
    return summary


@flow(name="end_to_end", validate_parameters=True)
def end_to_end(config: RunConfig) -> dict[str, Any]:
    """Generate synthetic data, train a DLRM, evaluate it on the test day and report."""
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(config.run_dir) / "config.json").write_text(config.model_dump_json(indent=2) + "\n")
    generated = generate_task(config)
    trained = train_task(config)
    metrics = evaluate_task(config)
    return report_task(config, generated, trained, metrics)

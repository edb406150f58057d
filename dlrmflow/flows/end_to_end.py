"""The ``end_to_end`` flow: ingest -> train -> evaluate -> report, as subflows.

Each stage is a flow of its own (usable alone, and its own deployment), so a run in the
Prefect UI shows one subflow per stage with its tasks and artifacts. The report task writes
``RUN_DIR/summary.json`` and publishes it as a markdown artifact, so a run can be judged
without reading logs.

``dlrmflow demo`` runs it on a configuration of its own (``demo_config``: two ranks, its
data beside its results) as a new run each time (``run_demo``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import RunConfig, apply_overrides
from dlrmflow.flows.evaluate import evaluate_flow
from dlrmflow.flows.ingest import run_ingest
from dlrmflow.flows.train import train_flow
from dlrmflow.train.run.rundir import run_dir_lock
from dlrmflow.train.run.trainer import END_TO_END_KIND, claim_run_dir

SUMMARY_FILE = "summary.json"
SUMMARY_KEY = "dlrmflow-summary"
# The demo trains sharded, on this many ranks unless its configuration says otherwise.
DEMO_RANKS = 2
# The demo trains once on a fixed dataset, where a vocabulary of the training days' IDs
# (rare ones sharing one row) comes closer to the Bayes AUC than hashing; hashing stays the
# default for datasets that grow, whose new IDs a vocabulary fitted once would not know.
DEMO_IDS = "vocab"
# ``dlrmflow demo --quick``: tiny data, so that the demo ends in under a minute.
QUICK = {
    "data.days": 3,
    "data.rows_per_day": 20_000,
    "data.row_group_size": 8_192,
    "train.batch_size": 1024,
    "train.log_every": 10,
}


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
        "calibration_error": metrics["calibration_error"],
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


def demo_config(base: RunConfig, run_dir: str, quick: bool = False) -> RunConfig:
    """The configuration ``dlrmflow demo`` runs: ``base`` (defaults, file, environment and
    --set) in ``run_dir``, with ``QUICK``'s tiny data and batch when ``quick`` (they replace
    the configuration's).

    What the user did not choose is the demo's: its data in ``RUN_DIR/data`` (beside its
    results), ``DEMO_IDS`` and ``DEMO_RANKS`` ranks. ``train.batch_size`` is per rank, so
    unless it was chosen the demo's global batch is split over its ranks: the demo then
    takes as many steps, and reaches the same AUC, as one process would.
    """
    overrides: dict[str, Any] = dict(QUICK) if quick else {}
    overrides["run_dir"] = run_dir
    if "url" not in base.data.model_fields_set:
        overrides["data.url"] = str(Path(run_dir) / "data")
    if "ids" not in base.features.model_fields_set:
        overrides["features.ids"] = DEMO_IDS
    if "nproc" not in base.distributed.model_fields_set:
        overrides["distributed.nproc"] = DEMO_RANKS
    nproc = overrides.get("distributed.nproc", base.distributed.nproc)
    if "batch_size" not in base.train.model_fields_set:
        global_batch = overrides.get("train.batch_size", base.train.batch_size)
        overrides["train.batch_size"] = max(1, global_batch // nproc)
    return apply_overrides(base, overrides)


def run_demo(config: RunConfig) -> dict[str, Any]:
    """Run the end_to_end flow as a new demo in ``config.run_dir``; returns its summary.

    The directory is claimed for end-to-end runs first: another kind of run (a ``dlrmflow
    train`` run) is never replaced unasked (``train.resume=never`` replaces it). The last
    demo's checkpoints are removed, so this one trains afresh rather than continuing it
    (the train task still resumes from this run's own checkpoints when Prefect retries
    it); its dataset is reused when unchanged (Prefect's cache).
    """
    run_dir = Path(config.run_dir)
    with run_dir_lock(config.run_dir, "dlrmflow demo"):
        replace = config.train.resume == "never"
        claim_run_dir(run_dir, END_TO_END_KIND, replace=replace, command="dlrmflow demo")
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        return end_to_end(config)

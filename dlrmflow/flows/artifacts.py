"""Prefect artifacts of a run: what a reviewer looks at in the UI instead of the logs.

Tables for the data statistics, the sharding plan and the training and evaluation metrics,
and the training curve. Prefect's image artifact stores only a URL, which a browser cannot
follow to a file on the worker, so the curve is saved as ``RUN_DIR/training_curve.png`` and
published as markdown that embeds the PNG (base64) and names the file.

Each ``*_table`` function is pure (the rows of a table artifact); each ``publish_*``
function creates the artifact in the current flow or task run and returns its id.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any
from uuid import UUID

from matplotlib.figure import Figure
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from dlrmflow.ingest.stats.results import DatasetStats
from dlrmflow.train.model.plan import ShardingPlan
from dlrmflow.train.run.calibration import RELIABILITY_FILE
from dlrmflow.train.run.trainer import METRICS_FILE

STATS_KEY = "dlrmflow-data-stats"
PLAN_KEY = "dlrmflow-sharding-plan"
TRAIN_METRICS_KEY = "dlrmflow-train-metrics"
EVAL_METRICS_KEY = "dlrmflow-eval-metrics"
CURVE_KEY = "dlrmflow-training-curve"
RELIABILITY_KEY = "dlrmflow-reliability"
PLAN_FILE = "plan.json"
CURVE_FILE = "training_curve.png"


def stats_table(stats: DatasetStats) -> list[dict[str, Any]]:
    """One row per column: missing rate, range and mean of counts, distinct IDs, list length."""
    rows: list[dict[str, Any]] = [
        {
            "column": "label",
            "kind": "label",
            "rows": stats.rows,
            "missing %": 0.0,
            "min": 0,
            "max": 1,
            "mean": round(stats.positive_rate, 4),
            "distinct IDs": None,
            "IDs per row": None,
        }
    ]
    for d in stats.dense:
        rows.append(
            {
                "column": d.name,
                "kind": "dense",
                "rows": d.present + d.missing,
                "missing %": round(100 * d.missing_rate, 2),
                "min": d.min,
                "max": d.max,
                "mean": None if d.mean is None else round(d.mean, 3),
                "distinct IDs": None,
                "IDs per row": None,
            }
        )
    for s in stats.sparse:
        rows.append(
            {
                "column": s.name,
                "kind": "sparse",
                "rows": s.rows,
                "missing %": round(100 * s.missing_rate, 2),
                "min": None,
                "max": None,
                "mean": None,
                "distinct IDs": s.distinct,
                "IDs per row": round(s.mean_length, 2),
            }
        )
    return rows


def plan_table(plan: ShardingPlan) -> list[dict[str, Any]]:
    """One row per embedding table: its sharding type and the ranks that hold its shards."""
    return [
        {
            "table": t.name,
            "sharding": t.sharding,
            "ranks": ", ".join(str(r) for r in sorted(set(t.ranks))),
            "rows": t.rows,
            "dim": t.dim,
            "tiers": ", ".join(sorted({s.tier for s in t.shards})),
        }
        for t in plan.tables
    ]


def metrics_table(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per metric; floats rounded to 6 decimals so the table stays readable."""
    return [
        {"metric": key, "value": round(value, 6) if isinstance(value, float) else value}
        for key, value in metrics.items()
    ]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The training records of ``RUN_DIR/metrics.jsonl`` (empty if training wrote none)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {number}: not a JSON record ({e})") from e
    return records


def plot_training_curve(records: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw the loss against the step into a PNG, and below it the test-day AUC and
    calibration of the records that carry them (``train.eval_every``).

    Uses matplotlib's Agg canvas through ``Figure`` rather than pyplot: no global figure
    state, so concurrent tasks cannot draw into each other's figures.
    """
    # The trainer writes training records (with "loss") and, with train.eval_every,
    # evaluation records (with "auc") into the same metrics.jsonl.
    trained = [r for r in records if "loss" in r]
    if not trained:
        raise ValueError(f"{path}: no training records to plot")
    evaluated = [r for r in records if "auc" in r]
    figure = Figure(figsize=(7, 6 if evaluated else 3.5), layout="constrained")
    loss_axes = figure.add_subplot(2 if evaluated else 1, 1, 1)
    loss_axes.plot([r["step"] for r in trained], [r["loss"] for r in trained], color="tab:blue")
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel("training loss", color="tab:blue")
    loss_axes.grid(alpha=0.3)
    if evaluated:
        steps = [r["step"] for r in evaluated]
        auc_axes = figure.add_subplot(2, 1, 2, sharex=loss_axes)
        auc_axes.plot(steps, [r["auc"] for r in evaluated], color="tab:orange", marker="o")
        auc_axes.set_xlabel("step")
        auc_axes.set_ylabel("test AUC", color="tab:orange")
        auc_axes.grid(alpha=0.3)
        if all("calibration" in r for r in evaluated):
            calibration_axes = auc_axes.twinx()
            calibration_axes.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
            calibration_axes.plot(
                steps, [r["calibration"] for r in evaluated], color="tab:green", marker="s"
            )
            calibration_axes.set_ylabel("test calibration", color="tab:green")
    path = Path(path)
    figure.savefig(path, dpi=100, format="png")
    return path


def image_markdown(title: str, png: Path) -> str:
    """Markdown that shows the PNG inline (base64, so no file server is needed) and names
    the file for anyone with access to the run directory."""
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    return (
        f"# {title}\n\n"
        f"![{title.lower()}](data:image/png;base64,{data})\n\n"
        f"File: `{png.resolve()}` ([open]({png.resolve().as_uri()}))\n"
    )


def curve_markdown(png: Path) -> str:
    return image_markdown("Training curve", png)


def publish_stats(stats: DatasetStats) -> UUID:
    return create_table_artifact(
        key=STATS_KEY,
        table=stats_table(stats),
        description=(
            f"Feature statistics of {stats.url}: {stats.rows} rows, "
            f"{stats.row_groups} row groups, positive rate {stats.positive_rate:.4f}"
        ),
    )


def publish_plan(run_dir: str | Path) -> UUID | None:
    """The sharding plan's table if the run wrote ``RUN_DIR/plan.json``, else None."""
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        return None
    try:
        plan = ShardingPlan.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a sharding plan ({e})") from e
    return create_table_artifact(
        key=PLAN_KEY,
        table=plan_table(plan),
        description=(
            f"Sharding plan of {path.parent}: {len(plan.tables)} tables over "
            f"{plan.world_size} ranks ({plan.ranks_per_host} per host)"
        ),
    )


def publish_metrics(metrics: dict[str, Any], *, key: str, description: str) -> UUID:
    return create_table_artifact(key=key, table=metrics_table(metrics), description=description)


def reliability_markdown(table: list[dict[str, Any]], png: Path | None) -> str:
    """The reliability table (predicted against observed click rate per bin) in markdown,
    its plot inline when there is one."""
    lines = [
        "| bin | rows | predictions | mean predicted | observed |",
        "|---|---|---|---|---|",
        *(
            f"| {b['bin']} | {b['rows']} | {b['low']:.4f}-{b['high']:.4f} "
            f"| {b['predicted']:.4f} | {b['observed']:.4f} |"
            for b in table
        ),
    ]
    text = "\n".join(lines) + "\n"
    if png is not None and png.is_file():
        return image_markdown("Reliability", png) + "\n" + text
    return "# Reliability\n\n" + text


def publish_evaluation(metrics: dict[str, Any], run_dir: str | Path, description: str) -> None:
    """The test-day metrics as a table and the reliability table with its plot."""
    table = metrics.get("reliability") or []
    publish_metrics(
        {k: v for k, v in metrics.items() if k != "reliability"},
        key=EVAL_METRICS_KEY,
        description=description,
    )
    if table:
        create_markdown_artifact(
            key=RELIABILITY_KEY,
            markdown=reliability_markdown(table, Path(run_dir) / RELIABILITY_FILE),
            description=f"Predicted against observed click rate by bin, {run_dir}",
        )


def publish_training_curve(run_dir: str | Path) -> Path | None:
    """Plot ``RUN_DIR/metrics.jsonl`` to ``RUN_DIR/training_curve.png`` and publish it as
    markdown; returns the PNG's path, or None when training logged no records."""
    records = read_metrics(run_dir)
    if not records:
        return None
    png = plot_training_curve(records, Path(run_dir) / CURVE_FILE)
    create_markdown_artifact(
        key=CURVE_KEY,
        markdown=curve_markdown(png),
        description=f"Training loss against step for {run_dir}",
    )
    return png

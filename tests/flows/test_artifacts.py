"""The artifact contents: tables of statistics, plan and metrics, and the training curve."""

from __future__ import annotations

import base64
import json

import pytest
from PIL import Image

from dlrmflow.flows.artifacts import (
    curve_markdown,
    metrics_table,
    plan_table,
    plot_training_curve,
    read_metrics,
    stats_table,
)
from dlrmflow.ingest.stats.results import DatasetStats, DenseStats, SparseStats
from dlrmflow.train.model.plan import Shard, ShardingPlan, TablePlan


def two_rank_plan() -> ShardingPlan:
    return ShardingPlan(
        world_size=2,
        ranks_per_host=2,
        tables=(
            TablePlan("C1", 10, 8, "table_wise", (Shard(1, 0, 10, 0, 8),)),
            TablePlan("C2", 20, 8, "row_wise", (Shard(0, 0, 10, 0, 8), Shard(1, 10, 20, 0, 8))),
        ),
    )


def test_stats_table_has_a_row_per_column():
    stats = DatasetStats(
        url="memory://d",
        rows=1000,
        positives=250,
        row_groups=2,
        multi_hot=True,
        dense=(DenseStats("I1", 900, 100, -2, 40, 3.25, 5),),
        sparse=(SparseStats("C1", 1000, 50, 150, 2400, 321, 9),),
    )
    label, dense, sparse = stats_table(stats)
    assert label["column"] == "label" and label["mean"] == 0.25
    assert dense == {
        "column": "I1", "kind": "dense", "rows": 1000, "missing %": 10.0, "min": -2,
        "max": 40, "mean": 3.25, "distinct IDs": None, "IDs per row": None,
    }  # fmt: skip
    assert sparse["distinct IDs"] == 321 and sparse["missing %"] == 5.0
    assert sparse["IDs per row"] == round(2400 / 800, 2)  # rows with at least one ID


def test_plan_table_lists_each_tables_sharding_and_ranks():
    assert plan_table(two_rank_plan()) == [
        {"table": "C1", "sharding": "table_wise", "ranks": "1", "rows": 10, "dim": 8,
         "tiers": "device"},
        {"table": "C2", "sharding": "row_wise", "ranks": "0, 1", "rows": 20, "dim": 8,
         "tiers": "device"},
    ]  # fmt: skip


def test_metrics_table_rounds_floats_only():
    assert metrics_table({"auc": 0.123456789, "rows": 6000, "checkpoint": "c.pt"}) == [
        {"metric": "auc", "value": 0.123457},
        {"metric": "rows", "value": 6000},
        {"metric": "checkpoint", "value": "c.pt"},
    ]


def _write_metrics(run_dir, records):
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_training_curve_png_with_and_without_auc(tmp_path):
    records = [{"step": s, "loss": 0.7 - 0.01 * s} for s in range(5, 55, 5)]
    _write_metrics(tmp_path / "a", records)
    assert read_metrics(tmp_path / "a") == records
    loss_only = plot_training_curve(read_metrics(tmp_path / "a"), tmp_path / "a" / "curve.png")
    with Image.open(loss_only) as image:
        assert image.format == "PNG" and image.size == (700, 350)

    records[4]["auc"], records[9]["auc"] = 0.70, 0.74
    with_auc = plot_training_curve(records, tmp_path / "b.png")
    assert with_auc.read_bytes() != loss_only.read_bytes()  # the AUC axis is drawn
    assert plot_training_curve(records, tmp_path / "c.png").read_bytes() == with_auc.read_bytes()
    # The trainer's own evaluation records carry the AUC but no training loss.
    evaluations = [{"step": 25, "auc": 0.70, "logloss": 0.5}, {"step": 50, "auc": 0.74}]
    mixed = [{k: v for k, v in r.items() if k != "auc"} for r in records] + evaluations
    assert plot_training_curve(mixed, tmp_path / "d.png").read_bytes() == with_auc.read_bytes()
    with Image.open(with_auc) as image:
        assert image.size == (700, 600)  # the loss above, the test-day metrics below
    evaluations[0]["calibration"], evaluations[1]["calibration"] = 1.2, 1.01
    calibrated = plot_training_curve(mixed, tmp_path / "e.png")
    assert calibrated.read_bytes() != with_auc.read_bytes()  # the calibration axis is drawn

    markdown = curve_markdown(with_auc)
    encoded = markdown.split("data:image/png;base64,")[1].split(")")[0]
    assert base64.b64decode(encoded) == with_auc.read_bytes()
    assert str(with_auc.resolve()) in markdown


def test_metrics_errors_name_the_file_and_line(tmp_path):
    assert read_metrics(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 2: not a JSON record"):
        read_metrics(tmp_path)
    with pytest.raises(ValueError, match="no training records"):
        plot_training_curve([], tmp_path / "x.png")

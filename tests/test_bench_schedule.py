"""``dlrmflow bench schedule`` at its quick size: every candidate trains with the overrides
it names, the last is the defaults, and the ratios and docs follow from the runs; never
quality (the days are tiny)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from dlrmflow.bench.docs import benchmarks_markdown, results_table
from dlrmflow.bench.schedule import CANDIDATES, run_schedule_sweep
from dlrmflow.config import TrainConfig

DOCS = Path(__file__).parents[1] / "docs"


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_schedule_sweep(quick=True, work_dir=tmp_path_factory.mktemp("schedule"))


def test_every_candidate_runs_each_seed_and_the_last_is_the_defaults(record: dict) -> None:
    rows = record["candidates"]
    assert [r["name"] for r in rows] == [name for name, _ in CANDIDATES]
    assert rows[-1]["name"] == "defaults" and rows[-1]["overrides"] == {}
    for row in rows:
        assert [r["seed"] for r in row["runs"]] == [0, 1]
        assert all(0 < r["auc"] < 1 and r["calibration"] > 0 for r in row["runs"])
        assert row["mean_auc"] == statistics.fmean(r["auc"] for r in row["runs"])
        assert row["auc_gap"] == record["bayes_auc"] - row["mean_auc"]
    # Seeds give other weights and orders; the batch size sets the steps.
    assert rows[0]["runs"][0]["auc"] != rows[0]["runs"][1]["auc"]
    steps = {r["overrides"].get("train.batch_size", TrainConfig().batch_size): r["runs"][0]["steps"]
             for r in rows}  # fmt: skip
    assert steps[1024] > steps[2048]
    defaults = TrainConfig()
    assert record["defaults"]["lr"] == defaults.lr
    assert record["defaults"]["dense_optimizer"] == defaults.dense_optimizer == "adam"
    assert record["defaults"]["lr_schedule"] == defaults.lr_schedule.model_dump()


def test_ratios_compare_the_defaults_with_the_constant_rates_of_before(record: dict) -> None:
    before, chosen = record["candidates"][0], record["candidates"][-1]
    assert before["overrides"]["train.lr_schedule.decay"] == "constant"
    assert record["ratios"] == {
        "auc_gap": chosen["auc_gap"] / before["auc_gap"],
        "calibration_miss": chosen["mean_calibration_miss"] / before["mean_calibration_miss"],
    }


def test_the_sweep_renders_into_the_docs_but_not_the_readmes_ratio_table(record: dict) -> None:
    committed = json.loads((DOCS / "benchmarks.json").read_text())
    with_sweep = {**committed, "schedule": record}
    markdown = benchmarks_markdown(with_sweep)
    assert "## Learning-rate sweep" in markdown
    assert "constant, lr 0.05, batch 2048 (before)" in markdown
    assert results_table(with_sweep) == results_table({**committed, "schedule": {}})

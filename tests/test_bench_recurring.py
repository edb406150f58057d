"""``dlrmflow bench recurring`` at its quick size: the three ways start from the same
model and see the same days, and the record, plot and docs hold what they claim; never
speed or quality (the days are tiny)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from dlrmflow.bench.docs import benchmarks_markdown, results_table, write_docs
from dlrmflow.bench.recurring import PLOT, WAYS

DOCS = Path(__file__).parents[1] / "docs"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("recurring") / "recurring.json"
    command = [Path(sys.executable).parent / "dlrmflow", "bench", "recurring", "--quick",
               "--days", "4", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(out.read_text())
    return json.loads(out.read_text()), out.parent


def test_each_way_is_scored_on_every_day_after_the_first(run):
    record, _ = run
    days = record["days"]
    for way in WAYS:
        assert [r["day"] for r in days[way]] == [1, 2, 3], way
        assert all(0 < r["auc"] < 1 and r["cpu_s"] > 0 for r in days[way]), way
        assert all(0.5 < r["bayes_auc"] < 1 for r in days[way]), way
    # On day 1 the three models are one: trained on day 0 alone, same seed and order.
    assert days["continued"][0]["auc"] == days["retrained"][0]["auc"] == days["frozen"][0]["auc"]
    # After that they differ: the line and the retrained model saw day 1, the frozen one not.
    assert days["continued"][1]["auc"] != days["frozen"][1]["auc"]
    assert days["retrained"][1]["auc"] != days["frozen"][1]["auc"]


def test_summary_and_ratios_follow_from_the_days(run):
    record, _ = run
    days, summary, ratios = record["days"], record["summary"], record["ratios"]
    for way in WAYS:
        assert summary[way]["mean_next_day_auc"] == statistics.fmean(r["auc"] for r in days[way])
        assert summary[way]["cpu_s_per_day"] == statistics.fmean(r["cpu_s"] for r in days[way])
    line = summary["continued"]
    assert ratios["mean_next_day_auc_vs_frozen"] == (
        line["mean_next_day_auc"] / summary["frozen"]["mean_next_day_auc"]
    )
    assert ratios["cpu_s_per_day_retrained_vs_continued"] == (
        summary["retrained"]["cpu_s_per_day"] / line["cpu_s_per_day"]
    )
    # Every day of every way was recalibrated on a quarter of its rows, judged on the rest.
    for way in WAYS:
        for r in days[way]:
            assert r["auc_recalibrated"] == r["auc_judged"]  # a shift keeps the ranking
            assert abs(r["calibration_recalibrated"] - 1) < 0.25
        assert summary[way]["mean_calibration_recalibrated"] == statistics.fmean(
            r["calibration_recalibrated"] for r in days[way]
        )
    errors = [
        statistics.fmean(abs(r[key] - 1) for r in days["continued"])
        for key in ("calibration_judged", "calibration_recalibrated")
    ]
    assert ratios["calibration_error_raw_vs_recalibrated"] == errors[0] / errors[1]


def test_the_plot_and_the_docs_show_every_way(run, tmp_path: Path):
    record, folder = run
    height, width, _ = matplotlib.image.imread(folder / PLOT).shape
    assert height > 200 and width > 300
    committed = json.loads((DOCS / "benchmarks.json").read_text())
    combined = {**committed, "recurring": record}
    markdown = benchmarks_markdown(combined)
    assert "## Recurring training" in markdown and f"]({PLOT})" in markdown
    for way in WAYS:  # the three ways side by side, in the docs
        summary = record["summary"][way]
        assert f"| {way} | {summary['mean_next_day_auc']:.3g} |" in markdown
    table = results_table(combined)  # the README: each ratio against its baseline
    for name, ratio in record["ratios"].items():
        assert (
            f"| Recurring training | `{name}` | retrained daily, or frozen; or the line "
            f"unrecalibrated | {ratio:.2f} |" in table
        )
    # bench docs --recurring adds the run and copies its plot beside the markdown.
    docs, readme = tmp_path / "docs", tmp_path / "README.md"
    docs.mkdir()
    readme.write_text((DOCS.parent / "README.md").read_text())
    write_docs(DOCS / "benchmarks.json", docs, readme, recurring_run=folder / "recurring.json")
    assert (docs / PLOT).read_bytes() == (folder / PLOT).read_bytes()
    assert json.loads((docs / "benchmarks.json").read_text())["recurring"] == record
    assert f"| Recurring training | `{next(iter(record['ratios']))}` |" in readme.read_text()


def test_the_lines_verdicts_are_judged_again_by_each_gate(run):
    record, _ = run
    judged = len(record["days"]["continued"]) + 1  # day 0's version too, with no champion
    for name in ("default", "raw", "rate"):
        gate = record["gate"][name]
        held = gate["held_back"]
        assert gate["promoted_share"] == (judged - len(held)) / judged
        assert all(r["reasons"] for r in held)  # a version held back says why
    assert "would promote" in benchmarks_markdown({**_committed(), "recurring": record})


def _committed() -> dict:
    return json.loads((DOCS / "benchmarks.json").read_text())

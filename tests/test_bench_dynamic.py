"""``dlrmflow bench dynamic`` at its quick size: the four lines see the same churning days,
differ only in how IDs become rows, and the record and docs hold what they claim; never
speed or quality (the days are tiny)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from dlrmflow.bench.docs import benchmarks_markdown, results_table, write_docs
from dlrmflow.bench.dynamic import WAYS

DOCS = Path(__file__).parents[1] / "docs"


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("dynamic") / "dynamic.json"
    command = [Path(sys.executable).parent / "dlrmflow", "bench", "dynamic", "--quick",
               "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(out.read_text())
    return json.loads(out.read_text())


def test_every_line_is_scored_on_every_day_after_the_first(record):
    days = record["days"]
    for way in WAYS:
        assert [r["day"] for r in days[way]] == [1, 2, 3], way
        assert all(0 < r["auc"] < 1 and r["cpu_s"] > 0 for r in days[way]), way
        assert all(0.5 < r["bayes_auc"] < 1 for r in days[way]), way
    assert record["data"]["churn"] > 0
    # Only the mapping differs: hashed lines into as many rows as the dynamic one and into
    # four times as many (floored per table), a vocabulary into day 0's IDs.
    assert record["features"]["dynamic"]["ids"] == "dynamic"
    assert record["features"]["vocab_day0"]["ids"] == "vocab"
    assert "ids" not in record["features"]["hash"]


def test_rows_memory_and_ratios_follow_from_the_lines(record):
    summary, ratios = record["summary"], record["ratios"]
    dynamic, hashed = summary["dynamic"], summary["hash"]
    assert dynamic["rows"] == hashed["rows"] == hashed["rows_in_use"]
    assert summary["hash_4x"]["rows"] > hashed["rows"] > summary["vocab_day0"]["rows"]
    # The dynamic tables fill as IDs are admitted; only they keep maps.
    assert 0 < dynamic["rows_in_use"] < dynamic["rows"] and dynamic["map_bytes"] > 0
    assert all(summary[way]["map_bytes"] == 0 for way in WAYS[1:])
    assert dynamic["table_bytes"] == hashed["table_bytes"]
    for way in WAYS:
        days = record["days"][way]
        assert summary[way]["mean_next_day_auc"] == statistics.fmean(r["auc"] for r in days)
    for way in WAYS[1:]:
        assert ratios[f"mean_next_day_auc_vs_{way}"] == (
            dynamic["mean_next_day_auc"] / summary[way]["mean_next_day_auc"]
        )
    step = record["step"]
    assert step["lookup_share_of_step"] == step["lookup_s_per_batch"] / step["dynamic_s"]
    assert step["lookups_per_s_per_core"] > 0 and step["lookup_s_per_batch"] > 0


def test_the_docs_show_every_line(record, tmp_path: Path):
    committed = json.loads((DOCS / "benchmarks.json").read_text())
    combined = {**committed, "dynamic": record}
    markdown = benchmarks_markdown(combined)
    assert "## Dynamic ID tables" in markdown and "lookups a second on one core" in markdown
    for way in WAYS:
        summary = record["summary"][way]
        assert f"| {way} | {summary['mean_next_day_auc']:.3g} |" in markdown
    table = results_table(combined)
    for name, ratio in record["ratios"].items():
        assert f"| Dynamic ID tables | `{name}` |" in table and f"{ratio:.2f} |" in table
    docs, readme = tmp_path / "docs", tmp_path / "README.md"
    docs.mkdir()
    readme.write_text((DOCS.parent / "README.md").read_text())
    write_docs(DOCS / "benchmarks.json", docs, readme, dynamic_run=_saved(record, tmp_path))
    assert json.loads((docs / "benchmarks.json").read_text())["dynamic"] == record
    assert "| Dynamic ID tables | `mean_next_day_auc_vs_hash` |" in readme.read_text()


def _saved(record: dict, folder: Path) -> Path:
    path = folder / "dynamic.json"
    path.write_text(json.dumps(record))
    return path

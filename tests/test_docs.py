"""The committed benchmark documents are exactly what the generator makes of their JSON."""

import json
from pathlib import Path

from dlrmflow.bench.docs import RESULTS_END, RESULTS_START, benchmarks_markdown, results_table

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "benchmarks.json"


def test_benchmarks_md_and_the_readme_table_match_the_committed_report():
    record = json.loads(RECORD.read_text())
    assert not record["quick"], "the documents must come from a full run"
    assert (ROOT / "docs" / "benchmarks.md").read_text() == benchmarks_markdown(record)
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index(RESULTS_START) + len(RESULTS_START) : readme.index(RESULTS_END)]
    assert table.strip() == results_table(record).strip()

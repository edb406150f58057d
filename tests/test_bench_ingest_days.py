"""The days-per-minute benchmark's raw days (its quick record is checked with the report)."""

from pathlib import Path

from dlrmflow.bench.ingest_days import write_raw_days


def test_raw_days_are_in_the_criteo_layout(tmp_path):
    (tmp_path / "raw").mkdir()
    [path] = write_raw_days(tmp_path / "raw", 1, 50)
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 50 and all(len(line.split("\t")) == 40 for line in lines)
    assert {line.split("\t")[0] for line in lines} <= {"0", "1"}

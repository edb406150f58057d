"""The days-per-minute benchmark: its raw days, and the record it makes of its runners.

The ingest flow itself, on threads and on a Dask cluster, is checked in
``tests/flows/test_ingest_days.py`` (the same bytes as the sequential converter, a new day
converted alone); here ``FakeIngest`` stands in for it, so the benchmark's own part (which
runners it times, on which days, into which outputs, and the record it makes of them) is
checked without starting a cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import dlrmflow.flows.ingest as ingest_flow
from dlrmflow.bench.ingest_days import BASELINE, QUICK, run_ingest_days_benchmark, write_raw_days
from dlrmflow.bench.report import ingest_days_section
from dlrmflow.config import RunConfig
from tests.test_bench_helpers import report_section, table_rows


class FakeIngest:
    """``run_ingest`` in the flow's place: records each call's runner, output and raw days
    (checking that every raw day is there to read) and writes nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str, list[str]]] = []

    def __call__(self, config: RunConfig, raw_inputs: list[str] | None = None) -> None:
        raw = list(raw_inputs or [])
        assert raw and all(Path(path).is_file() for path in raw), raw
        orchestration = config.orchestration
        self.calls.append(
            (orchestration.task_runner, orchestration.dask_workers, config.data.url, raw)
        )


@pytest.fixture
def fake_ingest(monkeypatch: pytest.MonkeyPatch) -> FakeIngest:
    fake = FakeIngest()
    monkeypatch.setattr(ingest_flow, "run_ingest", fake)
    return fake


def test_raw_days_are_in_the_criteo_layout(tmp_path):
    (tmp_path / "raw").mkdir()
    [path] = write_raw_days(tmp_path / "raw", 1, 50)
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 50 and all(len(line.split("\t")) == 40 for line in lines)
    assert {line.split("\t")[0] for line in lines} <= {"0", "1"}


def test_each_runner_ingests_the_same_days_into_an_output_of_its_own(fake_ingest):
    record = run_ingest_days_benchmark(quick=True)
    runners = sorted((runner, workers) for runner, workers, _, _ in fake_ingest.calls)
    assert runners == [("dask", 1), ("dask", 2), ("threads", 1)]
    assert len({url for _, _, url, _ in fake_ingest.calls}) == 3  # no case reuses a cache
    raw = [days for _, _, _, days in fake_ingest.calls]
    assert raw[0] == raw[1] == raw[2] and len(raw[0]) == QUICK["days"] == record["days"]
    assert not Path(raw[0][0]).exists()  # the raw days are removed with the benchmark


def test_the_record_names_its_baseline_and_every_ratio(fake_ingest):
    record = run_ingest_days_benchmark(quick=True)
    assert record["baseline"].startswith(BASELINE)
    assert set(record["results"]) == {BASELINE, "dask_2_workers", "threads"}
    assert set(record["ratios"]) == {f"dask_2_workers_vs_{BASELINE}", f"threads_vs_{BASELINE}"}
    base = record["results"][BASELINE]["days_per_minute"]
    for name, result in record["results"].items():
        assert result["days_per_minute"] == pytest.approx(60 * record["days"] / result["seconds"])
        if name != BASELINE:
            ratio = record["ratios"][f"{name}_vs_{BASELINE}"]
            assert ratio == pytest.approx(result["days_per_minute"] / base)
    assert (record["rows_per_day"], record["repeats"]) == (QUICK["rows_per_day"], 1)


def test_the_report_section_has_a_row_per_runner(fake_ingest):
    record = run_ingest_days_benchmark(quick=True)
    section = report_section(ingest_days_section, record)
    assert section.startswith("## Ingest days on Dask")
    assert f"{record['days']} raw days of {record['rows_per_day']:,} rows" in section
    assert [row[0] for row in table_rows(section)] == list(record["results"])

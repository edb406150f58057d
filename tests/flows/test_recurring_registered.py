"""The recurring flow over a team's registered Parquet: each run's ``land`` subflow
registers the day partitions that landed under the dataset, and the run trains them, as
``dlrmflow line`` does; a late partition fails the run naming it."""

from __future__ import annotations

from pathlib import Path

from dlrmflow.flows.recurring import recurring_flow
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.register import register_dataset
from dlrmflow.train.line.line import versions
from tests.conftest import tiny_run_config
from tests.flows.records import run_records
from tests.ingest.own_data import SCHEMA, write_own_dataset
from tests.ingest.test_registered_days import land_day


def test_each_run_registers_the_partitions_that_landed(prefect_api, tmp_path: Path) -> None:
    data = write_own_dataset(tmp_path / "data", days=2, rows=300, partition="dt")
    register_dataset(str(data), SCHEMA)
    line = tmp_path / "line"
    config = tiny_run_config(str(data), tmp_path / "unused", batch_size=100)
    config.gate.calibration_min, config.gate.calibration_max = 0.1, 10.0
    config.gate.ne_margin = 1.0  # tiny days: every version is promoted
    first = recurring_flow(str(line), config, return_state=True)
    assert first.is_completed(), first.message
    assert [v["day"] for v in first.result()["trained"]] == [0, 1]

    land_day(data, "dt=2026-11-03", seed=5, rows=300)
    second = recurring_flow(str(line), return_state=True)
    assert second.is_completed() and second.message == "trained day(s) 2", second.message
    records = run_records(second.state_details.flow_run_id)
    assert [s.name for s in records.subflows] and records.subflows[0].state.is_completed()
    assert read_manifest(str(data)).days == 3
    assert [v.day for v in versions(line)] == [0, 1, 2]

    late = land_day(data, "dt=2026-10-30", seed=6, rows=300)
    third = recurring_flow(str(line), return_state=True)
    assert third.is_failed() and str(late) in third.message, third.message
    assert [v.day for v in versions(line)] == [0, 1, 2]

"""The recurring flow on the session's Prefect server: raw days land in a folder, each run
converts what landed and trains the line on it; a run with no new day trains nothing and
says so; a version the gate holds back ends the run visibly not Completed. And ``dlrmflow
backfill``, which runs the flow a day at a time."""

from __future__ import annotations

import json
from pathlib import Path

from dlrmflow.config import RunConfig
from dlrmflow.flows.recurring import GATE_KEY, HELD_BACK, HISTORY_KEY, recurring_flow
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.train.line.line import history, versions
from tests.conftest import run_cli, tiny_run_config
from tests.flows.records import run_records

LINES_A_DAY = 50


def land(landing: Path, sample: Path, day: int) -> None:
    """Day ``day`` lands: 50 lines of the sample, copied in under a temporary name and
    renamed, as a transfer tool would."""
    lines = sample.read_text().splitlines(keepends=True)
    landing.mkdir(exist_ok=True)
    part = landing / f"day_{day}.tsv.part"
    part.write_text("".join(lines[day * LINES_A_DAY : (day + 1) * LINES_A_DAY]))
    part.rename(landing / f"day_{day}.tsv")


def line_config(tmp_path: Path, landing: Path) -> RunConfig:
    config = tiny_run_config(str(tmp_path / "data"), tmp_path / "unused", batch_size=16)
    config.data.landing = str(landing)
    # 50-row days: their NE and calibration are noise, and every version is to be promoted.
    config.gate.calibration_min, config.gate.calibration_max = 0.1, 10.0
    config.gate.ne_margin = 1.0
    return config


def test_each_run_trains_the_days_that_landed(prefect_api, tmp_path: Path, criteo_sample: Path):
    landing, line = tmp_path / "landing", tmp_path / "line"
    config = line_config(tmp_path, landing)
    land(landing, criteo_sample, 0)  # a line starts on a dataset of one day
    first = recurring_flow(str(line), config, return_state=True)
    assert first.is_completed(), first.message
    assert [v["day"] for v in first.result()["trained"]] == [0]
    assert read_manifest(str(tmp_path / "data")).days == 1

    land(landing, criteo_sample, 1)
    land(landing, criteo_sample, 2)
    second = recurring_flow(str(line), return_state=True)
    assert second.is_completed() and second.message == "trained day(s) 1, 2"
    records = run_records(second.state_details.flow_run_id)
    assert len(records.tasks("day-1")) == len(records.tasks("day-2")) == 1
    assert [s.name for s in records.subflows] and records.subflows[0].state.is_completed()
    assert [r["day"] for r in json.loads(records.artifact(HISTORY_KEY).data)] == [1, 2]
    gate = records.artifact(GATE_KEY).data
    assert "version 0000 **promoted** on day 1" in gate
    assert "version 0001 **promoted** on day 2" in gate

    written = {p: p.stat().st_mtime_ns for p in line.rglob("*") if p.is_file()}
    idle = recurring_flow(str(line), return_state=True)
    assert idle.is_completed()
    assert idle.message == f"no new day in {tmp_path / 'data'} (the line has trained days 0-2)"
    assert idle.result()["trained"] == []
    assert {p: p.stat().st_mtime_ns for p in line.rglob("*") if p.is_file()} == written

    # A gate no version can pass: the run trains its day but ends HeldBack, saying why.
    land(landing, criteo_sample, 3)
    strict = config.model_copy(deep=True)
    strict.gate.calibration_max, strict.gate.calibration_min = 60.0, 50.0
    held = recurring_flow(str(line), strict, return_state=True)
    assert held.is_failed() and held.name == HELD_BACK
    assert held.message.startswith("version 0002 held back on day 3: recalibrated calibration ")
    assert "outside [50.0, 60.0]" in held.message
    assert [v.day for v in versions(line)] == [0, 1, 2, 3]
    assert json.loads((line / "models" / "current" / "model.json").read_text())["number"] == 1
    gate = run_records(held.state_details.flow_run_id).artifact(GATE_KEY).data
    assert "version 0002 **held back** on day 3" in gate and "Serving: version 0001" in gate
    assert [r["day"] for r in history(line)] == [1, 2, 3]


def test_backfill_runs_the_flow_a_day_at_a_time(
    prefect_api, tmp_path: Path, criteo_sample: Path, monkeypatch, capsys
):
    landing, line = tmp_path / "landing", str(tmp_path / "line")
    for day in range(3):
        land(landing, criteo_sample, day)
    (tmp_path / "line.json").write_text(line_config(tmp_path, landing).model_dump_json())
    args = ["backfill", "--line", line, "--config", str(tmp_path / "line.json")]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--through", "1")
    assert code == 0, err
    result = json.loads(out)
    assert [r["state"] for r in result["runs"]] == ["Completed", "Completed"]
    assert result["versions"] == 2 and [r["day"] for r in result["history"]] == [1]

    code, out, err = run_cli(monkeypatch, capsys, "backfill", "--line", line)
    assert code == 0, err
    runs = json.loads(out)["runs"]
    assert [r["message"] for r in runs] == ["trained day(s) 2"]
    code, out, err = run_cli(monkeypatch, capsys, "backfill", "--line", line)
    assert code == 0 and json.loads(out)["versions"] == 3
    assert json.loads(out)["runs"][0]["message"].startswith("no new day")

    for through in ("7", "0"):  # at most: days not there yet, or trained already
        code, out, err = run_cli(
            monkeypatch, capsys, "backfill", "--line", line, "--through", through
        )
        assert code == 0, err
        assert json.loads(out)["runs"][0]["message"].startswith("no new day")


def test_max_days_must_be_positive(prefect_api, tmp_path: Path):
    state = recurring_flow(str(tmp_path / "line"), None, max_days=0, return_state=True)
    assert state.is_failed() and "max_days must be >= 1 (got 0)" in state.message


def test_an_empty_landing_folder_fails_naming_it_and_writes_no_dataset(prefect_api, tmp_path: Path):
    # An empty list of raw inputs once sent the ingest flow to the synthetic generator.
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "day_0.tsv.part").write_text("still being copied\n")
    state = recurring_flow(
        str(tmp_path / "line"), line_config(tmp_path, landing), return_state=True
    )
    assert state.is_failed()
    assert f"{landing}: no raw day file in the landing directory" in state.message
    assert not (tmp_path / "data").exists()

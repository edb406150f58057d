"""A line over a team's own registered Parquet: a version a day in day order, validated on
the next day; a day partition that lands later is registered alone and trained as the next
version, the versions before untouched; a late partition and a registered file rewritten
are refused in one line naming them, with nothing scored or written."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.register import register_dataset
from dlrmflow.train.line.line import history, train_line, versions
from dlrmflow.train.run.trainer import train
from tests.conftest import run_cli, same_weights, tiny_run_config
from tests.ingest.own_data import SCHEMA, write_own_dataset
from tests.ingest.test_registered_days import land_day

ROWS = 400


def _version_records(line: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in sorted(line.glob("versions/*/version.json"))}


def test_a_line_over_a_registered_dataset_trains_each_day_that_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    data = write_own_dataset(tmp_path / "data", days=3, rows=ROWS, partition="dt")
    register_dataset(str(data), SCHEMA)
    line = tmp_path / "line"
    config = tiny_run_config(str(data), tmp_path / "unused", batch_size=100)
    start = tmp_path / "line.json"
    start.write_text(config.model_dump_json())

    code, out, err = run_cli(
        monkeypatch, capsys, "line", "--line", str(line), "--config", str(start)
    )
    assert code == 0, err
    trained = json.loads(out)["trained"]
    assert [(v["number"], v["day"], v["days"]) for v in trained] == [
        (0, 0, [0]),
        (1, 1, [0, 1]),
        (2, 2, [0, 1, 2]),
    ]
    # A pass a day, each the day's rows: the run's rows grow by a day's at each version.
    assert [v["rows"] for v in trained] == [ROWS, 2 * ROWS, 3 * ROWS]
    assert [r["day"] for r in history(line)] == [1, 2]
    assert all(0.5 < r["auc"] <= 1 and r["rows"] == ROWS for r in history(line))
    records, manifest = _version_records(line), read_manifest(str(data))

    late = land_day(data, "dt=2026-10-31", seed=9)  # sorts before the registered days
    code, _, err = run_cli(monkeypatch, capsys, "line", "--line", str(line))
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {late}: landed after dt=2026-11-03 (day 2) was registered")
    late.rename(data.parent / late.name)  # moved out of the dataset

    part = data / "dt=2026-11-02" / "part-1.parquet"
    saved = part.read_bytes()
    pq.write_table(pq.read_table(part), part, row_group_size=50)  # the same rows, rewritten
    code, _, err = run_cli(monkeypatch, capsys, "line", "--line", str(line))
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {part}: rewritten since it was registered as day 1")
    part.write_bytes(saved)  # restored
    assert read_manifest(str(data)) == manifest and _version_records(line) == records
    assert [r["day"] for r in history(line)] == [1, 2]  # nothing scored meanwhile

    land_day(data, "dt=2026-11-04", seed=10, rows=ROWS)  # the next day lands
    [fourth] = train_line(line).made
    assert (fourth.number, fourth.day, fourth.days, fourth.rows) == (3, 3, [0, 1, 2, 3], 4 * ROWS)
    assert fourth.validation is not None and fourth.validation["day"] == 3
    grown = read_manifest(str(data))
    assert grown.files[: len(manifest.files)] == manifest.files  # the registered days kept
    assert {f.day for f in grown.files} == {0, 1, 2, 3}
    # The versions stand as they were, but version 2, validated on day 3, has its shift.
    now = {k: json.loads(v) for k, v in _version_records(line).items() if k in records}
    before = json.loads(records["0002"])
    assert before.pop("recalibration") is None and now["0002"].pop("recalibration")["day"] == 3
    assert now["0002"] == before
    assert all(now[k] == json.loads(v) for k, v in records.items() if k != "0002")
    assert [v.day for v in versions(line)] == [0, 1, 2, 3]
    assert train_line(line).made == []  # nothing new: nothing registered, nothing trained

    # One run over the four days in day order ends where the line's versions end.
    whole = tiny_run_config(str(data), tmp_path / "whole", batch_size=100)
    whole.train.order, whole.data.train_days, whole.data.eval_days = "days", "0-3", "none"
    train(whole)
    same_weights(line / "versions" / "0003" / "checkpoint", tmp_path / "whole")

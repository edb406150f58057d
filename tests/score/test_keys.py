"""Key columns in score's output: the columns that identify a row (declared in the
dataset's schema, or chosen with --keys) beside each prediction, with their own types, in
the order of the rows, at one process and two; a file without one is one line. The data
is a flat folder whose days are in a date column, so that such a dataset is trained and
scored here too."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmflow.config import build_config
from dlrmflow.flows.score import SCORES_KEY, score_flow
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.register import register_dataset
from dlrmflow.score.output import SCORES_FILE, ScoresDirError
from dlrmflow.score.score import score_dataset
from dlrmflow.train.run.trainer import train
from tests.conftest import run_cli
from tests.flows.records import run_records
from tests.ingest.own_data import SCHEMA, own_day

# A key that is no feature (an int64 request ID), one that is (the string user ID), and
# one of a type no feature takes (a timestamp with a time zone).
KEYS = ("request_id", "user_id", "seen_at")
KEYED = SCHEMA.model_copy(update={"keys": KEYS, "day_column": "date"})
ROWS = 1200  # a day: two files of three row groups each
SEEN_AT = pa.timestamp("ms", tz="UTC")


def _write_days(root: Path, days: int) -> dict[int, pa.Table]:
    """``days`` days of two files each (``D-a.parquet``, ``D-b.parquet``) in one folder,
    each row's day in its ``date`` column; each day's table in row order."""
    rng = np.random.default_rng(3)
    tables = {}
    for day in range(days):
        table, _ = own_day(rng, ROWS)
        # Request IDs unlike day-rows, so a key is never the row number by accident.
        table = table.set_column(
            table.schema.get_field_index("request_id"),
            "request_id",
            pa.array(rng.permutation(ROWS) + 10_000 * day, pa.int64()),
        )
        seen = 1_790_000_000_000 + np.arange(ROWS, dtype=np.int64) * 1000 + day
        table = table.append_column("seen_at", pa.array(seen, pa.int64()).cast(SEEN_AT))
        date = dt.date(2026, 11, 1) + dt.timedelta(days=day)
        table = table.append_column("date", pa.array([date] * ROWS, pa.date32()))
        root.mkdir(parents=True, exist_ok=True)
        half = ROWS // 2
        pq.write_table(table.slice(0, half), root / f"{day}-a.parquet", row_group_size=200)
        pq.write_table(table.slice(half), root / f"{day}-b.parquet", row_group_size=200)
        tables[day] = table
    return tables


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, dict[int, pa.Table]]:
    """A registered own-data dataset declaring key columns, and a run trained on it."""
    root = tmp_path_factory.mktemp("keyed")
    tables = _write_days(root / "data", 3)
    register_dataset(str(root / "data"), KEYED)
    config = build_config(
        {
            "run_dir": str(root / "run"),
            "data": {"url": str(root / "data")},
            "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8]},
            "train": {"batch_size": 256, "num_workers": 0, "max_steps": 2},
        }
    )
    train(config)
    return str(root / "run"), str(root / "data"), tables


def _parts(out: Path) -> list[pa.Table]:
    return [pq.read_table(p) for p in sorted(out.glob("day-*/part-*.parquet"))]


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_schemas_keys_are_copied_beside_each_prediction_in_row_order(
    keyed, tmp_path, nproc, monkeypatch, capsys
):
    run, data, tables = keyed
    out = tmp_path / "out"
    args = ["--model", run, "--data", data, "--out", str(out), "--days", "1-2"]
    code, printed, err = run_cli(monkeypatch, capsys, "score", *args, "--nproc", str(nproc))
    assert code == 0, err
    assert json.loads(printed)["keys"] == list(KEYS)
    parts = _parts(out)
    assert len(parts) == 2 * nproc
    for part in parts:
        assert part.schema.names == ["day", "row", "label", "prediction", *KEYS]
        assert part.schema.field("seen_at").type == SEEN_AT  # the column's own type
        assert part.schema.field("user_id").type == pa.string()
        [day] = set(part["day"].to_pylist())
        rows = part["row"].to_numpy()
        assert (np.diff(rows) > 0).all()  # a part's rows in read order
        # Each row's keys are its own: taken from the day's table at its row.
        want = tables[day].select(list(KEYS)).take(pa.array(rows))
        assert part.select(list(KEYS)).equals(want)
    assert sum(p.num_rows for p in parts) == 2 * ROWS
    manifest = json.loads((out / SCORES_FILE).read_text())
    assert manifest["keys"] == list(KEYS)
    assert manifest["columns"] == ["day", "row", "label", "prediction", *KEYS]


def test_keys_chosen_at_score_time_and_none(keyed, tmp_path):
    run, data, tables = keyed
    result = score_dataset(run, data, tmp_path / "one", days="2", keys="seen_at", max_rows=300)
    [part] = _parts(tmp_path / "one")
    assert result["keys"] == ["seen_at"]
    assert part.column_names == ["day", "row", "label", "prediction", "seen_at"]
    assert part["seen_at"].equals(tables[2]["seen_at"].slice(0, 300))
    result = score_dataset(run, data, tmp_path / "none", days="2", keys="")
    [part] = _parts(tmp_path / "none")
    assert "keys" not in result and part.column_names == ["day", "row", "label", "prediction"]
    manifest = json.loads((tmp_path / "none" / SCORES_FILE).read_text())
    assert "keys" not in manifest and manifest["columns"] == part.column_names


def test_an_output_of_other_keys_is_refused_unless_overwritten(keyed, tmp_path):
    run, data, _ = keyed
    out = tmp_path / "out"
    score_dataset(run, data, out, days="2", keys="request_id")
    with pytest.raises(ScoresDirError, match=r"key columns request_id \(this run asks for none\)"):
        score_dataset(run, data, out, days="2", keys=[])
    score_dataset(run, data, out, days="2", keys=[], overwrite=True)
    assert _parts(out)[0].column_names == ["day", "row", "label", "prediction"]


def test_a_declared_key_missing_from_a_file_is_one_line_naming_file_and_column(keyed, tmp_path):
    run, data, _ = keyed
    manifest = json.loads((Path(data) / "manifest.json").read_text())
    manifest["features"]["keys"] = ["request_id", "session"]
    copy = tmp_path / "data"
    copy.mkdir()
    for path in Path(data).iterdir():
        if path.name != "manifest.json":
            (copy / path.name).symlink_to(path)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"/1-a.parquet: column session: missing") as e:
        score_dataset(run, str(copy), tmp_path / "out", days="1")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.parquet"))


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ("nosuch", r"/2-a.parquet: column nosuch: missing \(a key column"),
        ("row", r"--keys: key column row: the output has a column of that name"),
        ("user_id,user_id", r"--keys: key column user_id is named twice"),
    ],
)
def test_bad_keys_are_one_line(keyed, tmp_path, keys, message, monkeypatch, capsys):
    run, data, _ = keyed
    args = ["--model", run, "--data", data, "--out", str(tmp_path / "out"), "--days", "2"]
    code, _, err = run_cli(monkeypatch, capsys, "score", *args, "--keys", keys)
    assert code == 1 and len(err) == 1
    assert re.search(message, err[0]), err


def test_keys_are_read_where_the_data_lies_on_s3(keyed, s3_bucket, tmp_path):
    run, data, tables = keyed
    url = f"{s3_bucket}/keyed"
    fs, path = fsspec.core.url_to_fs(url)
    for name in ("0-a", "0-b", "2-a", "2-b"):  # a training day and the one to score
        fs.put(f"{data}/{name}.parquet", f"{path}/{name}.parquet")
    register_dataset(url, KEYED)
    score_dataset(run, url, tmp_path / "out", days="1", keys="seen_at,request_id")
    [part] = _parts(tmp_path / "out")
    assert part.column_names[4:] == ["seen_at", "request_id"]
    want = tables[2].select(["seen_at", "request_id"]).take(pa.array(part["row"].to_numpy()))
    assert part.num_rows == ROWS and part.select(["seen_at", "request_id"]).equals(want)


def test_the_score_flow_takes_keys_as_the_command_does(keyed, tmp_path, prefect_api):
    run, data, tables = keyed
    state = score_flow(
        run, data, str(tmp_path / "out"), days="2", keys=["request_id"], return_state=True
    )
    assert state.result()["keys"] == ["request_id"]
    [part] = _parts(tmp_path / "out")
    want = tables[2]["request_id"].take(pa.array(part["row"].to_numpy()))
    assert part.column_names[4:] == ["request_id"] and part["request_id"].equals(want)
    records = run_records(state.state_details.flow_run_id)
    summary = {row["metric"]: row["value"] for row in json.loads(records.artifact(SCORES_KEY).data)}
    assert summary["keys"] == "request_id"

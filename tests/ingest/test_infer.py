"""``dlrmflow schema``: a feature schema guessed from a dataset's footers and a sample, which
``register`` takes as printed."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dlrmflow.config import DataConfig
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.infer import LABEL_PLACEHOLDER, SCORE_COLUMNS, infer_schema, schema_yaml
from dlrmflow.ingest.register import register_dataset
from dlrmflow.ingest.synthetic_logs import LOGS_SCHEMA, generate_logs_dataset
from dlrmflow.schema import DenseFeature, read_schema
from tests.conftest import run_cli
from tests.ingest.own_data import SCHEMA, own_day, write_own_dataset
from tests.train.run.test_own_data_ops import SCHEMA_YAML as OPS_SCHEMA_YAML
from tests.train.run.test_own_data_ops import write_days


def _write(root: Path, tables: list[pa.Table], partition: str = "day") -> Path:
    for day, table in enumerate(tables):
        folder = root / (f"day={day}" if partition == "day" else f"dt=2026-01-{day + 1:02d}")
        folder.mkdir(parents=True)
        pq.write_table(table, folder / "part-0.parquet")
    return root


def test_the_guess_for_own_data_is_its_schema_and_registers(tmp_path):
    root = write_own_dataset(tmp_path / "own")
    text = schema_yaml(infer_schema(str(root)))
    assert text.startswith("# A feature schema GUESSED from")
    path = tmp_path / "schema.yaml"
    path.write_text(text)
    # Label click, dense price (log), sparse in order, and the request ID as a key.
    assert read_schema(path) == SCHEMA.model_copy(update={"keys": ("request_id",)})
    # The key's line says why it is one.
    key = next(line for line in text.splitlines() if "- request_id" in line)
    assert key.endswith("; unique per row in every file sampled: a key, not a feature")
    # Every feature's line says what the sample showed.
    tags = next(line for line in text.splitlines() if "column: tags" in line)
    assert "list<int64>, null 14%" in tags and "length mean 1.5 max 3" in tags
    price = next(line for line in text.splitlines() if "column: price" in line)
    assert "float, null 9.1%, NaN" in price and "distinct" in price
    manifest = register_dataset(str(root), read_schema(path))
    assert manifest.days == 3 and manifest.rows == 6000


def test_types_and_values_decide_each_role(tmp_path):
    rng = np.random.default_rng(0)
    rows = 4000
    hashes = rng.integers(-(2**62), 2**62, 300)

    def day() -> pa.Table:
        when = datetime.datetime(2026, 1, 1)
        return pa.table(
            {
                "row": pa.array(np.arange(rows), pa.int64()),  # a key, but score's "row"
                "uuid": pa.array([f"r-{i}" for i in range(rows)]),  # a key
                "sent_ts": pa.array(np.arange(rows) + 1.7e12, pa.int64()),  # unique: a time
                "converted": pa.array(rng.integers(0, 2, rows), pa.int8()),  # 0/1: the label
                "is_new": pa.array(rng.integers(0, 2, rows), pa.int8()),  # a 0/1 flag
                "visits": pa.array(rng.geometric(0.01, rows), pa.int32()),  # a count
                "delta": pa.array(rng.normal(0, 1, rows), pa.float64()),  # negative values
                "ratio": pa.array(rng.random(rows), pa.float32()),  # [0, 1], not the label
                "country": pa.array(rng.integers(0, 30, rows), pa.int64()),  # few values
                "shopId": pa.array(rng.integers(0, 5000, rows), pa.int64()),  # named an ID
                "hashed": pa.array(rng.choice(hashes, rows), pa.int64()),  # IDs, hashed
                "store_id": pa.array(rng.integers(0, 100, rows), pa.int32()),  # an ID, int32
                "city": pa.array([f"c{i}" for i in rng.integers(0, 9, rows)]).dictionary_encode(),
                "words": pa.array(
                    [[f"w{i}"] * (i % 3) for i in range(rows)], pa.list_(pa.string())
                ),
                "scores": pa.array([[0.5]] * rows, pa.list_(pa.float32())),
                "small": pa.array([[1]] * rows, pa.list_(pa.int32())),
                "seen": pa.array([when] * rows, pa.timestamp("us")),
                "created_at": pa.array(rng.integers(1, 10**6, rows), pa.int64()),
                "meta": pa.array([{"a": 1}] * rows),
                "blob": pa.array([b"x"] * rows, pa.binary()),
                "flag": pa.array(rng.integers(0, 2, rows).astype(bool)),
                "price": pa.array([1] * rows, pa.decimal128(5, 2)),
                "empty": pa.array([None] * rows, pa.float64()),
                "version": pa.array([3] * rows, pa.int64()),
                "later": pa.array(rng.random(rows), pa.float64()),
            }
        )

    first, second = day(), day()
    second = second.set_column(
        second.schema.get_field_index("later"), "later", second.column("later").cast(pa.float32())
    )
    root = _write(tmp_path / "d", [first, second], partition="dt")
    guess = infer_schema(str(root))
    assert guess.label is not None and guess.label.profile.name == "converted"
    assert guess.days == 2 and guess.files == 2 and guess.rows == 2 * rows
    dense = {g.profile.name: g.transform for g in guess.dense}
    assert dense == {"is_new": "none", "visits": "log", "delta": "none", "ratio": "none"}
    assert [g.profile.name for g in guess.sparse] == [
        "country",
        "shopId",
        "hashed",
        "city",
        "words",
    ]
    assert [g.profile.name for g in guess.keys] == ["uuid"]
    out = dict(guess.left_out)
    assert set(out) == {
        "row",
        "sent_ts",
        "store_id",
        "scores",
        "small",
        "seen",
        "created_at",
        "meta",
        "blob",
        "flag",
        "price",
        "empty",
        "version",
        "later",
    }
    assert out["row"] == (
        "int64, unique per row in every file sampled: a key, but score's output has a column "
        "row (rename it to copy it beside each prediction)"
    )
    assert "named like a time" in out["sent_ts"] and "cast it to int64" in out["store_id"]
    assert "no dense lists" in out["scores"] and "cast its items" in out["small"]
    assert "a time" in out["seen"] and "named like a time" in out["created_at"]
    assert "nested" in out["meta"] and "bytes" in out["blob"] and "int8" in out["flag"]
    assert "decimal" in out["price"] and "always null" in out["empty"]
    assert "one value" in out["version"]
    assert out["later"].startswith("type differs between files: float in ")
    text = schema_yaml(guess)
    path = tmp_path / "schema.yaml"
    path.write_text(text)
    schema = read_schema(path)
    assert schema.label == "converted" and schema.sparse_names[-1] == "words"
    assert schema.keys == ("uuid",)
    # What it prints registers, the file whose type differs aside.
    (root / "dt=2026-01-02" / "part-0.parquet").unlink()
    _write(tmp_path / "again", [first, first], partition="dt")
    register_dataset(str(tmp_path / "again"), schema)


def test_without_a_label_the_placeholder_is_refused_in_one_line(tmp_path):
    rng = np.random.default_rng(1)
    tables = [
        pa.table(
            {
                "item_id": pa.array(rng.integers(0, 50, 500), pa.int64()),
                "rating": pa.array(rng.integers(1, 6, 500).astype(np.float32)),
            }
        )
        for _ in range(2)
    ]
    root = _write(tmp_path / "d", tables)
    text = schema_yaml(infer_schema(str(root)))
    assert "# NO LABEL FOUND" in text
    assert yaml.safe_load(text)["label"] == LABEL_PLACEHOLDER
    path = tmp_path / "schema.yaml"
    path.write_text(text)
    with pytest.raises(DataError) as caught:
        register_dataset(str(root), read_schema(path))
    message = str(caught.value)
    assert message.endswith(f"column {LABEL_PLACEHOLDER}: missing (the schema's label)")
    assert "day=0/part-0.parquet" in message and "\n" not in message


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    root = write_own_dataset(tmp_path / "own", days=2)
    (root / "day=1" / "part-2.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"day=1/part-2.parquet: not a readable Parquet file"):
        infer_schema(str(root))


def test_schema_from_the_command_line(tmp_path):
    root = write_own_dataset(tmp_path / "own", days=2)
    command = [sys.executable, "-m", "dlrmflow", "schema", "--data"]
    env = {**os.environ, "DLRMFLOW_DEBUG": ""}
    done = subprocess.run(command + [str(root)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    path = tmp_path / "schema.yaml"
    path.write_text(done.stdout)
    assert read_schema(path) == SCHEMA.model_copy(update={"keys": ("request_id",)})
    bad = subprocess.run(
        command + [str(tmp_path / "nope")], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'}: no such folder"]


def test_schema_has_help():
    from typer.testing import CliRunner

    from dlrmflow.cli import app

    result = CliRunner().invoke(app, ["schema", "--help"])
    assert result.exit_code == 0 and "guessed" in result.output


def test_long_lists_get_a_max_length_and_number_lists_become_their_weights(tmp_path):
    """A list whose longest are far longer than 99% of them gets ``max_length`` at that
    percentile; a list of numbers as long as a list of IDs row by row is its weights."""
    rng = np.random.default_rng(3)
    rows = 2000

    def day() -> pa.Table:
        lengths = np.where(rng.random(rows) < 0.995, rng.integers(0, 5, rows), 60)
        clicked = [[int(v) for v in rng.integers(0, 500, n)] for n in lengths]
        return pa.table(
            {
                "click": pa.array(rng.integers(0, 2, rows), pa.int8()),
                "clicked": pa.array(clicked, pa.list_(pa.int64())),
                "dwell": pa.array([[1.5] * len(c) for c in clicked], pa.list_(pa.float32())),
                "scores": pa.array([[0.5]] * rows, pa.list_(pa.float32())),
            }
        )

    root = _write(tmp_path / "d", [day(), day()])
    guess = infer_schema(str(root))
    clicked = guess.sparse[0]
    assert clicked.profile.name == "clicked" and clicked.weights == "dwell"
    assert clicked.max_length == 4 and clicked.profile.length_max == 60
    assert dict(guess.left_out).keys() == {"scores"}  # as long as no list of IDs
    text = schema_yaml(guess)
    assert "99% of the sampled lists hold at most 4 IDs, the longest 60" in text
    path = tmp_path / "schema.yaml"
    path.write_text(text)
    schema = read_schema(path)
    assert schema.sparse[0].max_length == 4 and schema.sparse[0].weights == "dwell"
    register_dataset(str(root), schema)


def test_a_key_is_never_named_as_a_column_of_scores_output():
    from dlrmflow.score.output import SCHEMA as OUTPUT

    assert tuple(OUTPUT.names) == SCORE_COLUMNS


@pytest.mark.parametrize(
    ("kind", "hint"),
    [
        (
            pa.timestamp("us", "UTC"),
            "a column of each row's day (seen (timestamp[us, tz=UTC]) in the data)",
        ),
        (pa.int32(), "a date, timestamp or integer column of each row's day"),
    ],
    ids=["timestamp", "integer"],
)
def test_a_flat_folder_is_guessed_with_its_day_column(tmp_path, monkeypatch, capsys, kind, hint):
    """Without day folders the command names the column that could say each row's day;
    with ``--day-column`` the guess declares it (never as a feature) and registers."""
    data = tmp_path / "flat"
    rng = np.random.default_rng(5)
    for offset, name in enumerate(["b.parquet", "more/a.parquet", "c.parquet"]):
        table, _ = own_day(rng, 600)
        day = datetime.datetime(2026, 11, 1 + offset, 8, tzinfo=datetime.UTC)
        value = day if pa.types.is_timestamp(kind) else 20261101 + offset
        table = table.append_column("seen", pa.array([value] * 600, kind))
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, data / name, row_group_size=200)
    code, printed, err = run_cli(monkeypatch, capsys, "schema", "--data", str(data))
    assert code == 1 and printed == ""
    assert err == [
        f"error: {data}: no day partitions; expected day=N/ or dt=YYYY-MM-DD/ folders of "
        f"Parquet, or --day-column naming {hint}"
    ]
    code, printed, err = run_cli(
        monkeypatch, capsys, "schema", "--data", str(data), "--day-column", "seen"
    )
    assert code == 0, err
    day_line = next(line for line in printed.splitlines() if line.startswith("day_column:"))
    assert day_line.endswith("# " + f"{kind}: each row's day; register groups the files by it")
    assert "seen" not in printed.replace(day_line, "")  # not a feature, nor left out
    path = tmp_path / "schema.yaml"
    path.write_text(printed)
    guessed = read_schema(path)
    assert guessed == SCHEMA.model_copy(update={"keys": ("request_id",), "day_column": "seen"})
    manifest = register_dataset(str(data), guessed)
    assert {f.path: f.day for f in manifest.files} == {
        "b.parquet": 0,
        "more/a.parquet": 1,
        "c.parquet": 2,
    }


def _guess_and_register(monkeypatch, capsys, data: Path, schema: Path):
    """``dlrmflow schema --data`` into ``schema``, then ``dlrmflow register`` with it as
    printed: the guessed schema and register's JSON."""
    code, printed, err = run_cli(monkeypatch, capsys, "schema", "--data", str(data))
    assert code == 0, err
    schema.write_text(printed)
    code, registered, err = run_cli(
        monkeypatch, capsys, "register", "--data", str(data), "--schema", str(schema)
    )
    assert code == 0, err
    return read_schema(schema), json.loads(registered)


def test_the_logs_shapes_files_round_trip_through_the_guess(tmp_path, monkeypatch, capsys):
    """``generate --shape logs`` writes a team's logs and declares their schema: the guess
    from its files alone is that schema but for the two things the data cannot show (that
    discount's values outside [0, 1] are logging errors to clip, and that ``item_id`` and
    ``recent_items`` name the same items, to look up in one table), and registers as it is."""
    generated = tmp_path / "generated"
    generate_logs_dataset(
        DataConfig(
            url=str(generated),
            days=3,
            rows_per_day=2000,
            row_group_size=500,
            cardinality_scale=0.0001,
        )
    )
    data = tmp_path / "logs"  # the files alone, as a team's own
    for path in generated.rglob("*.parquet"):
        (data / path.relative_to(generated)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, data / path.relative_to(generated))
    guessed, registered = _guess_and_register(monkeypatch, capsys, data, tmp_path / "s.yaml")
    # Declared clipped to [0, 1]; the guess, seeing -1 and 100, passes the values on.
    assert LOGS_SCHEMA.dense[1] == DenseFeature(
        column="discount", transform="clip", clip_min=0.0, clip_max=1.0
    )
    discount = DenseFeature(column="discount", transform="none")
    # Declared in one table, items; the guess gives each column a table of its own.
    assert [f.table for f in LOGS_SCHEMA.sparse] == [None, "items", "items", None]
    own_tables = tuple(f.model_copy(update={"table": None}) for f in LOGS_SCHEMA.sparse)
    assert guessed == LOGS_SCHEMA.model_copy(
        update={"dense": (LOGS_SCHEMA.dense[0], discount), "sparse": own_tables}
    )
    assert registered["days"] == 3 and registered["rows"] == 6000
    assert registered["partitions"] == ["day=0", "day=1", "day=2"]


def test_the_operations_datas_guess_registers_and_gets_what_data_shows(
    tmp_path, monkeypatch, capsys
):
    """The own data of the operations' end-to-end test: the guess registers as printed,
    with the label, the sparse columns and the per-ID weights that the schema file
    declares; what only the user knows (which number weighs examples, the transforms,
    the list cut, the cross) is left to edit."""
    data = tmp_path / "data"
    write_days(data, days=3, rows=600)
    guessed, registered = _guess_and_register(monkeypatch, capsys, data, tmp_path / "s.yaml")
    path = tmp_path / "declared.yaml"
    path.write_text(OPS_SCHEMA_YAML)
    declared = read_schema(path)
    assert guessed.label == declared.label and guessed.keys == ("request_id",)
    assert [(f.column, f.weights) for f in guessed.sparse] == [
        (f.column, f.weights) for f in declared.sparse
    ]
    # The example weight column is a number like any dense feature to a guess.
    assert guessed.dense_names == (*declared.dense_names[:1], declared.weight, "quantity")
    assert registered["days"] == 3 and registered["rows"] == 1800

"""``dlrmflow schema``: a feature schema guessed from a dataset's footers and a sample, which
``register`` takes as printed."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dlrmflow.ingest.infer import LABEL_PLACEHOLDER, infer_schema, schema_yaml
from dlrmflow.ingest.reader import DataError
from dlrmflow.ingest.register import register_dataset
from dlrmflow.schema import read_schema
from tests.ingest.own_data import SCHEMA, write_own_dataset


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
    assert read_schema(path) == SCHEMA  # label click, dense price (log), sparse in order
    # The per-file row number is a key, left out with the reason.
    assert "#   request_id: int64, unique per row in every file sampled: a key" in text
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
                "row": pa.array(np.arange(rows), pa.int64()),  # a key
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
    out = dict(guess.left_out)
    assert set(out) == {
        "row",
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
    assert "a key" in out["row"] and "cast it to int64" in out["store_id"]
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
    assert read_schema(path) == SCHEMA
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

"""Registering a team's own day-partitioned Parquet where it lies, under a declared schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import check_dataset, read_manifest
from dlrmflow.ingest.register import register_dataset
from dlrmflow.ingest.stats.results import read_stats
from dlrmflow.schema import SchemaError, criteo_schema, parse_schema, read_schema
from tests.ingest.own_data import SCHEMA, SCHEMA_YAML, write_own_dataset


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("partition", ["day", "dt"])
def test_registering_writes_only_a_manifest_and_statistics(tmp_path, partition):
    root = write_own_dataset(tmp_path / "own", partition=partition)
    before = _files(root)
    manifest = register_dataset(str(root), SCHEMA)
    after = _files(root)
    assert {k: v for k, v in after.items() if k in before} == before  # no data touched
    assert sorted(set(after) - set(before)) == [".lock", "manifest.json", "stats.json"]
    assert manifest.source == "registered" and manifest.days == 3 and manifest.test_day == 2
    assert [f.day for f in manifest.files] == [0, 0, 1, 1, 2, 2]
    assert manifest.rows == 6000 and manifest.multi_hot
    clicks = sum(
        pq.read_table(root / f.path, columns=["click"]).column(0).to_numpy().sum()
        for f in manifest.files
    )
    assert manifest.positive_rate == pytest.approx(clicks / 6000)
    assert parse_schema(manifest.features, "manifest") == SCHEMA
    # Distinct IDs size the tables: strings and lists counted as the transform maps them.
    assert 45 < manifest.cardinalities["user_id"] < 70
    assert 85 < manifest.cardinalities["item_id"] < 115
    assert 40 <= manifest.cardinalities["tags"] <= 60
    stats = read_stats(str(root))
    [price] = stats.dense
    assert price.name == "price" and price.missing > 0 and price.min > 0
    check_dataset(str(root), manifest)


def test_a_rewritten_file_is_caught_without_reading_its_data(tmp_path):
    root = write_own_dataset(tmp_path / "own")
    manifest = register_dataset(str(root), SCHEMA)
    path = root / manifest.files[0].path
    table = pq.read_table(path)
    # The same rows in other row groups: the same size is likely, the footer is not.
    pq.write_table(table, path, row_group_size=250)
    with pytest.raises(DataError, match=r"day 0: .*part-0.parquet: rewritten or replaced"):
        check_dataset(str(root), read_manifest(str(root)))


def test_registering_again_after_a_day_lands_keeps_the_days_before(tmp_path):
    root = write_own_dataset(tmp_path / "own", days=2)
    first = register_dataset(str(root), SCHEMA)
    write_own_dataset(tmp_path / "more", days=3, seed=1)
    (tmp_path / "more" / "day=2").rename(root / "day=2")
    seen = []
    second = register_dataset(str(root), SCHEMA, progress=seen.append)
    assert second.files[:4] == first.files and second.days == 3 and second.test_day == 2
    assert sum(seen) == 2000  # only the new day's labels were read


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.drop_columns(["item_id"]), r"day=1/part-1.parquet: column item_id: missing"),
        (
            lambda t: t.set_column(2, "item_id", t.column("item_id").cast(pa.int32())),
            r"day=1/part-1.parquet: column item_id: type int32 cannot be a sparse feature",
        ),
        (
            lambda t: t.set_column(1, "user_id", pa.array(range(len(t)), pa.int64())),
            r"day=1/part-1.parquet: column user_id: type int64, but .*day=0/part-0.parquet has "
            r"string: every day must have the same types",
        ),
        (
            lambda t: t.set_column(0, "click", pa.array([None] + [1] * (len(t) - 1), pa.int8())),
            r"day=1/part-1.parquet, row group 0, column click: 1 null labels",
        ),
        (
            lambda t: t.set_column(0, "click", pa.array([2] * len(t), pa.int8())),
            r"day=1/part-1.parquet, row group 0, column click: 1000 labels not 0 or 1",
        ),
        (
            lambda t: t.set_column(
                0, "click", pa.array([1.5] + [0.5] * (len(t) - 1), pa.float32())
            ),
            r"column click: type float, but .*has int8",
        ),
    ],
    ids=[
        "missing-column",
        "wrong-type",
        "type-changes-between-days",
        "null-label",
        "label-2",
        "label-type",
    ],
)
def test_data_that_does_not_fit_the_schema_fails_naming_file_and_column(tmp_path, change, message):
    root = write_own_dataset(tmp_path / "own")
    path = root / "day=1" / "part-1.parquet"
    pq.write_table(change(pq.read_table(path)), path, row_group_size=1000)
    with pytest.raises(DataError, match=message):
        register_dataset(str(root), SCHEMA)
    assert not (root / "manifest.json").exists()


def test_soft_and_boolean_labels_are_labels(tmp_path):
    root = write_own_dataset(tmp_path / "own")
    for path in root.rglob("*.parquet"):
        table = pq.read_table(path)
        soft = pa.array(table.column("click").to_numpy() * 0.5 + 0.25, pa.float32())
        pq.write_table(table.set_column(0, "click", soft), path)
    manifest = register_dataset(str(root), SCHEMA)
    assert 0.25 <= manifest.positive_rate <= 0.75


def test_partitions_that_are_not_days_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"no day partitions; expected day=N/ or dt="):
        register_dataset(str(tmp_path), SCHEMA)
    write_own_dataset(tmp_path / "one", days=1)
    with pytest.raises(DataError, match="one day partition"):
        register_dataset(str(tmp_path / "one"), SCHEMA)


def test_a_schema_file_with_a_mistake_is_named(tmp_path):
    good = tmp_path / "schema.yaml"
    good.write_text(SCHEMA_YAML)
    assert read_schema(good) == SCHEMA
    bad = tmp_path / "bad.yaml"
    bad.write_text(SCHEMA_YAML.replace("transform: log", "transform: logarithm"))
    with pytest.raises(SchemaError, match=r"bad.yaml: dense.0.transform: Input should be"):
        read_schema(bad)
    twice = tmp_path / "twice.yaml"
    twice.write_text(SCHEMA_YAML + "  - column: price\n")
    with pytest.raises(SchemaError, match="column price is declared twice"):
        read_schema(twice)
    assert criteo_schema().is_criteo and not SCHEMA.is_criteo


def test_register_from_the_command_line(tmp_path):
    root = write_own_dataset(tmp_path / "own")
    schema = tmp_path / "schema.yaml"
    schema.write_text(SCHEMA_YAML)
    command = [sys.executable, "-m", "dlrmflow", "register", "--data", str(root)]
    done = subprocess.run(command + ["--schema", str(schema)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["days"] == 3 and result["partitions"] == ["day=0", "day=1", "day=2"]
    missing = subprocess.run(
        command + ["--schema", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, "DLRMFLOW_DEBUG": ""},
    )
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope.yaml'}: cannot read the schema: No such file or directory"
    ]

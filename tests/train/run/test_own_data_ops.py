"""A team's own Parquet declaring the schema's feature operations, end to end through the
commands: ``dlrmflow register`` with a schema file that weighs examples, cuts a list to its
last IDs with per-ID weights, crosses two columns, bucketizes and standardizes, then
``dlrmflow train`` for a few steps and ``dlrmflow evaluate``. The checkpoint's spec carries
every operation, and a bad per-ID weight stops training in one line naming file, row
group and column."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from typer.testing import CliRunner

from dlrmflow.cli import app
from dlrmflow.ingest.dayfile import footer_digest
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.stats.results import read_stats
from dlrmflow.schema import read_schema
from dlrmflow.score.score import score_dataset
from dlrmflow.train.run.checkpoint import load_checkpoint
from tests.ingest.own_data import own_day

runner = CliRunner()

SCHEMA_YAML = """\
label: click
weight: importance
dense:
  - column: price
    transform: standardize
    mean: 20.0
    std: 14.0
  - column: quantity
    transform: bucketize
    boundaries: [1, 3, 10]
sparse:
  - column: user_id
  - column: item_id
  - column: tags
    max_length: 2
    keep: last
    weights: tag_weights
crosses:
  - name: user_x_item
    columns: [user_id, item_id]
    rows: 4096
"""


def write_days(root: Path, days: int = 3, rows: int = 1200, bad: bool = False) -> None:
    """``own_day``'s logs plus a weight a row, a weight per tag and an integer quantity."""
    rng = np.random.default_rng(7)
    for day in range(days):
        table, _ = own_day(rng, rows)
        tags = table.column("tags").to_pylist()
        weights = [None if t is None else [0.5 + (v % 3) for v in t] for t in tags]
        if bad and day == 1:
            weights[5] = [1.0] * (len(tags[5] or []) + 1)  # one weight too many
        table = table.append_column("tag_weights", pa.array(weights, pa.list_(pa.float32())))
        table = table.append_column("importance", pa.array(rng.uniform(0.5, 2.0, rows)))
        table = table.append_column("quantity", pa.array(rng.integers(0, 20, rows), pa.int32()))
        folder = root / f"day={day}"
        folder.mkdir(parents=True)
        pq.write_table(table, folder / "part-0.parquet", row_group_size=400)


def register_days(root: Path, schema_yaml: str, days: int = 2, rows: int = 800) -> Path:
    """``write_days`` under ``root/data``, registered with ``schema_yaml``; the data's path."""
    data = root / "data"
    write_days(data, days=days, rows=rows)
    schema = root / "schema.yaml"
    schema.write_text(schema_yaml)
    result = runner.invoke(app, ["register", "--data", str(data), "--schema", str(schema)])
    assert result.exit_code == 0, result.output
    return data


def invoke(*args: str) -> dict:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


TRAIN = ("--set", "train.batch_size=200", "--set", "train.num_workers=0")
MODEL = ("--set", "model.embedding_dim=8", "--set", "model.bottom_mlp=[16,8]")


def test_register_then_train_and_evaluate_with_every_operation(tmp_path):
    data = tmp_path / "data"
    write_days(data)
    schema = tmp_path / "schema.yaml"
    schema.write_text(SCHEMA_YAML)
    runner_result = runner.invoke(app, ["register", "--data", str(data), "--schema", str(schema)])
    assert runner_result.exit_code == 0, runner_result.output
    run_dir = str(tmp_path / "run")
    trained = invoke(
        "train", "--run-dir", run_dir, "--data", str(data), *TRAIN, *MODEL,
        "--set", "train.max_steps=8",
    )  # fmt: skip
    assert trained["steps"] == 8
    spec = load_checkpoint(run_dir).spec
    assert spec.weight == "importance"
    assert spec.dense == ("price",)
    assert (spec.dense_transforms[0].mean, spec.dense_transforms[0].std) == (20.0, 14.0)
    features = {f.name: f for f in spec.sparse}
    assert list(features) == ["user_id", "item_id", "tags", "quantity", "user_x_item"]
    assert (features["tags"].max_length, features["tags"].keep) == (2, "last")
    assert features["tags"].weights == "tag_weights"
    assert features["quantity"].bucketize.boundaries == (1.0, 3.0, 10.0)
    assert features["quantity"].num_embeddings == 4
    assert features["user_x_item"].cross == ("user_id", "item_id")
    assert features["user_x_item"].num_embeddings == 4096
    evaluated = invoke("evaluate", "--run-dir", run_dir)
    assert evaluated["rows"] == 1200 and 0.0 < evaluated["auc"] < 1.0


def test_a_bad_per_id_weight_stops_training_in_one_line(tmp_path):
    data = tmp_path / "data"
    write_days(data, bad=True)
    schema = tmp_path / "schema.yaml"
    schema.write_text(SCHEMA_YAML)
    assert (
        runner.invoke(app, ["register", "--data", str(data), "--schema", str(schema)]).exit_code
        == 0
    )
    result = runner.invoke(
        app, ["train", "--run-dir", str(tmp_path / "run"), "--data", str(data), *TRAIN, *MODEL]
    )
    # The command prints a DataError as its one line and exits 1 (``dlrmflow.cli.main``).
    assert result.exit_code == 1 and isinstance(result.exception, DataError)
    line = str(result.exception)
    assert "\n" not in line
    assert "day=1/part-0.parquet, row group 0: column tag_weights: 1 row(s) whose weights " in line
    assert "are not as many as feature tags's IDs (e.g. row 5: 1 IDs, 2 weights)" in line


def test_the_schema_file_reads_with_its_operations(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SCHEMA_YAML)
    schema = read_schema(path)
    assert schema.sparse[2].keep == "last" and schema.weight_columns == ("tag_weights",)
    assert schema.crosses[0].columns == ("user_id", "item_id")


def test_a_changed_operation_is_refused_on_resume_naming_the_feature(tmp_path):
    data = tmp_path / "data"
    write_days(data, days=2, rows=600)
    schema = tmp_path / "schema.yaml"
    schema.write_text(SCHEMA_YAML)
    assert (
        runner.invoke(app, ["register", "--data", str(data), "--schema", str(schema)]).exit_code
        == 0
    )
    run_dir = str(tmp_path / "run")
    sets = (*TRAIN, *MODEL, "--set", "train.max_steps=2")
    invoke("train", "--run-dir", run_dir, "--data", str(data), *sets)
    schema.write_text(SCHEMA_YAML.replace("max_length: 2", "max_length: 3"))
    assert (
        runner.invoke(app, ["register", "--data", str(data), "--schema", str(schema)]).exit_code
        == 0
    )
    result = runner.invoke(app, ["train", "--run-dir", run_dir, "--data", str(data), *sets])
    assert result.exit_code == 1
    assert "feature spec (feature tags max_length 2 -> 3)" in str(result.exception), (
        result.exception
    )


def test_data_without_the_label_and_weight_columns_is_scored(tmp_path):
    """Scoring reads neither the example weight nor the label: requests to score have
    neither, and a prediction depends on neither."""
    data = tmp_path / "data"
    write_days(data, days=2, rows=600)
    schema = tmp_path / "schema.yaml"
    schema.write_text(SCHEMA_YAML)
    runner.invoke(app, ["register", "--data", str(data), "--schema", str(schema)])
    run_dir = str(tmp_path / "run")
    invoke("train", "--run-dir", run_dir, "--data", str(data), *TRAIN, *MODEL)
    # The test day again, as requests: without click and importance, relisted by identity.
    requests = tmp_path / "requests"
    shutil.copytree(data, requests)
    day = requests / "day=1" / "part-0.parquet"
    table = pq.read_table(day).drop_columns(["click", "importance"])
    pq.write_table(table, day, row_group_size=400)
    manifest = json.loads((requests / "manifest.json").read_text())
    [listed] = [f for f in manifest["files"] if f["day"] == 1]
    with day.open("rb") as f:
        listed["digest"] = footer_digest(f, day.stat().st_size)
    listed["bytes"] = day.stat().st_size
    manifest["schema"] = [c for c in manifest["schema"] if c["name"] in table.column_names]
    (requests / "manifest.json").write_text(json.dumps(manifest))
    unlabeled = score_dataset(run_dir, str(requests), tmp_path / "a", days="1")
    labeled = score_dataset(run_dir, str(data), tmp_path / "b", days="1")
    assert unlabeled["labeled"] is False and unlabeled["rows"] == labeled["rows"] == 600
    a = pq.read_table(tmp_path / "a").sort_by("row")
    b = pq.read_table(tmp_path / "b").sort_by("row")
    assert a["label"].null_count == 600
    assert a["prediction"].equals(b["prediction"])


FITTED_YAML = """\
label: click
dense:
  - column: price
    transform: standardize
  - column: quantity
    transform: bucketize
    buckets: 4
sparse:
  - column: user_id
    ids: vocab
    min_count: 1
  - column: item_id
  - column: tags
crosses:
  - name: user_x_item
    columns: [user_id, item_id]
"""


def test_values_from_the_statistics_and_a_vocabulary_train_at_two_ranks(tmp_path):
    """What a schema leaves to the data (a standardized column's mean and deviation, a
    bucketized one's quantiles, one feature's vocabulary beside hashed ones) is taken from
    the dataset and frozen into the run, which trains sharded over two ranks, crosses and
    buckets included."""
    data = tmp_path / "data"
    write_days(data)
    schema = tmp_path / "schema.yaml"
    schema.write_text(FITTED_YAML)
    invoke("register", "--data", str(data), "--schema", str(schema))
    run_dir = str(tmp_path / "run")
    trained = invoke(
        "train", "--run-dir", run_dir, "--data", str(data), *TRAIN, *MODEL,
        "--set", "train.max_steps=4", "--nproc", "2",
    )  # fmt: skip
    assert trained["steps"] == 4
    spec = load_checkpoint(run_dir).spec
    stats = {d.name: d for d in read_stats(str(data)).dense}
    (price,) = spec.dense_transforms
    assert (price.mean, price.std) == stats["price"].filled_moments(0.0)
    features = {f.name: f for f in spec.sparse}
    boundaries = features["quantity"].bucketize.boundaries
    assert len(boundaries) == 3 and list(boundaries) == sorted(boundaries)
    assert features["quantity"].num_embeddings == 4
    # The vocabulary: user IDs of the training days, and the row IDs outside it share.
    users = pa.concat_tables(
        pq.read_table(data / f"day={d}" / "part-0.parquet", columns=["user_id"]) for d in (0, 1)
    )
    distinct = len(pc.unique(users["user_id"].drop_null()))
    assert features["user_id"].num_embeddings == distinct + 1
    assert features["item_id"].mapping("hash") == "hash"
    evaluated = invoke("evaluate", "--run-dir", run_dir)
    assert evaluated["rows"] == 1200 and 0.0 < evaluated["auc"] < 1.0

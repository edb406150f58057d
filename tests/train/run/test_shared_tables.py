"""Tables shared between features, end to end: a schema's ``table:`` gives ``item_id`` and
the ``tags`` list one table, which trains at 1 and 2 ranks and on disk, exports bitwise,
maps an ID to one row in both features (hashed or from one vocabulary counted over both
columns), and whose change a resume refuses naming the feature."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dlrmflow.cli import app
from dlrmflow.config import FeaturesConfig, ModelConfig
from dlrmflow.features.fit import feature_ids, fit_vocabulary
from dlrmflow.features.spec import FeatureSpec, dataset_schema
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.schema import SchemaError, read_schema
from dlrmflow.train.run.checkpoint import load_checkpoint
from tests.train.run.test_own_data import _with_features
from tests.train.run.test_own_data_ops import MODEL, TRAIN, register_days

runner = CliRunner()

SCHEMA_YAML = """\
label: click
dense:
  - column: price
sparse:
  - column: user_id
  - column: item_id
    table: things
  - column: tags
    table: things
    rows: 4096
"""


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> Path:
    return register_days(tmp_path_factory.mktemp("shared"), SCHEMA_YAML)


def train(run_dir: Path, data: Path, *extra: str) -> dict:
    result = runner.invoke(
        app,
        ["train", "--run-dir", str(run_dir), "--data", str(data), *TRAIN, *MODEL,
         "--set", "train.max_steps=6", *extra],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_features_sharing_a_table_take_its_settings_and_one_hash(registered):
    spec = FeatureSpec.for_dataset(read_manifest(str(registered)), FeaturesConfig(), ModelConfig())
    assert [t.name for t in spec.tables] == ["user_id", "things"]
    rows = {f.name: f.num_embeddings for f in spec.sparse}
    assert rows["item_id"] == rows["tags"] == 4096  # ``rows`` declared on tags alone
    ids = feature_ids(spec, "hash", None)
    raw = np.arange(-5, 500, dtype=np.int64)
    assert np.array_equal(ids.map("item_id", raw), ids.map("tags", raw))
    # A table of its own is salted apart: the same IDs land elsewhere.
    assert not np.array_equal(ids.map("user_id", raw) % 4096, ids.map("tags", raw))


def test_a_shared_vocabulary_counts_both_columns(registered):
    schema = dataset_schema(read_manifest(str(registered)))
    features = FeaturesConfig(ids="vocab", min_count=1)
    paths = sorted(str(p) for p in registered.rglob("*.parquet"))
    vocabulary = fit_vocabulary(schema, features, paths)
    # item_id holds 0..99 and tags 0..49: one vocabulary of the union for both features.
    assert np.array_equal(vocabulary.ids["item_id"], vocabulary.ids["tags"])
    assert sorted(vocabulary.ids["item_id"].tolist()) == list(range(100))
    spec = FeatureSpec.for_dataset(
        read_manifest(str(registered)), features, ModelConfig(), vocabulary.table_rows
    )
    mapper = feature_ids(spec, "vocab", vocabulary)
    raw = np.arange(0, 120, dtype=np.int64)
    assert np.array_equal(mapper.map("item_id", raw), mapper.map("tags", raw))


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_shared_table_trains_and_exports_bitwise(registered, tmp_path, nproc):
    run_dir = tmp_path / "run"
    train(run_dir, registered, "--set", f"distributed.nproc={nproc}")
    ckpt = load_checkpoint(run_dir)
    assert ckpt.model.embeddings.names == ["user_id", "things"]
    assert ckpt.spec.sparse_names == ["user_id", "item_id", "tags"]
    out = tmp_path / "model.pt2"
    result = runner.invoke(
        app, ["export", "--run-dir", str(run_dir), "--out", str(out), "--format", "torch-export"]
    )
    assert result.exit_code == 0, result.output
    check = json.loads(result.output)["verify"]
    assert check["rows"] > 0 and check["max_abs_diff"] == 0.0


def test_the_disk_tier_trains_a_shared_table_as_memory_does(registered, tmp_path):
    """Tables on disk behind a cache train bitwise as in memory. (A job against one
    process: ``tests/train/model/test_shared_tables.py``, every sharding type.)"""
    weights = {}
    for name, extra in {
        "memory": (),
        "disk": ("--set", "train.embedding_memory_bytes=50000"),
    }.items():
        run_dir = tmp_path / name
        result = train(run_dir, registered, *extra)
        assert bool(result["embedding_cache"]) == (name == "disk")  # a cache of rows on disk
        weights[name] = load_checkpoint(run_dir).model.embeddings.table("things").numpy()
    assert np.array_equal(weights["memory"], weights["disk"])
    assert np.abs(weights["memory"]).max() > 0


def test_a_resume_refuses_a_table_shared_since_naming_the_feature(registered, tmp_path):
    def unshare(features: dict) -> dict:
        sparse = [{k: v for k, v in f.items() if k != "table"} for f in features["sparse"]]
        return {**features, "sparse": sparse}

    run_dir = tmp_path / "run"
    train(run_dir, Path(_with_features(str(registered), tmp_path / "unshared", unshare)))
    result = runner.invoke(
        app,
        ["train", "--run-dir", str(run_dir), "--data", str(registered), *TRAIN, *MODEL,
         "--set", "train.max_steps=8"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert "feature item_id" in str(result.exception)
    assert "table none -> things" in str(result.exception)


def test_features_disagreeing_on_their_table_or_naming_a_column_are_one_line(tmp_path):
    schema = tmp_path / "schema.yaml"
    schema.write_text(
        SCHEMA_YAML.replace("    table: things\n", "    table: things\n    rows: 512\n", 1)
    )
    with pytest.raises(
        SchemaError, match="rows 4096, but item_id declares 512 for their shared table things"
    ):
        read_schema(schema)
    schema.write_text(SCHEMA_YAML.replace("table: things", "table: price"))
    with pytest.raises(SchemaError, match="table price is the name of another column"):
        read_schema(schema)

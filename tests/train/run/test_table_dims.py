"""A dimension per table: a schema gives a feature (or a cross) a ``dim`` of its own, DCNv2
trains on tables of several widths, the export scores them bitwise as the checkpoint, and
the dot interaction, which needs one width, refuses in one line naming the feature."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dlrmflow.cli import app
from dlrmflow.config import FeaturesConfig, ModelConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.schema import SchemaError
from dlrmflow.train.run.checkpoint import load_checkpoint
from tests.train.run.test_own_data_ops import TRAIN, register_days

runner = CliRunner()

SCHEMA_YAML = """\
label: click
dense:
  - column: price
sparse:
  - column: user_id
    dim: 12
  - column: item_id
  - column: tags
    dim: 4
crosses:
  - name: user_x_item
    columns: [user_id, item_id]
    rows: 2048
    dim: 2
"""
DCN = ("--set", "model.arch=dcnv2", "--set", "model.embedding_dim=8")


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> Path:
    return register_days(tmp_path_factory.mktemp("dims"), SCHEMA_YAML)


def test_each_table_takes_its_declared_dim(registered):
    manifest = read_manifest(str(registered))
    model = ModelConfig(arch="dcnv2", embedding_dim=8)
    spec = FeatureSpec.for_dataset(manifest, FeaturesConfig(), model)
    dims = {f.name: f.embedding_dim for f in spec.sparse}
    assert dims == {"user_id": 12, "item_id": 8, "tags": 4, "user_x_item": 2}


def test_the_dot_interaction_refuses_another_dim_naming_the_feature(registered, tmp_path):
    manifest = read_manifest(str(registered))
    with pytest.raises(SchemaError, match=r"feature user_id: dim 12, .*model.arch=dcnv2"):
        FeatureSpec.for_dataset(manifest, FeaturesConfig(), ModelConfig())
    result = runner.invoke(
        app, ["train", "--run-dir", str(tmp_path / "run"), "--data", str(registered), *TRAIN]
    )
    # The command prints a DlrmflowError as its one line and exits 1 (``dlrmflow.cli.main``).
    assert result.exit_code == 1 and isinstance(result.exception, SchemaError)
    assert isinstance(result.exception, DlrmflowError)
    assert "\n" not in str(result.exception)
    assert str(result.exception).startswith("feature user_id: dim 12")


@pytest.mark.parametrize("nproc", [1, 2])
def test_dcnv2_trains_on_several_widths_and_exports_them_bitwise(registered, tmp_path, nproc):
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        ["train", "--run-dir", str(run_dir), "--data", str(registered), *TRAIN, *DCN,
         "--set", "train.max_steps=6", "--set", f"distributed.nproc={nproc}"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    model = load_checkpoint(run_dir).model
    widths = [model.embeddings.table(f).shape[1] for f in model.embeddings.names]
    assert widths == [12, 8, 4, 2]
    out = tmp_path / "model.pt2"
    result = runner.invoke(
        app, ["export", "--run-dir", str(run_dir), "--out", str(out), "--format", "torch-export"]
    )
    assert result.exit_code == 0, result.output
    check = json.loads(result.output)["verify"]
    assert check["rows"] > 0 and check["max_abs_diff"] == 0.0

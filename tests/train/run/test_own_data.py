"""A team's own Parquet, registered where it lies, trains, evaluates and scores: at one rank
and two (sharded), near the Bayes AUC of the data's true click probabilities."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dlrmflow.config import apply_overrides, build_config
from dlrmflow.ingest.register import register_dataset
from dlrmflow.schema import DenseFeature
from dlrmflow.score.score import score_dataset
from dlrmflow.train.launch.job import launch_training
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.trainer import IncompatibleCheckpoint
from tests.ingest.own_data import SCHEMA, write_own_days


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    root = tmp_path_factory.mktemp("own") / "data"
    bayes = write_own_days(root, days=4, rows=6000)
    register_dataset(str(root), SCHEMA)
    return str(root), bayes


def _config(data: str, run_dir: Path, **sets: object):
    config = build_config(
        {
            "run_dir": str(run_dir),
            "data": {"url": data},
            "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32]},
            "train": {"batch_size": 256, "num_workers": 0, "log_every": 20, "epochs": 4},
        }
    )
    return apply_overrides(config, sets)


@pytest.mark.parametrize("nproc", [1, 2])
def test_own_data_trains_near_its_bayes_auc_and_scores(own, tmp_path, nproc):
    data, bayes = own
    config = _config(data, tmp_path / "run", **{"distributed.nproc": nproc})
    result = launch_training(config)
    assert result is not None and result.rows == 4 * 3 * 6000
    metrics = evaluate(tmp_path / "run")
    # The generator's own optimum on the test day; a model of the same data comes close.
    assert bayes - 0.03 < metrics["auc"] <= bayes + 0.01, (metrics["auc"], bayes)
    assert 0.9 < metrics["calibration"] < 1.1
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.spec.label == "click"
    assert ckpt.spec.sparse_names == ["user_id", "item_id", "tags"]
    scored = score_dataset(str(tmp_path / "run"), data, str(tmp_path / "scores"), days="3")
    assert scored["rows"] == 6000
    table = pq.read_table(tmp_path / "scores")
    assert table.num_rows == 6000 and table.column("label").null_count == 0


def _with_features(data: str, into: Path, change) -> str:
    """A dataset of ``data``'s files whose manifest declares ``change(features)``."""
    manifest = json.loads((Path(data) / "manifest.json").read_text())
    into.mkdir()
    for path in Path(data).iterdir():
        if path.name != "manifest.json":
            (into / path.name).symlink_to(path)
    manifest["features"] = change(manifest["features"])
    (into / "manifest.json").write_text(json.dumps(manifest))
    return str(into)


def test_a_changed_schema_is_refused_on_resume_naming_the_feature(own, tmp_path):
    data, _ = own
    config = _config(data, tmp_path / "run", **{"train.max_steps": 3})
    launch_training(config)
    fewer = _with_features(data, tmp_path / "fewer", lambda f: {**f, "sparse": f["sparse"][:2]})
    clipped = DenseFeature(column="price", transform="clip", clip_min=0.0, clip_max=9.0)
    other = _with_features(
        data, tmp_path / "other", lambda f: {**f, "dense": [clipped.model_dump(mode="json")]}
    )
    for url, change in ((fewer, "sparse feature tags gone"), (other, "feature price transform")):
        with pytest.raises(IncompatibleCheckpoint, match=rf"feature spec \({change}"):
            launch_training(apply_overrides(config, {"data.url": url, "train.max_steps": 6}))


def test_a_declared_transform_travels_with_the_checkpoint(own, tmp_path):
    """A clipped price trains and evaluates as declared; the checkpoint keeps the transform,
    so evaluation never re-reads the schema from the data."""
    data, _ = own
    clipped = DenseFeature(column="price", transform="clip", clip_min=0.0, clip_max=30.0, fill=5.0)
    copy = _with_features(
        data, tmp_path / "data", lambda f: {**f, "dense": [clipped.model_dump(mode="json")]}
    )
    launch_training(_config(str(copy), tmp_path / "run", **{"train.epochs": 1}))
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.spec.dense_transforms == (clipped,)
    metrics = evaluate(tmp_path / "run")
    assert metrics["auc"] > 0.65

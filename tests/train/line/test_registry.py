"""A line tracked with MLflow: each version a logged model with its weights, registered
where the store has a registry, and the champion alias following the gate."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
from safetensors.torch import load_file

from dlrmflow.train.line.gate import MODELS_DIR, champion
from dlrmflow.train.line.line import train_line
from dlrmflow.train.line.registry import CHAMPION_ALIAS, MLFLOW_FILE, registered_name
from dlrmflow.train.run.tracking import mlflow_client
from tests.train.line.test_line import _config, _grow


def test_versions_are_logged_registered_and_the_champion_aliased(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _grow(tmp_path / "data", 2)
    line = tmp_path / "ctr"
    config = _config(data, tmp_path / "x")
    config.train.tracker = "mlflow"
    config.gate.calibration_max, config.gate.calibration_min = 100.0, 0.01
    train_line(line, config)
    _grow(tmp_path / "data", 3)
    train_line(line)
    assert champion(line) == 1

    records = [
        json.loads((line / "versions" / f"000{n}" / MLFLOW_FILE).read_text()) for n in range(3)
    ]
    # Read back as a user would, with the line's store as the tracking URI.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", records[0]["tracking_uri"])
    client = mlflow_client(records[0]["tracking_uri"])
    name = registered_name(line)
    assert [r["registered_model"] for r in records] == [name] * 3
    assert [r["registered_version"] for r in records] == [1, 2, 3]
    for number, record in enumerate(records):
        model = client.get_logged_model(record["model_id"])
        assert model.name == f"version-000{number}" and json.loads(model.params["day"]) == number
        files = {f.path for f in client.list_logged_model_artifacts(record["model_id"])}
        assert files == {"model.safetensors", "version.json"}
    # The champion's logged weights are the published ones, tensor for tensor.
    alias = client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    assert int(alias.version) == 2
    stored = urlparse(client.get_logged_model(records[1]["model_id"]).artifact_location).path
    published = load_file(line / MODELS_DIR / "0001" / "model.safetensors")
    logged = load_file(Path(stored) / "model.safetensors")
    assert logged.keys() == published.keys()
    # Logged as trained; the published model has the recalibration of its next day in its
    # last bias, which the logged model's tags give.
    shift = float(client.get_logged_model(records[1]["model_id"]).tags["recalibration.shift"])
    last = "dense_arch.top.2.bias"  # top_mlp [32], then the logit
    assert all((logged[k] == published[k]).all() for k in published if k != last)
    torch.testing.assert_close(published[last], logged[last] + shift, rtol=0, atol=1e-6)

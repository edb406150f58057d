"""Checkpoints written by an earlier version (``tests/data/checkpoints``, see its README)
still resume bitwise and evaluate to the metrics their own version recorded: a change to
the train stage's code may move modules and rename classes, never break a user's runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dlrmflow.config import load_config
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.trainer import train
from tests.conftest import TEST_DATA

LEGACY = TEST_DATA / "checkpoints"


@pytest.fixture
def legacy(tmp_path: Path) -> Path:
    """A copy of the committed runs and their dataset (training writes into them)."""
    root = tmp_path / "legacy"
    shutil.copytree(LEGACY, root)
    return root


def _config(root: Path, run_dir: str, **sets: object):
    overrides = [f"run_dir={root / run_dir}", f"data.url={root / 'data'}"]
    overrides += [f"{key}={value}" for key, value in sets.items()]
    return load_config(root / "run.yaml", overrides, env=False)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    model = load_checkpoint(run_dir).model
    return {k: v.clone() for k, v in model.state_dict().items()}


def _records(run_dir: Path) -> list[dict]:
    timing = {"samples_per_s", "elapsed_s", "data_wait_s"}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]


def test_a_legacy_checkpoint_inside_an_epoch_resumes_bitwise(legacy: Path, tmp_path: Path):
    resumed = train(_config(legacy, "run_1rank", **{"train.max_steps": 6}))
    assert resumed.resumed_from_step == 3 and resumed.steps == 6
    fresh = train(_config(legacy, "fresh", **{"train.max_steps": 6}))
    assert resumed.final_loss == fresh.final_loss
    assert _records(legacy / "run_1rank") == _records(legacy / "fresh")
    got, want = _weights(legacy / "run_1rank"), _weights(legacy / "fresh")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("run", ["run_1rank", "run_2ranks"])
def test_a_legacy_checkpoint_evaluates_to_its_recorded_metrics(legacy: Path, run: str):
    recorded = json.loads((LEGACY / run / "eval.json").read_text())
    # The two-rank run's shards are resharded onto this one process.
    metrics = evaluate(legacy / run, data_url=str(legacy / "data"))
    for key in ("auc", "logloss", "ne", "calibration", "positive_rate", "rows", "step"):
        assert metrics[key] == recorded[key], key

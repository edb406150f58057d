"""Checkpoints written by an earlier version (``tests/data/checkpoints``, see its README)
still resume and evaluate to the metrics their own version recorded: a change to the train
stage's code may move modules and rename classes, never break a user's runs.

They were written on another machine, whose multiplies round differently: what is
compared with them holds within ``tests.across_cpus``' tolerance, and these tests run
again under another CPU's code paths (``tests/test_across_cpus.py``). On one machine a
resume is bitwise; ``tests/train/run/test_run_state.py`` holds runs written here to that."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dlrmflow.config import load_config
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.trainer import IncompatibleCheckpoint, train
from tests.across_cpus import assert_weights_close_across_cpus, close_across_cpus
from tests.conftest import TEST_DATA

LEGACY = TEST_DATA / "checkpoints"
pytestmark = pytest.mark.recorded


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
    # "lr": records written before schedules do not carry the rate.
    timing = {"samples_per_s", "elapsed_s", "data_wait_s", "lr"}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]


# What the defaults were when the legacy runs were written (their run.yaml leaves them to the
# defaults): a run continues only as it began.
LEGACY_DEFAULTS = {
    "train.dense_optimizer": "null",
    "train.lr": 0.05,
    "train.embedding_lr": "null",
    "train.lr_schedule.decay": "constant",
}


def test_a_legacy_checkpoint_is_not_continued_under_defaults_changed_since(legacy: Path):
    """Its manifest records the rates it trained with and no schedule (constant rates, as
    every run before schedules): today's defaults would make it another run, so "auto"
    refuses it naming each key, and nothing is written."""
    before = sorted(p.name for p in (legacy / "run_1rank" / "checkpoints").iterdir())
    with pytest.raises(IncompatibleCheckpoint) as refused:
        train(_config(legacy, "run_1rank", **{"train.max_steps": 6}))
    message = str(refused.value)
    for change in (
        "train.dense_optimizer None -> 'adam'",
        "train.lr 0.05 -> 0.002",
        "train.embedding_lr None -> 0.05",
        "train.lr_schedule.decay 'constant' -> 'linear'",
    ):
        assert change in message, message
    assert message.endswith(
        "or continue it as it began with --set train.dense_optimizer=null "
        "--set train.embedding_lr=null --set train.lr=0.05 "
        '--set train.lr_schedule.decay="constant"'
    ), message
    assert sorted(p.name for p in (legacy / "run_1rank" / "checkpoints").iterdir()) == before


def _same_records(got: list[dict], want: list[dict]) -> None:
    """The same records with the same keys; counts exact, figures within the tolerance."""
    assert [r.keys() for r in got] == [r.keys() for r in want]
    for a, b in zip(got, want, strict=True):
        for key, value in b.items():
            if isinstance(value, float):
                assert close_across_cpus(a[key], value), (key, a[key], value)
            else:
                assert a[key] == value, key


def test_a_legacy_checkpoint_inside_an_epoch_resumes(legacy: Path, tmp_path: Path):
    """Resumed at its step 3 (weights, optimizer state, reader position and metrics window
    as another machine wrote them), it ends where a run begun here ends, within the
    tolerance across CPUs."""
    resumed = train(_config(legacy, "run_1rank", **{"train.max_steps": 6}, **LEGACY_DEFAULTS))
    assert resumed.resumed_from_step == 3 and resumed.steps == 6
    fresh = train(_config(legacy, "fresh", **{"train.max_steps": 6}, **LEGACY_DEFAULTS))
    assert close_across_cpus(resumed.final_loss, fresh.final_loss)
    _same_records(_records(legacy / "run_1rank"), _records(legacy / "fresh"))
    assert_weights_close_across_cpus(_weights(legacy / "run_1rank"), _weights(legacy / "fresh"))


@pytest.mark.parametrize("run", ["run_1rank", "run_2ranks"])
def test_a_legacy_checkpoint_evaluates_to_its_recorded_metrics(legacy: Path, run: str):
    recorded = json.loads((LEGACY / run / "eval.json").read_text())
    # The two-rank run's shards are resharded onto this one process.
    metrics = evaluate(legacy / run, data_url=str(legacy / "data"))
    for key in ("positive_rate", "rows", "step"):  # counts: exact on any machine
        assert metrics[key] == recorded[key], key
    for key in ("logloss", "ne", "calibration"):
        assert close_across_cpus(metrics[key], recorded[key]), (key, metrics[key], recorded[key])
    # Another machine's rounding may swap two nearly tied scores: one swapped pair moves
    # the AUC by 1 / (positives * negatives), so two pairs are allowed.
    positives = round(recorded["rows"] * recorded["positive_rate"])
    pair = 1 / (positives * (recorded["rows"] - positives))
    assert abs(metrics["auc"] - recorded["auc"]) <= 2 * pair, (metrics["auc"], recorded["auc"])

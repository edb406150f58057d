"""Non-finite values never pass: a diverged loss stops training at its step without
saving that model, and evaluation refuses NaN or infinite predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlrmflow.train.launch.job import TrainingFailed, launch_training
from dlrmflow.train.run.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from dlrmflow.train.run.evaluate import NonFinitePredictions, evaluate
from dlrmflow.train.run.trainer import NonFiniteLoss, train
from tests.conftest import tiny_run_config

# Row-wise Adagrad's first step moves every touched weight by about lr: at this rate the
# logits overflow to infinity by the second step, whatever the data.
DIVERGING_LR = 1e30


def test_a_non_finite_loss_stops_at_its_step_and_saves_nothing_of_that_model(
    tiny_dataset: str, tmp_path: Path
) -> None:
    cfg = tiny_run_config(
        tiny_dataset,
        tmp_path / "run",
        max_steps=10,
        checkpoint_every=1,
        log_every=1,
        lr=DIVERGING_LR,
    )
    with pytest.raises(NonFiniteLoss) as stopped:
        train(cfg)
    message = str(stopped.value)
    saved = [c.step for c in list_checkpoints(tmp_path / "run")]
    bad_step = saved[-1] + 1 if saved else 1
    assert f"step {bad_step}: the loss is not finite" in message and "\n" not in message
    assert all(step < bad_step for step in saved)
    if saved:
        assert f"step_{saved[-1]:09d}" in message  # the last good checkpoint
        weights = load_checkpoint(tmp_path / "run").model.state_dict()
        assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    assert not (tmp_path / "run" / "train_result.json").exists()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all(r["step"] < bad_step for r in records)


def test_a_non_finite_loss_on_two_ranks_stops_both(tiny_dataset: str, tmp_path: Path) -> None:
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", max_steps=10, lr=DIVERGING_LR)
    cfg.distributed.nproc = 2
    with pytest.raises(TrainingFailed, match=r"NonFiniteLoss: step \d+: the loss is not finite"):
        launch_training(cfg)
    assert not list_checkpoints(tmp_path / "run")


def test_evaluate_refuses_non_finite_predictions(tiny_dataset: str, tmp_path: Path) -> None:
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", max_steps=2)
    train(cfg)
    # A checkpoint whose top layer holds an infinity (as a diverged model from elsewhere
    # would): scoring it must not turn into an AUC.
    ckpt = load_checkpoint(tmp_path / "run")
    with torch.no_grad():
        ckpt.model.dense_arch.top[0].weight[0, 0] = float("inf")
    optimizer = torch.optim.SGD(ckpt.model.dense_arch.parameters(), lr=0.0)
    save_checkpoint(
        tmp_path / "run",
        model=ckpt.model,
        optimizer=optimizer,
        config=ckpt.config,
        spec=ckpt.spec,
        progress={"step": 3, "epoch": 0, "rows": 0, "seconds": 0.0, "loss": None},
        loader_state=None,
    )
    with pytest.raises(NonFinitePredictions, match=r"step_000000003: the model predicts NaN"):
        evaluate(tmp_path / "run")
    assert not (tmp_path / "run" / "eval.json").exists()

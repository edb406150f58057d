"""Run state: a run killed at any checkpoint and resumed ends where the uninterrupted run
ends, a finished run re-run trains nothing, and asking for more continues exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dlrmflow.config import RunConfig
from dlrmflow.train.launch.job import launch_training
from dlrmflow.train.run.checkpoint import list_checkpoints, load_checkpoint
from dlrmflow.train.run.trainer import TrainResult
from tests.conftest import tiny_run_config

# The tiny dataset trains on 2 days x 6000 rows: 6 global batches of 2000 an epoch.
STEPS_PER_EPOCH = 6
EVERY = 3  # divides the epoch: checkpoints at 3, 6 (the epoch boundary), 9 and 12 (the end)


def _config(data: str, run_dir: Path, nproc: int, **train: object) -> RunConfig:
    options = {
        "batch_size": 2000 // nproc,
        "epochs": 2,
        "checkpoint_every": EVERY,
        "keep_checkpoints": 100,
        "log_every": 1,
        **train,
    }
    cfg = tiny_run_config(data, run_dir, **options)
    cfg.distributed.nproc = nproc
    return cfg


def _state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight and every embedding optimizer state of the run's newest checkpoint."""
    model = load_checkpoint(run_dir).model
    state = dict(model.state_dict())
    bag = model.embeddings
    for name in bag.names:
        state.update({f"{name}.{k}": v for k, v in bag.state(name).items()})
    return state


def _losses(run_dir: Path) -> list[tuple[int, int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [(r["step"], r["rows"], r["loss"]) for r in records]


def _killed_after(finished: Path, step: int, into: Path) -> Path:
    """The run directory as a kill right after checkpoint ``step`` leaves it: that
    checkpoint newest, metrics logged a little past it, no result."""
    shutil.copytree(finished, into)
    for info in list_checkpoints(into):
        if info.step > step:
            shutil.rmtree(info.path)
    (into / "train_result.json").unlink()
    return into


def _assert_same_run(got: Path, want: Path, result: TrainResult, reference: TrainResult) -> None:
    assert (result.steps, result.rows) == (reference.steps, reference.rows)
    assert result.final_loss == reference.final_loss
    assert _losses(got) == _losses(want)
    a, b = _state(got), _state(want)
    assert a.keys() == b.keys()
    for key in b:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("nproc", [1, 2])
def test_killed_at_every_checkpoint_and_resumed_ends_as_the_uninterrupted_run(
    tiny_dataset: str, tmp_path: Path, nproc: int
) -> None:
    whole = tmp_path / "whole"
    reference = launch_training(_config(tiny_dataset, whole, nproc))
    assert reference.steps == 2 * STEPS_PER_EPOCH and reference.rows == 2 * 12_000
    steps = [c.step for c in list_checkpoints(whole)]
    assert steps == [3, 6, 9, 12]
    # The checkpoint at the epoch's last step stands at the start of the next epoch.
    boundary = next(c for c in list_checkpoints(whole) if c.step == STEPS_PER_EPOCH)
    assert boundary.manifest["progress"]["epoch"] == 1
    # At 2 ranks (a job each, the slow part) a checkpoint inside an epoch and one at an
    # epoch's end, where the ranks' reader positions matter; at 1 rank every one.
    for step in steps if nproc == 1 else [3, STEPS_PER_EPOCH]:
        run_dir = _killed_after(whole, step, tmp_path / f"killed_at_{step}")
        result = launch_training(_config(tiny_dataset, run_dir, nproc))
        assert result.resumed_from_step == step, step
        assert result.trained_steps == reference.steps - step, step
        _assert_same_run(run_dir, whole, result, reference)


def test_a_finished_run_rerun_trains_nothing_and_asked_for_more_continues_exactly(
    tiny_dataset: str, tmp_path: Path
) -> None:
    one_epoch = _config(tiny_dataset, tmp_path / "run", 1, epochs=1, checkpoint_every=None)
    first = launch_training(one_epoch)
    assert first.steps == STEPS_PER_EPOCH and first.trained_steps == STEPS_PER_EPOCH
    records = _losses(tmp_path / "run")
    checkpoints = [c.path for c in list_checkpoints(tmp_path / "run")]

    again = launch_training(one_epoch)  # the nightly schedule fires again
    assert again.trained_steps == 0
    assert (again.steps, again.rows, again.final_loss) == (
        first.steps,
        first.rows,
        first.final_loss,
    )
    assert again.checkpoint == first.checkpoint
    assert _losses(tmp_path / "run") == records
    assert [c.path for c in list_checkpoints(tmp_path / "run")] == checkpoints

    # Asked for a second epoch and then a few steps more, it continues from where it ended
    # and ends as a run asked for all of it at once.
    two_epochs = one_epoch.model_copy(deep=True)
    two_epochs.train.epochs = 3
    two_epochs.train.max_steps = 2 * STEPS_PER_EPOCH
    more = launch_training(two_epochs)
    assert more.resumed_from_step == STEPS_PER_EPOCH and more.steps == 2 * STEPS_PER_EPOCH
    two_epochs.train.max_steps = 2 * STEPS_PER_EPOCH + 2
    most = launch_training(two_epochs)
    assert most.steps == 2 * STEPS_PER_EPOCH + 2 and most.trained_steps == 2

    at_once = two_epochs.model_copy(deep=True)
    at_once.run_dir = str(tmp_path / "at_once")
    reference = launch_training(at_once)
    _assert_same_run(tmp_path / "run", tmp_path / "at_once", most, reference)

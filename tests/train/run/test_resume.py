"""Resume compatibility: "auto" continues only the same run; an explicit checkpoint
fine-tunes (learning rate, batch size, data may change) and the run records it; a
checkpoint inside an epoch resumes only at the world size that took it; a resumed run
reports the loss and metrics of the uninterrupted run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.launch.job import launch_training
from dlrmflow.train.run.checkpoint import MANIFEST_FILE, list_checkpoints
from dlrmflow.train.run.trainer import IncompatibleCheckpoint, train
from tests.conftest import TINY_DATA, run_cli, tiny_run_config


@pytest.fixture(scope="module")
def finished(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    """A run of 4 steps whose directory later runs resume into (copied per test)."""
    cfg = tiny_run_config(tiny_dataset, tmp_path_factory.mktemp("first") / "run", max_steps=4)
    train(cfg)
    return cfg


def _continued(finished: RunConfig, tmp_path: Path, **changes: object) -> RunConfig:
    """``finished``'s configuration with more steps and ``changes`` ("section.key": value),
    in a copy of its run directory."""
    import shutil

    cfg = finished.model_copy(deep=True)
    cfg.run_dir = str(tmp_path / "run")
    shutil.copytree(finished.run_dir, cfg.run_dir)
    cfg.train.max_steps = 8
    data = cfg.model_dump()
    for key, value in changes.items():
        section, name = key.split(".")
        data[section][name] = value
    return RunConfig.model_validate(data)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"train.lr": 0.2}, ["train.lr 0.002 -> 0.2"]),
        ({"train.optimizer": "sgd"}, ["train.optimizer 'adagrad' -> 'sgd'"]),
        ({"train.batch_size": 256}, ["train.batch_size 512 -> 256"]),
        (
            {"model.embedding_dim": 4, "model.bottom_mlp": [16, 4]},
            ["model.bottom_mlp", "model.embedding_dim 8 -> 4"],
        ),
        ({"features.max_rows_per_table": 500}, ["features.max_rows_per_table"]),
        ({"train.num_workers": 2}, ["train.num_workers 0 -> 2"]),
    ],
)
def test_auto_refuses_a_checkpoint_of_another_configuration_naming_the_keys(
    finished: RunConfig, tmp_path: Path, changes: dict, named: list[str]
) -> None:
    cfg = _continued(finished, tmp_path, **changes)
    with pytest.raises(IncompatibleCheckpoint) as refused:
        train(cfg)
    message = str(refused.value)
    assert "\n" not in message and "step_000000004" in message and "--resume" in message
    for needle in named:
        assert needle in message
    assert [c.step for c in list_checkpoints(Path(cfg.run_dir))] == [4]  # nothing written


def test_auto_refuses_a_checkpoint_trained_on_another_dataset(
    finished: RunConfig, tmp_path: Path
) -> None:
    other = str(tmp_path / "other_data")
    generate_dataset(DataConfig(url=other, **{**TINY_DATA, "seed": 8}))
    cfg = _continued(finished, tmp_path, **{"data.url": other})
    # The same days (0-1), other files in them.
    trained_on = r"training data \(data.train_days and their files\) 'days 0-1' -> 'their files"
    with pytest.raises(IncompatibleCheckpoint, match=trained_on):
        train(cfg)


def test_auto_continues_when_only_the_length_or_the_machinery_changes(
    finished: RunConfig, tmp_path: Path
) -> None:
    cfg = _continued(finished, tmp_path, **{"train.log_every": 3, "train.keep_checkpoints": 1})
    result = train(cfg)
    assert result.resumed_from_step == 4 and result.steps == 8 and not result.changed_on_resume


def test_an_explicit_checkpoint_fine_tunes_records_what_changed_and_never_trains_twice(
    finished: RunConfig, tmp_path: Path
) -> None:
    source = list_checkpoints(Path(finished.run_dir))[-1].path
    cfg = finished.model_copy(deep=True)
    cfg.run_dir = str(tmp_path / "tuned")
    cfg.train.max_steps = 8
    cfg.train.lr = 0.03
    cfg.train.batch_size = 256
    cfg.train.resume = str(source)
    result = train(cfg)
    assert result.resumed_from_step == 4 and result.steps == 8 and result.trained_steps == 4
    changed = {"train.lr": [0.002, 0.03], "train.batch_size": [512, 256]}
    assert result.changed_on_resume == changed
    record = json.loads((Path(cfg.run_dir) / "train_result.json").read_text())
    assert record["changed_on_resume"] == changed and record["resumed_from"] == str(source)
    manifest = list_checkpoints(Path(cfg.run_dir))[-1].manifest
    assert manifest["origin"] == str(source.resolve())
    assert manifest["changed_on_resume"] == changed

    again = train(cfg)  # the same command again: the fine-tuned run has finished
    assert again.trained_steps == 0 and again.steps == 8
    assert again.changed_on_resume == changed


def test_an_explicit_checkpoint_of_another_shape_is_refused(
    finished: RunConfig, tmp_path: Path
) -> None:
    source = list_checkpoints(Path(finished.run_dir))[-1].path
    cfg = finished.model_copy(deep=True)
    cfg.run_dir = str(tmp_path / "tuned")
    cfg.model.top_mlp = [16]
    cfg.train.resume = str(source)
    with pytest.raises(IncompatibleCheckpoint, match=r"model.top_mlp \[32\] -> \[16\]"):
        train(cfg)


def test_fine_tuning_into_a_directory_holding_another_run_is_refused(
    finished: RunConfig, tiny_dataset: str, tmp_path: Path
) -> None:
    train(tiny_run_config(tiny_dataset, tmp_path / "busy", max_steps=2))
    cfg = finished.model_copy(deep=True)
    cfg.run_dir = str(tmp_path / "busy")
    cfg.train.resume = str(list_checkpoints(Path(finished.run_dir))[-1].path)
    with pytest.raises(IncompatibleCheckpoint, match="already holds a run"):
        train(cfg)


def test_never_starts_afresh_and_removes_the_previous_run(
    finished: RunConfig, tmp_path: Path
) -> None:
    cfg = _continued(finished, tmp_path, **{"train.resume": "never", "train.max_steps": 2})
    with pytest.warns(UserWarning, match="starting afresh"):
        result = train(cfg)
    assert result.resumed_from_step is None and result.steps == 2
    assert [c.step for c in list_checkpoints(Path(cfg.run_dir))] == [2]
    records = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").open()]
    assert max(r["step"] for r in records) == 2


def _write_config(cfg: RunConfig, path: Path) -> str:
    path.write_text(yaml.safe_dump(cfg.model_dump()))
    return str(path)


# The tiny dataset's 12,000 training rows at 2 ranks of 512-row batches: 12 steps an epoch.
TWO_RANK_EPOCH = 12


@pytest.fixture(scope="module")
def two_rank_epoch(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    """One epoch trained by 2 ranks, checkpointed at step 9 and at the epoch's end (which
    stands at the next epoch's start)."""
    run_dir = tmp_path_factory.mktemp("two_ranks") / "run"
    cfg = tiny_run_config(tiny_dataset, run_dir, checkpoint_every=9)
    cfg.distributed.nproc = 2
    result = launch_training(cfg)
    assert result.steps == TWO_RANK_EPOCH and result.rows == 12_000
    assert [c.step for c in list_checkpoints(run_dir)] == [9, 12]
    return cfg


@pytest.mark.parametrize("recorded", [True, False], ids=["manifest", "older-manifest"])
def test_a_resume_inside_an_epoch_at_another_rank_count_is_refused_in_one_line(
    two_rank_epoch: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    recorded: bool,
) -> None:
    """Interrupted after step 9 of 12, re-run at 1 rank: no reader can take up the 2-rank
    readers' positions, and restarting the epoch would train its first 9 steps twice."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_rank_epoch.run_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000000012")
    (run_dir / "train_result.json").unlink()
    if not recorded:  # written before manifests said whether the readers were mid-epoch
        manifest = run_dir / "checkpoints" / "step_000000009" / MANIFEST_FILE
        data = json.loads(manifest.read_text())
        assert data.pop("mid_epoch") is True
        manifest.write_text(json.dumps(data))
    config = _write_config(two_rank_epoch, tmp_path / "run.yaml")
    code, out, err = run_cli(
        monkeypatch, capsys, "train", "--config", config, "--run-dir", str(run_dir),
        "--set", "distributed.nproc=1",
    )  # fmt: skip
    assert code == 1 and out == "", err
    assert len(err) == 1 and re.fullmatch(
        r"error: checkpoint \S+step_000000009 stands inside epoch 0 of a job of 2 rank\(s\) "
        r"and this one has 1: .* resume with distributed\.nproc=2, or start afresh with "
        r"--resume never",
        err[0],
    ), err
    assert [c.step for c in list_checkpoints(run_dir)] == [9]  # nothing written


def test_a_checkpoint_at_an_epochs_end_continues_at_another_rank_count(
    two_rank_epoch: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(two_rank_epoch.run_dir, run_dir)
    config = _write_config(two_rank_epoch, tmp_path / "run.yaml")
    code, out, err = run_cli(
        monkeypatch, capsys, "train", "--config", config, "--run-dir", str(run_dir),
        "--set", "distributed.nproc=1", "--set", "train.epochs=2",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["resumed_from_step"] == TWO_RANK_EPOCH and result["world_size"] == 1
    assert result["rows"] == 2 * 12_000  # every row of each epoch trained once


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records without their timings."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [{k: r[k] for k in ("step", "epoch", "rows", "loss")} for r in records]


@pytest.mark.parametrize("killed", [False, True], ids=["stopped", "killed"])
def test_a_resumed_run_reports_the_loss_and_metrics_of_the_uninterrupted_run(
    tiny_dataset: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    killed: bool,
) -> None:
    """Records every 5 steps, checkpoints every 3: the run stops at step 7 (its last,
    partial window logged) or is killed after the checkpoint of step 6 (with steps 7 and
    a record logged past it); resumed to step 9, it reports what the run of 9 steps does:
    the window 6-9 in one record, and that record's loss as ``final_loss``."""
    cfg = tiny_run_config(tiny_dataset, tmp_path / "whole", log_every=5, checkpoint_every=3)
    config = _write_config(cfg, tmp_path / "run.yaml")
    interrupted = tmp_path / "interrupted"
    whole = tmp_path / "whole"

    def train_to(run_dir: Path, steps: int) -> dict:
        code, _, err = run_cli(
            monkeypatch, capsys, "train", "--config", config, "--run-dir", str(run_dir),
            "--set", f"train.max_steps={steps}",
        )  # fmt: skip
        assert code == 0, err
        return json.loads((run_dir / "train_result.json").read_text())

    reference = train_to(whole, 9)
    train_to(interrupted, 7)
    if killed:
        shutil.rmtree(interrupted / "checkpoints" / "step_000000007")
        (interrupted / "train_result.json").unlink()
    resumed = train_to(interrupted, 9)
    assert resumed["resumed_from_step"] == (6 if killed else 7)
    assert [r["step"] for r in _records(whole)] == [5, 9]
    assert _records(interrupted) == _records(whole)
    assert resumed["final_loss"] == reference["final_loss"]
    assert (resumed["steps"], resumed["rows"]) == (reference["steps"], reference["rows"])

"""Resume compatibility: "auto" continues only the same run; an explicit checkpoint
fine-tunes (learning rate, batch size, data may change) and the run records it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.checkpoint import list_checkpoints
from dlrmflow.train.trainer import IncompatibleCheckpoint, train
from tests.conftest import TINY_DATA, tiny_run_config


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
        ({"train.lr": 0.2}, ["train.lr 0.05 -> 0.2"]),
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
    with pytest.raises(IncompatibleCheckpoint, match=r"dataset \(digest of manifest.json\)"):
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
    cfg.train.lr = 0.01
    cfg.train.batch_size = 256
    cfg.train.resume = str(source)
    result = train(cfg)
    assert result.resumed_from_step == 4 and result.steps == 8 and result.trained_steps == 4
    changed = {"train.lr": [0.05, 0.01], "train.batch_size": [512, 256]}
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

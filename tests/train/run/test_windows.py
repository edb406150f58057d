"""Training and evaluating on day windows of a dataset that grows by a day: a run keeps
its training days when a day is added, is scored on days it has not seen, and any window
the dataset cannot give is one line naming the key and the day."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.days import WindowError
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.run.evaluate import EVAL_FILE, evaluate
from dlrmflow.train.run.resume import IncompatibleCheckpoint
from dlrmflow.train.run.trainer import train
from tests.conftest import TINY_DATA, run_cli, tiny_run_config

GROWING = {**TINY_DATA, "rows_per_day": 3000, "row_group_size": 1000}


def _dataset(url: Path, days: int) -> str:
    generate_dataset(DataConfig(url=str(url), **{**GROWING, "days": days}))
    return str(url)


def _config(data: str, run_dir: Path, **data_keys: object) -> RunConfig:
    config = tiny_run_config(data, run_dir, epochs=1)
    for key, value in data_keys.items():
        setattr(config.data, key, value)
    return config


def test_a_window_run_stays_whole_when_the_dataset_grows_and_scores_the_new_day(
    tmp_path: Path,
) -> None:
    data = _dataset(tmp_path / "data", 4)
    config = _config(data, tmp_path / "run", train_days="0-2", eval_days="3")
    first = train(config)
    assert first.trained_steps > 0
    scored = evaluate(config.run_dir)
    assert (scored["eval_days"], scored["test_day"]) == ([3], 3)

    _dataset(tmp_path / "data", 5)  # the next day lands; days 0-3 are kept as they were
    again = train(config)  # the same command, on the grown dataset
    assert again.trained_steps == 0 and again.checkpoint == first.checkpoint
    assert evaluate(config.run_dir)["auc"] == scored["auc"]  # its window's day 3, again
    next_day = evaluate(config.run_dir, eval_days=[4])
    assert next_day["eval_days"] == [4] and next_day["rows"] == GROWING["rows_per_day"]
    with pytest.raises(WindowError, match="data.eval_days: day 1: the model trained on it"):
        evaluate(config.run_dir, eval_days="1-3")
    with pytest.raises(WindowError, match="data.eval_days: none holds no day out"):
        evaluate(config.run_dir, eval_days="none")
    assert json.loads((Path(config.run_dir) / EVAL_FILE).read_text())["eval_days"] == [4]


def test_the_default_window_moves_with_the_dataset_and_resume_names_the_days(
    tmp_path: Path,
) -> None:
    data = _dataset(tmp_path / "data", 3)
    config = _config(data, tmp_path / "run")
    train(config)  # days 0-1, the last (2) held out
    _dataset(tmp_path / "data", 4)  # now day 2 is a training day and day 3 held out
    with pytest.raises(IncompatibleCheckpoint) as refused:
        train(config)
    message = str(refused.value)
    assert "training data (data.train_days and their files) 'days 0-1' -> 'days 0-2'" in message


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["data.train_days=0-5"], "data.train_days: day 3: not in the dataset (its days: 0-2)"),
        (["data.train_days=0-1", "data.eval_days=1"], "data.train_days: day 1 is also in"),
        (["data.eval_days=1"], None),  # trains on days 0 and 2
        (["data.train_days=0", "data.eval_days=all"], "data.train_days: day 0 is also in"),
        (["data.train_days=soon"], "data.train_days: Value error, 'soon' is not a day window"),
        (["data.train_days=0-1"], None),  # the same as unset here: runs
    ],
)
def test_train_refuses_a_window_the_dataset_cannot_give_in_one_line(
    overrides: list[str],
    named: str | None,
    tiny_dataset: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run_dir = tmp_path / "run"
    sets = [a for o in [*overrides, f"data.url={tiny_dataset}"] for a in ("--set", o)]
    sizes = ["--set", "train.max_steps=1", "--set", "train.batch_size=512"]
    code, out, err = run_cli(monkeypatch, capsys, "train", "--run-dir", str(run_dir), *sets, *sizes)
    if named is None:
        assert code == 0, err
        return
    assert code == 1 and len(err) == 1, err
    assert named in err[0], err
    assert not (run_dir / "checkpoints").exists()

"""A dataset's weight column (``FeatureSchema.weight``) in training and evaluation: each
row's loss counts by its weight, over the global batch's weights, and the held-out day is
scored with weighted metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrmflow.config import apply_overrides, build_config
from dlrmflow.features.batch import Batch
from dlrmflow.ingest.register import register_dataset
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.loss import StepLoss
from dlrmflow.train.run.rank import DistEnv
from dlrmflow.train.run.trainer import train
from tests.conftest import run_cli
from tests.ingest.own_data import SCHEMA, SCHEMA_YAML, own_day

WEIGHTED = SCHEMA.model_copy(update={"weight": "weight"})
TRAIN_ROWS = 300


def _weights(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Mostly 1, a third 2 and a few 0: integers, so that a row of weight k has an exact
    stand-in in k copies of it."""
    return rng.choice(np.array([0.0, 1.0, 2.0], np.float32), rows, p=[0.1, 0.55, 0.35])


def _write_day(root: Path, day: int, table: pa.Table) -> None:
    folder = root / f"day={day}"
    folder.mkdir(parents=True)
    pq.write_table(table, folder / "part-0.parquet", row_group_size=100)


def _datasets(root: Path) -> dict[str, str]:
    """The same rows three ways, each registered: ``weighted`` (a weight column of 0, 1
    and 2), ``copies`` (each row of weight k written k times, every weight 1) and
    ``ignored`` (the weighted files under a schema that declares no weight). Day 1, the
    held-out day, is the same in all three; ``weightless`` has ``weighted``'s day 0 and
    that day 1 with every weight 0."""
    rng = np.random.default_rng(7)
    train_day, _ = own_day(rng, TRAIN_ROWS)
    test_day, _ = own_day(rng, 400)
    train_w = _weights(rng, TRAIN_ROWS)
    test_w = _weights(rng, 400)
    weighted = root / "weighted"
    _write_day(weighted, 0, train_day.append_column("weight", pa.array(train_w)))
    _write_day(weighted, 1, test_day.append_column("weight", pa.array(test_w)))
    copies = root / "copies"
    repeated = train_day.take(np.repeat(np.arange(TRAIN_ROWS), train_w.astype(np.int64)))
    ones = pa.array(np.ones(repeated.num_rows, np.float32))
    _write_day(copies, 0, repeated.append_column("weight", ones))
    _write_day(copies, 1, test_day.append_column("weight", pa.array(test_w)))
    ignored = root / "ignored"
    for day in (0, 1):
        (ignored / f"day={day}").mkdir(parents=True)
        source = weighted / f"day={day}" / "part-0.parquet"
        (ignored / f"day={day}" / "part-0.parquet").symlink_to(source)
    weightless = root / "weightless"  # a held-out day whose every weight is 0
    _write_day(weightless, 0, train_day.append_column("weight", pa.array(train_w)))
    zeros = pa.array(np.zeros(test_day.num_rows, np.float32))
    _write_day(weightless, 1, test_day.append_column("weight", zeros))
    names = {"weighted": weighted, "copies": copies, "ignored": ignored, "weightless": weightless}
    for name, path in names.items():
        register_dataset(str(path), SCHEMA if name == "ignored" else WEIGHTED)
    return {name: str(path) for name, path in names.items()}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _datasets(tmp_path_factory.mktemp("weighted"))


def _config(data: str, run_dir: Path, **sets: object):
    config = build_config(
        {
            "run_dir": str(run_dir),
            "data": {"url": data},
            "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8]},
            "train": {"batch_size": 64, "num_workers": 0, "log_every": 2, "lr": 0.05},
        }
    )
    return apply_overrides(config, sets)


def _state(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir).model.state_dict()


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].numel())


def test_a_row_of_weight_k_trains_as_k_copies_of_it(datasets, tmp_path):
    """One batch holds a whole epoch (so both runs step on the same rows): the weighted
    rows and their copies give the same weights to float rounding (the sums run in
    another order), and far from a run that ignores the weights. SGD keeps rounding
    rounding-sized: Adam and Adagrad divide a gradient by its own size, so one near 0
    whose last bits differ can move a weight by the learning rate."""
    whole = {
        "train.batch_size": 1024,
        "train.epochs": 4,
        "train.optimizer": "sgd",
        "train.dense_optimizer": "sgd",
        "train.lr": 0.5,
    }
    for name in ("weighted", "copies", "ignored"):
        result = train(_config(datasets[name], tmp_path / name, **whole))
        assert result.steps == 4
    weighted, copies = _state(tmp_path / "weighted"), _state(tmp_path / "copies")
    same = _largest_difference(weighted, copies)
    ignored = _largest_difference(weighted, _state(tmp_path / "ignored"))
    assert same < 1e-6, same
    assert ignored > 1000 * same and ignored > 1e-3, (ignored, same)


def test_weighted_runs_resume_bitwise_and_are_repeatable(datasets, tmp_path):
    """Stopped inside an epoch at a checkpoint and continued, a weighted run ends bitwise
    where the uninterrupted one does; a second uninterrupted run matches it too."""
    data = datasets["weighted"]
    # 300 rows in batches of 64: 5 steps an epoch, so step 7 is inside the second.
    sets = {"train.epochs": 3, "train.max_steps": 12}
    whole = train(_config(data, tmp_path / "whole", **sets))
    stopped = _config(
        data, tmp_path / "stopped", **{**sets, "train.max_steps": 7, "train.checkpoint_every": 7}
    )
    train(stopped)
    resumed = train(apply_overrides(stopped, {"train.max_steps": 12}))
    assert resumed.resumed_from_step == 7 and resumed.steps == whole.steps == 12
    again = train(_config(data, tmp_path / "again", **sets))
    want = _state(tmp_path / "whole")
    for run, result in (("stopped", resumed), ("again", again)):
        got = _state(tmp_path / run)
        assert all(torch.equal(got[k], want[k]) for k in want), run
        assert result.final_loss == whole.final_loss, run


def test_dlrmflow_trains_and_evaluates_a_registered_dataset_with_a_weight_column(
    tmp_path, monkeypatch, capsys
):
    """register -> train -> evaluate from the command line: the evaluation says which
    metrics are weighted, and its weight sum is the held-out day's weight column's."""
    data = tmp_path / "data"
    rng = np.random.default_rng(3)
    days = []
    for day in range(3):
        table, _ = own_day(rng, 500)
        table = table.append_column("weight", pa.array(_weights(rng, 500)))
        _write_day(data, day, table)
        days.append(table)
    schema = tmp_path / "schema.yaml"
    schema.write_text(SCHEMA_YAML + "weight: weight\n")
    code, _, err = run_cli(
        monkeypatch, capsys, "register", "--data", str(data), "--schema", str(schema)
    )
    assert code == 0, err
    run_dir = tmp_path / "run"
    sets = ["train.batch_size=128", "train.epochs=2", "train.num_workers=0"]
    sets += ["model.embedding_dim=4", "model.bottom_mlp=[8,4]", "model.top_mlp=[8]"]
    args = ["--data", str(data), "--run-dir", str(run_dir)]
    code, _, err = run_cli(
        monkeypatch, capsys, "train", *args, *(x for s in sets for x in ("--set", s))
    )
    assert code == 0, err
    assert load_checkpoint(run_dir).spec.weight == "weight"
    code, _, err = run_cli(monkeypatch, capsys, "evaluate", "--run-dir", str(run_dir))
    assert code == 0, err
    metrics = json.loads((run_dir / "eval.json").read_text())
    assert metrics["weight_column"] == "weight"
    assert metrics["weighted"] == [
        "auc",
        "logloss",
        "ne",
        "ne_recalibrated",
        "calibration",
        "positive_rate",
        "calibration_error",
    ]
    test_weights = days[2].column("weight").to_numpy().astype(np.float64)
    assert metrics["rows"] == 500
    assert metrics["weight_sum"] == float(test_weights.sum())
    clicks = days[2].column("click").to_numpy()
    rate = float((test_weights * clicks).sum() / test_weights.sum())
    assert metrics["positive_rate"] == pytest.approx(rate, rel=1e-12)
    assert rate != pytest.approx(float(clicks.mean()), rel=1e-3)  # the weights mattered
    assert 0.6 < metrics["auc"] < 1.0


def test_evaluation_during_training_and_after_it_is_weighted_alike(datasets, tmp_path):
    """``train.eval_every`` scores the live model with the weights, as ``evaluate`` then
    scores its checkpoint; the same files under a schema without the weight give the
    unweighted metrics, with no weighted key."""
    sets = {"train.max_steps": 4, "train.eval_every": 4}
    train(_config(datasets["weighted"], tmp_path / "run", **sets))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    live = [r for r in map(json.loads, lines) if "auc" in r]
    assert [r["step"] for r in live] == [4]
    metrics = evaluate(tmp_path / "run")
    assert metrics["step"] == 4 and metrics["weight_column"] == "weight"
    for name in ("auc", "logloss", "calibration", "weight_sum", "weighted"):
        want = metrics[name]
        if name == "weighted":
            want = [m for m in want if m != "calibration_error"]
        assert live[0][name] == want, name
    train(_config(datasets["ignored"], tmp_path / "plain", **sets))
    plain = evaluate(tmp_path / "plain")
    assert not {"weighted", "weight_sum", "weight_column"} & plain.keys()
    assert all("weight" not in b for b in plain["reliability"])


def test_a_held_out_day_whose_weights_sum_to_0_is_one_line(datasets, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    train(_config(datasets["weighted"], run_dir, **{"train.max_steps": 2}))
    url = datasets["weightless"]
    code, _, err = run_cli(
        monkeypatch, capsys, "evaluate", "--run-dir", str(run_dir), "--data", url
    )
    assert code == 1 and len(err) == 1, err
    assert f"{url}: day 1 (the weights of the evaluated rows sum to 0" in err[0]
    assert not (run_dir / "eval.json").exists()


def test_a_batch_without_weights_in_a_weighted_run_is_refused():
    """Every batch of a weighted run carries its weights, the empty ones too: a batch
    without them would train unweighted rows among weighted ones."""
    loss = StepLoss(DistEnv(0, 1, 0, 1), weighted=True)
    batch = Batch.empty(1, ["a"], weighted=False)
    with pytest.raises(ValueError, match="carries no sample weights"):
        loss(torch.zeros(0), batch, 0)
    empty = Batch.empty(1, ["a"], weighted=True)
    assert float(loss(torch.zeros(0, requires_grad=True), empty, 0).detach()) == 0.0

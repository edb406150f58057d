"""train.tracker: TensorBoard and MLflow get metrics.jsonl's records at the same steps, from
rank 0, with the configuration as parameters; a resumed run continues the same MLflow run,
a failing one ends FAILED; none writes nothing; a missing package fails naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dlrmflow.config import ConfigError, load_config
from dlrmflow.train.run import tracking
from dlrmflow.train.run.checkpoint import list_checkpoints
from dlrmflow.train.run.trainer import NonFiniteLoss, train
from tests.conftest import tiny_run_config

DIVERGING_LR = 1e30  # the loss is infinite by step 2 (tests/train/run/test_non_finite.py)


@pytest.fixture(autouse=True)
def _mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tracker opts in to MLflow's file store in os.environ: undone after each test.
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def _records(run_dir: Path, key: str) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r[key] for r in records if key in r}


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events


def _scalars(events, tag: str) -> dict[int, float]:
    steps = [(e.step, e.value) for e in events.Scalars(tag)]
    assert len({s for s, _ in steps}) == len(steps), f"{tag}: a step logged twice"
    return dict(steps)


def _client(run_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "tracking.json").read_text())["run_id"]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_tensorboard_logs_the_metrics_records_and_the_config(
    tiny_dataset: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(
        tiny_dataset, run, max_steps=6, log_every=2, eval_every=3, tracker="tensorboard"
    )
    cfg.eval.max_rows = 1000
    train(cfg)
    events = _events(run)
    loss = _records(run, "loss")
    assert sorted(loss) == [2, 4, 6]
    assert _scalars(events, "loss") == pytest.approx(loss, rel=1e-6)
    assert _scalars(events, "samples_per_s") == pytest.approx(
        _records(run, "samples_per_s"), rel=1e-6
    )
    assert sorted(_scalars(events, "data_wait_s")) == [2, 4, 6]
    auc = _records(run, "auc")
    assert sorted(auc) == [3, 6]
    assert _scalars(events, "eval/auc") == pytest.approx(auc, rel=1e-6)
    assert "config/text_summary" in events.Tags()["tensors"]
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


def test_tensorboard_hides_what_an_interrupted_run_logged_past_its_checkpoint(
    tiny_dataset: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(
        tiny_dataset, run, max_steps=6, log_every=1, checkpoint_every=4, tracker="tensorboard"
    )
    train(cfg)
    # Killed after logging step 6 but before its checkpoint: the resumed run trains 5-8.
    shutil.rmtree(list_checkpoints(run)[-1].path)
    cfg.train.max_steps = 8
    train(cfg)
    loss = _records(run, "loss")
    assert sorted(loss) == list(range(1, 9))
    assert _scalars(_events(run), "loss") == pytest.approx(loss, rel=1e-6)


def test_mlflow_logs_params_and_metrics_and_finishes_the_run(
    tiny_dataset: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(
        tiny_dataset, run, max_steps=6, log_every=2, eval_every=3, tracker="mlflow"
    )
    cfg.eval.max_rows = 1000
    train(cfg)
    client = _client(run)
    mlflow_run = client.get_run(_run_id(run))
    assert mlflow_run.info.status == "FINISHED"
    assert client.get_experiment(mlflow_run.info.experiment_id).name == "dlrmflow"
    params = mlflow_run.data.params
    assert params["train.lr"] == "0.002" and params["train.tracker"] == "mlflow"
    assert params["model.bottom_mlp"] == "[16, 8]" and params["train.eval_every"] == "3"
    assert params["train.checkpoint_every"] == "null" and params["run_dir"] == str(run)
    loss = _records(run, "loss")
    assert _history(client, mlflow_run.info.run_id, "loss") == sorted(loss.items())
    for key in ("samples_per_s", "data_wait_s"):
        assert _history(client, mlflow_run.info.run_id, key) == sorted(_records(run, key).items())
    auc = _records(run, "auc")
    assert sorted(auc) == [3, 6]
    assert _history(client, mlflow_run.info.run_id, "eval/auc") == sorted(auc.items())


def test_mlflow_resumed_run_continues_the_same_run_and_a_fresh_one_starts_another(
    tiny_dataset: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(tiny_dataset, run, max_steps=4, log_every=1, tracker="mlflow")
    train(cfg)
    first = _run_id(run)
    assert _client(run).get_run(first).info.status == "FINISHED"

    cfg.train.max_steps = 8
    result = train(cfg)
    assert result.resumed_from_step == 4 and _run_id(run) == first
    client = _client(run)
    resumed = client.get_run(first)
    assert resumed.info.status == "FINISHED"
    loss = _records(run, "loss")
    assert [s for s, _ in _history(client, first, "loss")] == list(range(1, 9))
    assert _history(client, first, "loss") == sorted(loss.items())
    # MLflow params never change: a value changed on resuming is a tag.
    assert resumed.data.params["train.max_steps"] == "4"
    assert resumed.data.tags["resumed.train.max_steps"] == "8"

    cfg.train.resume = "never"
    with pytest.warns(UserWarning, match="starting afresh"):
        train(cfg)
    fresh = _run_id(run)
    assert fresh != first
    assert [s for s, _ in _history(client, fresh, "loss")] == list(range(1, 9))
    assert client.get_run(fresh).data.params["train.max_steps"] == "8"
    assert client.get_run(fresh).info.experiment_id == resumed.info.experiment_id


def test_mlflow_run_of_a_failing_training_ends_failed(tiny_dataset: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(
        tiny_dataset, run, max_steps=10, log_every=1, lr=DIVERGING_LR, tracker="mlflow"
    )
    with pytest.raises(NonFiniteLoss):
        train(cfg)
    client = _client(run)
    run_id = _run_id(run)
    assert client.get_run(run_id).info.status == "FAILED"
    assert _history(client, run_id, "loss") == sorted(_records(run, "loss").items())


def test_no_tracker_writes_nothing_new(tiny_dataset: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_run_config(tiny_dataset, run, max_steps=2))
    for name in ("tensorboard", "mlruns", "tracking.json"):
        assert not (run / name).exists()


def test_unknown_tracker_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"train\.tracker: .*'wandb'"):
        load_config(overrides=["train.tracker=wandb"], env=False)


@pytest.mark.parametrize("name", ["tensorboard", "mlflow"])
def test_a_missing_package_fails_before_any_work_naming_the_key_and_the_extra(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util,
        "find_spec",
        lambda module, *a: None if module == name else real(module, *a),
    )
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as failed:
        train(tiny_run_config(tiny_dataset, run, max_steps=2, tracker=name))
    message = str(failed.value)
    assert f"train.tracker={name}" in message and f"pip install 'dlrmflow[{name}]'" in message
    assert not (run / "metrics.jsonl").exists() and not list_checkpoints(run)

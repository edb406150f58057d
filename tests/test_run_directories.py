"""Run directories as a user meets them: the demo and the end-to-end flow never replace
another kind of run unasked, and ``evaluate`` never creates a run directory, records the
dataset it scored, and refuses a bad ``--nproc`` or a path that is no checkpoint in one
line. ``evaluate --config/--set`` change how a run is scored, never the model it scores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dlrmflow.config import ConfigError, DataConfig, RunConfig
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.run.checkpoint import dataset_digest
from dlrmflow.train.run.evaluate import EVAL_FILE, evaluate, evaluation_settings
from dlrmflow.train.run.trainer import (
    END_TO_END_KIND,
    RUN_FILE,
    TRAIN_KIND,
    RunDirTaken,
    claim_run_dir,
    run_kind,
    train,
)
from tests.conftest import TINY_DATA, run_cli, tiny_run_config


def _listing(run_dir: Path) -> dict[str, int]:
    """Every file of the run under ``run_dir`` with its size (the lock's files aside)."""
    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.name.startswith(".lock")]
    return {str(p.relative_to(run_dir)): p.stat().st_size for p in files}


@pytest.fixture(scope="module")
def trained(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    """A `train` run of 2 steps (copied by the tests that write into it)."""
    cfg = tiny_run_config(tiny_dataset, tmp_path_factory.mktemp("trained") / "run", max_steps=2)
    train(cfg)
    return cfg


def _copy(trained: RunConfig, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained.run_dir, run_dir)
    return run_dir


@pytest.mark.parametrize("marked", [True, False], ids=["run.json", "older-run-dir"])
def test_demo_refuses_a_directory_holding_a_train_run_and_leaves_it_intact(
    trained: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    marked: bool,
) -> None:
    run_dir = _copy(trained, tmp_path)
    assert json.loads((run_dir / RUN_FILE).read_text())["kind"] == TRAIN_KIND
    if not marked:  # written before runs recorded their kind: its files tell
        (run_dir / RUN_FILE).unlink()
    before = _listing(run_dir)
    code, out, err = run_cli(monkeypatch, capsys, "demo", "--quick", "--run-dir", str(run_dir))
    assert code == 1 and "summary" not in out, err
    assert err[-1] == (
        f"error: {run_dir} holds a train run, which dlrmflow demo would replace; use another "
        "run directory (--run-dir), or --set train.resume=never to replace it"
    ), err
    assert [line for line in err if line.startswith("error:")] == [err[-1]]
    assert _listing(run_dir) == before  # checkpoints, metrics and result untouched


def test_the_end_to_end_flow_refuses_a_train_run_unless_told_to_replace_it(
    trained: RunConfig, tmp_path: Path
) -> None:
    from dlrmflow.flows.end_to_end import end_to_end

    run_dir = _copy(trained, tmp_path)
    before = _listing(run_dir)
    cfg = trained.model_copy(deep=True)
    cfg.run_dir = str(run_dir)
    with pytest.raises(RunDirTaken, match="holds a train run, which the end_to_end flow"):
        end_to_end.fn(cfg)  # the flow's body: refused before any task
    assert _listing(run_dir) == before

    # Told to (train.resume=never, as `train --resume never`), it says so and takes it.
    with pytest.warns(UserWarning, match=r"train.resume=never: dlrmflow demo replaces the train"):
        claim_run_dir(run_dir, END_TO_END_KIND, replace=True, command="dlrmflow demo")
    assert run_kind(run_dir) == END_TO_END_KIND
    # A training in an end-to-end run's directory continues its training: it stays one.
    claim_run_dir(run_dir, TRAIN_KIND, replace=False, command="train")
    assert run_kind(run_dir) == END_TO_END_KIND


def test_evaluate_never_creates_a_missing_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "no_such_run"
    code, out, err = run_cli(monkeypatch, capsys, "evaluate", "--run-dir", str(missing))
    assert code == 1 and out == ""
    assert len(err) == 1 and err[0].startswith(f"error: {missing}: no such run directory"), err
    assert not missing.exists()


def test_evaluate_nproc_0_is_one_line_naming_it(
    trained: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run_dir = _copy(trained, tmp_path)
    code, _, err = run_cli(
        monkeypatch, capsys, "evaluate", "--run-dir", str(run_dir), "--nproc", "0"
    )
    assert code == 1 and err == ["error: --nproc must be at least 1, not 0"], err


def test_evaluate_checkpoint_naming_a_dataset_is_one_line_naming_the_path(
    trained: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run_dir = _copy(trained, tmp_path)
    data = trained.data.url  # has a manifest.json, of days rather than shards
    for nproc in ("1", "2"):
        code, _, err = run_cli(
            monkeypatch, capsys, "evaluate", "--run-dir", str(run_dir), "--checkpoint", data,
            "--nproc", nproc,
        )  # fmt: skip
        assert code == 1 and len(err) == 1, err
        assert err[0].startswith(f"error: {data}: not a checkpoint"), err
    assert not (run_dir / "eval.json").exists()


def test_evaluate_records_the_dataset_it_scored(
    trained: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run_dir = _copy(trained, tmp_path)
    other = str(tmp_path / "other")
    generate_dataset(DataConfig(url=other, **{**TINY_DATA, "seed": 8}))
    for data, args in ((trained.data.url, []), (other, ["--data", other])):
        code, _, err = run_cli(
            monkeypatch, capsys, "evaluate", "--run-dir", str(run_dir), "--max-rows", "500", *args
        )
        assert code == 0, err
        scored = json.loads((run_dir / "eval.json").read_text())
        assert scored["data_url"] == data
        assert scored["dataset_digest"] == dataset_digest(read_manifest(data))


def test_evaluate_takes_evaluation_settings_from_a_file_and_set(
    trained: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run_dir = _copy(trained, tmp_path)
    settings = tmp_path / "eval.yaml"
    settings.write_text("eval:\n  max_rows: 300\nmodel:\n  kernels: torch\n")
    code, out, err = run_cli(
        monkeypatch, capsys, "evaluate", "--run-dir", str(run_dir), "--config", str(settings)
    )
    assert code == 0, err
    assert json.loads(out)["rows"] == 300
    code, out, err = run_cli(
        monkeypatch, capsys, "evaluate", "--run-dir", str(run_dir), "--config", str(settings),
        "--set", "eval.max_rows=200", "--set", "train.device=cpu",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["rows"] == 200  # --set over the file, as for train


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--set", "model.embedding_dim=8"], "model.embedding_dim (--set model.embedding_dim=8)"),
        (["--set", "train.lr=0.1"], "train.lr (--set train.lr=0.1)"),
        (["--config", "{file}"], "features.ids (file {file})"),
        (
            ["--device", "gpu"],
            "invalid configuration: train.device: Input should be 'auto', 'cpu' or 'cuda'",
        ),
        (
            ["--set", "model.kernels=fast"],
            "invalid configuration: model.kernels: Input should be 'auto', 'torch'",
        ),
        (
            ["--max-rows", "0"],
            "invalid configuration: eval.max_rows: Input should be greater than or equal to 1",
        ),
    ],
)
def test_evaluate_refuses_a_model_key_or_a_bad_setting_in_one_line(
    args: list[str],
    named: str,
    trained: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run_dir = _copy(trained, tmp_path)
    settings = tmp_path / "train.yaml"
    settings.write_text("features:\n  ids: vocab\neval:\n  max_rows: 10\n")
    args = [a.format(file=settings) for a in args]
    code, out, err = run_cli(monkeypatch, capsys, "evaluate", "--run-dir", str(run_dir), *args)
    assert code == 1 and out == "" and len(err) == 1, err
    assert err[0].startswith(f"error: {named.format(file=settings)}"), err
    assert not (run_dir / EVAL_FILE).exists()


def test_evaluation_settings_take_only_the_hosts_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shell set up for training does not change what a run is scored on or how; the
    hosts of a job (one set of variables per host) still come from it, as for train."""
    monkeypatch.setenv("DLRMFLOW_DATA__URL", "/elsewhere")
    monkeypatch.setenv("DLRMFLOW_TRAIN__DEVICE", "cuda")
    monkeypatch.setenv("DLRMFLOW_EVAL__MAX_ROWS", "5")
    monkeypatch.setenv("DLRMFLOW_DISTRIBUTED__NPROC", "4")
    monkeypatch.setenv("DLRMFLOW_DISTRIBUTED__TIMEOUT_S", "12")
    monkeypatch.setenv("DLRMFLOW_DISTRIBUTED__NODE_RANK", "0")
    plain = evaluation_settings()
    assert (plain.data_url, plain.max_rows, plain.batch_size) == (None, None, None)
    assert (plain.device, plain.kernels, plain.nproc) == ("auto", "auto", 1)
    assert plain.distributed.timeout_s == 12
    given = evaluation_settings(
        None,
        ["eval.batch_size=64", "data.url=/test", "distributed.timeout_s=30"],
        {"eval.max_rows": 9, "model.kernels": "torch", "distributed.nnodes": None},
    )
    assert (given.data_url, given.max_rows, given.batch_size) == ("/test", 9, 64)
    assert (given.kernels, given.distributed.timeout_s) == ("torch", 30)
    monkeypatch.setenv("DLRMFLOW_DISTRIBUTED__NNODES", "abc")
    with pytest.raises(ConfigError, match="DLRMFLOW_DISTRIBUTED__NNODES"):
        evaluation_settings()  # every variable is still checked


def test_evaluate_on_two_ranks_scores_in_the_batch_size_asked_for(
    trained: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run_dir = _copy(trained, tmp_path)
    alone = evaluate(run_dir)  # the whole test day, as the two ranks score it
    assert alone["batch_size"] == trained.eval.batch_size != 64
    args = ["--nproc", "2", "--set", "eval.batch_size=64"]
    code, out, err = run_cli(monkeypatch, capsys, "evaluate", "--run-dir", str(run_dir), *args)
    assert code == 0, err
    recorded = json.loads((run_dir / EVAL_FILE).read_text())
    assert (recorded["batch_size"], recorded["world_size"]) == (64, 2)
    assert recorded["rows"] == alone["rows"]
    assert recorded["auc"] == pytest.approx(alone["auc"], abs=1e-6)


def test_evaluate_scores_in_the_batch_size_asked_for(trained: RunConfig, tmp_path: Path) -> None:
    run_dir = _copy(trained, tmp_path)
    batches: list[int] = []
    metrics = evaluate(run_dir, max_rows=500, batch_size=128, progress=batches.append)
    assert metrics["rows"] == 500 == sum(batches)
    assert max(batches) == 128

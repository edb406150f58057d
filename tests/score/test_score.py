"""Batch scoring: every row once, keyed by (day, row), with evaluation's own predictions;
resumable; refusing another model's output; unlabeled data; one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import dlrmflow.score.worker as worker
from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.ingest.manifest import DayFile, Manifest, read_manifest, write_manifest
from dlrmflow.ingest.shares import day_shares
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.score.model import ModelNotFound, _ids
from dlrmflow.score.output import (
    SCORES_FILE,
    PartWriter,
    list_parts,
    part_path,
    settle_days,
)
from dlrmflow.score.score import score_dataset
from dlrmflow.train.run import evaluate as evaluation_stage
from dlrmflow.train.run.checkpoint import load_checkpoint, save_checkpoint
from dlrmflow.train.run.data import load_ids
from dlrmflow.train.run.evaluate import NonFinitePredictions
from dlrmflow.train.run.metrics import click_metrics
from dlrmflow.train.run.rank import DistEnv
from dlrmflow.train.run.trainer import train
from tests.conftest import TINY_DATA, run_cli, tiny_run_config

# Divides the tiny dataset's row groups (2000 rows): every share's batches then hold the
# same rows as one process's, and a model's output for a row depends on its batch's rows
# in the last bits (measured: 3e-8 apart in batches of 700 and of 6000).
BATCH = 1000
TEST_DAY = 2


@pytest.fixture(scope="module")
def trained(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    cfg = tiny_run_config(tiny_dataset, tmp_path_factory.mktemp("score") / "run", max_steps=2)
    train(cfg)
    return cfg


@pytest.fixture(scope="module")
def other_model(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    cfg = tiny_run_config(tiny_dataset, tmp_path_factory.mktemp("other") / "run", max_steps=3)
    train(cfg)
    return cfg


def scores(out: Path) -> pa.Table:
    """Every prediction under ``out``, by day then row."""
    table = pq.read_table(out)
    return table.sort_by([("day", "ascending"), ("row", "ascending")])


def column(table: pa.Table, name: str) -> torch.Tensor:
    """A column as a float32 tensor (a copy: Arrow's buffers are read-only)."""
    return torch.tensor(table[name].to_numpy(), dtype=torch.float32)


def evaluation(run_dir: str, url: str, day: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation's probabilities and labels of ``day``, row by row: its own ``predict``
    over its own loader, one process, one reader (so in the day's file order)."""
    ckpt = load_checkpoint(run_dir)
    config = ckpt.config
    config.eval.batch_size, config.train.num_workers = BATCH, 0
    ids = load_ids(config.features.ids, ckpt.spec, Path(run_dir))
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
    # ``test_loader`` is not imported by name: pytest would collect it as a test.
    loader = evaluation_stage.test_loader(config, ckpt.spec, ids, env, url, [day])
    try:
        scored = evaluation_stage.predict(ckpt.model, loader, ckpt.spec, env)
    finally:
        loader.close()
    assert scored is not None
    return scored.probs, scored.labels


@pytest.mark.parametrize("nproc", [1, 2])
def test_predictions_are_evaluations_row_for_row(
    trained: RunConfig,
    tmp_path: Path,
    nproc: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    out = tmp_path / "out"
    args = ["--model", trained.run_dir, "--data", trained.data.url, "--out", str(out)]
    options = ["--days", str(TEST_DAY), "--batch-size", str(BATCH), "--nproc", str(nproc)]
    code, printed, err = run_cli(monkeypatch, capsys, "score", *args, *options)
    assert code == 0, err
    result = json.loads(printed)
    assert (result["rows"], result["rows_scored"], result["parts"]) == (6000, 6000, nproc)
    table = scores(out)
    # Every row of the day exactly once.
    assert table["day"].to_pylist() == [TEST_DAY] * 6000
    assert table["row"].to_pylist() == list(range(6000))
    probs, labels = evaluation(trained.run_dir, trained.data.url, TEST_DAY)
    got = column(table, "prediction")
    assert torch.equal(got, probs)  # bitwise: the same kernels on the same batches
    assert torch.equal(column(table, "label"), labels)
    assert click_metrics(got, labels) == click_metrics(probs, labels)
    manifest = json.loads((out / SCORES_FILE).read_text())
    assert manifest["complete"] and manifest["rows"] == 6000 and manifest["days"] == [TEST_DAY]
    assert manifest["model"]["step"] == 2 and manifest["max_rows"] is None
    assert [p["shares"] for p in manifest["parts"]] == [nproc] * nproc


def test_shares_deal_row_groups_as_the_reader_and_key_them_within_the_day(
    tiny_dataset: str,
) -> None:
    manifest = read_manifest(tiny_dataset)
    shares = day_shares(tiny_dataset, manifest, 1, 2)
    assert [[s.row_group for s in share.splits] for share in shares] == [[0, 2], [1]]
    assert [share.starts for share in shares] == [(0, 4000), (2000,)]
    assert [share.rows for share in shares] == [4000, 2000]
    # More shares than row groups: the last holds none, and is still a part.
    assert [s.rows for s in day_shares(tiny_dataset, manifest, 1, 4)] == [2000, 2000, 2000, 0]


def test_max_rows_caps_each_day_and_an_empty_share_writes_an_empty_part(
    trained: RunConfig, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = score_dataset(
        trained.run_dir, trained.data.url, out, days="0-1", max_rows=2500, batch_size=700
    )
    assert result["rows"] == 5000
    table = scores(out)
    for day in (0, 1):
        rows = table.filter(pa.compute.equal(table["day"], day))["row"].to_pylist()
        assert rows == list(range(2500))
    # The day's rows as one process reads them, cut into batches of another size: the
    # probabilities agree but for the last bits.
    probs, _ = evaluation(trained.run_dir, trained.data.url, 1)
    day1 = table.filter(pa.compute.equal(table["day"], 1))["prediction"].to_numpy()
    assert np.allclose(day1, probs[:2500].numpy(), rtol=0, atol=1e-6)


def test_a_stopped_run_resumes_to_the_same_output_without_duplicates(
    trained: RunConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = tmp_path / "whole"
    score_dataset(trained.run_dir, trained.data.url, whole, batch_size=BATCH)
    out = tmp_path / "out"
    real = worker.share_batches
    parts: list[int] = []

    def stopped_in_the_second_part(share, *args, **kwargs):
        parts.append(share.day)
        for i, keyed in enumerate(real(share, *args, **kwargs)):
            if len(parts) == 2 and i == 2:
                raise RuntimeError("simulated: the machine went away")
            yield keyed

    monkeypatch.setattr(worker, "share_batches", stopped_in_the_second_part)
    with pytest.raises(RuntimeError, match="simulated"):
        score_dataset(trained.run_dir, trained.data.url, out, batch_size=BATCH)
    assert parts == [0, 1]
    # The first part whole, nothing of the second visible.
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.parquet")) == [
        "day-0/part-0-of-1.parquet"
    ]
    assert not list(out.rglob("*.tmp"))
    # SIGKILL would have left the second part's temporary behind.
    (out / "day-1" / ".part-0-of-1.parquet.4242.tmp").write_bytes(b"PAR1 half a part")
    monkeypatch.undo()

    done: list[int] = []
    result = score_dataset(
        trained.run_dir, trained.data.url, out, batch_size=BATCH, progress=done.append
    )
    assert (result["parts_kept"], result["rows_scored"], result["rows"]) == (1, 12000, 18000)
    assert sum(done) == 18000  # the kept part counts, once
    assert scores(out).equals(scores(whole))
    assert not list(out.rglob("*.tmp"))
    # Once more: nothing left to do.
    again = score_dataset(trained.run_dir, trained.data.url, out, batch_size=BATCH)
    assert (again["parts_kept"], again["rows_scored"]) == (3, 0)
    assert scores(out).equals(scores(whole))


def _part(out: Path, day: int, share: int, count: int, digest: str = "m") -> None:
    footer = {"model_digest": digest, "day_digest": "d"}
    with PartWriter(part_path(out, day, share, count), footer) as writer:
        writer.write(day, np.arange(share, share + 1), None, np.zeros(1, np.float32))
        writer.commit()


def test_settling_keeps_a_complete_layout_and_drops_any_other(tmp_path: Path) -> None:
    _part(tmp_path, 0, 0, 2)  # day 0: half of a 2-share layout (a stopped run)
    _part(tmp_path, 1, 0, 1)  # day 1: whole in one share...
    _part(tmp_path, 1, 1, 2)  # ...and a stray share of another layout
    assert settle_days(tmp_path, [0, 1, 2], 1) == [0, 2]
    assert [(p.day, p.share, p.count) for p in list_parts(tmp_path)] == [(1, 0, 1)]


def test_another_models_or_datasets_output_is_refused_unless_overwritten(
    trained: RunConfig,
    other_model: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    out = tmp_path / "out"
    common = ["--data", trained.data.url, "--out", str(out), "--days", "2"]
    code, _, err = run_cli(monkeypatch, capsys, "score", "--model", trained.run_dir, *common)
    assert code == 0, err
    before = scores(out)

    code, _, err = run_cli(monkeypatch, capsys, "score", "--model", other_model.run_dir, *common)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {out} holds predictions of another model ("), err
    assert "--overwrite" in err[0]
    assert scores(out).equals(before)

    other_data = str(tmp_path / "other_data")
    generate_dataset(DataConfig(url=other_data, **{**TINY_DATA, "seed": 8}))
    code, _, err = run_cli(
        monkeypatch, capsys, "score", "--model", trained.run_dir, "--data", other_data,
        "--out", str(out), "--days", "2",
    )  # fmt: skip
    assert code == 1 and len(err) == 1, err
    assert f"holds predictions of day 2 from other files ({trained.data.url})" in err[0]

    capped = [*common, "--max-rows", "100"]
    code, _, err = run_cli(monkeypatch, capsys, "score", "--model", trained.run_dir, *capped)
    assert code == 1 and len(err) == 1, err
    assert "of every row of each day (this run asks for --max-rows 100)" in err[0]
    assert scores(out).equals(before)

    code, printed, err = run_cli(
        monkeypatch, capsys, "score", "--model", other_model.run_dir, *common, "--overwrite"
    )
    assert code == 0, err
    assert json.loads(printed)["model"]["step"] == 3
    replaced = scores(out)
    assert replaced["row"].equals(before["row"])
    assert not replaced["prediction"].equals(before["prediction"])
    assert json.loads((out / SCORES_FILE).read_text())["model"]["step"] == 3


@pytest.mark.parametrize(
    "case",
    ["no model", "dataset as model", "no dataset", "no such day", "nproc 0", "out is a file",
     "out holds other files", "remote out"],
)  # fmt: skip
def test_expected_failures_are_one_line_naming_the_thing(
    case: str,
    trained: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    args = {"--model": trained.run_dir, "--data": trained.data.url, "--out": str(tmp_path / "o")}
    extra: list[str] = []
    if case == "no model":
        args["--model"] = str(tmp_path / "no_run")
        expected = f"{tmp_path / 'no_run'}: no such model"
    elif case == "dataset as model":
        args["--model"] = trained.data.url
        expected = f"{trained.data.url}: not a checkpoint"
    elif case == "no dataset":
        args["--data"] = str(tmp_path / "no_data")
        expected = f"{tmp_path / 'no_data'}/manifest.json: no manifest"
    elif case == "no such day":
        extra = ["--days", "2-7"]
        expected = "--days: day 3: not in the dataset (its days: 0-2)"
    elif case == "nproc 0":
        extra = ["--nproc", "0"]
        expected = "--nproc must be at least 1, not 0"
    elif case == "out is a file":
        (tmp_path / "o").write_text("precious")
        expected = f"{tmp_path / 'o'} is not a directory"
    elif case == "out holds other files":
        (tmp_path / "o").mkdir()
        (tmp_path / "o" / "notes.txt").write_text("precious")
        expected = f"{tmp_path / 'o'}: not empty (notes.txt) and not the output of `dlrmflow score`"
    else:
        args["--out"] = "s3://bucket/scores"
        expected = "--out s3://bucket/scores: predictions are written to a local directory"
    flat = [item for pair in args.items() for item in pair]
    code, printed, err = run_cli(monkeypatch, capsys, "score", *flat, *extra)
    assert code == 1 and printed == "" and len(err) == 1, err
    assert err[0].startswith(f"error: {expected}"), err
    if case in ("out is a file", "out holds other files"):
        assert not list(tmp_path.rglob("*.parquet"))  # nothing written, nothing replaced
    else:
        assert not (tmp_path / "o").exists()  # refused before the directory was made


def test_a_failed_process_ends_the_command_in_one_line_naming_its_rank(
    trained: RunConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    # A day of two row groups, the second (rank 1's share) with a label that is not 0 or 1.
    day = pq.read_table(read_manifest(trained.data.url).day_paths(trained.data.url, [2])[0])
    labels = day["label"].to_numpy().copy()
    labels[2500] = 2
    bad = day.set_column(0, "label", pa.array(labels, pa.int8())).slice(0, 4000)
    data = tmp_path / "bad"
    _dataset(data, bad, day.schema)
    out = tmp_path / "out"
    code, _, err = run_cli(
        monkeypatch, capsys, "score", "--model", trained.run_dir, "--data", str(data),
        "--out", str(out), "--nproc", "2",
    )  # fmt: skip
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("error: scoring with 2 processes failed: rank 1: DataError: "), err
    assert "row group 1" in err[0] and "not 0 or 1" in err[0]
    assert not (out / "day-0" / "part-1-of-2.parquet").exists()
    # Rank 0 may be stopped inside its part: what it leaves is hidden, never a part, and
    # the next run removes it.
    assert all(path.name.startswith(".") for path in out.rglob("*.tmp"))
    assert not json.loads((out / SCORES_FILE).read_text())["complete"]


def _dataset(root: Path, table: pa.Table, schema: pa.Schema) -> None:
    """A one-day dataset of ``table`` (its manifest lists no digests, as old ones did)."""
    path = root / "day=0" / "part-0.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(table, path, row_group_size=2000)
    kept = set(table.column_names)
    columns = [{"name": f.name, "type": str(f.type)} for f in schema if f.name in kept]
    rows = table.num_rows
    labels = table["label"].to_numpy() if "label" in kept else np.zeros(1)
    rate = float(labels.mean())
    listed = DayFile(day=0, path=str(path.relative_to(root)), rows=rows, positive_rate=rate)
    manifest = Manifest(
        source="synthetic",
        rows=rows,
        days=1,
        test_day=0,
        positive_rate=rate,
        files=[listed],
        schema=columns,
    )
    write_manifest(str(root), manifest)


def test_unlabeled_data_is_scored_with_null_labels(trained: RunConfig, tmp_path: Path) -> None:
    day = pq.read_table(read_manifest(trained.data.url).day_paths(trained.data.url, [2])[0])
    data = tmp_path / "unlabeled"
    _dataset(data, day.drop_columns(["label"]), day.schema)
    out = tmp_path / "out"
    result = score_dataset(trained.run_dir, str(data), out, batch_size=BATCH)
    assert result["labeled"] is False and result["rows"] == 6000
    table = scores(out)
    assert table["label"].null_count == 6000
    assert table["row"].to_pylist() == list(range(6000))
    probs, _ = evaluation(trained.run_dir, trained.data.url, TEST_DAY)
    assert torch.equal(column(table, "prediction"), probs)


def test_non_finite_predictions_are_refused_and_leave_no_part(
    trained: RunConfig, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained.run_dir, run_dir)
    ckpt = load_checkpoint(run_dir)
    with torch.no_grad():
        ckpt.model.dense_arch.top[0].weight[0, 0] = float("inf")
    save_checkpoint(
        run_dir,
        model=ckpt.model,
        optimizer=torch.optim.SGD(ckpt.model.dense_arch.parameters(), lr=0.0),
        config=ckpt.config,
        spec=ckpt.spec,
        progress={"step": 3, "epoch": 0, "rows": 0, "seconds": 0.0, "loss": None},
        loader_state=None,
    )
    out = tmp_path / "out"
    with pytest.raises(NonFinitePredictions, match=r"step_000000003: the model predicts NaN"):
        score_dataset(run_dir, trained.data.url, out, days="2")
    assert not list(out.rglob("*.parquet")) and not list(out.rglob("*.tmp"))


def test_a_vocabulary_without_its_file_is_refused_in_one_line(trained: RunConfig) -> None:
    ckpt = load_checkpoint(trained.run_dir)
    config = ckpt.config.model_copy(deep=True)
    config.features.ids = "vocab"
    with pytest.raises(ModelNotFound, match=r"model.pt2: its IDs map through a vocabulary"):
        _ids(config, ckpt.spec, None, "model.pt2")


def test_a_servable_export_scores_as_its_checkpoint(trained: RunConfig, tmp_path: Path) -> None:
    from dlrmflow.train.run.exported_model import export_servable

    export = tmp_path / "model.pt2"
    export_servable(trained.run_dir, export, verify_rows=0)
    out = tmp_path / "out"
    result = score_dataset(export, trained.data.url, out, days="2", batch_size=BATCH)
    assert result["model"]["kind"] == "servable" and result["model"]["step"] == 2
    table = scores(out)
    assert table["row"].to_pylist() == list(range(6000))
    probs, labels = evaluation(trained.run_dir, trained.data.url, TEST_DAY)
    got = column(table, "prediction")
    assert torch.allclose(got, probs, rtol=0, atol=1e-6)
    assert torch.equal(column(table, "label"), labels)
    # The export is another model than its checkpoint for the output's identity.
    with pytest.raises(ValueError, match="holds predictions of another model"):
        score_dataset(trained.run_dir, trained.data.url, out, days="2")


def test_score_has_help() -> None:
    from typer.testing import CliRunner

    from dlrmflow.cli import app

    result = CliRunner().invoke(app, ["score", "--help"])
    assert result.exit_code == 0 and "--model" in result.output and "--overwrite" in result.output

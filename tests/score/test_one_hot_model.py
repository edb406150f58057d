"""A model trained on one-hot data refuses to score or evaluate a multi-hot dataset: its
tables never pooled a list, and its scores there would be wrong without a sign."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrmflow.config import DataConfig
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.run.exported_model import export_servable
from dlrmflow.train.run.trainer import train
from tests.conftest import TINY_DATA, run_cli, tiny_run_config


def test_a_one_hot_model_refuses_a_multi_hot_dataset_in_one_line(
    tiny_dataset: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run = tmp_path / "run"
    train(tiny_run_config(tiny_dataset, run, max_steps=2))
    export = tmp_path / "model.pt2"
    export_servable(run, export, verify_rows=0)
    lists = str(tmp_path / "multi_hot")
    small = {**TINY_DATA, "days": 2, "rows_per_day": 500, "row_group_size": 250}
    generate_dataset(DataConfig(url=lists, multi_hot=True, **small))

    for args in (
        ["score", "--model", str(run), "--data", lists, "--out", str(tmp_path / "s1")],
        ["score", "--model", str(export), "--data", lists, "--out", str(tmp_path / "s2")],
        ["evaluate", "--run-dir", str(run), "--data", lists],
    ):
        code, out, err = run_cli(monkeypatch, capsys, *args)
        assert code == 1 and out == "" and len(err) == 1, (args, err)
        assert err[0].startswith(f"error: {lists} is multi-hot"), err
        assert "trained on one-hot data" in err[0]
    assert not (tmp_path / "s1").exists() and not (tmp_path / "s2").exists()

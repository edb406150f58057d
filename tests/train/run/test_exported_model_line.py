"""Torch-exports of a model line's versions are checked against their checkpoint: the
line's run holds no day out, so the check takes the version's next day (or the day it
was validated on), and says on stderr when it can take none."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dlrmflow.config import DataConfig
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.line.line import train_line
from tests.conftest import TINY_DATA, run_cli, tiny_run_config

DAYS = {**TINY_DATA, "days": 2, "rows_per_day": 2000, "row_group_size": 500}


def test_line_versions_exports_are_checked_on_their_next_or_validated_day(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    data = str(tmp_path / "data")
    generate_dataset(DataConfig(url=data, **DAYS))
    line = tmp_path / "line"
    train_line(line, tiny_run_config(data, tmp_path / "ignored", batch_size=400))

    def export(version: str) -> tuple[dict, list[str]]:
        """The export's check, and the warnings it gave (one line each on stderr)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code, out, err = run_cli(
                monkeypatch, capsys, "export", "--run-dir", str(line / "run"),
                "--checkpoint", str(line / "versions" / version / "checkpoint"),
                "--out", str(tmp_path / f"{version}.pt2"), "--format", "torch-export",
            )  # fmt: skip
        assert code == 0 and err == [], err
        return json.loads(out)["verify"], [str(w.message) for w in caught]

    # Version 0 trained on day 0: checked on day 1, the day the line judges it on.
    check, err = export("0000")
    assert check["days"] == [1] and check["max_abs_diff"] == 0.0 and err == []
    # Version 1 trained on days 0-1 and the dataset has no day 2 yet: checked on day 1,
    # the day it was validated on before the line trained on it.
    check, err = export("0001")
    assert check["days"] == [1] and "validated on" in check["days_chosen"] and err == []
    assert check["max_abs_diff"] == 0.0

    record = line / "versions" / "0001" / "version.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "validation": None}))
    check, err = export("0001")
    assert "skipped" in check
    assert len(err) == 1 and "0001.pt2 was not checked against the checkpoint" in err[0]
    assert "day 2, the day after its last training day, is not in the dataset" in err[0]

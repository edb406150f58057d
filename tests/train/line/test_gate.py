"""The promotion gate of a model line: a version replaces the champion only when it is no
worse on the day after its last, and the published model is the version's, atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dlrmflow.config import ConfigError, DataConfig, GateConfig, load_config
from dlrmflow.errors import DlrmflowError
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.line.gate import champion, judge
from dlrmflow.train.line.line import train_line, verdicts
from dlrmflow.train.run.checkpoint import load_checkpoint
from tests.conftest import TINY_DATA, tiny_run_config

DAYS = {**TINY_DATA, "rows_per_day": 2500, "row_group_size": 500, "days": 3}
CANDIDATE = {"ne": 0.90, "calibration": 1.05}


@pytest.mark.parametrize(
    ("candidate", "champion_ne", "gate", "reasons"),
    [
        (CANDIDATE, None, {}, []),
        (CANDIDATE, 0.90, {}, []),  # no worse
        (CANDIDATE, 0.89, {}, ["NE 0.900000 above the champion's 0.890000"]),
        (CANDIDATE, 0.89, {"ne_margin": 0.02}, []),  # within the margin
        ({"ne": 0.9, "calibration": 1.3}, None, {}, ["calibration 1.3000 outside [0.8, 1.25]"]),
        (
            {"ne": 0.95, "calibration": 0.5},
            0.9,
            {},
            ["calibration 0.5000 outside", "NE 0.950000 above"],
        ),
    ],
)
def test_the_gate_names_each_reason_a_version_is_held_back(
    candidate, champion_ne, gate, reasons
) -> None:
    against = None if champion_ne is None else (3, {"ne": champion_ne, "calibration": 1.0})
    verdict = judge(4, 9, candidate, against, GateConfig(**gate))
    assert verdict.promoted == (not reasons)
    assert len(verdict.reasons) == len(reasons)
    for got, want in zip(verdict.reasons, reasons, strict=True):
        assert got.startswith(want)


def test_the_gate_can_judge_recalibrated_ne_and_calibration_against_the_trained_rate() -> None:
    """A day whose click rate rose 30%: a version calibrated on the days it trained on
    scores 1/1.3 there, and loses NE to its miscalibration alone."""
    moved = {"ne": 0.95, "ne_recalibrated": 0.90, "calibration": 0.77, "base_rate_ratio": 1.3}
    against = (3, {"ne": 0.93, "ne_recalibrated": 0.91, "calibration": 0.8})
    plain = judge(4, 9, moved, against, GateConfig())
    assert not plain.promoted and len(plain.reasons) == 2
    assert plain.reasons[0].startswith("calibration 0.7700 outside [0.8, 1.25]")
    follows = GateConfig(ne="ne_recalibrated", calibration_follows_rate=True)
    assert judge(4, 9, moved, against, follows).promoted  # 0.77 x 1.3 = 1.001; 0.90 <= 0.91
    worse = {**moved, "ne_recalibrated": 0.92, "calibration": 1.0}  # 1.0 x 1.3 = 1.3
    reasons = judge(4, 9, worse, against, follows).reasons
    assert reasons[0].startswith(
        "calibration against the trained days' click rate (1.3000 x the day's) 1.3000 outside"
    )
    assert reasons[1].startswith("recalibrated NE 0.920000 above the champion's 0.910000")
    with pytest.raises(DlrmflowError, match="gate.ne ne_recalibrated: day 9 was scored before"):
        judge(4, 9, {"ne": 0.9, "calibration": 1.0}, against, follows)


def test_calibration_bounds_must_be_ordered() -> None:
    with pytest.raises(ConfigError, match="calibration_min"):
        load_config(None, ["gate.calibration_min=1.5"])


def _line(tmp_path: Path, name: str, **gate: object) -> Path:
    data = tmp_path / "data"
    if not (data / "manifest.json").exists():
        generate_dataset(DataConfig(url=str(data), **DAYS))
    config = tiny_run_config(str(data), tmp_path / "unused", batch_size=400)
    config.gate = GateConfig(**{**config.gate.model_dump(), **gate})
    line = tmp_path / name
    train_line(line, config)
    return line


def test_versions_that_pass_are_published_and_current_moves_to_them(tmp_path: Path) -> None:
    line = _line(tmp_path, "open", calibration_min=0.01, calibration_max=100, ne_margin=1.0)
    # Version 0 was judged on day 1 (no champion), version 1 on day 2 against version 0.
    judged = verdicts(line)
    assert [(v.version, v.day, v.champion, v.promoted) for v in judged] == [
        (0, 1, None, True),
        (1, 2, 0, True),
    ]
    assert judged[1].champion_metrics["day"] == 2 and judged[1].candidate_metrics["day"] == 2
    assert champion(line) == 1 and os.readlink(line / "models" / "current") == "0001"
    published = load_file(line / "models" / "current" / "model.safetensors")
    trained = load_checkpoint(line / "versions" / "0001" / "checkpoint").model.state_dict()
    dense = [name for name in trained if not name.startswith("embeddings.")]
    assert dense and set(dense) <= set(published)  # the MLPs by name, as export writes them
    for name in dense:
        assert torch.equal(published[name], trained[name]), name
    record = json.loads((line / "models" / "0001" / "model.json").read_text())
    assert record["day"] == 1 and record["verdict"]["promoted"]


def test_a_version_that_fails_the_gate_is_kept_but_not_published(tmp_path: Path) -> None:
    line = _line(tmp_path, "strict", calibration_min=50.0, calibration_max=100.0)
    judged = verdicts(line)
    assert [v.promoted for v in judged] == [False, False]
    assert all("calibration" in v.reasons[0] for v in judged)
    assert champion(line) is None and not (line / "models").exists()
    assert (line / "versions" / "0002" / "checkpoint").is_dir()  # trained and kept

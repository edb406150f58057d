"""The promotion gate of a model line: a version replaces the champion only when it is no
worse on the day after its last, and the published model is the version's, atomically."""

from __future__ import annotations

import json
import os
import shutil
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
    verdict = judge(4, 9, candidate, against, GateConfig(ne="ne", calibration="raw", **gate))
    assert verdict.promoted == (not reasons)
    assert len(verdict.reasons) == len(reasons)
    for got, want in zip(verdict.reasons, reasons, strict=True):
        assert got.startswith(want)


def test_the_gate_can_judge_recalibrated_ne_and_calibration_against_the_trained_rate() -> None:
    """A day whose click rate rose 30%: a version calibrated on the days it trained on
    scores 1/1.3 there, and loses NE to its miscalibration alone."""
    moved = {"ne": 0.95, "ne_recalibrated": 0.90, "calibration": 0.77, "base_rate_ratio": 1.3}
    against = (3, {"ne": 0.93, "ne_recalibrated": 0.91, "calibration": 0.8})
    plain = judge(4, 9, moved, against, GateConfig(ne="ne", calibration="raw"))
    assert not plain.promoted and len(plain.reasons) == 2
    assert plain.reasons[0].startswith("calibration 0.7700 outside [0.8, 1.25]")
    follows = GateConfig(calibration="raw", calibration_follows_rate=True)
    assert judge(4, 9, moved, against, follows).promoted  # 0.77 x 1.3 = 1.001; 0.90 <= 0.91
    worse = {**moved, "ne_recalibrated": 0.92, "calibration": 1.0}  # 1.0 x 1.3 = 1.3
    reasons = judge(4, 9, worse, against, follows).reasons
    assert reasons[0].startswith(
        "calibration against the trained days' click rate (1.3000 x the day's) 1.3000 outside"
    )
    assert reasons[1].startswith("recalibrated NE 0.920000 above the champion's 0.910000")
    with pytest.raises(DlrmflowError, match="gate.ne ne_recalibrated: day 9 was scored before"):
        judge(4, 9, {"ne": 0.9, "calibration": 1.0}, against, follows)


def _fitted(after: float, shift: float = 0.25) -> dict:
    """A recalibration fitted on a day's first 250 rows, judged on its other 750."""
    return {
        "shift": shift,
        "day": 9,
        "fit_rows": 250,
        "judged_rows": 750,
        "before": {"calibration": 0.77},
        "after": {"calibration": after},
    }


def test_the_default_gate_judges_the_recalibrated_model_not_the_days_rate() -> None:
    """The day's click rate rose 30%: raw calibration 0.77 fails the bounds, but a shift
    fitted on the day's first rows calibrates the others (1.01), and the NE compared is
    the one miscalibration does not count. A model no shift calibrates (1.40 after) or one
    that ranks worse (recalibrated NE) is still held back, each reason with its figures."""
    against = (3, {"ne": 0.93, "ne_recalibrated": 0.91, "calibration": 0.8})
    moved = {"ne": 0.95, "ne_recalibrated": 0.90, "calibration": 0.77, "base_rate_ratio": 1.3}
    gate = GateConfig()
    assert judge(4, 9, {**moved, "recalibration": _fitted(1.01)}, against, gate).promoted
    held = judge(4, 9, {**moved, "recalibration": _fitted(1.4)}, against, gate)
    assert held.reasons == [
        "recalibrated calibration (shift +0.2500 fitted on the day's first 250 rows, judged "
        "on its other 750) 1.4000 outside [0.8, 1.25] (gate.calibration_min, "
        "gate.calibration_max)"
    ]
    spread = {**moved, "recalibration": {**_fitted(1.4), "rows": "spread"}}
    assert (
        judge(4, 9, spread, against, gate)
        .reasons[0]
        .startswith(
            "recalibrated calibration (shift +0.2500 fitted on 250 rows spread over the day, "
            "judged on its other 750) 1.4000 outside"
        )
    )
    worse = {**moved, "ne_recalibrated": 0.95, "recalibration": _fitted(1.0)}
    reasons = judge(4, 9, worse, against, gate).reasons
    assert len(reasons) == 1
    assert reasons[0].startswith("recalibrated NE 0.950000 above the champion's 0.910000")
    # The raw calibration, as before: 0.77 fails.
    raw = judge(
        4, 9, {**moved, "recalibration": _fitted(1.01)}, against, GateConfig(calibration="raw")
    )
    assert raw.reasons[0].startswith("calibration 0.7700 outside [0.8, 1.25]")
    # A day scored without a recalibration (gate.recalibration_share: 0) is judged raw.
    assert judge(4, 9, moved, against, gate).reasons[0].startswith("calibration 0.7700 outside")


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
    # Version 1 was recalibrated on a quarter of day 2 (625 of 2500 rows, spread over it),
    # judged on the rest: version.json, its verdict and the published record say so, and
    # its checkpoint carries the shift to every reader (the published weights above are
    # with it).
    lineage = json.loads((line / "versions" / "0001" / "version.json").read_text())
    fitted = lineage["recalibration"]
    assert (fitted["day"], fitted["fit_rows"], fitted["judged_rows"]) == (2, 625, 1875)
    assert fitted["rows"] == "spread"
    assert judged[1].candidate_metrics["recalibration"] == fitted == record["recalibration"]
    assert (line / "versions" / "0001" / "checkpoint" / "recalibration.json").is_file()
    raw = line / "raw"
    shutil.copytree(line / "versions" / "0001" / "checkpoint", raw)
    (raw / "recalibration.json").unlink()
    last = "dense_arch.top.2.bias"  # top_mlp [32], then the logit
    unshifted = load_checkpoint(raw).model.state_dict()[last]
    torch.testing.assert_close(published[last], unshifted + fitted["shift"], rtol=0, atol=1e-6)
    # The newest version awaits its next day; the run's own checkpoints never carry one.
    assert (
        json.loads((line / "versions" / "0002" / "version.json").read_text())["recalibration"]
        is None
    )
    assert not list((line / "run").rglob("recalibration.json"))


def test_a_version_that_fails_the_gate_is_kept_but_not_published(tmp_path: Path) -> None:
    line = _line(tmp_path, "strict", calibration_min=50.0, calibration_max=100.0)
    judged = verdicts(line)
    assert [v.promoted for v in judged] == [False, False]
    assert all("calibration" in v.reasons[0] for v in judged)
    assert champion(line) is None and not (line / "models").exists()
    assert (line / "versions" / "0002" / "checkpoint").is_dir()  # trained and kept

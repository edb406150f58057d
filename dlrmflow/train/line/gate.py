"""The promotion gate of a model line, and publishing a version that passes it.

A version can only be compared with the model serving (the champion) on data neither has
trained on: the day after the version's last. So a version is judged when that day
arrives, before the line trains on it: both are scored on it, and the version replaces
the champion only if its normalized entropy is no worse than the champion's by more than
``gate.ne_margin`` (relative) and its calibration lies within ``gate.calibration_min`` and
``gate.calibration_max``. The first version, with no champion, needs the calibration
bounds alone.

By default both checks judge the model, not the day. The NE compared is the one
miscalibration does not count (``gate.ne: ne_recalibrated``: each model's predictions
shifted to the day's click rate), and the calibration judged is the version's once
recalibrated (``gate.calibration: recalibrated``): the shift fitted on a share of the
day's rows (``gate.recalibration_share``, spread over the day or its first rows as
``gate.recalibration_rows`` says; ``train.run.recalibration``) applied to the other rows,
as the version would serve with it. A day whose click rate moved then holds no
version back for that alone, while a model whose predictions a shift cannot calibrate
still fails. ``gate.calibration: raw`` judges the version's own calibration on the day
(``gate.calibration_follows_rate``: against the click rate of the days it trained on,
the day's calibration times its ``base_rate_ratio``); ``gate.ne: ne`` compares plain NE.

A published version is ``LINE/models/NNNN/``: ``model.safetensors`` (the whole model by
parameter name, as ``dlrmflow export`` writes it) and ``model.json`` (its days, parent,
configuration digest, the verdict and both scores). ``LINE/models/current`` is a symbolic
link to the champion's directory, replaced in one rename: a reader sees the old champion
or the new one, never neither.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import GateConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.train.run.export import export_model

MODELS_DIR = "models"
CURRENT = "current"
MODEL_FILE = "model.safetensors"
RECORD_FILE = "model.json"


class ChampionError(DlrmflowError):
    """``models/current`` does not name a published version."""


@dataclass(frozen=True)
class Verdict:
    """Whether a version replaces the champion on ``day``, and why (or why not)."""

    version: int
    day: int
    champion: int | None
    promoted: bool
    reasons: list[str]
    candidate_metrics: dict[str, Any]
    champion_metrics: dict[str, Any] | None
    # The identity of the day's files judged on: a verdict on other files is made again.
    day_digest: str | None = None


def judge(
    version: int,
    day: int,
    candidate: dict[str, Any],
    champion: tuple[int, dict[str, Any]] | None,
    gate: GateConfig,
) -> Verdict:
    """The gate's verdict on ``candidate`` (a version's metrics on ``day``) against the
    ``champion`` (its number and metrics on the same day), if there is one."""
    reasons = []
    calibration, judged = candidate["calibration"], "calibration"
    ratio = candidate.get("base_rate_ratio")
    fitted = candidate.get("recalibration")
    if gate.calibration == "recalibrated" and fitted is not None:
        calibration = fitted["after"]["calibration"]
        rows = (
            f"the day's first {fitted['fit_rows']} rows"
            if fitted.get("rows", "first") == "first"
            else f"{fitted['fit_rows']} rows spread over the day"
        )
        judged = (
            f"recalibrated calibration (shift {fitted['shift']:+.4f} fitted on {rows}, "
            f"judged on its other {fitted['judged_rows']})"
        )
    elif gate.calibration_follows_rate and ratio:
        calibration *= ratio
        judged = f"calibration against the trained days' click rate ({ratio:.4f} x the day's)"
    if not gate.calibration_min <= calibration <= gate.calibration_max:
        reasons.append(
            f"{judged} {calibration:.4f} outside [{gate.calibration_min}, "
            f"{gate.calibration_max}] (gate.calibration_min, gate.calibration_max)"
        )
    if champion is not None:
        key, name = gate.ne, "NE" if gate.ne == "ne" else "recalibrated NE"
        if key not in candidate or key not in champion[1]:
            raise DlrmflowError(
                f"gate.ne {key}: day {day} was scored before {key} was recorded; set "
                "gate.ne: ne to judge it"
            )
        limit = champion[1][key] * (1 + gate.ne_margin)
        if candidate[key] > limit:
            reasons.append(
                f"{name} {candidate[key]:.6f} above the champion's {champion[1][key]:.6f} "
                f"x (1 + gate.ne_margin={gate.ne_margin}) = {limit:.6f}"
            )
    return Verdict(
        version=version,
        day=day,
        champion=None if champion is None else champion[0],
        promoted=not reasons,
        reasons=reasons,
        candidate_metrics=candidate,
        champion_metrics=None if champion is None else champion[1],
    )


def champion(line_dir: Path) -> int | None:
    """The version serving now (``models/current``), or None before the first promotion.

    Publishing only ever moves ``current`` forward, so the champion is the newest
    published version (``models/NNNN`` with its ``model.json``). A ``current`` that is
    not a link to one (dangling, another name, a regular file, or missing once a version
    was published) is one line naming it and the command that repairs it: the gate must
    not judge against no champion, or the wrong one."""
    models = line_dir / MODELS_DIR
    link = models / CURRENT
    published = sorted(
        path.name
        for path in (models.glob("[0-9][0-9][0-9][0-9]") if models.is_dir() else [])
        if (path / RECORD_FILE).is_file()
    )
    if link.is_symlink():
        target = os.readlink(link)
        if target in published:
            return int(target)
        cause = f"points at {target!r}, which is not a published version (models/NNNN)"
    elif link.exists():
        cause = "is not a symbolic link to the champion's models/NNNN"
    elif published:
        cause = f"is missing, but version {published[-1]} was published"
    else:
        return None
    repair = f"ln -sfn {published[-1]} {link}" if published else f"rm {link}"
    raise ChampionError(f"{link}: {cause}; the champion is the newest published version: {repair}")


def publish(line_dir: Path, checkpoint: Path, record: dict[str, Any], verdict: Verdict) -> Path:
    """Export the promoted version's model under ``models/NNNN/`` and make it current."""
    name = f"{verdict.version:04d}"
    target = line_dir / MODELS_DIR / name
    target.mkdir(parents=True, exist_ok=True)
    export_model(checkpoint, target / MODEL_FILE)
    write_atomic(
        target / RECORD_FILE,
        json.dumps({**record, "verdict": asdict(verdict)}, indent=1) + "\n",
    )
    link = line_dir / MODELS_DIR / CURRENT
    staged = link.with_name(f".{CURRENT}-{os.getpid()}")
    if staged.is_symlink() or staged.exists():
        staged.unlink()
    os.symlink(name, staged)
    os.replace(staged, link)  # one rename: the old champion or the new, never neither
    return target

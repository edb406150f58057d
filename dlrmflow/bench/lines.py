"""What the benchmarks that run model lines over generated days share (``bench recurring``,
``bench dynamic``): the days' settings, a line run over every day, and a way's summary of
its days."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from dlrmflow.config import RunConfig
from dlrmflow.train.line.line import VERSIONS_DIR, open_line

# The next-day scores each day's record keeps.
SCORES = ("auc", "logloss", "calibration")


def recalibrated(fitted: dict[str, Any] | None) -> dict[str, float]:
    """A day's recalibration (``train.run.recalibration``: fitted on its first rows) in a
    few figures, on the day's other rows: the shift, calibration and AUC before and after
    it; {} where none was fitted."""
    if not fitted:
        return {}
    before, after = fitted["before"], fitted["after"]
    return {
        "shift": fitted["shift"],
        "calibration_judged": before["calibration"],
        "calibration_recalibrated": after["calibration"],
        "auc_judged": before["auc"],
        "auc_recalibrated": after["auc"],
    }


def day_settings(defaults: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """``defaults`` (the generator's ``data`` settings) with the ``overrides`` that are not
    None; at least three days: day 0 and two next days to score."""
    data = dict(defaults)
    data.update({key: value for key, value in overrides.items() if value is not None})
    if data["days"] < 3:
        raise ValueError(f"days must be >= 3 (got {data['days']}): day 0 and two next days")
    return data


def run_line(config: RunConfig, line_dir: Path) -> tuple[list[dict[str, Any]], float, Path]:
    """A model line over every day of ``config``'s data: (each next day's scores and
    CPU-seconds, day 0's CPU-seconds, the newest version's checkpoint). A day's
    CPU-seconds are the process's (every thread) for scoring, judging and training it."""
    per_day, first_day = [], 0.0
    with open_line(line_dir, config) as line:
        for day in line.pending():
            cpu = time.process_time()
            version = line.advance(day)
            spent = time.process_time() - cpu
            if version.validation is None:
                first_day = spent
                continue
            scores = {k: float(version.validation[k]) for k in SCORES}
            fitted = recalibrated(version.validation.get("recalibration"))
            per_day.append({"day": day, **scores, **fitted, "cpu_s": spent})
        newest = line_dir / VERSIONS_DIR / line.versions[-1].name / "checkpoint"
    return per_day, first_day, newest


def summary_of(days: list[dict[str, Any]]) -> dict[str, float]:
    """A way's days in a few figures: mean and last next-day AUC, mean calibration,
    CPU-seconds a day and in all, and their recalibrations' (``recalibration_summary``)."""
    summary = {
        "mean_next_day_auc": statistics.fmean(r["auc"] for r in days),
        "last_day_auc": days[-1]["auc"],
        "mean_calibration": statistics.fmean(r["calibration"] for r in days),
        "cpu_s_per_day": statistics.fmean(r["cpu_s"] for r in days),
        "cpu_s_total": sum(r["cpu_s"] for r in days),
    }
    return summary | recalibration_summary(days)


def recalibration_summary(days: list[dict[str, Any]]) -> dict[str, float]:
    """The days' recalibrations (``recalibrated``) in a few figures, over the days that had
    one: calibration on the rows judged, mean before and after, the worst day's after (the
    farthest from 1), and the largest change of AUC; {} where no day had one."""
    fitted = [r for r in days if "calibration_recalibrated" in r]
    if not fitted:
        return {}
    after = [r["calibration_recalibrated"] for r in fitted]
    return {
        "mean_calibration_judged": statistics.fmean(r["calibration_judged"] for r in fitted),
        "mean_calibration_recalibrated": statistics.fmean(after),
        "worst_calibration_recalibrated": max(after, key=lambda c: abs(c - 1.0)),
        "max_auc_change_recalibrated": max(
            abs(r["auc_recalibrated"] - r["auc_judged"]) for r in fitted
        ),
    }

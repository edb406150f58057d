"""Recurring training benchmark: a model line continued daily against retraining from scratch
every day and against a model trained once and frozen, on drifting data.

The synthetic generator writes ``days`` days with ``data.drift`` and ``data.churn`` > 0:
each day the click model moves (each ID's effects take an AR(1) step), a share of IDs is
born and as many fade out, and the click rate walks a few percent, as a live service's
logs change. Every day d from 1 on, three models that have seen
only days before d are scored on day d (next-day AUC, log loss and calibration):

- ``continued``: a model line (``dlrmflow line``): on day d its newest version is scored
  and then continued on day d alone (weights and optimizer state carried over, day order);
- ``retrained``: a new model trained from scratch on every day before d (days 0..d-1, one
  epoch, rows shuffled across days as ``dlrmflow train`` does), then scored;
- ``frozen``: the model trained on day 0 alone, scored every day and never trained again.

All three use the same model, optimizer, batch, seed, threads and process. The CPU-seconds
of each day are the process's CPU time (every thread) spent on that day's work: for
``continued`` the scoring and the day's training (and the gate's export of a promoted
version), for ``retrained`` its training on all history and the scoring, for ``frozen``
the scoring alone (its one training on day 0 is reported apart). The ratios (higher is
better for the line): mean next-day AUC of the line ÷ that of each other way,
``retrained`` CPU-seconds per day ÷ the line's, and the line's mean distance of
calibration from 1 without its recalibration ÷ with it (on the rows it was not fitted on).

Each model scored on a day is also recalibrated there as the line's gate recalibrates a
version (``train.run.recalibration``): a shift of its logit fitted on a quarter of the
day's rows spread over it (``gate.recalibration_share``, ``gate.recalibration_rows``), and
the calibration and AUC of the other rows before and after it: the calibration a shift
fitted on the day's rows gives, and the AUC it leaves alone.

The line's own gate publishes every version (its work is part of each day). Its verdicts,
which hold both models' scores on the day, are then judged again by the default gate
(recalibrated NE, calibration once recalibrated), by the raw one (plain NE and
calibration) and by the raw one judging calibration against the trained days' click rate
(``gate.calibration_follows_rate``): the share of versions each would promote, each
against its parent, and why it holds the others back.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dlrmflow.bench.lines import SCORES, day_settings, recalibrated, run_line, summary_of
from dlrmflow.bench.machine import describe_machine
from dlrmflow.config import GateConfig, RunConfig
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.runtime.glibc_malloc import tune_allocator
from dlrmflow.train.line.gate import judge
from dlrmflow.train.line.line import verdicts
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.trainer import train

BASELINE = (
    "on the same drifting days, model, optimizer, batch, seed, threads and process: "
    "retrained = from scratch each day on every day before it; frozen = trained on day 0 "
    "only; ratios = the line's mean next-day AUC ÷ theirs, and retrained CPU-seconds a "
    "day ÷ the line's (> 1: the line better or cheaper)"
)
WAYS = ("continued", "retrained", "frozen")
DATA = {
    "days": 12,
    "rows_per_day": 200_000,
    "row_group_size": 50_000,
    "drift": 0.1,
    "churn": 0.05,
}
QUICK_DATA = {
    "days": 4,
    "rows_per_day": 3_000,
    "row_group_size": 1_500,
    "drift": 0.1,
    "churn": 0.05,
}
MODEL = {"embedding_dim": 16, "bottom_mlp": [64, 16], "top_mlp": [64]}
QUICK_MODEL = {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]}


def _config(data: dict[str, Any], run_dir: Path, quick: bool) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_dir": str(run_dir),
            "data": data,
            "model": QUICK_MODEL if quick else MODEL,
            "train": {
                "batch_size": 256 if quick else 1024,
                "log_every": 10**9,
                "checkpoint_every": 10**9,
            },
            # Every version is published: the gate's work is part of the line's day.
            "gate": {"calibration_min": 1e-9, "calibration_max": 1e9, "ne_margin": 1e9},
        }
    )


def _cpu() -> float:
    return time.process_time()


def _score(config: RunConfig, day: int) -> dict[str, float]:
    """The day's scores, and a recalibration fitted on its rows as the line's gate fits one
    (``gate.recalibration_share``, ``gate.recalibration_rows``), judged on the rest."""
    share, rows = config.gate.recalibration_share or None, config.gate.recalibration_rows
    metrics = evaluate(config.run_dir, eval_days=[day], recalibrate=share, recalibrate_rows=rows)
    scores = {k: float(metrics[k]) for k in SCORES}
    return {**scores, **recalibrated(metrics.get("recalibration_fitted"))}


def run_recurring_benchmark(
    quick: bool = False,
    *,
    days: int | None = None,
    rows_per_day: int | None = None,
    drift: float | None = None,
    work_dir: Path | None = None,
) -> dict[str, Any]:
    """Run the three ways over the same drifting days; the JSON record (see the module)."""
    tune_allocator()
    data = day_settings(
        QUICK_DATA if quick else DATA, days=days, rows_per_day=rows_per_day, drift=drift
    )
    with tempfile.TemporaryDirectory(prefix="dlrmflow-recurring-") as scratch:
        root = Path(work_dir) if work_dir is not None else Path(scratch)
        data["url"] = str(root / "data")
        base = _config(data, root / "unused", quick)
        generate_dataset(base.data)
        manifest = read_manifest(base.data.url)
        bayes = {f.day: f.bayes_auc for f in manifest.files}
        per_day: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
        started = time.perf_counter()

        # continued: a model line, a version a day.
        per_day["continued"], first_day_cpu, _ = run_line(base.model_copy(deep=True), root / "line")
        gate = _gate_record(root / "line")

        # frozen: day 0 alone, then scored each day.
        frozen = base.model_copy(deep=True)
        frozen.run_dir = str(root / "frozen")
        frozen.data.train_days, frozen.data.eval_days = "0", "none"
        cpu = _cpu()
        train(frozen)
        frozen_train_cpu = _cpu() - cpu
        for day in range(1, data["days"]):
            cpu = _cpu()
            scores = _score(frozen, day)
            per_day["frozen"].append({"day": day, **scores, "cpu_s": _cpu() - cpu})

        # retrained: from scratch on every day before, each day.
        for day in range(1, data["days"]):
            cpu = _cpu()
            fresh = base.model_copy(deep=True)
            fresh.run_dir = str(root / f"retrained-{day}")
            fresh.data.train_days, fresh.data.eval_days = f"0-{day - 1}", "none"
            train(fresh)
            scores = _score(fresh, day)
            per_day["retrained"].append({"day": day, **scores, "cpu_s": _cpu() - cpu})

    for way in WAYS:
        for record in per_day[way]:
            record["bayes_auc"] = bayes[record["day"]]
    summary = {way: summary_of(per_day[way]) for way in WAYS}
    continued = summary["continued"]
    ratios = {
        "mean_next_day_auc_vs_retrained": continued["mean_next_day_auc"]
        / summary["retrained"]["mean_next_day_auc"],
        "mean_next_day_auc_vs_frozen": continued["mean_next_day_auc"]
        / summary["frozen"]["mean_next_day_auc"],
        "cpu_s_per_day_retrained_vs_continued": summary["retrained"]["cpu_s_per_day"]
        / continued["cpu_s_per_day"],
        **calibration_ratio(per_day["continued"]),
    }
    return {
        "benchmark": "recurring",
        "quick": quick,
        "baseline": BASELINE,
        "data": {k: v for k, v in data.items() if k != "url"},
        "model": QUICK_MODEL if quick else MODEL,
        "batch_size": base.train.batch_size,
        "seconds": time.perf_counter() - started,
        "first_day_cpu_s": first_day_cpu,
        "frozen_train_cpu_s": frozen_train_cpu,
        "days": per_day,
        "summary": summary,
        "gate": gate,
        "ratios": ratios,
        "machine": describe_machine(),
    }


# Gates the line's verdicts are judged again by: the default (recalibrated NE, calibration
# once recalibrated), the raw one (plain NE and calibration, the default before
# recalibration), and the raw one with the calibration judged against the trained days'
# click rate.
GATES = {
    "default": GateConfig(),
    "raw": GateConfig(ne="ne", calibration="raw"),
    "rate": GateConfig(calibration="raw", calibration_follows_rate=True),
}


def calibration_ratio(days: list[dict[str, Any]]) -> dict[str, float]:
    """The line's mean distance of calibration from 1 on the rows each day's shift was not
    fitted on, without the shift ÷ with it (> 1: the recalibration helps); {} for days
    without one."""
    if not days or not all("calibration_recalibrated" in d for d in days):
        return {}
    raw = statistics.fmean(abs(d["calibration_judged"] - 1.0) for d in days)
    shifted = statistics.fmean(abs(d["calibration_recalibrated"] - 1.0) for d in days)
    return {"calibration_error_raw_vs_recalibrated": raw / shifted}


def _gate_record(line_dir: Path) -> dict[str, Any]:
    """The share of the continued line's versions each of ``GATES`` promotes, and why it
    holds the others back. Each is judged against the version serving when it was judged,
    which is its parent here (the line's own gate publishes every version), on the scores
    both had on the day."""
    judged = verdicts(line_dir)
    record: dict[str, Any] = {}
    for name, gate in GATES.items():
        again = [
            judge(
                v.version,
                v.day,
                v.candidate_metrics,
                None if v.champion is None else (v.champion, v.champion_metrics or {}),
                gate,
            )
            for v in judged
        ]
        record[name] = {
            "promoted_share": sum(v.promoted for v in again) / len(again) if again else 0.0,
            "held_back": [{"day": v.day, "reasons": v.reasons} for v in again if not v.promoted],
        }
    return record


def _gates(record: dict[str, Any]) -> str:
    """What the gates would promote of the line's versions (records from before they
    were judged again have nothing to say)."""
    gate = record.get("gate")
    if not gate:
        return ""
    shares = ", ".join(
        f"{name} {gate[name]['promoted_share']:.0%}" for name in GATES if name in gate
    )
    return (
        f" Versions of the line the gate would promote (each against its parent on the same "
        f"day): {shares}; `default` is the gate's defaults (recalibrated NE, calibration once "
        "recalibrated), `raw` plain NE and calibration, `rate` recalibrated NE and the raw "
        "calibration against the trained days' click rate."
    )


def _churn(data: dict[str, Any]) -> str:
    """The churn of a record's days (records from before it had none)."""
    churn = data.get("churn")
    return f", {churn} of the IDs born (and as many gone)" if churn else ""


def plot_recurring(record: dict[str, Any], path: Path) -> Path:
    """Next-day AUC against the day for the three ways, with each day's Bayes AUC."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.add_subplot(1, 1, 1)
    days = record["days"]
    for way, marker in zip(WAYS, ("o", "s", "^"), strict=True):
        axes.plot([r["day"] for r in days[way]], [r["auc"] for r in days[way]], marker=marker,
                  label=way)  # fmt: skip
    bayes = days["continued"]
    axes.plot([r["day"] for r in bayes], [r["bayes_auc"] for r in bayes], linestyle="--",
              color="grey", label="Bayes optimum")  # fmt: skip
    axes.set_xlabel("day (scored before training on it)")
    axes.set_ylabel("next-day AUC")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=100, format="png")
    return Path(path)


PLOT = "recurring_auc.png"


def recurring_section(record: dict[str, Any]) -> str:
    """The benchmark's results as markdown: the ways side by side, then day by day."""
    from dlrmflow.bench.report import markdown_table

    data, summary = record["data"], record["summary"]
    ways = [
        [way, s["mean_next_day_auc"], s["last_day_auc"], s["mean_calibration"],
         s["cpu_s_per_day"], s["cpu_s_total"]]
        for way, s in summary.items()
    ]  # fmt: skip
    days = record["days"]
    by_day = [
        [c["day"], c["bayes_auc"], c["auc"], r["auc"], f["auc"], c["cpu_s"], r["cpu_s"], f["cpu_s"]]
        for c, r, f in zip(days["continued"], days["retrained"], days["frozen"], strict=True)
    ]
    ratios = ", ".join(f"`{k}` {v:.3f}" for k, v in record["ratios"].items())
    return "\n\n".join(
        [
            "## Recurring training",
            f"Baseline: {record['baseline']}. {data['days']} days of {data['rows_per_day']:,} "
            f"rows drifting by {data['drift']} a day{_churn(data)}; model {record['model']}, batch "
            f"{record['batch_size']}. Day 0 trains the line's first version "
            f"({record['first_day_cpu_s']:.1f} CPU-s) and the frozen model "
            f"({record['frozen_train_cpu_s']:.1f} CPU-s). Ratios: {ratios}.{_gates(record)} "
            f"Run apart from the report (`make bench-recurring`), on "
            f"{record['machine']['cpu']} with {record['machine']['cpu_count']} CPUs, in "
            f"{record['seconds'] / 60:.1f} min.",
            markdown_table(
                [
                    "way",
                    "mean next-day AUC",
                    "last day's AUC",
                    "mean calibration",
                    "CPU-s a day",
                    "CPU-s in all",
                ],
                ways,
            ),  # fmt: skip
            markdown_table(
                [
                    "day",
                    "Bayes AUC",
                    "continued",
                    "retrained",
                    "frozen",
                    "CPU-s continued",
                    "CPU-s retrained",
                    "CPU-s frozen",
                ],
                by_day,
            ),  # fmt: skip
            *_recalibration_tables(record),
            f"![next-day AUC against the day]({PLOT})",
        ]
    )


def _recalibration_tables(record: dict[str, Any]) -> list[str]:
    """Each way's calibration on the rows a day's recalibration did not fit, before and
    after it, with its largest change of AUC; then day by day (records from before
    recalibration have none)."""
    from dlrmflow.bench.report import markdown_table

    summary, days = record["summary"], record["days"]
    if not all("mean_calibration_recalibrated" in s for s in summary.values()):
        return []
    ways = [
        [way, s["mean_calibration_judged"], s["mean_calibration_recalibrated"],
         s["worst_calibration_recalibrated"], s["max_auc_change_recalibrated"]]
        for way, s in summary.items()
    ]  # fmt: skip
    by_day = [
        [c["day"], c["shift"], c["calibration_judged"], c["calibration_recalibrated"],
         r["calibration_judged"], r["calibration_recalibrated"],
         f["calibration_judged"], f["calibration_recalibrated"]]
        for c, r, f in zip(days["continued"], days["retrained"], days["frozen"], strict=True)
    ]  # fmt: skip
    return [
        "Calibration on each day's rows outside the quarter its shift was fitted on "
        "(`gate.recalibration_share`, spread over the day), before and after the shift, and "
        "the largest change of the AUC of those rows it made:",
        markdown_table(
            [
                "way",
                "mean calibration before",
                "mean calibration after",
                "worst day after",
                "largest AUC change",
            ],
            ways,
        ),
        markdown_table(
            [
                "day",
                "continued's shift",
                "continued before",
                "continued after",
                "retrained before",
                "retrained after",
                "frozen before",
                "frozen after",
            ],
            by_day,
        ),
    ]

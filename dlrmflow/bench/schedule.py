"""Learning-rate sweep: the rates, schedule and batch size that the defaults (and so the
demo) train with, chosen by test-day AUC and calibration on the demo's dataset.

Every candidate trains the demo's model for one epoch over the demo's data (the default
``DataConfig``: 6 days of 200,000 rows, day 5 held out, its Bayes-optimal AUC in the
manifest) in one process, once per seed (the seed draws the initial weights and the rows'
order), and is scored on the whole test day. The rows report each seed's AUC and
calibration (mean prediction ÷ click rate) and the mean AUC's gap to the Bayes AUC, with
the training's CPU-seconds. "decay" is a linear decay to 0 over the second half of the
epoch; "dense" names the dense layers' optimizer and rate (the embeddings' is row-wise
Adagrad throughout). "vocabulary IDs" maps IDs by a vocabulary of the training days
(``features.ids=vocab``, as the demo does) instead of hashing them. The first candidate is
the configuration the defaults had before schedules (constant rates, Adagrad at lr 0.05 for
the dense layers and the embeddings, batch 2048), the baseline of the ratios:
the defaults' mean AUC gap and mean calibration error (|calibration - 1|) each ÷ the
baseline's (< 1: the defaults closer to the optimum and to calibrated).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dlrmflow.bench.machine import describe_machine
from dlrmflow.config import RunConfig, TrainConfig, apply_overrides
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.runtime.glibc_malloc import tune_allocator
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.trainer import train

BASELINE = (
    "the defaults before schedules, same data, model, seeds and process: constant rates, "
    "Adagrad lr 0.05 dense and embedding, batch 2048; ratios = the defaults' mean AUC gap to the "
    "Bayes AUC, and their mean |calibration - 1|, each ÷ the baseline's (< 1: better)"
)
# The dense optimizer and rate the defaults had before Adam, which every candidate of
# the first sweeps (the rows with "Adagrad") trained with.
ADAGRAD = {"train.dense_optimizer": "adagrad", "train.lr": 0.01}
CONSTANT = {
    **ADAGRAD,
    "train.lr": 0.05,
    "train.embedding_lr": 0.05,
    "train.batch_size": 2048,
    "train.lr_schedule.decay": "constant",
}
# (name, overrides of the defaults); "defaults" is the configuration the defaults train.
DECAY = {"train.lr_schedule.decay": "linear", "train.lr_schedule.decay_start": 0.5}
VOCAB = {"features.ids": "vocab"}
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("constant, lr 0.05, batch 2048 (before)", CONSTANT),
    ("decay, lr 0.05, batch 2048", {**CONSTANT, **DECAY}),
    (
        "constant, dense Adagrad 0.01, embeddings 0.05, batch 2048",
        {**ADAGRAD, "train.lr_schedule.decay": "constant", "train.lr_schedule.decay_start": 0.0},
    ),
    (
        "decay, dense Adagrad 0.02, embeddings 0.05, batch 1024",
        {**ADAGRAD, "train.lr": 0.02, "train.batch_size": 1024},
    ),
    ("decay, dense Adagrad 0.01, embeddings 0.05, batch 512", {**ADAGRAD, "train.batch_size": 512}),
    ("decay, dense Adagrad 0.01, embeddings 0.05, batch 2048", ADAGRAD),
    ("the same, vocabulary IDs", {**ADAGRAD, **VOCAB}),
    ("decay, dense Adam 0.01, embeddings 0.05, batch 2048", {"train.lr": 0.01}),
    ("decay, dense Adam 0.005, embeddings 0.05, batch 2048", {"train.lr": 0.005}),
    ("decay, dense Adam 0.003, embeddings 0.05, batch 2048", {"train.lr": 0.003}),
    ("defaults, vocabulary IDs (the demo)", VOCAB),
    ("defaults", {}),
]
SEEDS = (0, 1)
QUICK_DATA = {"days": 3, "rows_per_day": 4_000, "row_group_size": 2_000}
QUICK_MODEL = {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]}


def _defaults() -> dict[str, Any]:
    """What the defaults train with, for the record."""
    d = TrainConfig()
    return {
        "dense_optimizer": d.dense_optimizer or d.optimizer,
        "lr": d.lr,
        "embedding_lr": d.embedding_lr or d.lr,
        "batch_size": d.batch_size,
        "lr_schedule": d.lr_schedule.model_dump(),
    }


def run_schedule_sweep(
    quick: bool = False, *, seeds: tuple[int, ...] = SEEDS, work_dir: Path | None = None
) -> dict[str, Any]:
    """Train and score every candidate once per seed; the JSON record (see the module)."""
    tune_allocator()
    with tempfile.TemporaryDirectory(prefix="dlrmflow-schedule-") as scratch:
        root = Path(work_dir) if work_dir is not None else Path(scratch)
        data = {"url": str(root / "data"), **(QUICK_DATA if quick else {})}
        base = RunConfig.model_validate(
            {
                "data": data,
                "train": {"log_every": 10**9, "resume": "never"},
                **({"model": QUICK_MODEL} if quick else {}),
            }
        )
        generate_dataset(base.data)
        manifest = read_manifest(base.data.url)
        bayes = next(f.bayes_auc for f in manifest.files if f.day == manifest.test_day)
        started = time.perf_counter()
        rows = []
        for number, (name, overrides) in enumerate(CANDIDATES):
            runs = []
            for seed in seeds:
                config = apply_overrides(
                    base,
                    {**overrides, "train.seed": seed, "run_dir": str(root / f"c{number}s{seed}")},
                )
                cpu = time.process_time()
                result = train(config)
                cpu = time.process_time() - cpu
                metrics = evaluate(config.run_dir)
                runs.append(
                    {
                        "seed": seed,
                        "auc": metrics["auc"],
                        "logloss": metrics["logloss"],
                        "calibration": metrics["calibration"],
                        "calibration_error": metrics["calibration_error"],
                        "steps": result.steps,
                        "train_cpu_s": cpu,
                    }
                )
            mean_auc = statistics.fmean(r["auc"] for r in runs)
            rows.append(
                {
                    "name": name,
                    "overrides": overrides,
                    "runs": runs,
                    "mean_auc": mean_auc,
                    "auc_gap": bayes - mean_auc,
                    "mean_calibration_miss": statistics.fmean(
                        abs(r["calibration"] - 1) for r in runs
                    ),
                    "train_cpu_s": statistics.fmean(r["train_cpu_s"] for r in runs),
                }
            )
    before, chosen = rows[0], rows[-1]
    return {
        "benchmark": "schedule",
        "quick": quick,
        "baseline": BASELINE,
        "data": {k: v for k, v in base.data.model_dump().items() if k != "url"},
        "bayes_auc": bayes,
        "seeds": list(seeds),
        "defaults": _defaults(),
        "candidates": rows,
        "ratios": {
            "auc_gap": chosen["auc_gap"] / before["auc_gap"],
            "calibration_miss": chosen["mean_calibration_miss"] / before["mean_calibration_miss"],
        },
        "seconds": time.perf_counter() - started,
        "machine": describe_machine(),
    }


def schedule_section(record: dict[str, Any]) -> str:
    """The sweep's results as markdown: one row per candidate and seed."""
    from dlrmflow.bench.report import markdown_table

    lines = []
    for c in record["candidates"]:
        for r in c["runs"]:
            # Four decimals: the candidates differ in the fourth.
            lines.append(
                [c["name"], r["seed"], r["steps"], f"{r['auc']:.4f}",
                 f"{record['bayes_auc'] - r['auc']:.4f}", f"{r['calibration']:.3f}",
                 f"{r['logloss']:.4f}", f"{r['train_cpu_s']:.1f}"]
            )  # fmt: skip
    d = record["defaults"]
    schedule = d["lr_schedule"]
    ratios = ", ".join(f"`{k}` {v:.3f}" for k, v in record["ratios"].items())
    return "\n\n".join(
        [
            "## Learning-rate sweep",
            f"Baseline: {record['baseline']}. Test-day Bayes AUC {record['bayes_auc']:.4f}. "
            f"The defaults: dense {d.get('dense_optimizer', 'adagrad')} lr {d['lr']}, "
            f"embedding lr {d['embedding_lr']}, batch {d['batch_size']}, a {schedule['decay']} "
            f"decay from {schedule['decay_start']:.0%} of each epoch to {schedule['floor']} "
            f"of the rates, warm-up {schedule['warmup_steps']} steps. Ratios: {ratios}. "
            f"Run apart from the report (`make bench-schedule`), on "
            f"{record['machine']['cpu']} with {record['machine']['cpu_count']} CPUs, "
            f"in {record['seconds'] / 60:.1f} min.",
            markdown_table(
                [
                    "candidate",
                    "seed",
                    "steps",
                    "test AUC",
                    "gap to Bayes",
                    "calibration",
                    "log loss",
                    "train CPU-s",
                ],
                lines,
            ),  # fmt: skip
        ]
    )

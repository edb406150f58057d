"""Criteo-scale benchmark: tables larger than a rank's memory budget, on this machine.

One command (``dlrmflow bench scale``, ``make bench-scale``) runs every stage as a user
would, each a ``dlrmflow`` subprocess:

1. ``generate``: synthetic days with Criteo Kaggle's full cardinalities
   (``data.cardinality_scale`` 1.0: 33.8M distinct IDs over the 26 features, the largest
   10.1M), timed, with its peak resident set;
2. ``stats``: the dataset's ``stats.json`` (what the planner reads), timed, with its peak;
3. ``train --nproc 2`` of the training benchmark's model at dim 64 (bottom MLP 512-256-64,
   top MLP 512-256, batch 4096, row-wise Adagrad at lr 0.01), its hashed tables one row
   per distinct ID (``features.hash_size_factor`` 1): 33.8M rows, 8.7 GB of weights and
   8.8 GB with their optimizer state, with ``train.embedding_memory_bytes`` per rank well
   below its share; then ``evaluate --nproc 2`` under the same budget;
4. the same job with every shard in memory: the baseline.

Both jobs shard every table table-wise (``--sharding table_wise``): the budget then changes
only where shards live, not how they are split, so the two runs train the same weights
bit for bit and their test AUCs are equal (the record checks); under the planner's own
choice the budgeted job splits the largest tables column-wise, whose row-wise Adagrad sums
each row's squares in two halves, and rounding alone separates the runs.

Each rank reports its peak resident set (``VmHWM``) in ``train_result.json`` and
``eval.json``; the benchmark states the fixed overhead as the peak less the budget, and
the baseline's as its peak less its shards' bytes: the process, its libraries, the dense
arch and its optimizer, the reader's buffers and the step's activations, which do not
grow with the tables. The map from a row on disk to its cache slot (4 bytes a row) is not
in the budget and is stated apart. Cache figures: ``hit_rate`` is the share of a batch's
distinct rows on disk found in memory when its forward ran (kept from earlier batches or
read ahead by the prefetch during the previous step); ``cached_rate`` counts only those
kept from earlier batches. The ratio is tiered samples/s ÷ in-memory samples/s (< 1: the
disk tier is slower).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dlrmflow.bench.machine import describe_machine
from dlrmflow.errors import DlrmflowError
from dlrmflow.kernels.row_cache import ROW_MAP_BYTES
from dlrmflow.memory import peak_rss_bytes

BASELINE = (
    "the same 2-rank job with every shard in memory (no train.embedding_memory_bytes): "
    "same data, model, seed, threads and commands; ratio = tiered samples/s ÷ in-memory "
    "samples/s (< 1: the disk tier is slower)"
)
FULL_CARDINALITY = {"cardinality_scale": 1.0, "max_cardinality": 100_000_000}
MODEL = {"embedding_dim": 64, "bottom_mlp": [512, 256, 64], "top_mlp": [512, 256]}
TRAIN = {"batch_size": 4096, "lr": 0.01, "epochs": 1, "resume": "never", "log_every": 100}
SHARDING = "table_wise"
FEATURES = {"ids": "hash", "hash_size_factor": 1.0, "max_rows_per_table": 100_000_000}
DEFAULT_DAYS = 3
DEFAULT_ROWS_PER_DAY = 1_000_000
DEFAULT_BUDGET = 1 << 28  # 256 MiB a rank: 6% of the larger share of the tables
# ``quick``: the same stages at a scale that runs in seconds (for the tests).
QUICK = {
    "data": {"cardinality_scale": 0.002, "max_cardinality": 100_000_000},
    "days": 3,
    "rows_per_day": 4_000,
    "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
    "train": {"batch_size": 256, "log_every": 1000},
    "budget": 48_000,
}


class StageFailed(DlrmflowError):
    """A stage's command exited non-zero; the message ends with its output's last lines."""


def _stage(command: list[str], log: Path) -> dict[str, float]:
    """Run one ``dlrmflow`` command; its wall seconds and its own peak resident set.

    The peak is the child's ``VmHWM``, read every 20 ms while it runs (the high-water mark
    only grows, so the last reading misses at most the final 20 ms). Not ``wait4``'s
    ``ru_maxrss``: Linux carries the parent's resident set at the fork into it. Ranks of
    ``--nproc`` jobs report their own peaks in the run's result files.
    """
    start = time.perf_counter()
    peak = 0
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        while process.poll() is None:
            peak = max(peak, peak_rss_bytes(process.pid))
            time.sleep(0.02)
    seconds = time.perf_counter() - start
    if process.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise StageFailed(
            f"bench scale: {command[3]} exited {process.returncode}: " + " | ".join(tail)
        )
    return {"seconds": seconds, "peak_rss_bytes": peak}


def _dlrmflow() -> list[str]:
    return [sys.executable, "-m", "dlrmflow"]


def _plan_figures(plan: dict, nproc: int) -> dict[str, object]:
    """From a run's ``plan.json``: the tables' weights and row-wise Adagrad state in bytes
    (in all and per rank), the rows in each tier, and the row map of each rank's rows on
    disk."""
    per_rank, rows_by_tier, on_disk = [0] * nproc, {}, [0] * nproc
    for table in plan["tables"]:
        for shard in table["shards"]:
            rank, rows = shard["rank"], shard["row_end"] - shard["row_start"]
            per_rank[rank] += 4 * rows * (shard["col_end"] - shard["col_start"] + 1)
            rows_by_tier[shard["tier"]] = rows_by_tier.get(shard["tier"], 0) + rows
            if shard["tier"] != "device":
                on_disk[rank] += rows
    return {
        "table_bytes": sum(per_rank),
        "table_bytes_per_rank": per_rank,
        "rows_by_tier": rows_by_tier,
        "row_map_bytes_per_rank": [ROW_MAP_BYTES * rows for rows in on_disk],
    }


def _run(name: str, work: Path, config: dict, nproc: int, budget: int | None) -> dict[str, object]:
    """Train and evaluate one configuration; what its result files and plan say."""
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    train_options = {**config["train"]}
    if budget is not None:
        train_options["embedding_memory_bytes"] = budget
    path = run_dir.with_suffix(".json")
    path.write_text(json.dumps({**config, "run_dir": str(run_dir), "train": train_options}))
    cli = _dlrmflow()
    train = _stage(
        cli + ["train", "-c", str(path), "--nproc", str(nproc), "--sharding", SHARDING],
        work / f"{name}.log",
    )
    evaluate = _stage(
        cli + ["evaluate", "--run-dir", str(run_dir), "--nproc", str(nproc)],
        work / f"{name}-eval.log",
    )
    result = json.loads((run_dir / "train_result.json").read_text())
    metrics = json.loads((run_dir / "eval.json").read_text())
    figures = _plan_figures(json.loads((run_dir / "plan.json").read_text()), nproc)
    on_disk = sorted((run_dir / "embeddings").glob("rank*/*.tiered"))
    cache = result["embedding_cache"]
    if cache:
        lookups = max(cache["lookups"], 1)
        cache["cached_rate"] = (cache["hits"] - cache["prefetched"]) / lookups
    record = {
        "budget_bytes": budget,
        "train_seconds": train["seconds"],
        "samples_per_s": result["samples_per_s"],
        "rows": result["rows"],
        "steps": result["steps"],
        "data_wait_s": result["data_wait_s"],
        "checkpoint_save_s": result["checkpoint_save_s"],
        "final_loss": result["final_loss"],
        "train_peak_rss_bytes": result["peak_rss_bytes"],
        "eval_seconds": evaluate["seconds"],
        "eval_peak_rss_bytes": metrics["peak_rss_bytes"],
        "auc": metrics["auc"],
        "logloss": metrics["logloss"],
        "embedding_cache": cache,
        **figures,
        "tiered_file_bytes": sum(p.stat().st_size for p in on_disk),
    }
    peaks = [
        max(t, e)
        for t, e in zip(record["train_peak_rss_bytes"], record["eval_peak_rss_bytes"], strict=True)
    ]
    if budget is not None:
        record["overhead_bytes"] = [p - budget for p in peaks]
    else:
        per_rank = figures["table_bytes_per_rank"]
        record["overhead_bytes"] = [p - b for p, b in zip(peaks, per_rank, strict=True)]
    return record


def run_scale_benchmark(
    *,
    days: int = DEFAULT_DAYS,
    rows_per_day: int = DEFAULT_ROWS_PER_DAY,
    budget_bytes: int = DEFAULT_BUDGET,
    nproc: int = 2,
    work_dir: str | Path | None = None,
    quick: bool = False,
) -> dict[str, object]:
    """Generate, compute statistics, then train and evaluate tiered and all in memory.

    ``work_dir`` keeps the data, runs and logs (default: a temporary directory, removed
    afterwards: the full run writes about 25 GB). ``quick`` runs the stages at a small
    scale, for tests: its figures mean nothing.
    """
    if quick:
        days, rows_per_day, budget_bytes = QUICK["days"], QUICK["rows_per_day"], QUICK["budget"]
    keep = work_dir is not None
    work = Path(work_dir) if keep else Path(tempfile.mkdtemp(prefix="dlrmflow-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        data = work / "data"
        shutil.rmtree(data, ignore_errors=True)
        cardinality = QUICK["data"] if quick else FULL_CARDINALITY
        cli = _dlrmflow()
        settings = [f"data.{key}={value}" for key, value in cardinality.items()]
        generate = _stage(
            cli
            + ["generate", "--out", str(data), "--days", str(days)]
            + ["--rows-per-day", str(rows_per_day)]
            + [arg for s in settings for arg in ("--set", s)],
            work / "generate.log",
        )
        stats = _stage(cli + ["stats", "--data", str(data)], work / "stats.log")
        manifest = json.loads((data / "manifest.json").read_text())
        config = {
            "data": {"url": str(data), "days": days, "rows_per_day": rows_per_day, **cardinality},
            "features": FEATURES,
            "model": QUICK["model"] if quick else MODEL,
            "train": {**TRAIN, **(QUICK["train"] if quick else {})},
        }
        tiered = _run("tiered", work, config, nproc, budget_bytes)
        memory = _run("memory", work, config, nproc, None)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    cardinalities = manifest.get("cardinalities", {})
    return {
        "benchmark": "scale",
        "baseline": BASELINE,
        "machine": describe_machine(),
        "quick": quick,
        "ranks": nproc,
        "data": {
            "days": days,
            "rows_per_day": rows_per_day,
            "distinct_ids": sum(cardinalities.values()) if cardinalities else None,
            "largest_feature": max(cardinalities.values()) if cardinalities else None,
            "generate_seconds": generate["seconds"],
            "generate_peak_rss_bytes": generate["peak_rss_bytes"],
            "stats_seconds": stats["seconds"],
            "stats_peak_rss_bytes": stats["peak_rss_bytes"],
        },
        "model": config["model"],
        "tiered": tiered,
        "memory": memory,
        "ratios": {"tiered_vs_memory": tiered["samples_per_s"] / memory["samples_per_s"]},
        "same_auc": tiered["auc"] == memory["auc"] and tiered["logloss"] == memory["logloss"],
    }

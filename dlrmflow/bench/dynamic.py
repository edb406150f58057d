"""Dynamic ID tables benchmark: a model line whose tables keep a row per live ID against
hashing at the same table memory and at four times it, and against a vocabulary of day 0,
on days whose IDs churn.

The synthetic generator writes ``days`` days with ``data.churn`` > 0: each day a share of
every feature's IDs is born at random popularity ranks, older IDs fade down the ranks and
the least popular stop appearing (``ingest.synthetic``). Four model lines (``dlrmflow
line``: each day scored by the version trained through the day before, then trained on)
run over the same days with the same model (the demo's), optimizer, batch, seed, threads
and process; they differ only in how an ID becomes a row:

- ``dynamic``: ``features.ids: dynamic``, each table ``HASH_FACTOR`` rows per ID live on a
  day (day 0's distinct IDs), an ID admitted on its second sighting, freed after two days'
  steps unseen, evictions four times a day;
- ``hash``: hashed into as many rows (the same table memory);
- ``hash_4x``: hashed into four times as many;
- ``vocab_day0``: a vocabulary of day 0's IDs, kept by the line (IDs born later share the
  out-of-vocabulary row).

Reported per way: mean next-day AUC (and each day's, beside its Bayes AUC), the rows its
tables hold and, for the dynamic line, the rows in use at the end; the bytes of its
embedding rows and optimizer state and of its maps; its CPU-seconds a day. The ratios
(higher is better for the dynamic line): its mean next-day AUC ÷ each other way's.

The map's cost is measured side by side on the demo's model and day 0: the seconds a
training step takes with dynamic tables and with hashed ones of the same rows (each the
difference between the training loops of runs of ``2 * STEPS`` and ``STEPS`` steps, so that
the first steps' warm-up cancels), and
the seconds the maps take to look up (and count and admit) one batch's IDs, replayed in
training order through fresh maps in this thread: its share of the dynamic step, and
lookups per second on one core.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from dlrmflow.bench.lines import day_settings, run_line, summary_of
from dlrmflow.bench.machine import describe_machine
from dlrmflow.config import RunConfig
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.kernels.id_map_shards import ShardedIdMap
from dlrmflow.runtime.glibc_malloc import tune_allocator
from dlrmflow.train.model.dynamic_ids import DynamicIdEmbeddings
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.trainer import train

BASELINE = (
    "model lines on the same churning days, model, optimizer, batch, seed, threads and "
    "process: hash = hashed into the dynamic tables' rows; hash_4x = into four times as "
    "many; vocab_day0 = a vocabulary of day 0's IDs; ratios = the dynamic line's mean "
    "next-day AUC ÷ theirs (> 1: the dynamic line better)"
)
WAYS = ("dynamic", "hash", "hash_4x", "vocab_day0")
# Rows per ID live on a day of the dynamic and the same-memory hashed tables: as many rows
# as IDs, so that hashing collides where a map need not.
HASH_FACTOR = 1.0
DATA = {"days": 15, "rows_per_day": 60_000, "row_group_size": 30_000, "churn": 0.05}
QUICK_DATA = {"days": 4, "rows_per_day": 3_000, "row_group_size": 1_500, "churn": 0.1}
QUICK_MODEL = {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]}
BATCH, QUICK_BATCH = 1024, 256
# Steps of the side-by-side step timing (runs of STEPS and 2 * STEPS).
STEPS, QUICK_STEPS = 30, 4


def _features(way: str, steps_per_day: int) -> dict[str, Any]:
    features: dict[str, Any] = {"hash_size_factor": HASH_FACTOR}
    if way == "dynamic":
        features |= {
            "ids": "dynamic",
            "admit_after": 2,
            "ttl": 2 * steps_per_day,
            "evict_every": max(1, steps_per_day // 4),
        }
    elif way == "hash_4x":
        features["hash_size_factor"] = 4 * HASH_FACTOR
    elif way == "vocab_day0":
        features |= {"ids": "vocab", "min_count": 1}
    return features


def _config(data: dict[str, Any], run_dir: Path, quick: bool, way: str) -> RunConfig:
    batch = QUICK_BATCH if quick else BATCH
    steps_per_day = max(1, data["rows_per_day"] // batch)
    return RunConfig.model_validate(
        {
            "run_dir": str(run_dir),
            "data": data,
            "features": _features(way, steps_per_day),
            **({"model": QUICK_MODEL} if quick else {}),  # else the demo's (the defaults)
            "train": {"batch_size": batch, "log_every": 10**9, "checkpoint_every": 10**9},
            # Every version is published: the gate's work is part of each line's day.
            "gate": {"calibration_min": 1e-9, "calibration_max": 1e9, "ne_margin": 1e9},
        }
    )


def _memory(checkpoint: Path) -> dict[str, int]:
    """Bytes of the embedding rows and their optimizer state, and of the dynamic maps (with
    their clock), and the rows the tables hold (in use: the dynamic maps' live IDs and
    default rows)."""
    loaded = load_checkpoint(checkpoint)
    embeddings = loaded.model.embeddings
    dynamic = isinstance(embeddings, DynamicIdEmbeddings)
    tables = embeddings.inner if dynamic else embeddings

    def size(module: Any) -> int:
        return sum(t.nbytes for t in module.checkpoint_state().values() if hasattr(t, "nbytes"))

    rows = sum(t.num_embeddings for t in loaded.spec.tables)
    in_use = sum(m.rows_in_use + 1 for m in embeddings.maps.values()) if dynamic else rows
    table_bytes = size(tables)
    return {
        "table_bytes": table_bytes,
        "map_bytes": size(embeddings) - table_bytes,
        "rows": rows,
        "rows_in_use": in_use,
    }


def _step_seconds(base: RunConfig, root: Path, steps: int) -> float:
    """Seconds a step of ``base`` takes on day 0: the difference between the training
    loops of runs of ``2 * steps`` and ``steps`` steps, over ``steps``, after an untimed
    run that loads what a process loads once (compiled code, caches)."""
    seconds = []
    for n in (2, steps, 2 * steps):
        config = base.model_copy(deep=True)
        config.run_dir = str(root / f"steps-{n}")
        config.data.train_days, config.data.eval_days = "0", "none"
        config.train.max_steps = n
        result = train(config)
        assert result is not None  # one process
        seconds.append(result.seconds)  # the training loop's, setup aside
    return (seconds[2] - seconds[1]) / steps


def _lookups(config: RunConfig, batches: int) -> dict[str, float]:
    """Seconds the maps of ``config``'s dynamic tables take for one batch of day 0's IDs,
    replayed in order through fresh maps (counting and admitting), and lookups a second."""
    manifest = read_manifest(config.data.url)
    [day0] = [f for f in manifest.files if f.day == 0]
    table = pq.read_table(f"{config.data.url}/{day0.path}")
    spec = FeatureSpec.for_dataset(manifest, config.features, config.model)
    columns = [f.name for f in spec.sparse]
    maps = {
        f.name: ShardedIdMap(
            f.num_embeddings, f.map_shards or 1, admit_after=f.admit_after or 1, ttl=f.ttl
        )
        for f in spec.sparse
    }
    ids = {c: table.column(c).to_numpy(zero_copy_only=False) for c in columns}
    valid = {c: ~table.column(c).is_null().to_numpy(zero_copy_only=False) for c in columns}
    size, count, seconds = config.train.batch_size, 0, 0.0
    for step in range(min(batches, table.num_rows // size)):
        part = slice(step * size, (step + 1) * size)
        chunk = {c: ids[c][part][valid[c][part]].astype(np.int64) for c in columns}
        start = time.perf_counter()
        for c in columns:
            maps[c].map(chunk[c], step + 1)
        seconds += time.perf_counter() - start
        count += sum(len(v) for v in chunk.values())
    done = max(1, min(batches, table.num_rows // size))
    return {"seconds_per_batch": seconds / done, "lookups_per_s": count / seconds}


def run_dynamic_benchmark(
    quick: bool = False,
    *,
    days: int | None = None,
    rows_per_day: int | None = None,
    churn: float | None = None,
    work_dir: Path | None = None,
) -> dict[str, Any]:
    """Run the four lines and the side-by-side step timing; the JSON record (see the
    module)."""
    tune_allocator()
    data = day_settings(
        QUICK_DATA if quick else DATA, days=days, rows_per_day=rows_per_day, churn=churn
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlrmflow-dynamic-") as scratch:
        root = Path(work_dir) if work_dir is not None else Path(scratch)
        data["url"] = str(root / "data")
        configs = {way: _config(data, root / way, quick, way) for way in WAYS}
        generate_dataset(configs["dynamic"].data)
        bayes = {f.day: f.bayes_auc for f in read_manifest(data["url"]).files}
        per_day, first_day, memory = {}, {}, {}
        for way in WAYS:
            per_day[way], first_day[way], newest = run_line(configs[way], root / f"line-{way}")
            memory[way] = _memory(newest)
            for record in per_day[way]:
                record["bayes_auc"] = bayes[record["day"]]
        steps = QUICK_STEPS if quick else STEPS
        step = {
            way: _step_seconds(configs[way], root / f"step-{way}", steps)
            for way in ("dynamic", "hash")
        }
        lookups = _lookups(configs["dynamic"], 2 * steps)
    summary = {
        way: {**summary_of(per_day[way]), "first_day_cpu_s": first_day[way], **memory[way]}
        for way in WAYS
    }
    dynamic_auc = summary["dynamic"]["mean_next_day_auc"]
    ratios = {
        f"mean_next_day_auc_vs_{way}": dynamic_auc / summary[way]["mean_next_day_auc"]
        for way in WAYS[1:]
    }
    return {
        "benchmark": "dynamic",
        "quick": quick,
        "baseline": BASELINE,
        "data": {k: v for k, v in data.items() if k != "url"},
        "features": {
            way: configs[way].features.model_dump(mode="json", exclude_defaults=True)
            for way in WAYS
        },
        "model": configs["dynamic"].model.model_dump(mode="json"),
        "batch_size": configs["dynamic"].train.batch_size,
        "seconds": time.perf_counter() - started,
        "days": per_day,
        "summary": summary,
        "step": {
            "dynamic_s": step["dynamic"],
            "hash_s": step["hash"],
            "dynamic_vs_hash": step["dynamic"] / step["hash"],
            "lookup_s_per_batch": lookups["seconds_per_batch"],
            "lookup_share_of_step": lookups["seconds_per_batch"] / step["dynamic"],
            "lookups_per_s_per_core": lookups["lookups_per_s"],
        },
        "ratios": ratios,
        "machine": describe_machine(),
    }


def dynamic_section(record: dict[str, Any]) -> str:
    """The benchmark's results as markdown: the ways side by side, then day by day."""
    from dlrmflow.bench.report import markdown_table

    data, summary, step = record["data"], record["summary"], record["step"]
    ways = [
        [way, s["mean_next_day_auc"], s["last_day_auc"], s["mean_calibration"], s["rows"],
         s["rows_in_use"], s["table_bytes"], s["map_bytes"], s["cpu_s_per_day"]]
        for way, s in summary.items()
    ]  # fmt: skip
    days = record["days"]
    by_day = [
        [rows[0]["day"], rows[0]["bayes_auc"], *(r["auc"] for r in rows)]
        for rows in zip(*(days[way] for way in summary), strict=True)
    ]
    ratios = ", ".join(f"`{k}` {v:.3f}" for k, v in record["ratios"].items())
    machine = record["machine"]
    return "\n\n".join(
        [
            "## Dynamic ID tables",
            f"Baseline: {record['baseline']}. {data['days']} days of {data['rows_per_day']:,} "
            f"rows, a {data['churn']} share of each feature's IDs born (and as many gone) a "
            f"day; batch {record['batch_size']}. Ratios: {ratios}. A step on day 0: "
            f"{step['dynamic_s'] * 1e3:.1f} ms with dynamic tables, {step['hash_s'] * 1e3:.1f} "
            f"ms hashed ({step['dynamic_vs_hash']:.2f}x); the maps' lookups of one batch "
            f"{step['lookup_s_per_batch'] * 1e3:.2f} ms, {step['lookup_share_of_step']:.1%} "
            f"of the dynamic step, {step['lookups_per_s_per_core'] / 1e6:.1f}M lookups a "
            f"second on one core. Run apart from the report (`dlrmflow bench dynamic`), on "
            f"{machine['cpu']} with {machine['cpu_count']} CPUs, in "
            f"{record['seconds'] / 60:.1f} min.",
            markdown_table(
                [
                    "way",
                    "mean next-day AUC",
                    "last day's AUC",
                    "mean calibration",
                    "rows",
                    "rows in use",
                    "table bytes",
                    "map bytes",
                    "CPU-s a day",
                ],
                ways,
            ),  # fmt: skip
            markdown_table(["day", "Bayes AUC", *summary], by_day),
        ]
    )

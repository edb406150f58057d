"""MovieLens-100k as a model line: real data not made here, registered where it lies and
continued week by week.

The ratings come from the ``recbole`` wheel, which ships MovieLens-100k as package data
(install it with ``pip install --no-deps recbole``; the data's licence forbids passing it
on, so nothing of it is kept in this repository: without the wheel the benchmark says so
and stops). ``prepare_movielens`` turns them into what a team's logs look like: Parquet
partitioned by period (``day=N/``, N counting weeks from the first rating, since a day of
MovieLens-100k holds too few ratings to validate on), one row a rating, a rating of 4 or 5
as a click, with the user's attributes (age, gender, occupation, zip code) and the movie's
(release year, genres as a list) joined on. ``SCHEMA`` declares it: string IDs for users,
movies and attributes, the genres a multi-hot list, age and release year dense.

The dataset is registered (``dlrmflow register``) and trained as a model line (``dlrmflow
line``): version k trains on week k alone, continued from version k-1, and is validated on
week k+1 before it trains on it. The baseline, computed on the same weeks: each movie's
click rate over every week before (the popularity a recommender starts from), as a score;
the ratio is the line's mean next-week AUC ÷ the baseline's. Each version's recalibration
(fitted on a quarter of its next week's rows spread over the week,
``gate.recalibration_share`` and ``gate.recalibration_rows``) is reported as that week's
other rows' calibration before and after it.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from dlrmflow.bench.lines import recalibrated, recalibration_summary
from dlrmflow.bench.machine import describe_machine
from dlrmflow.config import RunConfig
from dlrmflow.ingest.register import register_dataset
from dlrmflow.schema import DenseFeature, FeatureSchema, SparseFeature
from dlrmflow.train.line.line import history, train_line

WEEK_S = 7 * 24 * 3600
SCHEMA = FeatureSchema(
    label="click",
    dense=(
        DenseFeature(column="age", transform="log"),
        DenseFeature(column="release_year", transform="clip", clip_min=1920, clip_max=2000),
    ),
    sparse=tuple(
        SparseFeature(column=c)
        for c in ("user_id", "item_id", "gender", "occupation", "zip_code", "genres")
    ),
)
MODEL = {"embedding_dim": 16, "bottom_mlp": [32, 16], "top_mlp": [64, 32]}
TRAIN = {"batch_size": 256, "num_workers": 0, "log_every": 50}
BASELINE = (
    "each movie's click rate over every week before, as the score (unseen movies: the "
    "overall rate), on the same weeks; ratio = the line's mean next-week AUC ÷ the baseline's"
)


def movielens_files() -> Path | None:
    """The folder of MovieLens-100k's ``.inter``/``.user``/``.item`` files in the installed
    ``recbole`` wheel (found without importing it), or None where it is not installed."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "dataset_example" / "ml-100k"
    return folder if (folder / "ml-100k.inter").is_file() else None


def _atomic_file(path: Path) -> pa.Table:
    """One of recbole's atomic files: tab-separated, ``name:type`` headers."""
    table = pacsv.read_csv(
        path,
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pacsv.ConvertOptions(strings_can_be_null=False),
        read_options=pacsv.ReadOptions(block_size=1 << 22),
    )
    return table.rename_columns([name.split(":")[0] for name in table.column_names])


def prepare_movielens(
    source: Path, out: Path, period_s: int = WEEK_S, periods: int | None = None
) -> int:
    """Write MovieLens-100k from ``source`` as ``out/day=N/part-0.parquet`` partitions of
    ``period_s`` seconds each (see the module's docstring), the first ``periods`` of them
    (default: all); returns how many were written."""
    ratings = _atomic_file(source / "ml-100k.inter")
    users = _atomic_file(source / "ml-100k.user")
    items = _atomic_file(source / "ml-100k.item")
    rows = ratings.join(users, "user_id", join_type="left outer")
    rows = rows.join(items, "item_id", join_type="left outer")
    rows = rows.sort_by(
        [("timestamp", "ascending"), ("user_id", "ascending"), ("item_id", "ascending")]
    )
    stamps = rows.column("timestamp").to_numpy().astype(np.int64)
    period = (stamps - stamps.min()) // period_s

    def text(name: str) -> pa.Array:
        return pc.cast(rows.column(name), pa.string())

    def number(name: str) -> pa.Array:
        # Non-numbers (an unknown release year) are missing, as a log's nulls are.
        values = pc.cast(rows.column(name), pa.string())
        numeric = pc.match_substring_regex(values, r"^[0-9]+(\.[0-9]*)?$")
        return pc.cast(pc.if_else(numeric, values, None), pa.float32())

    genres = pc.split_pattern(pc.fill_null(text("class"), ""), " ")
    table = pa.table(
        {
            "click": pc.cast(pc.greater_equal(rows.column("rating"), 4), pa.int8()),
            "user_id": text("user_id"),
            "item_id": text("item_id"),
            "age": number("age"),
            "gender": text("gender"),
            "occupation": text("occupation"),
            "zip_code": text("zip_code"),
            "release_year": number("release_year"),
            "genres": _without_empty(genres),
        }
    )
    partitions = int(period.max()) + 1 if periods is None else min(periods, int(period.max()) + 1)
    for n in range(partitions):
        folder = out / f"day={n}"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.filter(pa.array(period == n)), folder / "part-0.parquet")
    return partitions


def _without_empty(lists: pa.ChunkedArray) -> pa.Array:
    """Lists of strings without their empty strings (a movie with no genre: an empty list)."""
    return pa.array(
        [[g for g in genres if g] for genres in lists.to_pylist()], pa.list_(pa.string())
    )


def popularity_auc(out: Path, weeks: int) -> list[float | None]:
    """The baseline's AUC on each week from 1 (see the module's docstring)."""
    import torch
    from torchmetrics.functional.classification import binary_auroc

    clicks: dict[str, float] = {}
    seen: dict[str, float] = {}
    total_clicks = total = 0.0
    aucs: list[float | None] = []
    for week in range(weeks):
        table = pq.read_table(out / f"day={week}", columns=["item_id", "click"])
        items = table.column("item_id").to_pylist()
        labels = table.column("click").to_numpy()
        if week > 0:
            overall = total_clicks / max(total, 1.0)
            scores = [clicks[i] / seen[i] if i in seen else overall for i in items]
            both = 0 < labels.sum() < len(labels)
            aucs.append(
                float(binary_auroc(torch.tensor(scores), torch.from_numpy(labels.astype(np.int64))))
                if both
                else None
            )
        for item, label in zip(items, labels.tolist(), strict=True):
            clicks[item] = clicks.get(item, 0.0) + label
            seen[item] = seen.get(item, 0.0) + 1.0
        total_clicks += float(labels.sum())
        total += len(labels)
    return aucs


def run_movielens(work: Path | None = None, quick: bool = False) -> dict[str, Any]:
    """Prepare, register and train MovieLens-100k as a model line; the JSON record.
    ``quick``: its first 4 weeks only (a check of the benchmark, not a result)."""
    source = movielens_files()
    if source is None:
        return {
            "skipped": "MovieLens-100k comes from the recbole wheel, which is not installed "
            "(pip install --no-deps recbole)"
        }
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="movielens-") as scratch:
        root = Path(work) if work is not None else Path(scratch)
        data = root / "data"
        weeks = prepare_movielens(source, data, periods=4 if quick else None)
        manifest = register_dataset(str(data), SCHEMA)
        config = RunConfig.model_validate(
            {
                "run_dir": str(root / "line" / "run"),
                "data": {"url": str(data)},
                "model": MODEL,
                "train": TRAIN,
            }
        )
        train_line(root / "line", config)
        records = history(root / "line")
        baseline = popularity_auc(data, weeks)
    by_week = []
    for record in records:
        week = record["day"]
        by_week.append(
            {
                "week": week,
                "rows": next(f.rows for f in manifest.files if f.day == week),
                "auc": record.get("auc"),
                "calibration": record.get("calibration"),
                "baseline_auc": baseline[week - 1] if 0 < week <= len(baseline) else None,
                # The version's recalibration, fitted on a quarter of the week's rows: the
                # calibration of the rest before and after it.
                **recalibrated(record.get("recalibration")),
            }
        )
    scored = [w for w in by_week if w["auc"] is not None and w["baseline_auc"] is not None]
    line_auc = statistics.fmean(w["auc"] for w in scored)
    base_auc = statistics.fmean(w["baseline_auc"] for w in scored)
    return {
        "baseline": BASELINE,
        "data": {"rows": manifest.rows, "weeks": weeks, "positive_rate": manifest.positive_rate},
        "model": MODEL,
        "train": TRAIN,
        "weeks": by_week,
        "summary": {
            "mean_next_week_auc": line_auc,
            "baseline_mean_auc": base_auc,
            **recalibration_summary(by_week),
        },
        "ratios": {"line_auc_over_popularity": line_auc / base_auc},
        "machine": describe_machine(),
        "seconds": time.perf_counter() - start,
        "quick": quick,
    }


def movielens_section(record: dict[str, Any]) -> str:
    """The benchmark's results as markdown."""
    from dlrmflow.bench.report import markdown_table

    if "skipped" in record:
        return f"## MovieLens-100k model line\n\nNot run: {record['skipped']}."

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    rows = [
        [
            w["week"],
            w["rows"],
            show(w["auc"]),
            show(w["baseline_auc"]),
            show(w["calibration"]),
            show(w.get("calibration_recalibrated")),
        ]
        for w in record["weeks"]
    ]
    summary, data = record["summary"], record["data"]
    recalibration = ""
    if "mean_calibration_recalibrated" in summary:
        recalibration = (
            " Each version recalibrated on a quarter of its next week's rows, spread over the "
            "week (a shift of its logit): that week's other rows' calibration "
            f"{summary['mean_calibration_judged']:.3f} before it, "
            f"{summary['mean_calibration_recalibrated']:.3f} after, on average."
        )
    ratio = record["ratios"]["line_auc_over_popularity"]
    return "\n\n".join(
        [
            "## MovieLens-100k model line",
            f"Baseline: {record['baseline']}. {data['rows']:,} ratings over {data['weeks']} "
            f"weeks (click rate {data['positive_rate']:.3f}); model {record['model']}, "
            f"batch {record['train']['batch_size']}. Mean next-week AUC "
            f"{summary['mean_next_week_auc']:.4f} against the baseline's "
            f"{summary['baseline_mean_auc']:.4f}: ratio {ratio:.3f}. Run apart from the "
            f"report (`make bench-movielens`), on {record['machine']['cpu']} with "
            f"{record['machine']['cpu_count']} CPUs, in {record['seconds'] / 60:.1f} min."
            + recalibration,
            markdown_table(
                [
                    "week",
                    "rows",
                    "next-week AUC (line)",
                    "popularity AUC",
                    "calibration",
                    "recalibrated",
                ],
                rows,
            ),
        ]
    )

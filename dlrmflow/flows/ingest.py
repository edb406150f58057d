"""The ``ingest`` flow: raw Criteo days (or the synthetic generator) -> Parquet -> statistics.

Raw days are converted by one ``convert`` task per day and scanned by one ``stats`` task
per day; the tasks of different days run in parallel on the configured task runner
(``orchestration``: threads, or a Dask cluster, see ``dlrmflow.flows.runners``). A small
``manifest`` task then writes ``manifest.json`` from the days' results, and ``merge-stats``
merges the days' statistics into ``stats.json``; both are exactly what ``convert_criteo``
and ``dataset_stats`` write for the same inputs, as they run the same per-day functions.
The synthetic generator stays one ``generate`` task; its days are scanned per day too.

Ingest is the slow, repeatable part of a pipeline, so the per-day tasks are cached: a run
whose inputs are unchanged since an earlier run skips the work and returns the earlier
result, so a new day converts and scans only that day. The inputs are what the output
depends on, fingerprinted cheaply (no file is read):

- conversion of a day: its raw file's URL, size and modification time, the day number,
  the output URL and the conversion options;
- generation: every generation parameter (the output is a function of them alone) and the
  numpy version (whose random streams may change between releases);
- statistics of a day: the size and modification time of its Parquet file, and the layout.

A cached result is only good while the output it describes exists, so the flow refreshes
the cache (runs the task again) when a day's Parquet file is missing (its name follows from
the same inputs, see ``day_file_name``), or, for generation, when the dataset's manifest
does not list exactly the files this configuration generates (the folder was deleted, or
another configuration was generated there since). The manifest and merged statistics are
always rewritten (they are small); the manifest is switched only once every day is written,
so a failed run leaves the dataset that was there before.

The cached results, and the cache records that name them, are kept where every worker can
read them: ``orchestration.result_storage`` (by default ``_prefect_results`` beside the
dataset; see ``dlrmflow.flows.storage``), as JSON, so a second machine pointed at the same
location reuses the first one's ingest. The cached tasks return plain records for that: a
converted day's counts as a dict, a day's statistics totals with each distinct-count
sketch packed as base64 text (``stats_record``).

Call ``run_ingest`` to run the flow on the task runner the configuration names.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import fsspec
import numpy as np
from prefect import flow, get_run_logger, task
from prefect.context import TaskRunContext

import dlrmflow
from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.flows.artifacts import publish_stats
from dlrmflow.flows.policies import retry_unless_bad_input
from dlrmflow.flows.runners import task_runner, worker_api
from dlrmflow.flows.storage import shared_results
from dlrmflow.ingest.criteo.convert import (
    ConvertedDay,
    convert_day,
    day_file,
    finish_conversion,
    input_fingerprint,
    start_conversion,
)
from dlrmflow.ingest.manifest import STATS_NAME, Manifest, join_url, read_manifest
from dlrmflow.ingest.stats.results import DatasetStats, write_stats
from dlrmflow.ingest.stats.scan import StatsAccumulator, file_stats, merge_stats
from dlrmflow.ingest.synthetic import day_file_name, generate_dataset

# Hang guard, not a budget: far beyond what generating a month of data should take, so a
# task still running after it has stalled (a dead mount, a stuck object store). The per-day
# tasks have none: they run on worker threads (or Dask workers), where Prefect's timeout
# cannot interrupt blocking work and only warns on every run.
INGEST_TIMEOUT_S = 12 * 3600

# The shape of the cached tasks' result records, part of every cache key: change it when a
# record changes shape, so a run never reads an older record as the new shape.
RESULT_FORMAT = 3  # 3: day files named by content, with digests (2: JSON; 1: pickles)


def file_fingerprint(url: str) -> dict[str, Any]:
    """``url``, its size and whatever version metadata its file system reports.

    Raises FileNotFoundError naming the file if it does not exist.
    """
    return input_fingerprint(url)


def _digest(kind: str, payload: dict[str, Any]) -> str:
    """A cache key: the hash of ``payload`` as canonical JSON, with the package version (a
    new release may write its output differently), the result format and ``kind`` so tasks
    never share keys."""
    text = json.dumps(
        {"kind": kind, "dlrmflow": dlrmflow.__version__, "results": RESULT_FORMAT, **payload},
        sort_keys=True,
        default=str,
    )
    return f"dlrmflow-{kind}-{hashlib.sha256(text.encode()).hexdigest()}"


def generate_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    """Cache key of ``generate_task``: the generation parameters and the numpy version."""
    data: DataConfig = parameters["data"]
    return _digest("generate", {"data": data.model_dump(mode="json"), "numpy": np.__version__})


def convert_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    """Cache key of ``convert_task``: the day's raw file fingerprint, day, output, options."""
    return _digest(
        "convert-day",
        {
            "input": file_fingerprint(parameters["raw"]),
            "day": parameters["day"],
            "out": parameters["out"],
            "row_group_size": parameters["row_group_size"],
            "max_bad_fraction": parameters["max_bad_fraction"],
        },
    )


def stats_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    """Cache key of ``stats_task``: the day file's fingerprint and layout."""
    # v2: the records gained the access-skew summaries; v3: dense columns their
    # deviation and quantile sketch. Older cached records lack them.
    return _digest(
        "stats-day-v3",
        {"file": file_fingerprint(parameters["path"]), "multi_hot": parameters["multi_hot"]},
    )


def output_exists(url: str) -> bool:
    """Whether ``url`` (a file an earlier run wrote) still exists."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs.exists(path)


def _manifest_summary(manifest: Manifest, seconds: float) -> dict[str, Any]:
    return {
        "rows": manifest.rows,
        "days": manifest.days,
        "source": manifest.source,
        "bayes_auc": manifest.bayes_auc,
        "bayes_logloss": manifest.bayes_logloss,
        "positive_rate": manifest.positive_rate,
        # Measured when the data were written; a cached run reports the original rate.
        "ingest_rows_per_s": manifest.rows / max(seconds, 1e-9),
    }


def stats_record(totals: StatsAccumulator) -> dict[str, Any]:
    """``totals`` as a plain JSON record that ``stats_from_record`` turns back into the
    same totals exactly: the counts as numbers, each distinct-count sketch's registers as
    base64 text of their zlib-compressed bytes (mostly a few KiB a feature)."""
    sparse = {}
    for name, t in totals.sparse.items():
        fields = {key: value for key, value in vars(t).items() if key != "sketch"}
        packed = base64.b64encode(zlib.compress(t.sketch.registers.tobytes())).decode("ascii")
        sparse[name] = {**fields, "registers": packed}
    return {
        "rows": totals.rows,
        "positives": totals.positives,
        "row_groups": totals.row_groups,
        "dense": {name: dict(vars(t)) for name, t in totals.dense.items()},
        "sparse": sparse,
    }


def stats_from_record(record: dict[str, Any]) -> StatsAccumulator:
    """The totals ``stats_record`` made ``record`` of. Raises ValueError if its shape is
    not what this version writes."""
    totals = StatsAccumulator()
    totals.rows, totals.positives = record["rows"], record["positives"]
    totals.row_groups = record["row_groups"]
    for kind, columns in (("dense", totals.dense), ("sparse", totals.sparse)):
        if record[kind].keys() != columns.keys():
            raise ValueError(f"statistics record: {kind} columns differ from {list(columns)}")
        for name, t in columns.items():
            fields = dict(record[kind][name])
            if kind == "sparse":
                registers = zlib.decompress(base64.b64decode(fields.pop("registers")))
                expected = t.sketch.registers
                if len(registers) != expected.nbytes:
                    raise ValueError(f"statistics record: {name}: {len(registers)} registers")
                t.sketch.registers = np.frombuffer(registers, dtype=expected.dtype).copy()
            if fields.keys() != {k for k in vars(t) if k != "sketch"}:
                raise ValueError(f"statistics record: {name}: fields {sorted(fields)}")
            vars(t).update(fields)
    return totals


# Ingest tasks: results persisted (so the cache can skip them), one retry, none on bad input.
CACHED_RETRIED_ONCE: dict[str, Any] = {
    "persist_result": True,
    "retries": 1,
    "retry_delay_seconds": 10,
    "retry_condition_fn": retry_unless_bad_input,
}


@task(
    name="generate",
    cache_key_fn=generate_cache_key,
    **CACHED_RETRIED_ONCE,
    timeout_seconds=INGEST_TIMEOUT_S,
)
def generate_task(data: DataConfig) -> dict[str, Any]:
    """Write the synthetic dataset; its manifest summary plus the generation rate."""
    start = time.perf_counter()
    manifest = generate_dataset(data)
    seconds = time.perf_counter() - start
    get_run_logger().info(
        "generated %d rows over %d days in %.1f s", manifest.rows, manifest.days, seconds
    )
    return _manifest_summary(manifest, seconds)


@task(
    name="convert",
    cache_key_fn=convert_cache_key,
    **CACHED_RETRIED_ONCE,
)
def convert_task(
    raw: str, day: int, out: str, row_group_size: int, max_bad_fraction: float
) -> dict[str, Any]:
    """Convert one raw Criteo TSV day to ``OUT/day=DAY``; its counts and the seconds taken."""
    start = time.perf_counter()
    converted = convert_day(
        raw, day, out, max_bad_fraction=max_bad_fraction, row_group_size=row_group_size
    )
    seconds = time.perf_counter() - start
    get_run_logger().info(
        "day %d (%s): %d rows, %d bad lines, %.1f s",
        day,
        raw,
        converted.rows,
        converted.bad_lines,
        seconds,
    )
    return {"converted": asdict(converted), "seconds": seconds}


@task(name="manifest", retries=1, retry_delay_seconds=10, retry_condition_fn=retry_unless_bad_input)
def manifest_task(raw_inputs: list[str], out: str, days: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``manifest.json`` from the converted days; the manifest summary plus bad-line
    counts. The ingest rate is rows per second of conversion work (summed over days)."""
    converted = [ConvertedDay(**d["converted"]) for d in days]
    result = finish_conversion(raw_inputs, out, converted)
    seconds = sum(d["seconds"] for d in days)
    get_run_logger().info(
        "converted %d files: %d rows, %d bad lines quarantined in %s",
        len(raw_inputs),
        result.rows,
        result.bad_lines,
        result.quarantine,
    )
    return {
        **_manifest_summary(result.manifest, seconds),
        "bad_lines": result.bad_lines,
        "quarantine": result.quarantine,
    }


@task(
    name="stats",
    cache_key_fn=stats_cache_key,
    **CACHED_RETRIED_ONCE,
)
def stats_task(path: str, multi_hot: bool) -> dict[str, Any]:
    """The running totals of one day file, as a ``stats_record`` (0.4 MiB of sketches
    before compression, whatever the file's size)."""
    start = time.perf_counter()
    totals = file_stats(path, multi_hot)
    seconds = time.perf_counter() - start
    get_run_logger().info(
        "statistics of %s: %d rows in %.1f s (%.0f rows/s)",
        path,
        totals.rows,
        seconds,
        totals.rows / max(seconds, 1e-9),
    )
    return stats_record(totals)


@task(name="merge-stats", retries=1, retry_delay_seconds=10)
def merge_stats_task(url: str, multi_hot: bool, days: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the days' totals (``stats_record``s) into the dataset's statistics, written to
    ``URL/stats.json``."""
    stats = merge_stats(url, multi_hot, (stats_from_record(day) for day in days))
    written = write_stats(url, stats)
    get_run_logger().info("statistics of %d rows -> %s", stats.rows, written)
    return stats.to_dict()


@flow(name="ingest", validate_parameters=True)
def ingest_flow(
    config: RunConfig,
    raw_inputs: list[str] | None = None,
    max_bad_fraction: float = 0.001,
) -> dict[str, Any]:
    """Make the dataset at ``config.data.url`` and publish its feature statistics.

    With ``raw_inputs`` (raw Criteo TSV days, one per day, the last held out) they are
    converted, one task per day; without, the synthetic generator writes the data
    ``config.data`` describes. Returns the manifest summary (rows, days, Bayes metrics for
    synthetic data, the ingest rate) with ``stats`` and, for conversions, the quarantined
    line count. The tasks run on the flow's task runner (threads unless the caller chose
    another: ``run_ingest`` applies ``config.orchestration``); the cached tasks' results go
    to the run's shared result location (``orchestration.result_storage``).
    """
    url = config.data.url
    results = shared_results(config)
    scan = stats_task.with_options(**results)
    if raw_inputs:
        convert = convert_task.with_options(**results)
        summary, stats_days = _convert(
            convert, scan, raw_inputs, url, config.data.row_group_size, max_bad_fraction
        )
        multi_hot = False
    else:
        stale = not _generated(config.data)
        generate = generate_task.with_options(refresh_cache=stale, **results)
        summary = generate(config.data)
        manifest = read_manifest(url)
        multi_hot = manifest.multi_hot
        stats_days = [scan.submit(path, multi_hot) for path in manifest.day_paths(url)]
    stats = DatasetStats.from_dict(merge_stats_task(url, multi_hot, stats_days))
    publish_stats(stats)
    return {**summary, "stats": join_url(url, STATS_NAME)}


def _generated(data: DataConfig) -> bool:
    """Whether the dataset at ``data.url`` is what generating ``data`` writes: its manifest
    lists this configuration's day files (``day_file_name``), and they exist."""
    try:
        manifest = read_manifest(data.url)
    except (OSError, ValueError):
        return False
    expected = [f"day={day}/{day_file_name(data, day)}" for day in range(data.days)]
    return [f.path for f in manifest.files] == expected and all(
        output_exists(join_url(data.url, path)) for path in expected
    )


def _convert(
    convert: Any,
    scan: Any,
    raw_inputs: Sequence[str],
    url: str,
    row_group_size: int,
    max_bad_fraction: float,
) -> tuple[dict[str, Any], list[Any]]:
    """Submit one conversion per day, each day's statistics as soon as its file is written,
    and the manifest once every day is converted; the manifest summary and the statistics'
    futures. ``convert`` and ``scan`` are ``convert_task`` and ``stats_task`` with the
    run's result options."""
    start_conversion(
        raw_inputs, url, max_bad_fraction=max_bad_fraction, row_group_size=row_group_size
    )
    converted, stats_days = [], []
    for day, raw in enumerate(raw_inputs):
        path = day_file(url, day, raw, row_group_size)
        convert_day_task = convert.with_options(refresh_cache=not output_exists(path))
        converted.append(convert_day_task.submit(raw, day, url, row_group_size, max_bad_fraction))
        stats_days.append(scan.submit(path, False, wait_for=[converted[-1]]))
    return manifest_task(list(raw_inputs), url, converted), stats_days


def run_ingest(
    config: RunConfig,
    raw_inputs: list[str] | None = None,
    max_bad_fraction: float = 0.001,
    **options: Any,
) -> Any:
    """Call ``ingest_flow`` on the task runner ``config.orchestration`` names (``options``
    such as ``return_state=True`` are passed on to the flow call)."""
    flow_ = ingest_flow.with_options(task_runner=task_runner(config.orchestration))
    with worker_api(config.orchestration):
        return flow_(config, raw_inputs, max_bad_fraction, **options)

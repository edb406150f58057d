"""The ``ingest`` flow: raw Criteo days (or the synthetic generator) -> Parquet -> statistics.

Ingest is the slow, repeatable part of a pipeline, so its tasks are cached: a run whose
inputs are unchanged since an earlier run skips the work and returns the earlier result.
The inputs are what the output depends on, fingerprinted cheaply (no file is read):

- conversion: each raw file's URL, size and modification time, the output URL and the
  conversion options;
- generation: every generation parameter (the output is a function of them alone) and the
  numpy version (whose random streams may change between releases);
- statistics: the size and modification time of the manifest and of every day file.

A cached result is only good while the output it describes exists, so the flow refreshes
the cache (runs the task again) when the output's ``manifest.json`` or ``stats.json`` is
missing, for example after the dataset folder was deleted.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import fsspec
import numpy as np
from prefect import flow, get_run_logger, task
from prefect.context import TaskRunContext

import dlrmflow
from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.flows.artifacts import publish_stats
from dlrmflow.flows.policies import retry_unless_bad_input
from dlrmflow.ingest.criteo import convert_criteo
from dlrmflow.ingest.manifest import MANIFEST_NAME, Manifest, join_url, read_manifest
from dlrmflow.ingest.stats import STATS_NAME, DatasetStats, dataset_stats, write_stats
from dlrmflow.ingest.synthetic import generate_dataset

# Hang guards, not budgets: far beyond what converting or scanning a month of Criteo days
# should take, so a task still running after these has stalled (a dead mount, a stuck
# object store) and its worker is better freed.
INGEST_TIMEOUT_S = 12 * 3600
STATS_TIMEOUT_S = 6 * 3600

# Metadata keys that identify a file's version on the file systems fsspec supports
# (local and memory: mtime/created; s3: ETag/LastModified; gcs: md5Hash/updated).
_VERSION_KEYS = ("mtime", "created", "LastModified", "last_modified", "updated", "ETag", "md5Hash")


def file_fingerprint(url: str) -> dict[str, Any]:
    """``url``, its size and whatever version metadata its file system reports.

    Raises FileNotFoundError naming the file if it does not exist.
    """
    fs, path = fsspec.core.url_to_fs(url)
    try:
        info = fs.info(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url}: input file not found") from e
    version = {key: str(info[key]) for key in _VERSION_KEYS if info.get(key) is not None}
    return {"url": url, "size": info.get("size"), **version}


def _digest(kind: str, payload: dict[str, Any]) -> str:
    """A cache key: the hash of ``payload`` as canonical JSON, with the package version (a
    new release may write its output differently) and ``kind`` so tasks never share keys."""
    text = json.dumps(
        {"kind": kind, "dlrmflow": dlrmflow.__version__, **payload}, sort_keys=True, default=str
    )
    return f"dlrmflow-{kind}-{hashlib.sha256(text.encode()).hexdigest()}"


def generate_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    """Cache key of ``generate_task``: the generation parameters and the numpy version."""
    data: DataConfig = parameters["data"]
    return _digest("generate", {"data": data.model_dump(mode="json"), "numpy": np.__version__})


def convert_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    """Cache key of ``convert_task``: raw file fingerprints, output URL and options."""
    return _digest(
        "convert",
        {
            "inputs": [file_fingerprint(url) for url in parameters["raw_inputs"]],
            "out": parameters["out"],
            "row_group_size": parameters["row_group_size"],
            "max_bad_fraction": parameters["max_bad_fraction"],
        },
    )


def stats_cache_key(context: TaskRunContext | None, parameters: dict[str, Any]) -> str:
    """Cache key of ``stats_task``: fingerprints of the manifest and every day file."""
    url = parameters["url"]
    manifest = read_manifest(url)
    files = [join_url(url, MANIFEST_NAME), *manifest.day_paths(url)]
    return _digest("stats", {"url": url, "files": [file_fingerprint(f) for f in files]})


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
    timeout_seconds=INGEST_TIMEOUT_S,
)
def convert_task(
    raw_inputs: list[str], out: str, row_group_size: int, max_bad_fraction: float
) -> dict[str, Any]:
    """Convert raw Criteo TSV days to Parquet; the manifest summary plus bad-line counts."""
    start = time.perf_counter()
    result = convert_criteo(
        raw_inputs, out, max_bad_fraction=max_bad_fraction, row_group_size=row_group_size
    )
    seconds = time.perf_counter() - start
    get_run_logger().info(
        "converted %d files: %d rows, %d bad lines quarantined in %s, %.1f s",
        len(raw_inputs),
        result.rows,
        result.bad_lines,
        result.quarantine,
        seconds,
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
    timeout_seconds=STATS_TIMEOUT_S,
)
def stats_task(url: str) -> dict[str, Any]:
    """Feature statistics of the dataset at ``url``, also written to ``URL/stats.json``."""
    start = time.perf_counter()
    stats = dataset_stats(url)
    seconds = time.perf_counter() - start
    written = write_stats(url, stats)
    get_run_logger().info(
        "statistics of %d rows in %.1f s (%.0f rows/s) -> %s",
        stats.rows,
        seconds,
        stats.rows / max(seconds, 1e-9),
        written,
    )
    return stats.to_dict()


@flow(name="ingest", validate_parameters=True)
def ingest_flow(
    config: RunConfig,
    raw_inputs: list[str] | None = None,
    max_bad_fraction: float = 0.001,
) -> dict[str, Any]:
    """Make the dataset at ``config.data.url`` and publish its feature statistics.

    With ``raw_inputs`` (raw Criteo TSV days, one per day, the last held out) they are
    converted; without, the synthetic generator writes the data ``config.data`` describes.
    Returns the manifest summary (rows, days, Bayes metrics for synthetic data, the ingest
    rate) with ``stats`` and, for conversions, the quarantined line count.
    """
    url = config.data.url
    manifest_missing = not output_exists(join_url(url, MANIFEST_NAME))
    if raw_inputs:
        convert = convert_task.with_options(refresh_cache=manifest_missing)
        summary = convert(raw_inputs, url, config.data.row_group_size, max_bad_fraction)
    else:
        summary = generate_task.with_options(refresh_cache=manifest_missing)(config.data)
    # New day files change the statistics' cache key; only a lost stats.json needs a refresh.
    stats_missing = not output_exists(join_url(url, STATS_NAME))
    stats = DatasetStats.from_dict(stats_task.with_options(refresh_cache=stats_missing)(url))
    publish_stats(stats)
    return {**summary, "stats": join_url(url, STATS_NAME)}

"""Days converted per minute: the ingest flow's per-day tasks on a Dask cluster of 1 and 2
workers.

Raw Criteo-layout TSV days (label, 13 integers, 26 hex IDs, some fields empty) are written
once; each case then runs the ``ingest`` flow over all of them (``run_ingest``: one
convert task and one statistics task per day, then the manifest and the merged
statistics) into an output directory of its own, so no case reuses another's cached
results. Baseline: the same flow on a local Dask cluster of one worker process. The other
cases: a local cluster of two worker processes (the headline ratio), and the default
thread runner in the flow's own process, for reference. Every case pays for starting its
runner (the cluster's processes importing the package) inside its time, as a user's run
does. The cases take turns within each of ``repeats`` rounds and each keeps its best
(``dlrmflow.bench.turns``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from dlrmflow.bench.machine import describe_machine
from dlrmflow.bench.turns import best_of_turns
from dlrmflow.config import RunConfig

BASELINE = "dask_1_worker"
FULL = {"days": 4, "rows_per_day": 250_000}
QUICK = {"days": 2, "rows_per_day": 2_000}


def write_raw_days(folder: Path, days: int, rows_per_day: int, seed: int = 0) -> list[str]:
    """``days`` raw Criteo-layout TSV files of ``rows_per_day`` lines each."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for day in range(days):
        labels = rng.random(rows_per_day) < 0.25
        ints = rng.integers(-2, 10_000, size=(rows_per_day, 13))
        ids = rng.integers(0, 2**32, size=(rows_per_day, 26), dtype=np.uint64)
        missing = rng.random((rows_per_day, 39)) < 0.05
        lines = []
        for r in range(rows_per_day):
            fields = [str(int(labels[r]))]
            fields += ["" if missing[r, c] else str(ints[r, c]) for c in range(13)]
            fields += ["" if missing[r, 13 + c] else f"{ids[r, c]:08x}" for c in range(26)]
            lines.append("\t".join(fields))
        path = folder / f"day_{day}.tsv"
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def run_ingest_days_benchmark(*, quick: bool = False, repeats: int = 2) -> dict[str, object]:
    """Measure the three runners on the same raw days; return the JSON record."""
    from dlrmflow.flows.ingest import run_ingest

    size = QUICK if quick else FULL
    repeats = 1 if quick else repeats
    root = Path(tempfile.mkdtemp(prefix="dlrmflow-ingest-days-"))
    try:
        raw = write_raw_days(root / "raw", size["days"], size["rows_per_day"])
        runs = {"count": 0}

        def case(runner: str, workers: int):
            def run() -> dict[str, float]:
                runs["count"] += 1
                out = root / f"out_{runs['count']}"
                config = RunConfig.model_validate(
                    {
                        "data": {"url": str(out)},
                        "orchestration": {"task_runner": runner, "dask_workers": workers},
                    }
                )
                start = time.perf_counter()
                run_ingest(config, raw)
                seconds = time.perf_counter() - start
                shutil.rmtree(out, ignore_errors=True)
                return {"seconds": seconds, "days_per_minute": 60 * len(raw) / seconds}

            return run

        cases = {
            BASELINE: case("dask", 1),
            "dask_2_workers": case("dask", 2),
            "threads": case("threads", 1),
        }
        results = best_of_turns(cases, repeats, key=lambda r: r["days_per_minute"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = results[BASELINE]["days_per_minute"]
    return {
        "benchmark": "ingest_days",
        "baseline": f"{BASELINE}: the ingest flow's per-day tasks on a local Dask cluster of "
        "one worker process",
        "days": size["days"],
        "rows_per_day": size["rows_per_day"],
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "results": results,
        "ratios": {
            f"{name}_vs_{BASELINE}": r["days_per_minute"] / base
            for name, r in results.items()
            if name != BASELINE
        },
        "machine": describe_machine(),
    }

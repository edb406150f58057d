"""Per-day ingest: one convert and one stats task per day, on threads or a Dask cluster.

The per-day flow must write exactly what the sequential ``convert_criteo`` and
``dataset_stats`` write (the same bytes), and a new day must convert and scan only itself.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrmflow.config import OrchestrationConfig, build_config
from dlrmflow.flows.ingest import run_ingest
from dlrmflow.flows.runners import task_runner
from dlrmflow.flows.storage import RESULTS_DIR
from dlrmflow.ingest.criteo.convert import convert_criteo
from dlrmflow.ingest.stats.results import write_stats
from dlrmflow.ingest.stats.scan import dataset_stats
from dlrmflow.locks import LOCK_FILE
from tests.flows.records import run_records
from tests.prefect_server import stop_process_group

pytest.importorskip("prefect_dask")

MAX_BAD = 0.01  # one malformed line in a 200-line day is allowed (and quarantined)
BIN = Path(sys.executable).parent


def raw_days(sample: Path, folder: Path, days: int) -> list[str]:
    """``days`` distinct raw days: the sample's lines rotated by 37 per day, and day 2 with
    a malformed line (so a quarantine file is compared too)."""
    lines = sample.read_bytes().splitlines(keepends=True)
    paths = []
    for day in range(days):
        shift = 37 * day % len(lines)
        body = lines[shift:] + lines[:shift]
        if day == 2:
            body.insert(5, b"not\ta\tcriteo\tline\n")
        path = folder / f"day{day}.tsv"
        path.write_bytes(b"".join(body))
        paths.append(str(path))
    return paths


def snapshot(root: Path) -> dict[str, bytes]:
    """The dataset's files, less the flow's cached task results kept beside them and the
    folder's lock file (which the sequential converter holds while it writes)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] not in (RESULTS_DIR, LOCK_FILE)
    }


def sequential(raw: list[str], url: Path) -> dict[str, bytes]:
    """What the sequential converter and the all-days statistics write at ``url``."""
    if url.exists():
        shutil.rmtree(url)
    convert_criteo(raw, str(url), max_bad_fraction=MAX_BAD, row_group_size=64)
    write_stats(str(url), dataset_stats(str(url)))
    return snapshot(url)


def states(flow_state, name: str) -> list[str]:
    records = run_records(flow_state.state_details.flow_run_id)
    return sorted(t.state_name for t in records.tasks(name))


def test_task_runner_follows_the_configuration():
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    assert isinstance(task_runner(OrchestrationConfig()), ThreadPoolTaskRunner)
    local = task_runner(OrchestrationConfig(task_runner="dask", dask_workers=3))
    assert isinstance(local, DaskTaskRunner) and local.address is None
    assert local.cluster_kwargs["n_workers"] == 3
    assert local.cluster_kwargs["threads_per_worker"] == 1
    remote = task_runner(OrchestrationConfig(task_runner="dask", dask_address="tcp://h:8786"))
    assert remote.address == "tcp://h:8786" and not remote.cluster_kwargs


def test_days_on_a_local_dask_cluster_match_the_sequential_run(
    prefect_api, criteo_sample, tmp_path
):
    raw = raw_days(criteo_sample, tmp_path, 5)
    url = tmp_path / "criteo"
    expected = sequential(raw[:4], url)
    assert "_quarantine/day2.tsv.jsonl" in expected
    shutil.rmtree(url)

    config = build_config(
        {
            "data": {"url": str(url), "row_group_size": 64},
            "orchestration": {"task_runner": "dask", "dask_workers": 2},
        }
    )
    first = run_ingest(config, raw[:4], MAX_BAD, return_state=True)
    assert first.result()["rows"] == 800 and first.result()["bad_lines"] == 1
    assert snapshot(url) == expected
    assert states(first, "convert") == ["Completed"] * 4
    assert states(first, "stats") == ["Completed"] * 4

    # A fifth day: only it is converted and scanned; the others come from the cache.
    written = {p: p.stat().st_mtime_ns for p in url.rglob("*.parquet")}
    second = run_ingest(config, raw, MAX_BAD, return_state=True)
    assert states(second, "convert") == ["Cached"] * 4 + ["Completed"]
    assert states(second, "stats") == ["Cached"] * 4 + ["Completed"]
    assert {p: p.stat().st_mtime_ns for p in written} == written
    assert snapshot(url) == sequential(raw, url)


def test_ingest_on_an_existing_dask_scheduler(prefect_api, criteo_sample, tmp_path):
    raw = raw_days(criteo_sample, tmp_path, 3)
    url = tmp_path / "criteo"
    expected = sequential(raw, url)
    shutil.rmtree(url)

    scheduler_file = tmp_path / "scheduler.json"
    procs: list[subprocess.Popen] = []
    logs = []

    def start(*args: str) -> None:
        log = (tmp_path / f"dask-{len(procs)}.log").open("w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [str(BIN / "dask"), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    try:
        start("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
              "--scheduler-file", str(scheduler_file))  # fmt: skip
        deadline = time.monotonic() + 60
        while not scheduler_file.is_file() and time.monotonic() < deadline:
            assert procs[0].poll() is None, (tmp_path / "dask-0.log").read_text()
            time.sleep(0.2)
        for _ in range(2):
            start("worker", "--scheduler-file", str(scheduler_file), "--nthreads", "1",
                  "--no-dashboard", "--host", "127.0.0.1")  # fmt: skip
        from distributed import Client

        with Client(scheduler_file=str(scheduler_file), timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            address = client.scheduler.address

        config = build_config(
            {
                "data": {"url": str(url), "row_group_size": 64},
                "orchestration": {"task_runner": "dask", "dask_address": address},
            }
        )
        state = run_ingest(config, raw, MAX_BAD, return_state=True)
        assert state.result()["rows"] == 600
        assert states(state, "convert") == ["Completed"] * 3
        assert snapshot(url) == expected
    finally:
        for proc in reversed(procs):
            stop_process_group(proc)
        for log in logs:
            log.close()
    assert all(proc.poll() is not None for proc in procs)

"""Cached task results at ``orchestration.result_storage``, shared by every worker.

A second host is a second process with its own PREFECT_HOME (so its own default result
storage) reporting to the same Prefect server, as the hosts of a work pool do: pointed at
the first host's result location it reuses the first host's ingest; pointed elsewhere, a
run recomputes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

import fsspec

from dlrmflow.config import OrchestrationConfig, build_config
from dlrmflow.flows.ingest import ingest_flow, run_ingest
from dlrmflow.flows.storage import RESULTS_DIR, result_location, result_storage
from tests.flows.records import run_records
from tests.prefect_server import server_env

HOST_SCRIPT = """
import json, sys
from dlrmflow.config import build_config
from dlrmflow.flows.ingest import run_ingest
state = run_ingest(build_config(json.loads(sys.argv[1])), json.loads(sys.argv[2]),
                   return_state=True)
print(json.dumps({"flow_run": str(state.state_details.flow_run_id), "result": state.result()}))
"""


def ingest_on_host(home: Path, api: str, config: dict[str, Any], raw: list[str]):
    """Run the ingest flow in a new process with PREFECT_HOME ``home``; its flow run id and
    result."""
    env = {**server_env(home), "PREFECT_API_URL": api}
    proc = subprocess.run(
        [sys.executable, "-c", HOST_SCRIPT, json.dumps(config), json.dumps(raw)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return UUID(out["flow_run"]), out["result"]


def task_states(flow_run: UUID, *names: str) -> list[list[str]]:
    records = run_records(flow_run)
    return [sorted(t.state_name for t in records.tasks(name)) for name in names]


def test_result_location_defaults_beside_the_dataset(tmp_path):
    assert OrchestrationConfig().result_storage is None
    config = build_config({"data": {"url": "s3://bucket/criteo"}})
    assert result_location(config) == f"s3://bucket/criteo/{RESULTS_DIR}"
    shared = config.model_copy(
        update={"orchestration": OrchestrationConfig(result_storage="gs://b/results")}
    )
    assert result_location(shared) == "gs://b/results"
    assert result_storage(str(tmp_path)) == tmp_path
    assert result_storage(f"file://{tmp_path}") == tmp_path


def test_a_second_host_reuses_the_first_hosts_ingest(prefect_api, criteo_sample, tmp_path):
    raw = [str(tmp_path / f"day{d}.tsv") for d in range(2)]
    for path in raw:
        shutil.copy(criteo_sample, path)
    data = tmp_path / "criteo"
    config = {"data": {"url": str(data), "row_group_size": 64}}
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"

    run, first = ingest_on_host(host_a, prefect_api, config, raw)
    assert task_states(run, "convert", "stats") == [["Completed"] * 2, ["Completed"] * 2]
    assert first["rows"] == 400
    # One JSON record per cached task run, named by its cache key, beside the dataset.
    records = sorted((data / RESULTS_DIR).iterdir())
    assert len(records) == 4
    for path in records:
        record = json.loads(path.read_bytes())
        assert record["metadata"]["serializer"]["type"] == "json"
        assert isinstance(json.loads(record["result"]), dict)
    written = {p: p.stat().st_mtime_ns for p in data.rglob("*.parquet")}
    stats = (data / "stats.json").read_bytes()

    run, second = ingest_on_host(host_b, prefect_api, config, raw)
    assert task_states(run, "convert", "stats") == [["Cached"] * 2, ["Cached"] * 2]
    assert second == first
    assert {p: p.stat().st_mtime_ns for p in written} == written
    assert (data / "stats.json").read_bytes() == stats
    assert sorted((data / RESULTS_DIR).iterdir()) == records
    # Neither host kept results of its own.
    assert not (host_a / "storage").exists() and not (host_b / "storage").exists()

    # Pointed at another location (in this process: no new host is needed for that),
    # nothing is reused.
    elsewhere = {**config, "orchestration": {"result_storage": str(tmp_path / "elsewhere")}}
    state = run_ingest(build_config(elsewhere), raw, return_state=True)
    run, third = state.state_details.flow_run_id, state.result()
    assert task_states(run, "convert", "stats") == [["Completed"] * 2, ["Completed"] * 2]
    assert len(list((tmp_path / "elsewhere").iterdir())) == 4
    rate = "ingest_rows_per_s"  # measured, so it differs between computed runs
    assert {**third, rate: None} == {**first, rate: None}
    assert (data / "stats.json").read_bytes() == stats


def test_results_in_an_fsspec_url(prefect_api, tmp_path):
    """A URL that is not a local path is a saved RemoteFileSystem block (memory:// here)."""
    small = {"days": 2, "rows_per_day": 800, "row_group_size": 400, "cardinality_scale": 0.0005}
    config = build_config(
        {
            "data": {"url": str(tmp_path / "data"), **small},
            "orchestration": {"result_storage": f"memory://dlrmflow-test/{tmp_path.name}"},
        }
    )
    first = ingest_flow(config, return_state=True)
    second = ingest_flow(config, return_state=True)
    assert task_states(first.state_details.flow_run_id, "generate", "stats") == [
        ["Completed"],
        ["Completed"] * 2,
    ]
    assert task_states(second.state_details.flow_run_id, "generate", "stats") == [
        ["Cached"],
        ["Cached"] * 2,
    ]
    assert second.result() == first.result()
    memory = fsspec.filesystem("memory")
    assert len(memory.ls(f"/dlrmflow-test/{tmp_path.name}")) == 3
    assert not (tmp_path / "data" / RESULTS_DIR).exists()

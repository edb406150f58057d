"""The end-to-end Prefect flow, on the local ephemeral API as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

SUMMARY_KEYS = {
    "auc", "logloss", "ne", "calibration", "bayes_auc", "bayes_logloss", "rows_trained",
    "train_samples_per_s", "ingest_rows_per_s", "steps", "world_size", "checkpoint",
}  # fmt: skip


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_flow_records_summary_and_artifact(prefect_api, tmp_path):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from dlrmflow.flows.end_to_end import end_to_end
    from tests.conftest import tiny_run_config

    cfg = tiny_run_config(str(tmp_path / "data"), tmp_path / "run", max_steps=10)
    summary = end_to_end(cfg)
    assert summary.keys() >= SUMMARY_KEYS
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    assert summary["steps"] == 10 and summary["world_size"] == 1

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["dlrmflow-summary"]))
            )

    found = asyncio.run(artifacts())
    assert found, "the flow published no summary artifact"
    assert f"| auc | {summary['auc']:.4f} |" in found[0].data


def test_demo_quick_command(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    run_dir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "demo", "--quick", "--run-dir", str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["auc"] > 0.6
    assert summary["rows_trained"] == 2 * 20_000
    assert "auc" in proc.stdout and str(run_dir / "summary.json") in proc.stdout

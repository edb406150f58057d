"""`dlrmflow demo --quick`: the end-to-end flow on the local ephemeral API, as a user runs it.

Its tasks and artifacts are checked on a real server in test_server.py."""

import json
import subprocess
import sys

from tests.flows.conftest import new_prefect_home, server_env

SUMMARY_KEYS = {
    "auc", "logloss", "ne", "calibration", "bayes_auc", "bayes_logloss", "rows_trained",
    "train_samples_per_s", "ingest_rows_per_s", "steps", "world_size", "checkpoint",
}  # fmt: skip


def test_demo_quick_command(tmp_path, pytestconfig):
    env = server_env(new_prefect_home(tmp_path / "prefect", pytestconfig))
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
    # Sharded over two ranks by default, every training row trained once.
    assert summary["world_size"] == 2
    assert summary["rows_trained"] == 2 * 20_000
    assert "auc" in proc.stdout and str(run_dir / "summary.json") in proc.stdout

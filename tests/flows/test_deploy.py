"""The flows deployed to a process work pool and run by a real worker, as the README says:

``dlrmflow deploy --pool P`` (a subprocess, against the session's real Prefect server), then
``prefect worker start --pool P`` (the venv's, so dlrmflow is importable), then a run of
``end_to_end/dlrmflow`` created through the server; the worker runs it and the test reads
the run, its subflows and artifacts back. The config's paths are relative: they resolve in
the directory ``deploy`` ran in, which the worker starts its runs in.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL, temporary_settings

from dlrmflow.cli import main
from dlrmflow.flows.end_to_end import SUMMARY_KEY
from dlrmflow.flows.serve import FLOWS
from tests.conftest import TINY_DATA
from tests.flows.conftest import free_port, server_env, stop_process_group
from tests.flows.records import call_client, run_records

POOL = "dlrmflow-test"
BIN = Path(sys.executable).parent
RUN_TIMEOUT_S = 150
CONFIG = {
    "run_dir": "run",
    "data": {"url": "data", **TINY_DATA, "rows_per_day": 2000},
    "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32]},
    "train": {"batch_size": 512, "log_every": 2, "num_workers": 0, "max_steps": 6},
}


def _forget_deployments() -> None:
    """Remove the ``*/dlrmflow`` deployments (another test module may have served them)."""
    for flow_name in FLOWS:
        try:
            found = call_client("read_deployment_by_name", f"{flow_name}/dlrmflow")
        except ObjectNotFound:
            continue
        call_client("delete_deployment", found.id)


@pytest.fixture
def workspace(prefect_api: str, tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A folder to deploy from and the environment of the deploy and worker processes."""
    env = server_env(tmp_path / "prefect-home")
    # The worker asks for runs every second (default 10 s).
    env.update(PREFECT_API_URL=prefect_api, PREFECT_WORKER_QUERY_SECONDS="1")
    _forget_deployments()
    try:
        yield tmp_path, env
    finally:
        _forget_deployments()
        with contextlib.suppress(ObjectNotFound):
            call_client("delete_work_pool", POOL)


def _wait_final(run_id, worker: subprocess.Popen, log: Path):
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        run = call_client("read_flow_run", run_id)
        if run.state is not None and run.state.is_final():
            return run
        if worker.poll() is not None:
            pytest.fail(f"worker exited with {worker.returncode}:\n{log.read_text()[-5000:]}")
        time.sleep(0.5)
    pytest.fail(f"run not finished after {RUN_TIMEOUT_S} s; worker log:\n{log.read_text()[-5000:]}")


def test_deployed_flows_run_on_a_process_worker(workspace):
    root, env = workspace
    (root / "run.json").write_text(json.dumps(CONFIG))
    deployed = subprocess.run(
        [BIN / "dlrmflow", "deploy", "--pool", POOL, "--cron", "0 3 * * *",
         "--config", "run.json", "--set", "train.max_steps=4"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert deployed.returncode == 0, deployed.stderr
    result = json.loads(deployed.stdout)
    assert result["work_pool_created"] is True
    assert sorted(result["deployments"]) == sorted(f"{f}/dlrmflow" for f in FLOWS)
    assert call_client("read_work_pool", POOL).type == "process"

    deployment = call_client("read_deployment_by_name", "end_to_end/dlrmflow")
    assert deployment.work_pool_name == POOL
    assert deployment.entrypoint == "dlrmflow.flows.end_to_end.end_to_end"
    assert deployment.pull_steps == []  # the code comes from the worker's installed package
    assert deployment.job_variables == {"working_dir": str(root)}
    assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
    assert deployment.parameters["config"]["train"]["max_steps"] == 4
    train = call_client("read_deployment_by_name", "train/dlrmflow")
    assert train.work_pool_name == POOL and train.schedules == []

    log = root / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [BIN / "prefect", "worker", "start", "--pool", POOL, "--limit", "1"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        started = call_client("create_flow_run_from_deployment", deployment.id)
        run = _wait_final(started.id, worker, log)
    finally:
        # A worker stops on the second signal: SIGTERM, then SIGINT.
        stop_process_group(worker, 3, (signal.SIGTERM, signal.SIGINT, signal.SIGKILL))
    assert run.state.is_completed(), f"{run.state.message}\n{log.read_text()[-5000:]}"

    records = run_records(run.id)
    assert len(records.subflows) == 3 and all(s.state.is_completed() for s in records.subflows)
    summary = json.loads((root / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["rows_trained"] == 4 * 512
    assert f"| auc | {summary['auc']:.4f} |" in records.artifact(SUMMARY_KEY).data
    assert (root / "data" / "manifest.json").is_file()


def test_deploy_without_a_server_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["dlrmflow", "deploy", "--pool", POOL])
    nowhere = f"http://127.0.0.1:{free_port()}/api"
    for settings, message in (
        ({"restore_defaults": {PREFECT_API_URL}}, "no Prefect server configured"),
        ({"updates": {PREFECT_API_URL: nowhere}}, f"Prefect server at {nowhere} does not answer"),
    ):
        with temporary_settings(**settings), pytest.raises(SystemExit) as exited:
            main()
        assert exited.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err

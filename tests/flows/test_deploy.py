"""The flows deployed to a process work pool and run by a real worker, as the README says:

``dlrmflow deploy --pool P --flow recurring --cron ...`` (a subprocess, against the
session's real Prefect server), then ``prefect worker start --pool P`` (the venv's, so
dlrmflow is importable), then runs of ``recurring/dlrmflow`` created through the server,
a raw day landing before each; the worker runs them and the test reads the runs, their
subflows, tasks and artifacts back. The config's paths are relative: they resolve in the
directory ``deploy`` ran in, which the worker starts its runs in.
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
from dlrmflow.flows.deployments import FLOWS
from dlrmflow.flows.recurring import GATE_KEY
from tests.conftest import TINY_DATA
from tests.flows.records import call_client, run_records
from tests.flows.test_recurring import land
from tests.prefect_server import free_port, server_env, stop_process_group

POOL = "dlrmflow-test"
BIN = Path(sys.executable).parent
RUN_TIMEOUT_S = 150  # a run, not the test
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


def test_deployed_flows_run_on_a_process_worker(workspace, criteo_sample: Path):
    """Every flow deployed, and the recurring flow, the one on the daily schedule, run by
    the worker: two runs, a raw day landing before each, in the directory ``deploy`` ran
    in, each continuing the line the run before it left. (The flow's own behaviour, its
    versions ending where one run over the days ends and a run with no new day changing
    nothing, is checked in process by tests/train/line/test_line.py and
    tests/flows/test_recurring.py; the end-to-end flow's subflows and artifacts on a
    served deployment in test_server.py.)"""
    root, env = workspace
    (root / "run.json").write_text(json.dumps(CONFIG))
    deployed = subprocess.run(
        [BIN / "dlrmflow", "deploy", "--pool", POOL, "--flow", "recurring",
         "--cron", "0 3 * * *", "--line", "ctr-line", "--config", "run.json",
         "--set", "train.max_steps=4"],
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
    assert deployment.schedules == []
    assert deployment.parameters["config"]["train"]["max_steps"] == 4
    daily = call_client("read_deployment_by_name", "recurring/dlrmflow")
    assert daily.work_pool_name == POOL and daily.parameters["line"] == "ctr-line"
    assert [s.schedule.cron for s in daily.schedules] == ["0 3 * * *"]

    log = root / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [BIN / "prefect", "worker", "start", "--pool", POOL, "--limit", "1"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        daily_runs = []
        line_run = {"line": "ctr-line", "config": _line_config()}
        for day in range(2):
            land(root / "landing", criteo_sample, day)  # the day lands before its run
            started = call_client("create_flow_run_from_deployment", daily.id, parameters=line_run)
            daily_runs.append(_wait_final(started.id, worker, log))
    finally:
        # A worker stops on the second signal: SIGTERM, then SIGINT.
        stop_process_group(worker, 3, (signal.SIGTERM, signal.SIGINT, signal.SIGKILL))

    assert all(r.state.is_completed() for r in daily_runs), [r.state for r in daily_runs]
    assert [r.state.message for r in daily_runs] == [f"trained day(s) {d}" for d in range(2)]
    second = run_records(daily_runs[1].id)
    assert len(second.tasks("day-1")) == 1 and second.subflows[0].state.is_completed()
    assert "version 0000 **promoted** on day 1" in second.artifact(GATE_KEY).data
    for version, days in ((0, [0]), (1, [0, 1])):
        kept = root / "ctr-line" / "versions" / f"{version:04d}"
        assert json.loads((kept / "version.json").read_text())["days"] == days


def _line_config() -> dict:
    """The daily flow's line: raw days landing in ``landing``, converted into ``days``."""
    return {
        **CONFIG,
        "data": {**CONFIG["data"], "url": "days", "landing": "landing"},
        "train": {**CONFIG["train"], "batch_size": 16, "max_steps": None},
        "gate": {"calibration_min": 0.1, "calibration_max": 10.0, "ne_margin": 1.0},
    }


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

"""The flows served as deployments against a real Prefect server, as a team runs them.

``serve_flows`` runs in its own process (as ``dlrmflow serve`` would) with an interval
schedule on ``end_to_end``; the runner executes the run the schedule fires in a process of
its own, and the test reads the run, its subflows, task runs and artifacts back from the
server. One scheduled run serves both as "a schedule fires" and as "a deployment run is
recorded": each served run costs a process start (torch, prefect) on a 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.client.schemas.objects import Deployment, FlowRun
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.states import Scheduled

from dlrmflow.config import RunConfig, build_config
from dlrmflow.flows.artifacts import (
    CURVE_KEY,
    EVAL_METRICS_KEY,
    RELIABILITY_KEY,
    STATS_KEY,
    TRAIN_METRICS_KEY,
)
from dlrmflow.flows.end_to_end import SUMMARY_KEY
from dlrmflow.flows.train import PROGRESS_KEY
from tests.conftest import TINY_DATA
from tests.flows.records import call_client, run_records
from tests.prefect_server import server_env, stop_process_group

SCHEDULE_INTERVAL_S = 2
RUN_TIMEOUT_S = 180
SERVE = (
    "import json, sys\n"
    "from dlrmflow.config import build_config\n"
    "from dlrmflow.flows.deployments import serve_flows\n"
    "serve_flows(build_config(json.loads(sys.argv[1])), interval=float(sys.argv[2]))\n"
)


def _config(root: Path) -> RunConfig:
    return build_config(
        {
            "run_dir": str(root / "run"),
            "data": {"url": str(root / "data"), **TINY_DATA, "rows_per_day": 2000},
            "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32]},
            "train": {"batch_size": 512, "log_every": 2, "num_workers": 0, "max_steps": 6},
        }
    )


class Served:
    """The serving process, its log and the folder its default config writes to."""

    def __init__(self, proc: subprocess.Popen, log: Path, root: Path) -> None:
        self.proc, self.log, self.root = proc, log, root

    def wait(self, what: str, check):
        """Poll ``check()`` until it returns something truthy; fail if serving died."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-5000:]
                pytest.fail(f"serve exited with {self.proc.returncode} before {what}:\n{tail}")
            time.sleep(0.5)
        pytest.fail(f"timed out waiting for {what}; serve log:\n{self.log.read_text()[-5000:]}")

    def deployment(self, name: str) -> Deployment:
        """The deployment ``name`` (``flow/deployment``) once serving has registered it."""

        def found() -> Deployment | None:
            try:
                return call_client("read_deployment_by_name", name)
            except ObjectNotFound:
                return None

        return self.wait(f"deployment {name}", found)


@pytest.fixture(scope="module")
def served(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served")
    env = server_env(root / "prefect-home")
    env.update(PREFECT_API_URL=prefect_server, PREFECT_RUNNER_POLL_FREQUENCY="1")
    log = root / "serve.log"
    with log.open("w") as out:
        command = [sys.executable, "-c", SERVE, _config(root).model_dump_json()]
        proc = subprocess.Popen(
            [*command, str(SCHEDULE_INTERVAL_S)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Served(proc, log, root)
    finally:
        stop_process_group(proc)


def test_a_scheduled_deployment_run_is_recorded_with_tasks_and_artifacts(prefect_api, served):
    deployment = served.deployment("end_to_end/dlrmflow")
    assert deployment.entrypoint == "dlrmflow.flows.end_to_end.end_to_end"

    def finished_scheduled_run() -> FlowRun | None:
        runs = call_client(
            "read_flow_runs",
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
        )
        return next((r for r in runs if r.auto_scheduled and r.state.is_final()), None)

    run = served.wait("a scheduled end_to_end run", finished_scheduled_run)
    call_client("pause_deployment", deployment.id)  # no more runs: they would only use CPU
    assert run.state.is_completed(), run.state.message

    records = run_records(run.id)
    assert len(records.subflows) == 3  # ingest, train, evaluate
    assert all(s.state.is_completed() for s in records.subflows)
    for name in ("generate", "merge-stats", "train", "evaluate", "report"):
        assert [t.state_name for t in records.tasks(name)] == ["Completed"], name
    # Statistics run one task per day file (each cached on its own).
    stats = [t.state_name for t in records.tasks("stats")]
    assert stats == ["Completed"] * len(stats) and len(stats) >= 2

    summary = json.loads((served.root / "run" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["rows_trained"] == 6 * 512
    assert summary["resumed_from_step"] is None and summary["train_attempts"] == 1
    assert f"| auc | {summary['auc']:.4f} |" in records.artifact(SUMMARY_KEY).data
    # No sharding-plan table: a single-process run writes no plan.json.
    assert {a.key for a in records.artifacts} == {
        SUMMARY_KEY, STATS_KEY, PROGRESS_KEY, TRAIN_METRICS_KEY, CURVE_KEY, EVAL_METRICS_KEY,
        RELIABILITY_KEY,
    }  # fmt: skip
    assert float(records.artifact(PROGRESS_KEY).data) == 100.0
    train_metrics = json.loads(records.artifact(TRAIN_METRICS_KEY).data)
    assert {"metric": "steps", "value": 6} in train_metrics
    assert "data:image/png;base64," in records.artifact(CURVE_KEY).data
    evaluated = json.loads(records.artifact(EVAL_METRICS_KEY).data)
    assert {"metric": "rows", "value": 2000} in evaluated
    assert not any(row["metric"] == "reliability" for row in evaluated)  # its own artifact
    reliability = records.artifact(RELIABILITY_KEY).data
    assert "data:image/png;base64," in reliability
    assert "| mean predicted | observed |" in reliability
    assert (served.root / "run" / "reliability.png").is_file()
    assert len(json.loads(records.artifact(STATS_KEY).data)) == 1 + 13 + 26


def test_the_server_checks_run_parameters_against_the_config_schema(prefect_api, served):
    deployment = served.deployment("train/dlrmflow")
    later = Scheduled(scheduled_time=datetime.now(UTC) + timedelta(days=1))
    custom = _config(served.root / "custom").model_dump(mode="json")
    accepted = call_client(
        "create_flow_run_from_deployment",
        deployment.id,
        parameters={"config": custom},
        state=later,  # far enough ahead that the runner leaves it alone
    )
    assert accepted.parameters["config"]["run_dir"] == custom["run_dir"]
    call_client("delete_flow_run", accepted.id)

    bad = {"config": {**custom, "train": {**custom["train"], "batch_size": 0}}}
    with pytest.raises(PrefectHTTPStatusError, match="409|422") as refused:
        call_client("create_flow_run_from_deployment", deployment.id, parameters=bad, state=later)
    assert "batch_size" in refused.value.response.text


def test_a_score_run_names_its_output_and_scores_the_configured_run(prefect_api, served):
    deployment = served.deployment("score/dlrmflow")
    assert deployment.entrypoint == "dlrmflow.flows.score.score_flow"
    later = Scheduled(scheduled_time=datetime.now(UTC) + timedelta(days=1))
    out = str(served.root / "scores")
    accepted = call_client(
        "create_flow_run_from_deployment", deployment.id, parameters={"out": out}, state=later
    )
    assert accepted.parameters == {
        "model": str(served.root / "run"),
        "data": str(served.root / "data"),
        "out": out,
    }
    call_client("delete_flow_run", accepted.id)
    with pytest.raises(PrefectHTTPStatusError, match="409|422") as refused:
        call_client("create_flow_run_from_deployment", deployment.id, parameters={}, state=later)
    assert "'out' is a required property" in refused.value.response.text

"""The train flow: planned steps, the progress artifact, retries and the training artifacts."""

from __future__ import annotations

import base64
import json

import pytest
from prefect import flow
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.exceptions import ParameterTypeError

import dlrmflow.flows.train as train_module
from dlrmflow.config import DataConfig
from dlrmflow.flows.artifacts import CURVE_KEY, PLAN_KEY, TRAIN_METRICS_KEY
from dlrmflow.flows.progress import ProgressReporter
from dlrmflow.flows.train import PROGRESS_KEY, planned_steps, train_flow
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.launch import job as launch
from tests.conftest import tiny_run_config
from tests.flows.records import call_client, run_records
from tests.flows.test_artifacts import two_rank_plan
from tests.flows.test_ingest import SMALL


def test_planned_steps_follow_rows_batch_epochs_and_max_steps(tiny_dataset, tmp_path):
    # Two training days of 6000 rows: 12000 / 512 -> 24 batches, the last one partial.
    assert planned_steps(tiny_run_config(tiny_dataset, tmp_path)) == 24
    assert planned_steps(tiny_run_config(tiny_dataset, tmp_path, epochs=3)) == 72
    assert planned_steps(tiny_run_config(tiny_dataset, tmp_path, max_steps=10)) == 10
    assert planned_steps(tiny_run_config(tiny_dataset, tmp_path, batch_size=5000)) == 3
    two_ranks = tiny_run_config(tiny_dataset, tmp_path)
    two_ranks.distributed.nproc = 2  # each rank takes a batch a step
    assert planned_steps(two_ranks) == 12


def _progress(key: str) -> float:
    found = call_client(
        "read_artifacts", artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
    )
    assert len(found) == 1
    return float(found[0].data)


def test_progress_reporter_moves_forward_and_finishes(prefect_api):
    key = "test-progress"

    @flow
    def report_steps() -> list[float]:
        with pytest.raises(ValueError, match="total must be >= 1"):
            ProgressReporter(0, key=key, description="nothing to do")
        reporter = ProgressReporter(200, key=key, description="200 steps")
        shown = [_progress(key)]
        reporter.update(1)  # 0.5%: below the next whole percent, no request
        assert reporter.percent == 0
        reporter.update(150)
        reporter.update(100)  # a restarted count never moves the bar back
        shown.append(_progress(key))
        reporter.update(260)  # past an estimated total: held below 100 until finish
        shown.append(_progress(key))
        reporter.finish()
        return [*shown, _progress(key)]

    assert report_steps() == [0.0, 75.0, 99.0, 100.0]


def test_a_retry_resumes_from_the_last_checkpoint_and_artifacts_are_published(
    prefect_api, tiny_dataset, tmp_path, monkeypatch
):
    config = tiny_run_config(
        tiny_dataset, tmp_path / "run", max_steps=10, log_every=2, checkpoint_every=4
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "plan.json").write_text(json.dumps(two_rank_plan().to_dict()))
    attempts = []
    real_train = launch.train

    def preempted_at_step_6_once(config, progress=None):
        attempts.append(config.run_dir)
        if len(attempts) > 1:
            return real_train(config, progress=progress)

        def crash(record):
            progress(record)
            if record["step"] == 6:
                raise OSError("simulated: the host was preempted")

        return real_train(config, progress=crash)

    monkeypatch.setattr(launch, "train", preempted_at_step_6_once)
    fast_retry = train_module.train_task.with_options(retry_delay_seconds=0)
    monkeypatch.setattr(train_module, "train_task", fast_retry)

    state = train_flow(config, return_state=True)
    result = state.result()
    assert len(attempts) == 2 and result["attempts"] == 2 and result["steps"] == 10
    assert result["resumed_from_step"] == 4  # the checkpoint before the crash
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == config.model_dump()

    records = run_records(state.state_details.flow_run_id)
    (task_run,) = records.tasks("train")
    assert task_run.state_name == "Completed" and task_run.run_count == 2
    assert float(records.artifact(PROGRESS_KEY).data) == 100.0
    metrics = json.loads(records.artifact(TRAIN_METRICS_KEY).data)
    assert {"metric": "steps", "value": 10} in metrics
    assert {"metric": "attempts", "value": 2} in metrics
    png = (tmp_path / "run" / "training_curve.png").read_bytes()
    assert base64.b64encode(png).decode() in records.artifact(CURVE_KEY).data
    plan = json.loads(records.artifact(PLAN_KEY).data)
    assert [(row["table"], row["sharding"], row["ranks"]) for row in plan] == [
        ("C1", "table_wise", "1"),
        ("C2", "row_wise", "0, 1"),
    ]


def test_bad_data_fails_without_retrying(prefect_api, tmp_path):
    data = tmp_path / "data"
    manifest = generate_dataset(DataConfig(url=str(data), **SMALL))
    (data / manifest.files[0].path).write_bytes(b"not parquet")
    # A plain mapping (as a deployment run's parameters arrive) is validated into RunConfig.
    config = tiny_run_config(str(data), tmp_path / "run").model_dump(mode="json")
    state = train_flow(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"day 0: .*/day=0/part-\w+\.parquet"):
        state.result()
    (task_run,) = run_records(state.state_details.flow_run_id).tasks("train")
    assert task_run.state_name == "Failed" and task_run.run_count == 1


def test_a_bad_configuration_is_refused_naming_the_key(prefect_api, tmp_path):
    with pytest.raises(ParameterTypeError, match="train.batch_size"):
        train_flow({"run_dir": str(tmp_path), "train": {"batch_size": 0}})
    assert not (tmp_path / "config.json").exists()  # refused before the flow body ran

"""Deployments of the flows: names, entrypoints, default parameters and the schedule."""

from __future__ import annotations

import datetime

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from dlrmflow.cli import main
from dlrmflow.config import RunConfig, build_config
from dlrmflow.flows.deployments import build_deployments, serve_flows


def test_one_deployment_per_flow_with_the_config_as_default():
    config = build_config({"run_dir": "runs/nightly", "train": {"batch_size": 256}})
    deployments = build_deployments(config)
    assert [(d.flow_name, d.name) for d in deployments] == [
        ("ingest", "dlrmflow"),
        ("train", "dlrmflow"),
        ("evaluate", "dlrmflow"),
        ("end_to_end", "dlrmflow"),
        ("recurring", "dlrmflow"),
        ("score", "dlrmflow"),
    ]
    # Module paths: a run finds the flow wherever the package is installed.
    assert deployments[1].entrypoint == "dlrmflow.flows.train.train_flow"
    assert deployments[5].entrypoint == "dlrmflow.flows.score.score_flow"
    for deployment in deployments[:5]:
        assert build_config(deployment.parameters["config"]) == config
    assert all(deployment.schedules == [] for deployment in deployments)
    assert deployments[4].parameters["line"] == "line"  # the recurring flow's model line
    assert build_deployments(config, line="lines/ctr")[4].parameters["line"] == "lines/ctr"
    # Scoring defaults to the configuration's run and dataset; each run names its output.
    assert deployments[5].parameters == {"model": "runs/nightly", "data": config.data.url}


def test_the_schedule_goes_on_the_chosen_flow_only():
    cron = build_deployments(RunConfig(), cron="0 3 * * *")
    assert [len(d.schedules) for d in cron] == [0, 0, 0, 1, 0, 0]
    assert cron[3].schedules[0].schedule.cron == "0 3 * * *"

    interval = build_deployments(RunConfig(), interval=90, scheduled="ingest")
    assert [len(d.schedules) for d in interval] == [1, 0, 0, 0, 0, 0]
    daily = build_deployments(RunConfig(), cron="0 3 * * *", scheduled="recurring")
    assert [len(d.schedules) for d in daily] == [0, 0, 0, 0, 1, 0]
    assert interval[0].schedules[0].schedule.interval == datetime.timedelta(seconds=90)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cron": "0 3 * * *", "interval": 60}, "not both"),
        ({"interval": 0}, "interval must be > 0"),
        ({"interval": 60, "scheduled": "report"}, "no flow 'report'"),
        ({"cron": "0 3 * * *", "scheduled": "score"}, "'score' to schedule .*on demand only"),
    ],
)
def test_bad_schedules_are_refused_before_serving(options, message):
    with pytest.raises(ValueError, match=message):
        serve_flows(RunConfig(), **options)


def test_scheduling_the_score_flow_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["dlrmflow", "serve", "--flow", "score", "--cron", "0 3 * * *"])
    with (
        temporary_settings(restore_defaults={PREFECT_API_URL}),
        pytest.raises(SystemExit) as exited,
    ):
        main()
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no flow 'score' to schedule (it runs on demand only)")
    assert err.count("\n") == 1, err

"""Deployments of the flows, served from this process, with an optional schedule.

``serve_flows`` registers one deployment per flow (``ingest/dlrmflow``, ``train/dlrmflow``,
``evaluate/dlrmflow``, ``end_to_end/dlrmflow``, ``recurring/dlrmflow``) with the Prefect API
and runs each flow run it is handed in a subprocess: scheduled runs, and runs started from
the UI or with ``prefect deployment run 'end_to_end/dlrmflow'``. With no ``PREFECT_API_URL``
that API is the local ephemeral one and lives as long as this process; pointed at a Prefect
server, the deployments, runs and artifacts stay there.

Deployments name their flows by module path (``dlrmflow.flows.train.train_flow``), not by
file, so a run finds its code wherever the package is installed. ``build_deployments`` is
shared with ``dlrmflow.flows.deploy``, which registers the same deployments to a work pool.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow, serve
from prefect.deployments.runner import EntrypointType, RunnerDeployment

from dlrmflow.config import RunConfig
from dlrmflow.flows.api import require_api
from dlrmflow.flows.end_to_end import end_to_end
from dlrmflow.flows.evaluate import evaluate_flow
from dlrmflow.flows.ingest import ingest_flow
from dlrmflow.flows.recurring import DEFAULT_LINE, recurring_flow
from dlrmflow.flows.train import train_flow

DEPLOYMENT_NAME = "dlrmflow"
FLOWS: dict[str, Flow[..., Any]] = {
    "ingest": ingest_flow,
    "train": train_flow,
    "evaluate": evaluate_flow,
    "end_to_end": end_to_end,
    "recurring": recurring_flow,
}


def build_deployments(
    config: RunConfig,
    *,
    cron: str | None = None,
    interval: float | None = None,
    scheduled: str = "end_to_end",
    name: str = DEPLOYMENT_NAME,
    job_variables: dict[str, Any] | None = None,
    line: str = DEFAULT_LINE,
) -> list[RunnerDeployment]:
    """One deployment per flow, each defaulting to ``config`` (and the recurring flow to
    the model line ``line``); the flow named ``scheduled`` runs on the ``cron`` schedule or
    every ``interval`` seconds (neither: on demand only). ``job_variables`` (work-pool
    deployments only) override the pool's job template."""
    if cron is not None and interval is not None:
        raise ValueError("give a cron schedule or an interval, not both")
    if interval is not None and interval <= 0:
        raise ValueError(f"interval must be > 0 seconds (got {interval})")
    if scheduled not in FLOWS:
        raise ValueError(f"no flow {scheduled!r} to schedule; one of {sorted(FLOWS)}")
    parameters = {"config": config.model_dump(mode="json")}
    deployments = []
    for flow_name, flow in FLOWS.items():
        flow_parameters = {**parameters, "line": line} if flow is recurring_flow else parameters
        schedule: dict[str, Any] = (
            {"cron": cron, "interval": interval} if flow_name == scheduled else {}
        )
        deployments.append(
            flow.to_deployment(
                name,
                parameters=flow_parameters,
                entrypoint_type=EntrypointType.MODULE_PATH,
                tags=["dlrmflow"],
                job_variables=job_variables,
                **schedule,
            )
        )
    return deployments


def serve_flows(
    config: RunConfig | None = None,
    *,
    cron: str | None = None,
    interval: float | None = None,
    scheduled: str = "end_to_end",
    limit: int | None = 1,
    name: str = DEPLOYMENT_NAME,
    line: str = DEFAULT_LINE,
) -> None:
    """Serve the flows as deployments until interrupted (Ctrl-C or SIGTERM).

    ``config`` (default: the defaults) is every deployment's default parameter; a run can
    override it. ``limit`` caps the flow runs executing at once: one by default, because
    runs on one machine share its cores and often its run directory. On shutdown the
    schedule is paused, so no runs pile up while nothing serves them.
    """
    require_api()
    deployments = build_deployments(
        config if config is not None else RunConfig(),
        cron=cron,
        interval=interval,
        scheduled=scheduled,
        name=name,
        line=line,
    )
    serve(*deployments, limit=limit)

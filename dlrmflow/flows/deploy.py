"""Deployments of the flows to a process work pool, run by ``prefect worker start`` processes.

``deploy_flows`` registers the deployments that ``dlrmflow serve`` serves
(``dlrmflow.flows.deployments``: ``ingest/dlrmflow``, ``train/dlrmflow``,
``evaluate/dlrmflow``, ``end_to_end/dlrmflow``, ``recurring/dlrmflow``, ``score/dlrmflow``,
the same parameters and schedule) with the Prefect server at ``PREFECT_API_URL``, in a
process work pool it creates when missing, and returns. A worker on any host (``prefect
worker start --pool NAME``) then runs each flow run in a subprocess of its own.

The deployments carry no code and no pull steps: their entrypoints are module paths
(``dlrmflow.flows.end_to_end.end_to_end``), which the run imports from the Python
environment the worker runs in. A host runs dlrmflow's flows when dlrmflow is installed
there, whatever its directory layout, and runs the version installed there. (``from_source``
of a local directory would record this machine's path, which other hosts lack.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import RunnerDeployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import get_current_settings

from dlrmflow.config import RunConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.flows.api import PrefectServerError
from dlrmflow.flows.deployments import DEPLOYMENT_NAME, build_deployments
from dlrmflow.flows.recurring import DEFAULT_LINE

POOL_TYPE = "process"


class WorkPoolError(DlrmflowError):
    """The work pool exists but is not one a process worker can serve."""


def api_url() -> str:
    """The configured ``PREFECT_API_URL``; refuses the local ephemeral API, which would
    hold the deployments only until this process exits."""
    url = get_current_settings().api.url
    if not url:
        raise PrefectServerError(
            "no Prefect server configured: start one (prefect server start) and set "
            "PREFECT_API_URL, e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    return url


async def _ensure_pool(client: Any, pool: str) -> bool:
    """Create the process work pool ``pool`` unless it exists; True when created."""
    try:
        existing = await client.read_work_pool(pool)
    except ObjectNotFound:
        from prefect.workers.process import ProcessWorker

        await client.create_work_pool(
            WorkPoolCreate(
                name=pool,
                type=POOL_TYPE,
                base_job_template=ProcessWorker.get_default_base_job_template(),
            )
        )
        return True
    if existing.type != POOL_TYPE:
        raise WorkPoolError(
            f"work pool {pool!r} is of type {existing.type!r}; dlrmflow deploys to a "
            f"{POOL_TYPE!r} pool: choose another --pool name"
        )
    return False


async def _deploy(deployments: list[RunnerDeployment], pool: str, url: str) -> dict[str, Any]:
    async with get_client() as client:
        failure = await client.api_healthcheck()
        if failure is not None:
            reason = str(failure).splitlines()[0] if str(failure) else type(failure).__name__
            raise PrefectServerError(f"Prefect server at {url} does not answer: {reason}")
        created = await _ensure_pool(client, pool)
    ids = {f"{d.flow_name}/{d.name}": str(await d.aapply(work_pool_name=pool)) for d in deployments}
    return {"api_url": url, "work_pool": pool, "work_pool_created": created, "deployments": ids}


def deploy_flows(
    pool: str,
    config: RunConfig | None = None,
    *,
    cron: str | None = None,
    interval: float | None = None,
    scheduled: str = "end_to_end",
    working_dir: str | None = None,
    name: str = DEPLOYMENT_NAME,
    line: str = DEFAULT_LINE,
) -> dict[str, Any]:
    """Register the flows' deployments to the process work pool ``pool`` (created
    when missing) on the server at ``PREFECT_API_URL``; returns the pool and the
    deployments' ids by ``flow/deployment`` name.

    ``config`` (default: the defaults) gives every deployment its default parameters (see
    ``build_deployments``), ``line`` the recurring flow's model line; the flow
    ``scheduled`` runs on ``cron`` or every ``interval`` seconds. A worker starts each run
    in ``working_dir``, where a relative ``run_dir``, ``data.url`` or line resolves: by
    default the directory this is called from, as ``dlrmflow serve`` runs its flows in
    its own. It must exist on the workers' hosts (a shared file system, or the same
    layout); Prefect's own default, a temporary directory per run, would delete a
    relative run directory.
    """
    url = api_url()
    folder = Path(working_dir if working_dir is not None else ".").absolute()
    deployments = build_deployments(
        config if config is not None else RunConfig(),
        cron=cron,
        interval=interval,
        scheduled=scheduled,
        name=name,
        job_variables={"working_dir": str(folder)},
        line=line,
    )
    return asyncio.run(_deploy(deployments, pool, url))

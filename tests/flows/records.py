"""What a flow run left on the Prefect server, read back through the client."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
)
from prefect.client.schemas.objects import Artifact, FlowRun, TaskRun


@dataclass
class RunRecords:
    """A flow run, its subflow runs (any depth), and the task runs and artifacts of all."""

    flow_run: FlowRun
    subflows: list[FlowRun]
    task_runs: list[TaskRun]
    artifacts: list[Artifact]

    def tasks(self, name: str) -> list[TaskRun]:
        """Runs of the task called ``name``; a subflow's stand-in task run (named after the
        subflow, so ``train`` would match the train flow too) is left out."""
        stand_ins = {s.parent_task_run_id for s in self.subflows}
        return [
            t for t in self.task_runs if t.name.rsplit("-", 1)[0] == name and t.id not in stand_ins
        ]

    def artifact(self, key: str) -> Artifact:
        found = [a for a in self.artifacts if a.key == key]
        assert len(found) == 1, f"expected one artifact {key!r}, got {len(found)}"
        return found[0]


async def _read(flow_run_id: UUID) -> RunRecords:
    async with get_client() as client:
        root = await client.read_flow_run(flow_run_id)
        subflows: list[FlowRun] = []
        parents = [flow_run_id]
        while parents:
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)
                )
            )
            subflows += children
            parents = [c.id for c in children]
        ids = [flow_run_id, *(s.id for s in subflows)]
        task_runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids))
        )
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids))
        )
    return RunRecords(root, subflows, task_runs, artifacts)


def run_records(flow_run_id: UUID) -> RunRecords:
    return asyncio.run(_read(flow_run_id))


def call_client(method: str, *args: Any, **kwargs: Any) -> Any:
    """One call of a ``PrefectClient`` method, from synchronous test code."""

    async def call() -> Any:
        async with get_client() as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(call())

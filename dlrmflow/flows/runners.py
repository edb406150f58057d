"""The task runner a flow's tasks run on, chosen by ``orchestration`` in the configuration.

``threads`` (the default) runs tasks on Prefect's thread pool in the flow's process. ``dask``
runs them on a Dask cluster through ``prefect-dask``: a local cluster of
``orchestration.dask_workers`` worker processes with one thread each, started and stopped
with the flow, or the existing scheduler at ``orchestration.dask_address``.

A task run on a Dask worker reports to the Prefect API the flow's process uses (the
settings travel with each task). With no ``PREFECT_API_URL`` that API is the flow process's
own ephemeral server, which other processes do not know of, so each worker would start one
of its own (seconds each, against the same database); ``worker_api`` points the workers at
the flow process's ephemeral server instead. Workers on other hosts need a Prefect server
they can all reach (``PREFECT_API_URL``), and shared storage for the dataset and for cached
task results (``orchestration.result_storage``, by default beside the dataset: see
``dlrmflow.flows.storage``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from dlrmflow.config import ConfigError, OrchestrationConfig


def task_runner(orchestration: OrchestrationConfig) -> TaskRunner:
    """A new task runner for ``orchestration`` (started by the flow that uses it)."""
    if orchestration.task_runner == "threads":
        return ThreadPoolTaskRunner()
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as e:
        raise ConfigError(
            "orchestration.task_runner=dask needs prefect-dask: pip install 'dlrmflow[dask]'"
        ) from e
    if orchestration.dask_address:
        return DaskTaskRunner(address=orchestration.dask_address)
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": orchestration.dask_workers,
            "threads_per_worker": 1,
            "processes": True,
            "host": "127.0.0.1",
            "dashboard_address": None,
        }
    )


@contextmanager
def worker_api(orchestration: OrchestrationConfig) -> Iterator[None]:
    """Within this context, task runs on Dask workers report to the Prefect API this process
    uses: with no ``PREFECT_API_URL``, this process's ephemeral server (started now if it
    is not running; it stops when the process exits). Nothing changes for threads."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if orchestration.task_runner != "dask" or PREFECT_API_URL.value():
        yield
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the one this process's clients use
    server.start()
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        yield

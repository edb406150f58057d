"""Deployments of the flows, served from this process, with an optional schedule.

``serve_flows`` registers one deployment per flow (``ingest/dlrmflow``, ``train/dlrmflow``,
``evaluate/dlrmflow``, ``end_to_end/dlrmflow``, ``recurring/dlrmflow``, ``score/dlrmflow``)
with the Prefect API and runs each flow run it is handed in a subprocess: scheduled runs,
and runs started from the UI or with ``prefect deployment run 'end_to_end/dlrmflow'``.
With no ``PREFECT_API_URL`` that API is the local ephemeral one and lives as long as this
process; pointed at a Prefect server, the deployments, runs and artifacts stay there.

The score deployment scores the configuration's run on its dataset unless a run says
otherwise, into the folder each run names (``--param out=scores/``); with no folder of
its own to default to, it runs on demand only, never on the schedule.

Deployments name their flows by module path (``dlrmflow.flows.train.train_flow``), not by
file, so a run finds its code wherever the package is installed. ``build_deployments`` is
shared with ``dlrmflow.flows.deploy``, which registers the same deployments to a work pool.

A stopping signal (SIGTERM, SIGINT, SIGHUP) stops the runner first: its in-flight runs are
cancelled and their processes ended, the schedule is paused. Then the signal does what it
does to the rest of the process: under ``dlrmflow serve``, one line and the shell's exit
code (143 for SIGTERM), as for every command. Left to Prefect, SIGTERM met the handler
its runner installs in place of the command's, and ``serve`` ended as if nothing had
stopped it (``_Runner``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from prefect import Flow
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.runner import Runner

from dlrmflow.config import RunConfig
from dlrmflow.flows.api import require_api
from dlrmflow.flows.end_to_end import end_to_end
from dlrmflow.flows.evaluate import evaluate_flow
from dlrmflow.flows.ingest import ingest_flow
from dlrmflow.flows.recurring import DEFAULT_LINE, recurring_flow
from dlrmflow.flows.score import score_flow
from dlrmflow.flows.train import train_flow
from dlrmflow.runtime.prefect_serve import display_serve_start_message
from dlrmflow.supervise import STOP_SIGNALS

DEPLOYMENT_NAME = "dlrmflow"
FLOWS: dict[str, Flow[..., Any]] = {
    "ingest": ingest_flow,
    "train": train_flow,
    "evaluate": evaluate_flow,
    "end_to_end": end_to_end,
    "recurring": recurring_flow,
    "score": score_flow,
}
# The flows a schedule may run: each from its deployment's parameters alone.
SCHEDULABLE = ("ingest", "train", "evaluate", "end_to_end", "recurring")
# How long the runner may take to stop after a stopping signal before the signal has its
# usual effect regardless: longer than Prefect's grace for a cancelled run's process to
# exit before it is killed, so that runs are stopped by the runner, not swept.
STOP_S = 60.0

_Handler = Callable[[int, FrameType | None], Any] | int | None


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
    """One deployment per flow, each defaulting to ``config`` (the recurring flow also to
    the model line ``line``; the score flow to ``config``'s run and dataset, its output
    folder left to each run); the flow named ``scheduled`` (one of ``SCHEDULABLE``) runs on
    the ``cron`` schedule or every ``interval`` seconds (neither: on demand only).
    ``job_variables`` (work-pool deployments only) override the pool's job template."""
    if cron is not None and interval is not None:
        raise ValueError("give a cron schedule or an interval, not both")
    if interval is not None and interval <= 0:
        raise ValueError(f"interval must be > 0 seconds (got {interval})")
    if scheduled not in SCHEDULABLE:
        on_demand = " (it runs on demand only)" if scheduled in FLOWS else ""
        raise ValueError(
            f"no flow {scheduled!r} to schedule{on_demand}; one of {sorted(SCHEDULABLE)}"
        )
    parameters: dict[str, Any] = {"config": config.model_dump(mode="json")}
    deployments = []
    for flow_name, flow in FLOWS.items():
        if flow is score_flow:
            flow_parameters = {"model": config.run_dir, "data": config.data.url}
        elif flow is recurring_flow:
            flow_parameters = {**parameters, "line": line}
        else:
            flow_parameters = parameters
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
    """Serve the flows as deployments until stopped by a signal (Ctrl-C, SIGTERM, SIGHUP),
    which cancels the runs in flight before it ends the process as it would have.

    ``config`` (default: the defaults) gives every deployment its default parameters (see
    ``build_deployments``); a run can override them. ``limit`` caps the flow runs
    executing at once: one by default, because runs on one machine share its cores and
    often its run directory. On shutdown the schedule is paused, so no runs pile up while
    nothing serves them.
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
    runner = _Runner(pause_on_shutdown=True, limit=limit)
    for deployment in deployments:
        runner.add_deployment(deployment)
    with runner.stopped_by_signals():
        display_serve_start_message(deployments)
        asyncio.run(runner.start())


class _Runner(Runner):
    """Prefect's runner, stopped in order by SIGTERM, SIGINT and SIGHUP.

    ``Runner.start`` installs ``handle_sigterm`` for SIGTERM, in place of whatever handled
    it; Prefect's exits 0 before the runner has started and, once it has, stops the runner
    and lets ``start`` return, so that a stopped ``serve`` looks like one that ended by
    itself. This one, installed for every stopping signal for as long as the runner
    serves (``stopped_by_signals``), stops the runner, and once it has stopped calls the
    handler the signal had before (``dlrmflow``'s: one line, exit 128 + the signal). A
    signal that comes while there is nothing to stop in order (the runner not started, or
    already stopping: a second signal), or ``STOP_S`` after the first, goes straight to
    that handler. A signal the process ignored stays ignored.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stopped_by: int | None = None
        self._previous: dict[int, _Handler] = {}
        self._deadline: threading.Timer | None = None

    @contextlib.contextmanager
    def stopped_by_signals(self) -> Iterator[None]:
        """For the block (that runs the runner), stopping signals stop it; at the block's end,
        the signal that did is handed on to its previous handler, so that the caller ends as
        it would have at that signal. In the main thread only, as Prefect's handler."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig, previous in self._previous.items():
            if previous is not signal.SIG_IGN:
                signal.signal(sig, self.handle_sigterm)
        try:
            yield
        finally:
            if self._deadline is not None:
                self._deadline.cancel()
            if self.stopped_by is not None:
                self._hand_over(self.stopped_by, None)
            self._restore()

    def handle_sigterm(self, signum: int, frame: FrameType | None = None) -> None:
        """The handler of every stopping signal (see the class)."""
        if self._previous.get(signum) is signal.SIG_IGN:
            return  # ignored before Prefect's start replaced the handler (nohup)
        if self.stopped_by is None and self.started and not self.stopping:
            self.stopped_by = signum
            self.stopping = True  # a second signal is handed on
            self.execute_in_background(self.astop)
            self._deadline = threading.Timer(STOP_S, os.kill, (os.getpid(), signum))
            self._deadline.daemon = True
            self._deadline.start()
            return
        self._hand_over(signum, frame)

    def _hand_over(self, signum: int, frame: FrameType | None) -> None:
        """Restore the previous handlers and let the one of ``signum`` handle it."""
        self._restore()
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signum)

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            if previous is not None:
                signal.signal(sig, previous)

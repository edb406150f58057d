"""Retry policy shared by the flows' tasks."""

from __future__ import annotations

from typing import Any

from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from dlrmflow.supervise import JobStopped
from dlrmflow.train.line.line import LineError
from dlrmflow.train.run.evaluate import NonFinitePredictions
from dlrmflow.train.run.rundir import RunDirBusy
from dlrmflow.train.run.trainer import IncompatibleCheckpoint, NonFiniteLoss

# Failures that a retry would only repeat.
NOT_TRANSIENT = (
    ValueError,
    FileNotFoundError,
    RunDirBusy,
    IncompatibleCheckpoint,
    NonFiniteLoss,
    NonFinitePredictions,
    LineError,  # another configuration, a layout the line did not write
    JobStopped,  # the user (or a scheduler's timeout) asked the command to stop
)


def retry_unless_bad_input(task: Any, task_run: TaskRun, state: State) -> bool:
    """Retry what may be transient (storage, network, a crashed worker), never bad data or
    configuration, which would only fail again after the retry delay.

    The stages raise ValueError for bad data or settings (the message names the file, row
    group and column, or the config key) and FileNotFoundError for a missing input; a run
    directory in use, a checkpoint of another run and a diverged model fail the same way
    on every try; a job stopped by a signal was asked to stop, not to be run again.
    """
    return not isinstance(state.data, NOT_TRANSIENT)

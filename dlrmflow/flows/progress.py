"""A Prefect progress artifact that follows long work, such as the steps of a training run.

A run that trains for hours should show how far it got in the Prefect UI without anyone
reading logs. ``ProgressReporter`` creates one progress artifact and moves it as work is
reported, calling the API only when the whole percentage changes, so a fast loop costs at
most a hundred small requests however often it reports.
"""

from __future__ import annotations

import logging

from prefect.artifacts import create_progress_artifact, update_progress_artifact

# The API is what failed, so the warning goes to the process's own log, not to the API.
logger = logging.getLogger(__name__)


class ProgressReporter:
    """Report ``done`` out of ``total`` units to a progress artifact under ``key``.

    ``total`` may be an estimate (the planned steps of a run whose last batches are
    partial): the artifact never shows more than 99% until ``finish``. Progress only moves
    forward: a retried attempt that resumes (or restarts) from an earlier step moves the
    bar again once it passes where the failed attempt stopped.
    """

    def __init__(self, total: int, *, key: str, description: str) -> None:
        if total < 1:
            raise ValueError(f"progress total must be >= 1 (got {total})")
        self.total = total
        self.percent = 0
        self._failed = False
        self._artifact_id = create_progress_artifact(0.0, key=key, description=description)

    def update(self, done: int) -> None:
        """Record that ``done`` units are complete."""
        percent = min(99, 100 * done // self.total)
        if percent > self.percent:
            self._send(percent)

    def finish(self) -> None:
        """Mark the work complete (100%)."""
        self._send(100)

    def _send(self, percent: int) -> None:
        self.percent = percent
        if self._failed:
            return
        try:
            update_progress_artifact(self._artifact_id, float(percent))
        except Exception as e:  # a progress bar must never fail the work it shows
            self._failed = True
            logger.warning("progress artifact update failed, no more updates: %s", e)

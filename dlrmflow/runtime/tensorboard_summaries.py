"""Summaries written into a TensorBoard run's own event file, through ``SummaryWriter``'s
private file writer.

A run logged with ``train.tracker: tensorboard`` records its configuration as TensorBoard
hyperparameters (``torch.utils.tensorboard.summary.hparams``), so that the HParams tab
lists each run with its settings beside its own metrics. ``SummaryWriter`` writes such
summaries only through ``add_hparams``, which starts a separate run in a new subfolder
with copies of the metrics given to it, not the run's own. What it reaches into, written
against torch 2.13.0 (and tensorboard 2.21.0): ``SummaryWriter._get_file_writer()``, the
``FileWriter`` every ``add_*`` method writes through, and its public ``add_summary``.
Nothing is gained in speed; the configuration joins the run's own scalars.

Fallback, where the writer has no ``_get_file_writer``: nothing is written and
``add_summaries`` returns False (the HParams tab then lacks the run; the caller still logs
the configuration as text). ``tests/runtime/test_tensorboard_summaries.py`` reads the
summaries back from the event file and runs the fallback.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def add_summaries(writer: Any, summaries: Iterable[Any]) -> bool:
    """Append ``summaries`` (``Summary`` protobufs) to the event file of ``writer`` (a
    ``SummaryWriter``); False when it could not be reached and nothing was written."""
    file_writer = getattr(writer, "_get_file_writer", None)
    if not callable(file_writer):
        return False
    for summary in summaries:
        file_writer().add_summary(summary)
    return True

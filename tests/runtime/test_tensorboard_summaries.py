"""Summaries in a TensorBoard run's own event file (``runtime.tensorboard_summaries``):
written through ``SummaryWriter``'s private file writer where it is as written against,
nothing written where it has moved."""

from __future__ import annotations

import types
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from dlrmflow.runtime.tensorboard_summaries import add_summaries


def _hparams_tags(logdir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return sorted(events.PluginTagToContent("hparams"))


def test_the_hyperparameters_land_in_the_runs_own_event_file(tmp_path: Path):
    # Fails when the installed torch's SummaryWriter no longer has its file writer.
    writer = SummaryWriter(str(tmp_path))
    assert add_summaries(writer, hparams({"lr": "0.1", "batch": "64"}, {"auc": None}))
    writer.close()
    assert [p.parent for p in tmp_path.rglob("events.out.tfevents.*")] == [tmp_path]
    assert _hparams_tags(tmp_path) == [
        "_hparams_/experiment",
        "_hparams_/session_end_info",
        "_hparams_/session_start_info",
    ]


def test_where_the_file_writer_has_moved_nothing_is_written():
    taken = []

    def summaries():
        taken.append(True)
        yield from ()

    assert add_summaries(types.SimpleNamespace(), summaries()) is False
    assert not taken

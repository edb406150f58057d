"""A run's progress as a checkpoint's manifest stores it: the keys, their order and their
values of every checkpoint written before, so that all of them still resume."""

from __future__ import annotations

import json

from dlrmflow.train.run.progress import MetricsWindow, RunProgress


def test_progress_round_trips_the_manifest_format() -> None:
    stored = {
        "step": 12,
        "epoch": 1,
        "rows": 6144,
        "seconds": 3.25,
        "loss": 0.5,
        "pass_start": 10,
        "pass_steps": 24,
        "window": {"loss": 1.5, "steps": 3, "rows": 1536, "seconds": 0.75},
    }
    progress = RunProgress.from_dict(json.loads(json.dumps(stored)))
    assert (progress.pass_start, progress.pass_steps) == (10, 24)
    assert progress.window == MetricsWindow(1.5, 3, 1536)
    assert progress.window_seconds == 0.75
    written = progress.to_dict(window_seconds=0.75)
    assert json.dumps(written) == json.dumps(stored)  # the same keys, order and values


def test_a_fresh_run_and_a_fine_tuned_one_write_an_empty_window() -> None:
    fresh = RunProgress().to_dict(window_seconds=0.0)
    assert fresh == {
        "step": 0,
        "epoch": 0,
        "rows": 0,
        "seconds": 0.0,
        "loss": None,
        "pass_start": 0,
        "pass_steps": None,
        "window": {"loss": 0.0, "steps": 0, "rows": 0, "seconds": 0.0},
    }
    stored = {"step": 4, "epoch": 0, "rows": 2048, "seconds": 1.0, "loss": 0.6}
    stored["window"] = {"loss": 1.2, "steps": 2, "rows": 1024, "seconds": 0.5}
    tuned = RunProgress.from_dict(stored, with_window=False)  # another run's checkpoint
    assert tuned.step == 4 and tuned.window == MetricsWindow() and tuned.window_seconds == 0.0


def test_an_older_manifest_without_a_window_keeps_its_other_keys() -> None:
    """Checkpoints from before the window was stored (and with keys no longer read) resume
    with no window open and write those keys back where they stood. Without the step its
    pass began after (before schedules), it stands at a pass's start, as a model line's
    versions do; the next pass begins after the step that ends this one."""
    stored = {"step": 8, "epoch": 0, "rows": 4096, "dropped_rows": 0, "seconds": 2.0}
    stored["loss"] = 0.7
    progress = RunProgress.from_dict(stored)
    assert progress.window.steps == 0 and progress.window_seconds == 0.0
    assert (progress.pass_start, progress.pass_steps) == (8, None)
    progress.pass_steps = 2  # as the schedule fixes it at the pass's first step
    progress.finish_step(512, 0.4, epoch_ended=False)
    assert (progress.pass_start, progress.pass_steps) == (8, 2)
    progress.finish_step(512, 0.4, epoch_ended=True)
    assert (progress.step, progress.epoch, progress.rows, progress.pass_start) == (10, 1, 5120, 10)
    assert progress.pass_steps is None  # the next pass's steps are counted as it begins
    assert list(progress.to_dict(window_seconds=0.1)) == [
        "step",
        "epoch",
        "rows",
        "seconds",
        "loss",
        "pass_start",
        "pass_steps",
        "dropped_rows",
        "window",
    ]

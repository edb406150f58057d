"""Where a training run stands, and what it reports: its progress, the metrics window in
progress, and the result of an invocation.

A checkpoint's manifest stores ``RunProgress.to_dict()`` under ``progress`` and a resumed
run continues from ``RunProgress.from_dict``: the keys and values stay those checkpoints
have always held, so every checkpoint written before resumes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "train_result.json"


@dataclass
class MetricsWindow:
    """The steps since the last metrics record: the global batch's loss summed over them
    (the same on every rank), their count and their rows (this rank's).

    A checkpoint stores the window open at its step, so that the first record after a
    resume covers the steps the uninterrupted run's does, with the same sum.
    """

    loss: float = 0.0
    steps: int = 0
    rows: int = 0

    def add(self, loss: float, rows: int) -> None:
        self.loss += loss
        self.steps += 1
        self.rows += rows

    def mean_loss(self) -> float:
        return self.loss / self.steps

    def clear(self) -> None:
        self.loss, self.steps, self.rows = 0.0, 0, 0

    def to_dict(self, seconds: float) -> dict[str, Any]:
        """As a manifest stores it, with the wall time the window has taken so far."""
        return {"loss": self.loss, "steps": self.steps, "rows": self.rows, "seconds": seconds}


@dataclass
class RunProgress:
    """Where the run stands after its last step; a checkpoint stores it, a resumed run
    continues it.

    ``epoch`` is the epoch the next step reads: a checkpoint taken on an epoch's last step
    records the next epoch, with its reader at that epoch's start. ``seconds`` is the
    training time up to the last checkpoint, ``loss`` the mean of the last logged window.
    """

    step: int = 0
    epoch: int = 0
    rows: int = 0
    seconds: float = 0.0
    loss: float | None = None
    # The step after which the pass (epoch, or day in day order) the next step reads began,
    # and the steps the learning-rate schedule spans in it, fixed as the pass began (None:
    # not begun): a resumed run continues the schedule of its pass exactly.
    pass_start: int = 0
    pass_steps: int | None = None
    window: MetricsWindow = field(default_factory=MetricsWindow)
    # The wall time of the open window before this invocation (a resumed run's).
    window_seconds: float = 0.0
    # Keys of an older manifest's progress that this one no longer reads: carried over
    # unchanged into the next checkpoint, as they always were.
    extra: dict[str, Any] = field(default_factory=dict)

    def finish_step(self, rows: int, loss: float, *, epoch_ended: bool) -> None:
        """Count a trained step of ``rows`` rows and global-batch ``loss``."""
        self.step += 1
        self.rows += rows
        if epoch_ended:
            self.epoch += 1
            self.restart_pass()
        self.window.add(loss, rows)

    def restart_pass(self) -> None:
        """The next step begins a pass (a new one, or the same epoch read again)."""
        self.pass_start = self.step
        self.pass_steps = None

    def to_dict(self, window_seconds: float) -> dict[str, Any]:
        """The manifest's ``progress``; ``window_seconds``: the open window's time so far."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "rows": self.rows,
            "seconds": self.seconds,
            "loss": self.loss,
            "pass_start": self.pass_start,
            "pass_steps": self.pass_steps,
            **self.extra,
            "window": self.window.to_dict(window_seconds),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, with_window: bool = True) -> RunProgress:
        """A manifest's ``progress``. ``with_window=False`` leaves the window empty: a run
        fine-tuned from another's checkpoint continues its counts, not its metrics. A
        manifest from before windows were stored has none open."""
        known = {"step", "epoch", "rows", "seconds", "loss", "pass_start", "pass_steps", "window"}
        progress = cls(
            **{k: data[k] for k in ("step", "epoch", "rows", "seconds", "loss") if k in data},
            extra={k: v for k, v in data.items() if k not in known},
        )
        # A manifest from before schedules has none: its runs had constant rates, and the
        # checkpoints that end a pass (a line's versions) stand at the next one's start.
        progress.pass_start = data.get("pass_start", progress.step)
        progress.pass_steps = data.get("pass_steps")
        window = data.get("window")
        if with_window and window:
            progress.window = MetricsWindow(window["loss"], window["steps"], window["rows"])
            progress.window_seconds = float(window.get("seconds", 0.0))
        return progress


@dataclass
class TrainResult:
    """What a training run did, for the summary and the flow's report."""

    steps: int
    rows: int
    seconds: float
    samples_per_s: float
    final_loss: float
    checkpoint: str
    world_size: int = 1
    data_wait_s: float = 0.0  # time the loop waited for the reader
    comm_bytes_per_step: dict[str, int] = field(default_factory=dict)
    resumed_from_step: int | None = None
    embedding_cache: dict[str, float] = field(default_factory=dict)  # on-disk tables only
    trained_steps: int = 0  # steps this invocation trained (0: the run had already finished)
    resumed_from: str | None = None  # the checkpoint it continued from
    # Fine-tuning (an explicit ``train.resume`` path): key -> [the checkpoint's, this run's].
    changed_on_resume: dict[str, list] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # e.g. training days without rows
    checkpoint_save_s: float = 0.0  # writing (and hashing) this invocation's checkpoints
    checkpoint_verify_s: float = 0.0  # verifying the checkpoint it resumed from
    device: str = "cpu"  # where rank 0 trained (cuda:0, cpu)
    precision: str = "fp32"  # the dense arch's (train.precision)
    kernels: dict[str, str] = field(default_factory=dict)  # what ran: {"tbe", "interaction"}
    kernels_reason: str = ""  # why: how model.kernels resolved, and any bag that could not
    # Each rank's peak resident set (VmHWM) over its whole process, in bytes, by rank.
    peak_rss_bytes: list[int] = field(default_factory=list)
    # Dynamic tables (``ids: dynamic``): each map's IDs admitted and evicted by this
    # invocation, and its rows in use at its end.
    id_maps: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainResult:
        """A result read back from ``train_result.json`` (unknown keys are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

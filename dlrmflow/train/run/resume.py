"""Where a training invocation starts from (``train.resume``), and what it refuses.

A run directory's checkpoint continues its run bitwise; another run's checkpoint is
fine-tuned from. Both are checked against this configuration first: continuing one run
under another's settings would silently mix two runs in one directory, and a
checkpoint's weights only fit the model it was taken of.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import RunConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.train.model.memory_budget import TIERED_DIR
from dlrmflow.train.run.checkpoint import (
    CHECKPOINTS_DIR,
    DATASET_KEY,
    TRAIN_DATA_KEY,
    CheckpointInfo,
    DataIdentity,
    differences,
    latest_checkpoint,
    read_checkpoint,
)
from dlrmflow.train.run.progress import METRICS_FILE, RESULT_FILE, TrainResult
from dlrmflow.train.run.rank import DistEnv


class IncompatibleCheckpoint(DlrmflowError):
    """A checkpoint that does not belong to (or cannot be continued by) this configuration."""


# What makes two configurations the same run: resuming one's checkpoint under the other
# with ``train.resume: auto`` would silently mix two runs in one directory.
RUN_KEYS = (
    "model",
    "features",
    "train.optimizer",
    "train.dense_optimizer",
    "train.lr",
    "train.embedding_lr",
    "train.lr_schedule",
    "train.batch_size",
    "train.seed",
    "train.shuffle",
    "train.shuffle_window",
    "train.num_workers",  # rows are dealt to a rank's reader streams by their number
    "train.precision",
    "train.order",
)
# Configuration keys under the sections above that choose how a step is computed, not what
# it computes: a run may continue under another (on a GPU after a CPU, with other kernels).
IMPLEMENTATION_KEYS = ("model.kernels",)
# The reader's position means nothing for other data or another batch size: a fine-tuning
# run that changes one of these reads the checkpoint's epoch from its start.
REREAD_KEYS = frozenset({DATASET_KEY, TRAIN_DATA_KEY, "train.batch_size"})
# What an explicit ``train.resume`` path (fine-tuning) may not change: the weights and the
# optimizer state would not fit.
SHAPE_KEYS = ("model", "features", "train.optimizer", "train.dense_optimizer")


@dataclass
class ResumePoint:
    """Where a training invocation starts from."""

    info: CheckpointInfo | None = None  # the checkpoint it loads (None: from scratch)
    own: bool = False  # one of this run directory's own checkpoints
    changed: dict[str, list] = field(default_factory=dict)  # what fine-tuning changes now
    origin: str | None = None  # the checkpoint the run directory's run was fine-tuned from
    verify_seconds: float = 0.0  # finding and verifying it

    def lineage(self, data: DataIdentity) -> dict:
        """What every checkpoint of this run records of where it came from and what it
        trains on."""
        changed = self.changed
        if not changed and self.own and self.info is not None:
            changed = self.info.manifest.get("changed_on_resume", {})
        return {"origin": self.origin, "changed_on_resume": changed, **data.record()}


def resume_point(
    config: RunConfig, run_dir: Path, spec: FeatureSpec, digest: DataIdentity
) -> ResumePoint:
    """The checkpoint to continue from (``train.resume``).

    "auto" continues the run directory's newest intact checkpoint, which must come from
    this same run (``RUN_KEYS``, the feature spec and the dataset); "never" starts afresh
    (the caller removed the directory's previous run); a checkpoint path fine-tunes from
    it: anything but ``SHAPE_KEYS`` may change, and what did is recorded. A fine-tuned
    run that already has checkpoints of its own continues from those: re-running the
    same command never trains twice.
    """
    if config.train.resume == "never":
        return ResumePoint()
    own = latest_checkpoint(run_dir)
    if config.train.resume == "auto":
        if own is None:
            return ResumePoint()
        _refuse_differences(own, config, spec, digest, RUN_KEYS, "resume: auto")
        return ResumePoint(own, True, {}, own.manifest.get("origin"))
    source = read_checkpoint(config.train.resume)
    if source.path.parent.resolve() == (run_dir / CHECKPOINTS_DIR).resolve():
        if own is not None and own.step > source.step:
            raise IncompatibleCheckpoint(
                f"{run_dir} holds newer checkpoints (step {own.step}) than {source.path}; "
                "to go back to it, fine-tune from it into another --run-dir"
            )
        _refuse_differences(source, config, spec, digest, SHAPE_KEYS, "fine-tuning")
        changed = differences(source.manifest, config, digest, RUN_KEYS, IMPLEMENTATION_KEYS)
        return ResumePoint(source, True, changed, source.manifest.get("origin"))
    origin = str(source.path.resolve())
    if own is not None:
        if own.manifest.get("origin") != origin:
            raise IncompatibleCheckpoint(
                f"{run_dir} already holds a run that was not fine-tuned from {source.path}; "
                "fine-tune into another --run-dir"
            )
        _refuse_differences(own, config, spec, digest, RUN_KEYS, "its continuation")
        return ResumePoint(own, True, {}, origin)
    _refuse_differences(source, config, spec, digest, SHAPE_KEYS, "fine-tuning")
    changed = differences(source.manifest, config, digest, RUN_KEYS, IMPLEMENTATION_KEYS)
    return ResumePoint(source, False, changed, origin)


def _refuse_differences(
    info: CheckpointInfo,
    config: RunConfig,
    spec: FeatureSpec,
    digest: DataIdentity,
    keys: tuple[str, ...],
    what: str,
) -> None:
    """``IncompatibleCheckpoint`` naming every key among ``keys`` (and the feature spec,
    which must match for the weights to load) in which ``info`` differs from this run."""
    changed: dict[str, object] = differences(
        info.manifest, config, digest, keys, IMPLEMENTATION_KEYS
    )
    if keys is SHAPE_KEYS:
        changed.pop(DATASET_KEY, None)
        changed.pop(TRAIN_DATA_KEY, None)
    recorded = info.manifest.get("spec")
    if recorded is not None and recorded != json.loads(json.dumps(spec.to_dict())):
        changed.setdefault(f"feature spec ({spec_changes(recorded, spec)})", None)
    if not changed:
        return
    shown = ", ".join(
        key if pair is None else f"{key} {pair[0]!r} -> {pair[1]!r}"
        for key, pair in sorted(changed.items())
    )
    hint = (
        "start it in another --run-dir, or fine-tune from it with --resume CHECKPOINT_DIR"
        if what == "resume: auto"
        else "the checkpoint's weights do not fit this model"
    )
    own_values = _as_it_began(changed)
    if what == "resume: auto" and own_values:
        # Most often a default changed since the run began, and its file leaves it to them.
        hint += f", or continue it as it began with {own_values}"
    raise IncompatibleCheckpoint(
        f"checkpoint {info.path} differs from this configuration ({what}): {shown}; {hint}"
    )


def spec_changes(recorded: dict, spec: FeatureSpec) -> str:
    """What differs between a checkpoint's recorded feature spec and ``spec``, by feature:
    the label, features gone or new, a table's size, a dense column's transform."""
    before = FeatureSpec.from_dict(recorded)
    changes = []
    if before.label != spec.label:
        changes.append(f"label {before.label} -> {spec.label}")
    for kind, old, new in (
        ("dense", list(before.dense), list(spec.dense)),
        ("sparse", before.sparse_names, spec.sparse_names),
    ):
        changes += [f"{kind} feature {name} gone" for name in old if name not in new]
        changes += [f"{kind} feature {name} new" for name in new if name not in old]
        if not any(name not in new for name in old) and old != new and set(old) == set(new):
            changes.append(f"{kind} features reordered")
    tables = {f.name: f for f in before.sparse}
    for f in spec.sparse:
        was = tables.get(f.name)
        if was is not None and was != f:
            changes.append(f"feature {f.name} {_field_changes(was, f)}")
    old_transforms = dict(zip(before.dense, before.dense_transforms or (), strict=False))
    new_transforms = dict(zip(spec.dense, spec.dense_transforms or (), strict=False))
    for name in spec.dense:
        if name in before.dense and old_transforms.get(name) != new_transforms.get(name):
            changes.append(f"feature {name} transform changed")
    return "; ".join(changes) or "the tables the dataset gives"


def _field_changes(was: SparseFeature, now: SparseFeature) -> str:
    """``field old -> new`` for each field of a sparse feature that differs (the table's
    size as ``table A -> B rows``, as resumes have always said it)."""
    parts = []
    for item in dataclasses.fields(now):
        old, new = getattr(was, item.name), getattr(now, item.name)
        if old == new:
            continue
        if item.name == "num_embeddings":
            parts.append(f"table {old} -> {new} rows")
        else:
            parts.append(f"{item.name} {_shown(old)} -> {_shown(new)}")
    return ", ".join(parts)


def _shown(value: object) -> str:
    if isinstance(value, BaseModel):
        return json.dumps(value.model_dump(mode="json", exclude_defaults=True))
    return "none" if value is None else str(value)


def _as_it_began(changed: dict[str, object]) -> str | None:
    """``--set KEY=VALUE`` of the checkpoint's value for each changed key, when every one
    is a configuration key (not the data or the feature spec)."""
    sets = []
    for key, pair in sorted(changed.items()):
        if pair is None or key.split(".")[0] not in RunConfig.model_fields:
            return None
        sets.append(f"--set {key}={json.dumps(pair[0]) if pair[0] is not None else 'null'}")
    return " ".join(sets) or None


def refuse_rank_change(
    resume: ResumePoint, world_size: int, epoch_rows: int, config: RunConfig
) -> None:
    """``IncompatibleCheckpoint`` naming ``distributed.nproc`` when the checkpoint stands
    inside an epoch and was taken at another world size, unless this run reads that epoch
    from its start anyway (fine-tuning on other data or batches, see ``TrainLoop``).

    Why refuse rather than reposition: a reader's position is its place in its own share
    of the epoch. The splits (file x row group) are dealt round-robin to the
    ``world_size x train.num_workers`` readers, and each reader has handed out the first
    rows of a window that it permutes across several row groups. At another world size the
    shares are dealt otherwise, and what is left of the epoch is a set of partial row
    groups that no split can express: continuing exactly would need every reader's
    trained rows recorded and readers of row subsets. Restarting the epoch instead would
    train its first part twice. A checkpoint at an epoch's start (the one an epoch's last
    step writes) holds no position, and continues at any world size.
    """
    info = resume.info
    if info is None or info.world_size == world_size:
        return
    if REREAD_KEYS & resume.changed.keys():
        return
    mid_epoch = info.manifest.get("mid_epoch")
    progress = info.manifest["progress"]
    if mid_epoch is None:  # a checkpoint from before manifests said: its rows tell
        mid_epoch = int(progress["rows"]) != int(progress["epoch"]) * epoch_rows
    if not mid_epoch:
        return
    recorded = info.manifest["config"].get("distributed", {})
    nproc = f"distributed.nproc={recorded.get('nproc', info.world_size)}"
    if recorded.get("nnodes", 1) != config.distributed.nnodes:
        nproc += f" and distributed.nnodes={recorded.get('nnodes', 1)}"
    remedy = (
        f"resume with {nproc}, or start afresh with --resume never"
        if resume.own
        else f"fine-tune from it with {nproc}, or from a checkpoint of an epoch's end"
    )
    raise IncompatibleCheckpoint(
        f"checkpoint {info.path} stands inside epoch {progress['epoch']} of a job of "
        f"{info.world_size} rank(s) and this one has {world_size}: a reader's position "
        f"holds only at the world size that took it, and restarting the epoch would train "
        f"its rows twice; {remedy}"
    )


def finished(info: CheckpointInfo, config: RunConfig, passes: int) -> bool:
    """Whether the checkpoint already stands where this configuration would stop, after
    ``passes`` passes (``pass_count``)."""
    progress = info.manifest["progress"]
    max_steps = config.train.max_steps or math.inf
    return progress["epoch"] >= passes or progress["step"] >= max_steps


def finished_result(info: CheckpointInfo, run_dir: Path, env: DistEnv) -> TrainResult:
    """The result of a run that has nothing left to train: its recorded one when that
    describes this checkpoint, else rebuilt from the checkpoint's progress."""
    recorded = run_dir / RESULT_FILE
    with_steps = None
    if recorded.is_file():
        with_steps = TrainResult.from_dict(json.loads(recorded.read_text()))
        if with_steps.steps != info.step or Path(with_steps.checkpoint) != info.path:
            with_steps = None
    if with_steps is None:
        progress = info.manifest["progress"]
        loss = progress.get("loss")
        window = progress.get("window") or {}
        if window.get("steps"):  # logged after the checkpoint, as the run's last record
            loss = window["loss"] / window["steps"]
        with_steps = TrainResult(
            steps=info.step,
            rows=int(progress["rows"]),
            seconds=float(progress["seconds"]),
            samples_per_s=int(progress["rows"]) / max(float(progress["seconds"]), 1e-9),
            final_loss=float("nan") if loss is None else float(loss),
            checkpoint=str(info.path),
            world_size=env.world_size,
        )
    with_steps.trained_steps = 0
    with_steps.resumed_from_step = info.step
    with_steps.resumed_from = str(info.path)
    return with_steps


def start_afresh(run_dir: Path) -> None:
    """``train.resume: never``: the directory's previous run (checkpoints, metrics, results)
    goes, so the new run cannot be mixed with it; said on stderr, never silently."""
    old = [run_dir / CHECKPOINTS_DIR, run_dir / METRICS_FILE, run_dir / RESULT_FILE]
    old += [run_dir / "eval.json", run_dir / TIERED_DIR, run_dir / "tensorboard"]
    old += [run_dir / "tracking.json"]
    present = [p for p in old if p.exists()]
    if not present:
        return
    warnings.warn(
        f"train.resume=never: starting afresh in {run_dir}, removing the previous run's "
        + ", ".join(p.name for p in present),
        stacklevel=3,
    )
    for path in present:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def rewind_metrics(path: Path, step: int, window_open: bool) -> None:
    """Drop the metrics records past ``step``: a run killed after its last checkpoint
    logged steps that the resumed run trains again, and must not be listed twice.

    ``window_open``: the checkpoint holds a metrics window in progress, which the resumed
    run completes; a training record at ``step`` itself is then the one a run that ended
    there logged for the part of the window it had, and goes too (the uninterrupted run
    never wrote it)."""
    if not path.is_file():
        return

    def kept(record: dict) -> bool:
        if record["step"] == step and window_open:
            return "loss" not in record  # an evaluation at that step stays
        return record["step"] <= step

    lines = [line for line in path.read_text().splitlines() if line.strip()]
    write_atomic(path, "".join(line + "\n" for line in lines if kept(json.loads(line))))

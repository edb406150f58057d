"""The training loop of every rank: reader -> (sharded) DLRM -> BCE loss -> optimizers.

Every knob comes from ``RunConfig``; the loop stays flat so it can be read top to bottom.
One process trains the plain ``DLRM``; the ranks of a job train the ``ShardedDLRM`` under
the planner's plan. Around the loop sits what makes a run trustworthy: the run
directory's lock, the dataset check, where to resume from (and whether that checkpoint
belongs to this run), a stop at the first non-finite loss, and a checkpoint whose
position is the next step's. Metrics go to ``RUN_DIR/metrics.jsonl`` every
``train.log_every`` steps, checkpoints to ``RUN_DIR/checkpoints/`` every
``train.checkpoint_every`` steps and at the end, the result to ``train_result.json``.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dlrmflow.config import ConfigError, RunConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.ingest.manifest import Manifest, check_dataset, read_manifest
from dlrmflow.kernels.backends import check_kernels
from dlrmflow.kernels.backends import resolve as resolve_kernels
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.kernels.tiered import TieredEmbeddingBag
from dlrmflow.memory import tune_allocator
from dlrmflow.outputs import write_atomic
from dlrmflow.train.checkpoint import (
    CHECKPOINTS_DIR,
    DATASET_KEY,
    CheckpointInfo,
    dataset_digest,
    differences,
    latest_checkpoint,
    prune_checkpoints,
    read_checkpoint,
    restore,
    save_checkpoint,
)
from dlrmflow.train.comms import CommStats
from dlrmflow.train.data import IdMapper, fit_features, load_ids, make_train_loader
from dlrmflow.train.device import BatchStager, resolve_device, use_device
from dlrmflow.train.distributed import (
    DistEnv,
    ShardedDLRM,
    compute_threads,
    gather_peak_rss,
    init_distributed,
    seed_everything,
)
from dlrmflow.train.evaluate import score, test_loader
from dlrmflow.train.metrics import click_metrics
from dlrmflow.train.model import DLRM, embedding_optimizer
from dlrmflow.train.planner.jobs import plan_for_job
from dlrmflow.train.rundir import rank0_lock
from dlrmflow.train.sharding import ShardingPlan
from dlrmflow.train.tiers import TIERED_DIR, tier_storage, tiered_embeddings
from dlrmflow.train.tracking import Tracker, config_params, open_tracker, require_tracker

METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.json"
RESULT_FILE = "train_result.json"
RUN_FILE = "run.json"  # the kind of run the directory holds: {"kind": ...}
# The kinds of run a directory holds: a training (``train``, the train flows), or the
# end-to-end flow's data, training, evaluation and summary (``demo``, ``end_to_end``).
TRAIN_KIND = "train"
END_TO_END_KIND = "end_to_end"


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
    # Each rank's peak resident set (VmHWM) over its whole process, in bytes, by rank.
    peak_rss_bytes: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainResult:
        """A result read back from ``train_result.json`` (unknown keys are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class NonFiniteLoss(DlrmflowError):
    """The loss became NaN or infinite: the model is ruined and is not checkpointed."""


class IncompatibleCheckpoint(DlrmflowError):
    """A checkpoint that does not belong to (or cannot be continued by) this configuration."""


class RunDirTaken(DlrmflowError):
    """The run directory holds another kind of run, which the command would replace."""


def _features(
    config: RunConfig, manifest: Manifest, run_dir: Path, env: DistEnv
) -> tuple[FeatureSpec, IdMapper]:
    """The feature spec and ID mapping: fitted by rank 0 (a vocabulary is written to the run
    dir once), then loaded by the other ranks, so every rank maps IDs identically."""
    if env.rank == 0:
        fitted = fit_features(config, manifest, run_dir)
    if env.distributed:
        dist.barrier()
    if env.rank == 0:
        return fitted
    if config.features.ids == "vocab":
        vocab = load_ids("vocab", FeatureSpec((), ()), run_dir)
        spec = FeatureSpec.for_dataset(manifest, config.features, config.model, vocab.table_rows)
        return spec, vocab
    return fit_features(config, manifest, run_dir)


def _build_model(
    config: RunConfig, spec: FeatureSpec, env: DistEnv, run_dir: Path, device: torch.device
) -> tuple[nn.Module, list[nn.Parameter], CommStats | None, ShardingPlan | None]:
    """One process: the DLRM. Several: the sharded DLRM under the planner's plan, which
    rank 0 writes to ``RUN_DIR/plan.json`` for the report and for resharding. Either is
    built on the CPU (the seed's draws are the same on every device) and lives on
    ``device``."""
    optimizer = embedding_optimizer(config.train)
    if config.train.embedding_memory_bytes is not None and device.type != "cpu":
        raise ConfigError(
            "train.embedding_memory_bytes: embeddings on disk are served from host memory; "
            f"set train.device=cpu (the model is on {device})"
        )
    if not env.distributed:
        embeddings = tiered_embeddings(config, spec, optimizer, run_dir / TIERED_DIR)
        model = DLRM(
            spec,
            config.model,
            optimizer,
            seed=config.train.seed,
            embeddings=embeddings,
            precision=config.train.precision,
        ).to(device)
        return model, list(model.parameters()), None, None
    ranks_per_host = config.distributed.ranks_per_host or env.local_world_size
    # With train.embedding_memory_bytes the plan puts the shards beyond it on disk.
    plan = plan_for_job(config, spec, env.world_size, ranks_per_host)
    if env.rank == 0:
        write_atomic(run_dir / PLAN_FILE, json.dumps(plan.to_dict(), indent=1))
    stats = CommStats()
    model = ShardedDLRM(
        spec,
        config,
        plan,
        optimizer,
        stats=stats,
        device=device,
        tiers=tier_storage(config, env.rank, env.world_size, run_dir),
    )
    return model, model.dense_parameters(), stats, plan


def kernels_used(model: nn.Module, config: RunConfig) -> dict[str, str]:
    """Which implementation ran the embedding bags and the interaction (``model.kernels``
    resolved on the model's device), for the result: "auto" hides what it picked."""
    embeddings = model.embeddings
    bags = [embeddings]
    if isinstance(model, ShardedDLRM):
        bags = [b for b in (embeddings.local, embeddings.replicated) if b is not None]
    tbe = sorted({b.backend for b in bags if isinstance(b, TableBatchedEmbeddingBag)})
    dense = next(model.dense_arch.parameters())
    interaction = resolve_kernels(config.model.kernels, dense)
    return {
        "tbe": "+".join(tbe) or "tiered",
        "interaction": "triton" if interaction == "triton" else "torch",
    }


def dense_optimizer(parameters: list[nn.Parameter], config: RunConfig) -> torch.optim.Optimizer:
    """The torch optimizer of the MLPs and the interaction (the embedding weights are
    buffers updated by their own fused backward)."""
    if config.train.optimizer == "adagrad":
        return torch.optim.Adagrad(parameters, lr=config.train.lr)
    return torch.optim.SGD(parameters, lr=config.train.lr)


class _Batches:
    """The loader's batches, with every rank taking part in every step of the epoch.

    Ranks read different splits, so one can run out a few batches before another, and a
    rank missing from a step's collectives would hang the others. A rank whose splits
    ended steps on with empty batches until every rank's have (the loss is a sum over the
    global batch, so an empty batch adds nothing but still joins the exchanges): every row
    of the epoch is trained, none dropped.
    """

    def __init__(self, loader, env: DistEnv, spec: FeatureSpec, stager: BatchStager) -> None:
        self._iter = iter(loader)
        self._env = env
        self._spec = spec
        self._stager = stager
        self._done = False

    def next(self) -> Batch | None:
        """The next batch, its copy to the device started; None once every rank's share
        of the epoch has run out."""
        batch = None if self._done else next(self._iter, None)
        self._done = batch is None
        batch = self._stager.stage(batch)
        if not self._env.distributed:
            return batch
        anyone = torch.tensor([int(batch is not None)], device="cpu")
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
        if not bool(anyone):
            return None
        if batch is not None:
            return batch
        spec = self._spec
        return Batch.empty(len(spec.dense), spec.sparse_names, self._stager.device)


# What makes two configurations the same run: resuming one's checkpoint under the other
# with ``train.resume: auto`` would silently mix two runs in one directory.
RUN_KEYS = (
    "model",
    "features",
    "train.optimizer",
    "train.lr",
    "train.embedding_lr",
    "train.batch_size",
    "train.seed",
    "train.shuffle",
    "train.shuffle_window",
    "train.num_workers",  # rows are dealt to a rank's reader streams by their number
    "train.precision",
)
# Configuration keys under the sections above that choose how a step is computed, not what
# it computes: a run may continue under another (on a GPU after a CPU, with other kernels).
IMPLEMENTATION_KEYS = ("model.kernels",)
# The reader's position means nothing for other data or another batch size: a fine-tuning
# run that changes one of these reads the checkpoint's epoch from its start.
REREAD_KEYS = frozenset({DATASET_KEY, "train.batch_size"})
# What an explicit ``train.resume`` path (fine-tuning) may not change: the weights and the
# optimizer state would not fit.
SHAPE_KEYS = ("model", "features", "train.optimizer")


@dataclass
class _Resume:
    """Where a training invocation starts from."""

    info: CheckpointInfo | None = None  # the checkpoint it loads (None: from scratch)
    own: bool = False  # one of this run directory's own checkpoints
    changed: dict[str, list] = field(default_factory=dict)  # what fine-tuning changes now
    origin: str | None = None  # the checkpoint the run directory's run was fine-tuned from
    verify_seconds: float = 0.0  # finding and verifying it

    def lineage(self, digest: str) -> dict:
        """What every checkpoint of this run records of where it came from."""
        changed = self.changed
        if not changed and self.own and self.info is not None:
            changed = self.info.manifest.get("changed_on_resume", {})
        return {"origin": self.origin, "changed_on_resume": changed, "dataset_digest": digest}


def _resume_point(config: RunConfig, run_dir: Path, spec: FeatureSpec, digest: str) -> _Resume:
    """The checkpoint to continue from (``train.resume``).

    "auto" continues the run directory's newest intact checkpoint, which must come from
    this same run (``RUN_KEYS``, the feature spec and the dataset); "never" starts afresh
    (the caller removed the directory's previous run); a checkpoint path fine-tunes from
    it: anything but ``SHAPE_KEYS`` may change, and what did is recorded. A fine-tuned
    run that already has checkpoints of its own continues from those: re-running the
    same command never trains twice.
    """
    if config.train.resume == "never":
        return _Resume()
    own = latest_checkpoint(run_dir)
    if config.train.resume == "auto":
        if own is None:
            return _Resume()
        _refuse_differences(own, config, spec, digest, RUN_KEYS, "resume: auto")
        return _Resume(own, True, {}, own.manifest.get("origin"))
    source = read_checkpoint(config.train.resume)
    if source.path.parent.resolve() == (run_dir / CHECKPOINTS_DIR).resolve():
        if own is not None and own.step > source.step:
            raise IncompatibleCheckpoint(
                f"{run_dir} holds newer checkpoints (step {own.step}) than {source.path}; "
                "to go back to it, fine-tune from it into another --run-dir"
            )
        _refuse_differences(source, config, spec, digest, SHAPE_KEYS, "fine-tuning")
        changed = differences(source.manifest, config, digest, RUN_KEYS, IMPLEMENTATION_KEYS)
        return _Resume(source, True, changed, source.manifest.get("origin"))
    origin = str(source.path.resolve())
    if own is not None:
        if own.manifest.get("origin") != origin:
            raise IncompatibleCheckpoint(
                f"{run_dir} already holds a run that was not fine-tuned from {source.path}; "
                "fine-tune into another --run-dir"
            )
        _refuse_differences(own, config, spec, digest, RUN_KEYS, "its continuation")
        return _Resume(own, True, {}, origin)
    _refuse_differences(source, config, spec, digest, SHAPE_KEYS, "fine-tuning")
    changed = differences(source.manifest, config, digest, RUN_KEYS, IMPLEMENTATION_KEYS)
    return _Resume(source, False, changed, origin)


def _refuse_differences(
    info: CheckpointInfo,
    config: RunConfig,
    spec: FeatureSpec,
    digest: str,
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
    recorded = info.manifest.get("spec")
    if recorded is not None and recorded != json.loads(json.dumps(spec.to_dict())):
        changed.setdefault("feature spec (the tables the dataset gives)", None)
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
    raise IncompatibleCheckpoint(
        f"checkpoint {info.path} differs from this configuration ({what}): {shown}; {hint}"
    )


def _refuse_rank_change(
    resume: _Resume, world_size: int, epoch_rows: int, config: RunConfig
) -> None:
    """``IncompatibleCheckpoint`` naming ``distributed.nproc`` when the checkpoint stands
    inside an epoch and was taken at another world size, unless this run reads that epoch
    from its start anyway (fine-tuning on other data or batches, see ``_train_loop``).

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


def _finished(info: CheckpointInfo, config: RunConfig) -> bool:
    """Whether the checkpoint already stands where this configuration would stop."""
    progress = info.manifest["progress"]
    max_steps = config.train.max_steps or math.inf
    return progress["epoch"] >= config.train.epochs or progress["step"] >= max_steps


def _finished_result(info: CheckpointInfo, run_dir: Path, env: DistEnv) -> TrainResult:
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


def _start_afresh(run_dir: Path) -> None:
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


def _rewind_metrics(path: Path, step: int, window_open: bool) -> None:
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


def run_kind(run_dir: Path) -> str | None:
    """The kind of run ``run_dir`` holds (``RUN_FILE``), None when it holds none.

    A directory written before runs recorded their kind tells by its files: a summary or
    a dataset of its own (the demo's ``data/``) is the end-to-end flow's, checkpoints,
    metrics or a training result a training's.
    """
    marker = run_dir / RUN_FILE
    if marker.is_file():
        try:
            kind = json.loads(marker.read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
        if isinstance(kind, str):
            return kind
    if (run_dir / "summary.json").exists() or (run_dir / "data" / "manifest.json").exists():
        return END_TO_END_KIND
    if any((run_dir / name).exists() for name in (CHECKPOINTS_DIR, METRICS_FILE, RESULT_FILE)):
        return TRAIN_KIND
    return None


def claim_run_dir(run_dir: Path, kind: str, *, replace: bool, command: str) -> None:
    """Record in ``RUN_FILE`` that ``run_dir`` holds a ``kind`` run; ``RunDirTaken`` when it
    holds another kind, which ``command`` would replace.

    A training in an end-to-end run's directory continues that run's training
    (``train.resume`` decides whether it may), so it leaves the kind as it is. The other
    way round, the end-to-end flow would start the training of a ``train`` run afresh (the
    demo does) and add its data, evaluation and summary: it needs ``replace``
    (``train.resume=never``), and then says on stderr what it replaces.
    """
    found = run_kind(run_dir)
    if found == END_TO_END_KIND and kind == TRAIN_KIND:
        return
    if found == kind and (run_dir / RUN_FILE).is_file():
        return
    if found not in (None, kind):
        if not replace:
            raise RunDirTaken(
                f"{run_dir} holds a {found} run, which {command} would replace; use another "
                "run directory (--run-dir), or --set train.resume=never to replace it"
            )
        warnings.warn(
            f"train.resume=never: {command} replaces the {found} run in {run_dir}",
            stacklevel=2,
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / RUN_FILE, json.dumps({"kind": kind, "command": command}) + "\n")


def train(
    config: RunConfig,
    progress: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train a DLRM on every day but the test day, checkpointing as configured.

    Run by every rank of a torchrun job (``dlrmflow train --nproc N``), or alone. Each rank
    reads its own splits; rank 0 holds the run directory's lock and writes the metrics,
    the plan and ``train_result.json``; every rank writes its shards of each checkpoint. A
    run directory holding a checkpoint continues from it (``train.resume``), bitwise as if
    it had never stopped, and a finished run re-run trains nothing and reports its result.
    ``progress`` receives each metrics record as it is written (the CLI and the Prefect
    flow show it); it must not be slow.
    """
    env = DistEnv.from_env()
    tune_allocator()  # also when called outside the CLI (a Prefect worker, a notebook)
    device = resolve_device(config.train.device, env.local_rank)
    check_kernels(config.model.kernels, device)
    use_device(device)
    init_distributed(config, env, device)
    run_dir = Path(config.run_dir)
    with rank0_lock(run_dir, "train", env.rank, env.distributed):
        return _train(config, env, run_dir, progress, device)


def _train(
    config: RunConfig,
    env: DistEnv,
    run_dir: Path,
    progress: Callable[[dict], None] | None,
    device: torch.device,
) -> TrainResult:
    rank0 = env.rank == 0
    if rank0:
        require_tracker(config.train.tracker)  # a missing package fails before any work
    seed_everything(config.train.seed, compute_threads(config, env))
    manifest = read_manifest(config.data.url)
    data_warnings = check_dataset(config.data.url, manifest)
    for warning in data_warnings if rank0 else []:
        warnings.warn(warning, stacklevel=2)
    digest = dataset_digest(manifest)
    if rank0 and config.train.resume == "never":
        _start_afresh(run_dir)
    if rank0 and run_kind(run_dir) is None:  # in an end-to-end run's, it stays one
        claim_run_dir(run_dir, TRAIN_KIND, replace=False, command="train")
    spec, ids = _features(config, manifest, run_dir, env)
    verify_start = time.perf_counter()
    resume = _resume_point(config, run_dir, spec, digest)
    resume.verify_seconds = time.perf_counter() - verify_start
    if resume.own and not resume.changed and _finished(resume.info, config):
        result = _finished_result(resume.info, run_dir, env)
        result.checkpoint_verify_s = resume.verify_seconds
        if env.distributed:
            dist.barrier()
        return result
    epoch_rows = sum(f.rows for f in manifest.files if f.day != manifest.test_day)
    _refuse_rank_change(resume, env.world_size, epoch_rows, config)
    # Local reader threads, or the reader servers of ``distributed.readers``: same batches.
    loader = make_train_loader(
        config,
        spec,
        ids,
        manifest.day_paths(config.data.url, manifest.train_days()),
        rank=env.rank,
        world_size=env.world_size,
        pin_memory=device.type == "cuda",
    )
    try:
        # train.tracker: ends the run FINISHED, or FAILED when training raises.
        own_step = resume.info.step if resume.own else None
        with open_tracker(config, run_dir, own_step, env.rank) as tracker:
            tracker.log_params(config_params(config))
            return _train_loop(
                config,
                env,
                run_dir,
                spec,
                ids,
                loader,
                resume,
                digest,
                data_warnings,
                progress,
                tracker,
                device,
            )
    finally:
        loader.close()  # also on errors: no reader thread outlives the run


def _train_loop(
    config: RunConfig,
    env: DistEnv,
    run_dir: Path,
    spec: FeatureSpec,
    ids: IdMapper,
    loader,
    resume: _Resume,
    digest: str,
    data_warnings: list[str],
    progress: Callable[[dict], None] | None,
    tracker: Tracker,
    device: torch.device,
) -> TrainResult:
    rank0 = env.rank == 0
    resume_from, own = resume.info, resume.own
    model, parameters, stats, plan = _build_model(config, spec, env, run_dir, device)
    stager = BatchStager(device)
    optimizer = dense_optimizer(parameters, config)
    # Summed, then divided by the global batch (all ranks' rows) and multiplied by the world
    # size that DDP and the embeddings' backward divide by: the gradient of the mean loss
    # over the global batch, however unevenly the ranks' batches are sized.
    loss_fn = nn.BCEWithLogitsLoss(reduction="sum")
    sharded = isinstance(model, ShardedDLRM)
    pipelined = sharded and config.distributed.pipeline
    tiered = isinstance(getattr(model, "embeddings", None), TieredEmbeddingBag)
    # A job's shards on disk (train.embedding_memory_bytes): prefetched when pipelined.
    sharded_tiers = sharded and model.embeddings.tiers is not None

    # Where the run stands after its last step; a checkpoint stores it, a resumed run
    # continues it. ``epoch`` is the epoch the next step reads: a checkpoint taken on an
    # epoch's last step records the next epoch, with its reader at that epoch's start.
    state = {"step": 0, "epoch": 0, "rows": 0, "seconds": 0.0, "loss": None}
    # The metrics window in progress: the global batch's loss summed over its steps, the
    # same on every rank. A checkpoint stores it, so that the first record after a resume
    # covers the steps the uninterrupted run's does, with the same sum.
    window = {"loss": 0.0, "steps": 0, "rows": 0}
    window_seconds = 0.0  # the window's time before this invocation
    metrics_path = run_dir / METRICS_FILE
    if resume_from is not None:
        loader_state = restore(resume_from, model, optimizer)
        progress_then = dict(resume_from.manifest["progress"])
        open_window = progress_then.pop("window", None)
        state.update(progress_then)
        if own and open_window:
            window.update({k: open_window[k] for k in window})
            window_seconds = float(open_window.get("seconds", 0.0))
        repositioned = REREAD_KEYS & resume.changed.keys()
        if loader_state is not None and not repositioned:
            loader.load_state_dict(loader_state)
    if rank0:
        if own:
            _rewind_metrics(metrics_path, resume_from.step, window["steps"] > 0)
        else:
            metrics_path.unlink(missing_ok=True)
    lineage = resume.lineage(digest)
    trained_from = state["step"]

    def start(batch: Batch):
        """Begin fetching what the embeddings need (the sharded input all-to-all), once the
        batch's copy to the device is in (a wait on the device, not the host)."""
        if not sharded:
            return None
        return model.start_input_dist(stager.ready(batch).sparse, async_op=pipelined)

    def forward(batch: Batch, pending) -> tuple[torch.Tensor, int]:
        batch = stager.ready(batch)
        if not sharded:
            return model(batch.dense, batch.sparse), len(batch)
        received = pending.wait()
        return model.forward_received(batch.dense, received), sum(received.batch_sizes)

    start_time = time.perf_counter()
    window_start = start_time - window_seconds
    elapsed_before = state["seconds"]

    def log_window() -> None:
        """Append one metrics record for the steps since the last one: their mean loss
        over the global batch."""
        nonlocal window_start
        now = time.perf_counter()
        state["loss"] = window["loss"] / window["steps"]
        record = {
            "step": state["step"],
            "epoch": state["epoch"],
            "rows": state["rows"],
            "loss": state["loss"],
            "samples_per_s": window["rows"] / max(now - window_start, 1e-9),
            "elapsed_s": elapsed_before + now - start_time,
            "data_wait_s": loader.wait_seconds + stager.wait_seconds,
        }
        if stats is not None:
            steps_here = max(state["step"] - trained_from, 1)
            record["comm_bytes_per_step"] = {
                kind: n // steps_here for kind, n in stats.snapshot().items()
            }
        window.update(loss=0.0, steps=0, rows=0)
        window_start = now
        if not rank0:
            return
        with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        tracker.log_metrics(record, state["step"])
        if progress is not None:
            progress(record)

    eval_loader = (
        test_loader(config, spec, ids, env, pin_memory=device.type == "cuda")[0]
        if config.train.eval_every is not None
        else None
    )
    last_eval: dict[str, float] = {}

    def evaluate_now() -> None:
        """Score the test day with the live model (every rank), log it, keep it for the
        next checkpoint's manifest, where it decides which checkpoint is the best."""
        scored = score(model, eval_loader, spec, env, config.eval.max_rows)
        if scored is None:
            return
        last_eval.clear()
        last_eval.update(click_metrics(*scored))
        record = {"step": state["step"], "epoch": state["epoch"], **last_eval}
        with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        tracker.log_metrics(last_eval, state["step"], prefix="eval/")

    # The newest checkpoint in this run dir, tracked here rather than listed from the disk:
    # every rank must take the same decisions, and rank 0 prunes while the others go on.
    # One resumed from elsewhere (``train.resume`` naming another run's) does not count.
    saved = {"step": state["step"], "path": resume_from.path if own else None, "seconds": 0.0}

    def checkpoint(loader_state: dict | None) -> None:
        began = time.perf_counter()
        state["seconds"] = elapsed_before + began - start_time
        saved["path"] = save_checkpoint(
            run_dir,
            model=model,
            optimizer=optimizer,
            config=config,
            spec=spec,
            progress={**state, "window": {**window, "seconds": began - window_start}},
            loader_state=loader_state,
            plan=plan.to_dict() if plan is not None else None,
            metrics=dict(last_eval),
            extra=lineage,
        )
        saved["step"] = state["step"]
        if rank0:
            prune_checkpoints(run_dir, config.train.keep_checkpoints)
        saved["seconds"] += time.perf_counter() - began

    def global_loss(step: int, value: float) -> float:
        """The step's loss over the global batch (every rank's ``value`` is its rows' share),
        the same on every rank. Stops every rank at the first step whose loss is NaN or
        infinite, before that step updates anything: such a model is never checkpointed
        or reported."""
        both = torch.tensor(
            [0.0 if math.isfinite(value) else 1.0, value], dtype=torch.float64, device="cpu"
        )
        if env.distributed:
            dist.all_reduce(both)
        if not bool(both[0]):
            return float(both[1]) / env.world_size
        last = (
            f"the last good checkpoint is {saved['path']}"
            if saved["path"]
            else ("no checkpoint was written")
        )
        raise NonFiniteLoss(
            f"step {step}: the loss is not finite ({value} on rank {env.rank}); training "
            f"stopped and this model was not saved ({last}); try a lower train.lr"
        )

    every = config.train.checkpoint_every
    max_steps = config.train.max_steps or math.inf
    # The reader's position after the latest step (None: the start of ``state["epoch"]``).
    loader_state: dict | None = None
    model.train()
    while state["epoch"] < config.train.epochs and state["step"] < max_steps:
        loader.set_epoch(state["epoch"])
        batches = _Batches(loader, env, spec, stager)
        batch = batches.next()
        if batch is None:  # nothing left of this epoch (resumed right at its end)
            state["epoch"] += 1
            loader_state = None
            continue
        pending = start(batch)
        while batch is not None:
            step = state["step"] + 1
            last = step >= max_steps
            # A checkpoint after this step records the reader before the next batch is
            # fetched: resuming then reads that batch again, exactly as this run will.
            save_now = every is not None and step % every == 0
            loader_state = loader.state_dict() if save_now or last else None
            # Fetched at the last step too: it tells whether this step ends the epoch.
            following = batches.next()
            following_pending = None
            if following is not None and not last:
                # The next batch's input exchange runs while this one computes (pipelined).
                following_pending = start(following) if pipelined else None
                if tiered:
                    # Its rows load from disk into the cache while this one computes.
                    model.embeddings.prefetch(following.sparse)
            logits, n = forward(batch, pending)
            if sharded_tiers and following_pending is not None:
                # The next batch's IDs are in: its rows on disk load during this backward.
                model.embeddings.prefetch(following_pending.wait())
            loss = loss_fn(logits, batch.labels) * (env.world_size / n)
            value = global_loss(step, loss.item())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # also updates the touched embedding rows (fused optimizer)
            optimizer.step()
            state["step"] = step
            state["rows"] += n
            if following is None:
                # The epoch ended with this step: its position is the next epoch's start.
                state["epoch"] += 1
                loader_state = None
            window["loss"] += value
            window["steps"] += 1
            window["rows"] += n
            if step % config.train.log_every == 0:
                log_window()
            if config.train.eval_every is not None and step % config.train.eval_every == 0:
                evaluate_now()
            if save_now:
                checkpoint(loader_state)
            if last:
                break
            if following is not None and not pipelined:
                following_pending = start(following)
            batch, pending = following, following_pending
    if eval_loader is not None:
        eval_loader.close()  # on an error path, the reader's exit hook closes it
    if tiered or sharded_tiers:
        model.embeddings.flush()
    if state["step"] == 0:
        raise ValueError(f"{config.data.url}: the training days hold no rows to train on")
    if saved["path"] is None or saved["step"] != state["step"]:
        checkpoint(loader_state)
    if window["steps"]:
        # After the checkpoint, which keeps the window open: a run that continues this
        # one (more steps or epochs) completes it, as the uninterrupted run does.
        log_window()
    cache = model.embeddings.cache_stats() if sharded_tiers else None  # a collective
    if tiered:
        cache = model.embeddings.stats
    seconds = time.perf_counter() - start_time
    peaks = gather_peak_rss(env)
    rows_here = state["rows"] - (resume_from.manifest["progress"]["rows"] if resume_from else 0)
    result = TrainResult(
        steps=state["step"],
        rows=state["rows"],
        seconds=seconds,
        samples_per_s=rows_here / seconds,
        final_loss=state["loss"] if state["loss"] is not None else float("nan"),
        checkpoint=str(saved["path"]),
        world_size=env.world_size,
        data_wait_s=loader.wait_seconds + stager.wait_seconds,
        comm_bytes_per_step=(
            {k: n // max(state["step"], 1) for k, n in stats.snapshot().items()}
            if stats is not None
            else {}
        ),
        resumed_from_step=resume_from.step if resume_from else None,
        embedding_cache=cache.to_dict() if cache is not None else {},
        trained_steps=state["step"] - trained_from,
        resumed_from=str(resume_from.path) if resume_from else None,
        changed_on_resume=lineage["changed_on_resume"],
        warnings=data_warnings,
        checkpoint_save_s=saved["seconds"],
        checkpoint_verify_s=resume.verify_seconds,
        device=str(device),
        precision=config.train.precision,
        kernels=kernels_used(model, config),
        peak_rss_bytes=peaks,
    )
    if rank0:
        write_atomic(run_dir / RESULT_FILE, json.dumps(result.to_dict(), indent=1))
    if env.distributed:
        dist.barrier()
    return result

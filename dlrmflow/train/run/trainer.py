"""Training a DLRM on a dataset's training days: what surrounds the loop.

Every knob comes from ``RunConfig``. One process trains the ``DLRM`` with its tables in
memory or on disk; the ranks of a job train it sharded under the planner's plan
(``parallelize.py`` applies either). Around the loop (``loop.py``) sits
what makes a run trustworthy: the run directory's lock and kind, the dataset check, where
to resume from and whether that checkpoint belongs to this run (``resume.py``), a stop at
the first non-finite loss, and a checkpoint whose position is the next step's. Metrics go
to ``RUN_DIR/metrics.jsonl`` every ``train.log_every`` steps, checkpoints to
``RUN_DIR/checkpoints/`` every ``train.checkpoint_every`` steps and at the end, the result
to ``train_result.json``.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import ConfigError, RunConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.ingest.manifest import Manifest, check_dataset, read_manifest
from dlrmflow.kernels.backends import check_kernels
from dlrmflow.runtime.glibc_malloc import tune_allocator
from dlrmflow.train.model.comms import CommStats
from dlrmflow.train.model.device import BatchStager, resolve_device, use_device
from dlrmflow.train.model.memory_budget import TIERED_DIR, tier_storage
from dlrmflow.train.model.parallelize import build_model, parallelize
from dlrmflow.train.planner.jobs import plan_for_job
from dlrmflow.train.run.checkpoint import CHECKPOINTS_DIR, DataIdentity, list_checkpoints
from dlrmflow.train.run.data import (
    IdMapper,
    day_windows,
    fit_features,
    make_train_loader,
    pass_count,
    pass_steps_of_run,
    train_paths,
)
from dlrmflow.train.run.loop import NonFiniteLoss, TrainLoop, dense_optimizer, kernels_used
from dlrmflow.train.run.progress import METRICS_FILE, RESULT_FILE, TrainResult
from dlrmflow.train.run.rank import (
    DistEnv,
    compute_threads,
    init_distributed,
    seed_everything,
)
from dlrmflow.train.run.resume import (
    IncompatibleCheckpoint,
    finished,
    finished_result,
    refuse_rank_change,
    resume_point,
    start_afresh,
)
from dlrmflow.train.run.rundir import rank0_lock
from dlrmflow.train.run.schedule import LrSchedule
from dlrmflow.train.run.steps import StepRunner
from dlrmflow.train.run.tracking import config_params, open_tracker, require_tracker

# Defined beside the loop and the resume logic, imported from here by the flows and tests.
__all__ = [
    "END_TO_END_KIND",
    "METRICS_FILE",
    "PLAN_FILE",
    "RESULT_FILE",
    "RUN_FILE",
    "TRAIN_KIND",
    "IncompatibleCheckpoint",
    "NonFiniteLoss",
    "RunDirTaken",
    "TrainResult",
    "claim_run_dir",
    "dense_optimizer",
    "kernels_used",
    "run_kind",
    "train",
]

PLAN_FILE = "plan.json"
RUN_FILE = "run.json"  # the kind of run the directory holds: {"kind": ...}
# The kinds of run a directory holds: a training (``train``, the train flows), or the
# end-to-end flow's data, training, evaluation and summary (``demo``, ``end_to_end``).
TRAIN_KIND = "train"
END_TO_END_KIND = "end_to_end"


class RunDirTaken(DlrmflowError):
    """The run directory holds another kind of run, which the command would replace."""


def _features(
    config: RunConfig, manifest: Manifest, run_dir: Path, env: DistEnv
) -> tuple[FeatureSpec, IdMapper]:
    """The feature spec and ID mapping: fitted by rank 0 (a vocabulary is written to the run
    dir once), then loaded by the other ranks, so every rank maps IDs identically."""
    # A run continued in day order keeps its vocabulary: refitted on the grown window it
    # would map the IDs it trained on to other rows.
    keep = config.train.order == "days" and config.train.resume == "auto"
    if env.rank == 0:
        fitted = fit_features(
            config, manifest, run_dir, keep=keep and bool(list_checkpoints(run_dir))
        )
    if env.distributed:
        dist.barrier()
    if env.rank == 0:
        return fitted
    # The vocabulary rank 0 has just written (if any), kept as a continuing run keeps it.
    return fit_features(config, manifest, run_dir, keep=True)


def _build_model(
    config: RunConfig, spec: FeatureSpec, env: DistEnv, run_dir: Path, device: torch.device
) -> StepRunner:
    """The DLRM, parallelized for this run: in one process, its tables in memory or on
    disk; in a job, sharded under the planner's plan, which rank 0 writes to
    ``RUN_DIR/plan.json`` for the report and for resharding. It is built on the CPU (the
    seed's draws are the same on every device) and lives on ``device``; it comes with the
    runner that feeds it its batches."""
    stager = BatchStager(device)
    if config.train.embedding_memory_bytes is not None and device.type != "cpu":
        raise ConfigError(
            "train.embedding_memory_bytes: embeddings on disk are served from host memory; "
            f"set train.device=cpu (the model is on {device})"
        )
    if not env.distributed:
        model = build_model(config, spec)
        parallelize(model, config, device=device, embeddings_dir=run_dir / TIERED_DIR)
        return StepRunner(model, stager)
    ranks_per_host = config.distributed.ranks_per_host or env.local_world_size
    # With train.embedding_memory_bytes the plan puts the shards beyond it on disk.
    plan = plan_for_job(config, spec, env.world_size, ranks_per_host)
    if env.rank == 0:
        write_atomic(run_dir / PLAN_FILE, json.dumps(plan.to_dict(), indent=1))
    stats = CommStats()
    tiers = tier_storage(config, spec, env.rank, env.world_size, run_dir)
    model = build_model(config, spec)
    parallelize(model, config, device=device, plan=plan, tiers=tiers, stats=stats)
    return StepRunner(model, stager, comms=stats, plan=plan)


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
    if config.data.train_days is None and config.data.eval_days is None:
        data_warnings = check_dataset(config.data.url, manifest)  # the test day held out
        train_days, _ = day_windows(config, manifest)
    else:  # the run's own windows decide what must have rows
        train_days, eval_days = day_windows(config, manifest)
        data_warnings = check_dataset(
            config.data.url, manifest, train_days=train_days, eval_days=eval_days
        )
    for warning in data_warnings if rank0 else []:
        warnings.warn(warning, stacklevel=2)
    digest = DataIdentity.of(manifest, train_days)
    if rank0 and config.train.resume == "never":
        start_afresh(run_dir)
    if rank0 and run_kind(run_dir) is None:  # in an end-to-end run's, it stays one
        claim_run_dir(run_dir, TRAIN_KIND, replace=False, command="train")
    spec, ids = _features(config, manifest, run_dir, env)
    verify_start = time.perf_counter()
    resume = resume_point(config, run_dir, spec, digest)
    resume.verify_seconds = time.perf_counter() - verify_start
    passes = pass_count(config, train_days)
    if resume.own and not resume.changed and finished(resume.info, config, passes):
        result = finished_result(resume.info, run_dir, env)
        result.checkpoint_verify_s = resume.verify_seconds
        if env.distributed:
            dist.barrier()
        return result
    epoch_rows = sum(f.rows for f in manifest.files if f.day in train_days)
    refuse_rank_change(resume, env.world_size, epoch_rows, config)
    # Local reader threads, or the reader servers of ``distributed.readers``: same batches.
    loader = make_train_loader(
        config,
        spec,
        ids,
        train_paths(config, manifest),
        rank=env.rank,
        world_size=env.world_size,
        pin_memory=device.type == "cuda",
        days=manifest.path_days(config.data.url),
    )
    try:
        # train.tracker: ends the run FINISHED, or FAILED when training raises.
        own_step = resume.info.step if resume.own else None
        with open_tracker(config, run_dir, own_step, env.rank) as tracker:
            tracker.log_params(config_params(config))
            runner = _build_model(config, spec, env, run_dir, device)
            loop = TrainLoop(
                config,
                env,
                run_dir,
                spec,
                ids,
                loader,
                runner,
                resume,
                digest,
                data_warnings,
                progress,
                tracker,
                device,
                LrSchedule.of(
                    config,
                    pass_steps_of_run(config, train_days, loader),
                ),
            )
            return loop.run()
    finally:
        loader.close()  # also on errors: no reader thread outlives the run

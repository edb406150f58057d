"""The single-process training loop: reader -> DLRM -> BCE loss -> optimizers.

Every knob comes from ``RunConfig``; the loop stays flat so it can be read top to bottom.
Metrics go to ``RUN_DIR/metrics.jsonl`` every ``train.log_every`` steps and a checkpoint
to ``RUN_DIR/checkpoint.pt`` at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dlrmflow.config import ConfigError, RunConfig
from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.ingest.manifest import Manifest, read_manifest
from dlrmflow.kernels.tiered import FILE_SUFFIX as TIERED_SUFFIX
from dlrmflow.kernels.tiered import TieredEmbeddingBag, record_width
from dlrmflow.memory import tune_allocator
from dlrmflow.train.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    CheckpointInfo,
    latest_checkpoint,
    prune_checkpoints,
    restore,
    save_checkpoint,
    verify,
)
from dlrmflow.train.comms import CommStats
from dlrmflow.train.data import IdMapper, fit_features, load_ids, make_train_loader
from dlrmflow.train.distributed import (
    DistEnv,
    ShardedDLRM,
    compute_threads,
    init_distributed,
    seed_everything,
)
from dlrmflow.train.evaluate import score, test_loader
from dlrmflow.train.metrics import click_metrics
from dlrmflow.train.model import DLRM, embedding_optimizer
from dlrmflow.train.planner import plan_for_config
from dlrmflow.train.sharding import ShardingPlan

METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.json"
RESULT_FILE = "train_result.json"


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

    def to_dict(self) -> dict:
        return asdict(self)


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
    config: RunConfig, spec: FeatureSpec, env: DistEnv, run_dir: Path
) -> tuple[nn.Module, list[nn.Parameter], CommStats | None, ShardingPlan | None]:
    """One process: the DLRM. Several: the sharded DLRM under the planner's plan, which
    rank 0 writes to ``RUN_DIR/plan.json`` for the report and for resharding."""
    optimizer = embedding_optimizer(config.train)
    if not env.distributed:
        embeddings = _tiered_embeddings(config, spec, optimizer, run_dir)
        model = DLRM(spec, config.model, optimizer, seed=config.train.seed, embeddings=embeddings)
        return model, list(model.parameters()), None, None
    if config.train.embedding_memory_bytes is not None:
        raise ConfigError(
            "train.embedding_memory_bytes: embeddings on disk run in one process for now "
            f"(distributed.nproc is {env.world_size})"
        )
    ranks_per_host = config.distributed.ranks_per_host or env.local_world_size
    plan = plan_for_config(config, spec, env.world_size, ranks_per_host)
    if env.rank == 0:
        (run_dir / PLAN_FILE).write_text(json.dumps(plan.to_dict(), indent=1))
    stats = CommStats()
    model = ShardedDLRM(spec, config, plan, optimizer, stats=stats)
    return model, model.dense_parameters(), stats, plan


TIERED_DIR = "embeddings"


def _tiered_embeddings(
    config: RunConfig, spec: FeatureSpec, optimizer, run_dir: Path
) -> TieredEmbeddingBag | None:
    """The embeddings on disk behind a cache of hot rows, when their rows and optimizer state
    exceed ``train.embedding_memory_bytes`` (the cache gets that memory); else None.

    The file starts afresh from the seed's rows; a resumed run then writes the checkpoint's
    rows into it, so only the checkpoint, never a half-written file, decides the weights.
    """
    budget = config.train.embedding_memory_bytes
    if budget is None:
        return None
    widths = [record_width(optimizer, f.embedding_dim) for f in spec.sparse]
    needed = 4 * sum(f.num_embeddings * w for f, w in zip(spec.sparse, widths, strict=True))
    if needed <= budget:
        return None
    directory = run_dir / TIERED_DIR
    path = directory / f"embeddings{TIERED_SUFFIX}"
    path.unlink(missing_ok=True)
    return TieredEmbeddingBag(
        spec.sparse,
        optimizer,
        directory,
        cache_rows=max(1, budget // (4 * max(widths))),
        seed=config.train.seed,
    )


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

    def __init__(self, loader, env: DistEnv, spec: FeatureSpec) -> None:
        self._iter = iter(loader)
        self._env = env
        self._spec = spec
        self._done = False
        self.exhausted = False  # the epoch's data ran out (not stopped at max_steps)

    def next(self) -> Batch | None:
        batch = None if self._done else next(self._iter, None)
        self._done = batch is None
        if not self._env.distributed:
            self.exhausted = batch is None
            return batch
        anyone = torch.tensor([int(batch is not None)])
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
        if not bool(anyone):
            self.exhausted = True
            return None
        return (
            batch
            if batch is not None
            else Batch.empty(len(self._spec.dense), self._spec.sparse_names)
        )


def _resume_point(config: RunConfig, run_dir: Path) -> CheckpointInfo | None:
    """The checkpoint to continue from: ``train.resume`` "auto" (the run dir's newest
    intact one, if any), "never", or a checkpoint directory."""
    if config.train.resume == "never":
        return None
    if config.train.resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(config.train.resume)
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MANIFEST_FILE})")
    info = CheckpointInfo(path, json.loads(manifest.read_text()))
    problem = verify(info)
    if problem is not None:
        raise ValueError(f"{path}: corrupt checkpoint ({problem})")
    return info


def train(
    config: RunConfig,
    progress: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train a DLRM on every day but the test day, checkpointing as configured.

    Run by every rank of a torchrun job (``dlrmflow train --nproc N``), or alone. Each rank
    reads its own splits; rank 0 writes the metrics, the plan and ``train_result.json``;
    every rank writes its shards of each checkpoint. A run directory holding a checkpoint
    continues from it (``train.resume``), bitwise as if it had never stopped.
    ``progress`` receives each metrics record as it is written (the CLI and the Prefect
    flow show it); it must not be slow.
    """
    env = DistEnv.from_env()
    tune_allocator()  # also when called outside the CLI (a Prefect worker, a notebook)
    init_distributed(config, env)
    rank0 = env.rank == 0
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(config.train.seed, compute_threads(config, env))
    manifest = read_manifest(config.data.url)
    spec, ids = _features(config, manifest, run_dir, env)
    # Local reader threads, or the reader servers of ``distributed.readers``: same batches.
    loader = make_train_loader(
        config,
        spec,
        ids,
        manifest.day_paths(config.data.url, manifest.train_days()),
        rank=env.rank,
        world_size=env.world_size,
    )
    model, parameters, stats, plan = _build_model(config, spec, env, run_dir)
    optimizer = dense_optimizer(parameters, config)
    # Summed, then divided by the global batch (all ranks' rows) and multiplied by the world
    # size that DDP and the embeddings' backward divide by: the gradient of the mean loss
    # over the global batch, however unevenly the ranks' batches are sized.
    loss_fn = nn.BCEWithLogitsLoss(reduction="sum")
    sharded = isinstance(model, ShardedDLRM)
    pipelined = sharded and config.distributed.pipeline
    tiered = isinstance(getattr(model, "embeddings", None), TieredEmbeddingBag)

    # Where the run stands; a checkpoint stores it, a resumed run continues it.
    state = {"step": 0, "epoch": 0, "rows": 0, "seconds": 0.0, "loss": None}
    resume_from = _resume_point(config, run_dir)
    if resume_from is not None:
        loader_state = restore(resume_from, model, optimizer)
        state.update(resume_from.manifest["progress"])
        if loader_state is not None:
            loader.load_state_dict(loader_state)
    metrics_path = run_dir / METRICS_FILE
    if rank0 and resume_from is None:
        metrics_path.unlink(missing_ok=True)

    def start(batch: Batch):
        """Begin fetching what the embeddings need (the sharded input all-to-all)."""
        return model.start_input_dist(batch.sparse, async_op=pipelined) if sharded else None

    def forward(batch: Batch, pending) -> tuple[torch.Tensor, int]:
        if not sharded:
            return model(batch.dense, batch.sparse), len(batch)
        received = pending.wait()
        return model.forward_received(batch.dense, received), sum(received.batch_sizes)

    window = {"loss": 0.0, "steps": 0, "rows": 0}
    start_time = window_start = time.perf_counter()
    elapsed_before = state["seconds"]

    def log_window() -> None:
        """Append one metrics record for the steps since the last one (a collective when
        distributed: the loss is averaged over the ranks)."""
        nonlocal window_start
        now = time.perf_counter()
        loss = torch.tensor([window["loss"] / window["steps"]], dtype=torch.float64)
        if sharded:
            dist.all_reduce(loss)
            loss /= env.world_size
        state["loss"] = float(loss)
        record = {
            "step": state["step"],
            "epoch": state["epoch"],
            "rows": state["rows"],
            "loss": state["loss"],
            "samples_per_s": window["rows"] / max(now - window_start, 1e-9),
            "elapsed_s": elapsed_before + now - start_time,
            "data_wait_s": loader.wait_seconds,
        }
        if stats is not None:
            steps_here = max(state["step"] - (resume_from.step if resume_from else 0), 1)
            record["comm_bytes_per_step"] = {
                kind: n // steps_here for kind, n in stats.snapshot().items()
            }
        window.update(loss=0.0, steps=0, rows=0)
        window_start = now
        if not rank0:
            return
        with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if progress is not None:
            progress(record)

    eval_loader = (
        test_loader(config, spec, ids, env)[0] if config.train.eval_every is not None else None
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

    # The newest checkpoint in this run dir, tracked here rather than listed from the disk:
    # every rank must take the same decisions, and rank 0 prunes while the others go on.
    # One resumed from elsewhere (``train.resume`` naming another run's) does not count.
    own = resume_from is not None and (
        resume_from.path.parent.resolve() == (run_dir / CHECKPOINTS_DIR).resolve()
    )
    saved = {"step": state["step"], "path": resume_from.path if own else None}

    def checkpoint(loader_state: dict) -> None:
        state["seconds"] = elapsed_before + time.perf_counter() - start_time
        saved["path"] = save_checkpoint(
            run_dir,
            model=model,
            optimizer=optimizer,
            config=config,
            spec=spec,
            progress=dict(state),
            loader_state=loader_state,
            plan=plan.to_dict() if plan is not None else None,
            metrics=dict(last_eval),
        )
        saved["step"] = state["step"]
        if rank0:
            prune_checkpoints(run_dir, config.train.keep_checkpoints)

    every = config.train.checkpoint_every
    max_steps = config.train.max_steps or float("inf")
    model.train()
    while state["epoch"] < config.train.epochs and state["step"] < max_steps:
        loader.set_epoch(state["epoch"])
        batches = _Batches(loader, env, spec)
        batch = batches.next()
        pending = start(batch) if batch is not None else None
        while batch is not None:
            step = state["step"] + 1
            # A checkpoint after this step records the reader before the next batch is
            # fetched: resuming then reads that batch again, exactly as this run will.
            save_now = every is not None and step % every == 0
            loader_state = loader.state_dict() if save_now else None
            # The next batch's input exchange runs while this one computes (pipelined).
            following = batches.next() if step < max_steps else None
            following_pending = start(following) if pipelined and following is not None else None
            if tiered and following is not None:
                # The next batch's rows load from disk into the cache while this one computes.
                model.embeddings.prefetch(following.sparse)
            logits, n = forward(batch, pending)
            loss = loss_fn(logits, batch.labels) * (env.world_size / n)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # also updates the touched embedding rows (fused optimizer)
            optimizer.step()
            state["step"] = step
            state["rows"] += n
            window["loss"] += loss.item()
            window["steps"] += 1
            window["rows"] += n
            if step % config.train.log_every == 0:
                log_window()
            if config.train.eval_every is not None and step % config.train.eval_every == 0:
                evaluate_now()
            if save_now:
                checkpoint(loader_state)
            if following is not None and not pipelined:
                following_pending = start(following)
            batch, pending = following, following_pending
        if batches.exhausted:
            state["epoch"] += 1
    if window["steps"]:
        log_window()
    loader.close()
    if tiered:
        model.embeddings.flush()
    if state["step"] == 0:
        raise ValueError(f"{config.data.url}: the training days hold no rows to train on")
    if saved["path"] is None or saved["step"] != state["step"]:
        checkpoint(loader.state_dict())
    seconds = time.perf_counter() - start_time
    rows_here = state["rows"] - (resume_from.manifest["progress"]["rows"] if resume_from else 0)
    result = TrainResult(
        steps=state["step"],
        rows=state["rows"],
        seconds=seconds,
        samples_per_s=rows_here / seconds,
        final_loss=state["loss"] if state["loss"] is not None else float("nan"),
        checkpoint=str(saved["path"]),
        world_size=env.world_size,
        data_wait_s=loader.wait_seconds,
        comm_bytes_per_step=(
            {k: n // max(state["step"], 1) for k, n in stats.snapshot().items()}
            if stats is not None
            else {}
        ),
        resumed_from_step=resume_from.step if resume_from else None,
        embedding_cache=model.embeddings.stats.to_dict() if tiered else {},
    )
    if rank0:
        (run_dir / RESULT_FILE).write_text(json.dumps(result.to_dict(), indent=1))
    if env.distributed:
        dist.barrier()
    return result

"""Evaluation on the held-out test day: AUC, log loss, NE and calibration to ``eval.json``.

One process, or every rank of a job: each rank scores its own splits of the test day
through the (sharded) model, all ranks stepping together, and rank 0 gathers every
prediction to compute the exact AUC (no histogram). The trainer calls ``predict`` every
``train.eval_every`` steps on the live model; ``evaluate`` scores a checkpoint, loaded at
whatever world size runs it. ``evaluation_settings`` resolves what ``dlrmflow evaluate``
may change of how a run is scored (its flags, ``--config`` and ``--set``): never the model.

A dataset with a weight column (``FeatureSpec.weight``) is scored as it was trained, each
row counting by its weight: the metrics that are weighted are listed under ``weighted``
in the result, beside ``weight_column`` and ``weight_sum``. Without one, the result is
what it always was.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import (
    ConfigError,
    DeviceType,
    DistributedConfig,
    KernelsType,
    RunConfig,
    Source,
    given_keys,
    recorded_config,
    resolve_config,
)
from dlrmflow.days import EVAL_KEY, Window, WindowError, describe, held_out_days
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.loader import ReaderLoader, make_loader
from dlrmflow.ingest.manifest import Manifest, check_dataset, read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.shares import RowKeys, day_shares
from dlrmflow.kernels.backends import check_kernels
from dlrmflow.memory import reset_peak_rss
from dlrmflow.train.model.device import resolve_device, use_device
from dlrmflow.train.model.dlrm import DLRM
from dlrmflow.train.model.dynamic_ids import id_map_counts
from dlrmflow.train.model.memory_budget import scratch_directory, scratch_tier_storage
from dlrmflow.train.model.parallelize import build_model, parallelize
from dlrmflow.train.planner.jobs import plan_for_job
from dlrmflow.train.run.calibration import (
    RELIABILITY_FILE,
    calibration_error,
    plot_reliability,
    reliability_table,
)
from dlrmflow.train.run.checkpoint import (
    dataset_digest,
    find_checkpoint,
    load_checkpoint,
    restore,
    trained_multi_hot,
)
from dlrmflow.train.run.data import IdMapper, batch_loader, load_ids
from dlrmflow.train.run.metrics import click_metrics
from dlrmflow.train.run.rank import (
    DistEnv,
    compute_threads,
    gather_peak_rss,
    init_distributed,
)
from dlrmflow.train.run.recalibration import (
    apply_recalibration,
    check_fit_rows,
    fit_recalibration,
)
from dlrmflow.train.run.rundir import rank0_lock

EVAL_FILE = "eval.json"


class NonFinitePredictions(DlrmflowError):
    """The model scores some rows NaN or infinite: its metrics would mean nothing."""


class NoRunDirectory(DlrmflowError):
    """``evaluate`` was given a run directory that does not exist."""


# The job's hosts and its collective timeout: also taken from DLRMFLOW_DISTRIBUTED__*
# variables (one set per host), as ``train`` takes them.
HOST_KEYS = (
    "distributed.nnodes",
    "distributed.node_rank",
    "distributed.rdzv_endpoint",
    "distributed.local_addr",
    "distributed.connect_timeout_s",
    "distributed.timeout_s",
)
# What ``dlrmflow evaluate --config/--set`` may set: on what, where, how and by how many
# ranks the run's model is scored. The model itself (architecture, features, optimizer,
# training) is the run's config.json, carried by its checkpoint: a file or --set changing
# it would describe another model than the one scored, so every other key is refused.
EVALUATION_KEYS = (
    "data.url",
    "data.eval_days",
    "eval.batch_size",
    "eval.max_rows",
    "train.device",
    "model.kernels",
    "distributed.nproc",
    *HOST_KEYS,
)


@dataclass(frozen=True)
class EvaluationSettings:
    """How ``evaluate`` scores a run. ``data_url``, ``eval_days``, ``batch_size`` and
    ``max_rows`` are None where not given: the run's own (its config.json's) then apply."""

    nproc: int
    data_url: str | None
    eval_days: Window
    batch_size: int | None
    max_rows: int | None
    device: DeviceType
    kernels: KernelsType
    distributed: DistributedConfig


def _given(source: Source) -> str:
    return f"--set {source.name}" if source.kind == "set" else str(source)


def evaluation_settings(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> EvaluationSettings:
    """The settings of one evaluation: a configuration file at ``path``, then
    ``section.key=value`` ``overrides``, then ``flags`` (``{"section.key": value}``, None
    when not given), each checked by the configuration's types, as ``train``'s are.

    Only ``EVALUATION_KEYS`` may be set: any other key is a ``ConfigError`` naming it and
    where it was set. The environment's ``DLRMFLOW_SECTION__KEY`` variables are checked as
    for every command, but only ``distributed.*`` ones apply (the hosts of a job, one set
    per host): a shell set up for training (``DLRMFLOW_DATA__URL``) does not change what a
    run is scored on.
    """
    for key, source in given_keys(path, overrides).items():
        if key not in EVALUATION_KEYS:
            raise ConfigError(
                f"{key} ({_given(source)}): not an evaluation setting; evaluate scores the "
                "run's model as its config.json defines it, and --config and --set may set "
                f"only {', '.join(EVALUATION_KEYS)}"
            )
    own = resolve_config(path, overrides, flags, env=False)
    # The hosts: the environment's too (validated whole, as every command does).
    hosts = resolve_config(path, overrides, flags).config.distributed
    config, chosen = own.config, own.sources
    settings = EvaluationSettings(
        nproc=config.distributed.nproc,
        data_url=config.data.url if "data.url" in chosen else None,
        eval_days=config.data.eval_days if "data.eval_days" in chosen else None,
        batch_size=config.eval.batch_size if "eval.batch_size" in chosen else None,
        max_rows=config.eval.max_rows if "eval.max_rows" in chosen else None,
        device=config.train.device,
        kernels=config.model.kernels,
        distributed=hosts,
    )
    return settings


def check_run_dir(run_dir: str | Path) -> None:
    """``NoRunDirectory`` unless ``run_dir`` is a directory: evaluation reads the run's ID
    mapping there and writes ``eval.json`` beside its checkpoints, so a missing one is a
    mistyped path, never a directory to create."""
    if not Path(run_dir).is_dir():
        raise NoRunDirectory(
            f"{run_dir}: no such run directory; evaluate scores a trained run in its own "
            "directory (give the --run-dir of a `dlrmflow train` run)"
        )


def test_loader(
    config,
    spec: FeatureSpec,
    ids,
    env: DistEnv,
    data_url: str | None = None,
    days: list[int] | None = None,
    pin_memory: bool = False,
    manifest: Manifest | None = None,
):
    """This rank's share of the held-out ``days`` (by default the run's eval window), in
    file order (page-locked for a CUDA model). ``manifest``: the dataset's, when the caller
    has read it already."""
    url = data_url or config.data.url
    manifest = read_manifest(url) if manifest is None else manifest
    if days is None:
        days = eval_window(config, manifest)
    if not days:
        raise WindowError(f"{EVAL_KEY}: none holds no day out: name the days to evaluate on")
    check_dataset(url, manifest, training=False, eval_days=days)  # a missing or empty day
    _, loader = batch_loader(
        manifest.day_paths(url, days, held_out=[]),
        spec,
        ids,
        batch_size=config.eval.batch_size,
        num_workers=config.train.num_workers,
        shuffle=False,
        rank=env.rank,
        world_size=env.world_size,
        pin_memory=pin_memory,
        days=manifest.path_days(url),
    )
    return loader


def keyed_loader(
    config: RunConfig,
    spec: FeatureSpec,
    ids: IdMapper,
    env: DistEnv,
    url: str,
    manifest: Manifest,
    days: list[int],
    pin_memory: bool = False,
) -> tuple[ReaderLoader, RowKeys]:
    """This rank's share of the one day in ``days`` (``ingest.shares``: the day's row
    groups dealt as the reader deals them, read in order by one reader) and the day-rows
    of its rows in that order: what a recalibration needs, each row's place in the day
    known whatever the rank count."""
    if len(days) != 1:
        raise WindowError(f"{EVAL_KEY}: a recalibration is fitted on one day, not {describe(days)}")
    check_dataset(url, manifest, training=False, eval_days=days)
    share = day_shares(url, manifest, days[0], env.world_size)[env.rank]
    transform = BatchTransform(spec, ids)
    dataset = ParquetBatchDataset(
        list(share.splits),
        spec.columns,
        config.eval.batch_size,
        shuffle=False,
        validate=transform.validate,
        transform=transform,
    )
    loader = make_loader(dataset, num_workers=0, pin_memory=pin_memory)
    return loader, RowKeys(share.splits, share.starts)


class OneHotModel(DlrmflowError):
    """A model trained on one-hot data asked to score a multi-hot dataset."""


def refuse_multi_hot(trained: bool | None, manifest: Manifest, url: str, model: object) -> None:
    """Refuse to score the multi-hot dataset at ``url`` with ``model`` when it trained on
    one-hot data (``trained`` False; None, unknown, lets it through). Its tables never saw
    a bag of several IDs: each list would be pooled into a vector unlike any it learned
    from, and the scores would be wrong without a sign of it."""
    if manifest.multi_hot and trained is False:
        raise OneHotModel(
            f"{url} is multi-hot (its sparse columns hold lists of IDs) and {model} was "
            "trained on one-hot data, which never pooled a list; score it with a model "
            "trained on multi-hot data"
        )


def eval_window(
    config: RunConfig, manifest: Manifest, trained: list[int] | None = None
) -> list[int]:
    """The days ``config`` evaluates on in ``manifest``'s dataset (``data.eval_days``, by
    default its test day), none of them among ``trained``."""
    available = [f.day for f in manifest.files]
    return held_out_days(config.data.eval_days, available, manifest.test_day, trained)


class Predictions(NamedTuple):
    """Every scored row's probability and label, and its weight where the dataset declares
    a weight column (None where it does not)."""

    probs: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor | None
    rows: torch.Tensor | None = None  # each row's index in its day, where keys were given


@torch.no_grad()
def predict(
    model: DLRM,
    loader,
    spec: FeatureSpec,
    env: DistEnv,
    max_rows: int | None = None,
    progress: Callable[[int], None] | None = None,
    keys: RowKeys | None = None,
) -> Predictions | None:
    """Probabilities, labels and (for a weighted dataset) weights of every test row, on
    rank 0 (None on the others); with ``keys`` (the day-rows of this rank's loader, read
    in order), each row's index in its day too.

    ``max_rows`` caps the rows scored in total (each rank scores its share of the cap).
    The model is put in eval mode for the pass and back in its previous mode after.
    Batches go to the model's device; the scores come back to the host.
    """
    device = next(model.dense_arch.parameters()).device
    weighted = spec.weight is not None
    was_training = model.training
    model.eval()
    limit = None if max_rows is None else math.ceil(max_rows / env.world_size)
    probs, labels, weights, rows = [], [], [], []
    seen = 0
    batches = iter(loader)
    while True:
        batch = next(batches, None) if limit is None or seen < limit else None
        if env.distributed:
            anyone = torch.tensor([int(batch is not None)], device="cpu")
            dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
            if not bool(anyone):
                break
            if batch is None:
                batch = Batch.empty(len(spec.dense), spec.sparse_names, weighted=weighted)
        elif batch is None:
            break
        batch = batch.to(device, non_blocking=True)
        take = len(batch) if limit is None else min(len(batch), limit - seen)
        logits = model(batch.dense, batch.sparse)
        logits = logits[:take]
        # An infinite logit would become a confident 0 or 1: mark it NaN, so the
        # evaluation refuses it rather than scoring a broken model.
        probs.append(torch.sigmoid(logits).masked_fill(~torch.isfinite(logits), math.nan).cpu())
        labels.append(batch.labels[:take].cpu())
        if weighted:
            weights.append(batch.sample_weights[:take].cpu())
        if keys is not None:
            rows.append(torch.from_numpy(keys.take(take)))
        seen += take
        if progress is not None and take:
            progress(take * env.world_size)
    model.train(was_training)
    none = torch.empty(0, device="cpu")
    mine = Predictions(
        torch.cat(probs) if probs else none,
        torch.cat(labels) if labels else none,
        None if not weighted else torch.cat(weights) if weights else none,
        None if keys is None else torch.cat(rows) if rows else none.long(),
    )
    if not env.distributed:
        return mine
    gathered = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(tuple(mine), gathered, dst=0)
    if gathered is None:
        return None
    out_probs = torch.cat([p for p, _, _, _ in gathered])
    out_labels = torch.cat([y for _, y, _, _ in gathered])
    out_weights = torch.cat([w for _, _, w, _ in gathered]) if weighted else None
    out_rows = torch.cat([r for _, _, _, r in gathered]) if keys is not None else None
    if max_rows is not None:
        out_probs, out_labels = out_probs[:max_rows], out_labels[:max_rows]
        out_weights = None if out_weights is None else out_weights[:max_rows]
        out_rows = None if out_rows is None else out_rows[:max_rows]
    return Predictions(out_probs, out_labels, out_weights, out_rows)


class UnweighableDay(DlrmflowError):
    """The held-out days' weights leave nothing to score: they sum to 0, or every row of
    one class weighs 0."""


def _metrics(scored: Predictions, url: str, days: list[int]) -> dict[str, Any]:
    """``click_metrics`` of the scored rows; for a weighted dataset, weights that leave
    no positive or no negative row, or sum to 0, are one line naming the days."""
    try:
        return click_metrics(scored.probs, scored.labels, scored.weights)
    except ValueError as e:
        if scored.weights is None:
            raise
        raise UnweighableDay(f"{url}: day {describe(days)} ({e})") from None


def evaluate(
    run_dir: str | Path,
    *,
    data_url: str | None = None,
    checkpoint: str | Path | None = None,
    max_rows: int | None = None,
    progress: Callable[[int], None] | None = None,
    device: str = "auto",
    kernels: str = "auto",
    batch_size: int | None = None,
    eval_days: Window = None,
    recalibrate: float | None = None,
    recalibrate_rows: str = "spread",
) -> dict[str, float]:
    """Score a checkpoint of ``run_dir`` on the held-out days of its dataset (or
    ``data_url``'s): ``eval_days`` (a window, see ``dlrmflow.days``), else the run's
    ``data.eval_days``, else the dataset's test day. Days the checkpoint trained on are
    refused in one line (on the run's own dataset).

    Alone, or on every rank of a torchrun job (``dlrmflow evaluate --nproc N``): the
    checkpoint is loaded at this world size (resharded under this job's plan). The ID
    mapping is the run's, so test IDs map to the rows they trained; IDs never seen in
    training hit untrained or OOV rows, exactly as they would in serving.
    ``progress(n)`` receives the rows scored per batch. ``device`` ("auto", "cpu" or
    "cuda", as ``train.device``) is where the model runs and ``kernels`` (as
    ``model.kernels``) what runs it, whatever device and kernels trained it;
    ``batch_size`` replaces the run's ``eval.batch_size`` (memory, not the metrics).
    ``recalibrate`` (a share of the rows, on one day): also fit a recalibration on that
    share of the day's rows (``recalibrate_rows``: which, ``FIT_ROWS``) and judge it on
    the rest (``train.run.recalibration``), under
    ``recalibration_fitted``; a checkpoint that carries one is scored with it applied
    (``recalibration``).
    """
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    # Before scoring: a day that gives no recalibration is recorded, a bad choice refused.
    check_fit_rows(recalibrate_rows)
    env = DistEnv.from_env()
    where = resolve_device(device, env.local_rank, key="evaluate --device")
    check_kernels(kernels, where)
    use_device(where)
    if env.distributed:
        # Only the configuration, to join the job; every rank verifies its share below.
        info = find_checkpoint(checkpoint if checkpoint is not None else run_dir, verified=False)
        init_distributed(recorded_config(info.manifest["config"]), env, where)
    with rank0_lock(run_dir, "evaluate", env.rank, env.distributed):
        try:
            return _evaluate(
                run_dir,
                env,
                data_url,
                checkpoint,
                max_rows,
                progress,
                where,
                kernels,
                batch_size,
                eval_days,
                recalibrate,
                recalibrate_rows,
            )
        finally:
            shutil.rmtree(scratch_directory(run_dir, env.rank), ignore_errors=True)


def _evaluate(
    run_dir: Path,
    env: DistEnv,
    data_url: str | None,
    checkpoint: str | Path | None,
    max_rows: int | None,
    progress: Callable[[int], None] | None,
    device: torch.device,
    kernels: str,
    batch_size: int | None = None,
    eval_days: Window = None,
    recalibrate: float | None = None,
    recalibrate_rows: str = "spread",
) -> dict[str, float]:
    # eval.json's peak resident set is the evaluation's own: where this process trained
    # first (the flows, the demo), the peak since it started would be the training's.
    reset_peak_rss()
    if env.distributed:
        info = find_checkpoint(checkpoint if checkpoint is not None else run_dir)
        config = recorded_config(info.manifest["config"])
        config.model.kernels = kernels
        spec = FeatureSpec.from_dict(info.manifest["spec"])
        plan = plan_for_job(config, spec, env.world_size, env.local_world_size)
        tiers = scratch_tier_storage(config, spec, env.rank, run_dir)
        model = parallelize(
            build_model(config, spec), config, device=device, plan=plan, tiers=tiers
        )
        restore(info, model, None)
        step, path, trained = info.step, info.path, info.manifest.get("train_days")
        multi_hot = trained_multi_hot(info.manifest)
        applied = apply_recalibration(info.path, model.dense_arch)
    else:
        ckpt = load_checkpoint(
            checkpoint if checkpoint is not None else run_dir,
            device,
            kernels,
            scratch=scratch_directory(run_dir, env.rank),
        )
        config, spec, model, step, path = ckpt.config, ckpt.spec, ckpt.model, ckpt.step, ckpt.path
        trained, multi_hot, applied = ckpt.trained_days, ckpt.multi_hot, ckpt.recalibration
    own_data = data_url is None or data_url == config.data.url
    if eval_days is not None:
        config.data.eval_days = eval_days
    if batch_size is not None:
        config.eval.batch_size = batch_size
    if model.embeddings.rows_on_disk:
        # The cache was sized for a training batch's rows: score in batches no larger.
        config.eval.batch_size = min(config.eval.batch_size, config.train.batch_size)
    torch.set_num_threads(compute_threads(config, env))
    ids = load_ids(config.features.ids, spec, run_dir)
    url = data_url or config.data.url
    manifest = read_manifest(url)
    refuse_multi_hot(multi_hot, manifest, url, path)
    held_out = eval_window(config, manifest, trained if own_data else [])
    keys = None
    if recalibrate is None:
        loader = test_loader(
            config,
            spec,
            ids,
            env,
            url,
            held_out,
            pin_memory=device.type == "cuda",
            manifest=manifest,
        )
    else:
        loader, keys = keyed_loader(
            config, spec, ids, env, url, manifest, held_out, pin_memory=device.type == "cuda"
        )
    start = time.perf_counter()
    limit = max_rows if max_rows is not None else config.eval.max_rows
    try:
        scored = predict(model, loader, spec, env, limit, progress, keys)
    finally:
        loader.close()
    seconds = time.perf_counter() - start
    peaks = gather_peak_rss(env)
    # In a job, every rank's shards of the maps, summed (a collective on every rank).
    looked_up = id_map_counts(model.embeddings, ("lookups", "default_lookups", "rows_in_use"))
    if scored is None:
        return {}
    if len(scored.probs) == 0:
        raise DlrmflowError(f"{url}: day {describe(held_out)} holds no rows to evaluate on")
    finite = torch.isfinite(scored.probs)
    if not bool(finite.all()):
        raise NonFinitePredictions(
            f"{path}: the model predicts NaN or infinity for {int((~finite).sum())} of "
            f"{len(finite)} test rows; its weights are not usable"
        )
    metrics = _metrics(scored, url, held_out)
    if applied is not None:
        metrics["recalibration"] = {"shift": applied.shift, "day": applied.day}
    if recalibrate is not None:
        assert scored.rows is not None
        try:
            fitted = fit_recalibration(
                scored.probs,
                scored.labels,
                scored.weights,
                scored.rows,
                held_out[0],
                recalibrate,
                recalibrate_rows,
            )
            metrics["recalibration_fitted"] = fitted.to_dict()
        except ValueError as e:  # the version is then judged without one, and says why
            metrics["recalibration_skipped"] = str(e)
    table = reliability_table(scored.probs, scored.labels, weights=scored.weights)
    if spec.weight is not None:
        # By the weights of the declared column, as the training loss counted the rows.
        metrics["weighted"].append("calibration_error")
        metrics["weight_column"] = spec.weight
    metrics.update(
        {
            "calibration_error": calibration_error(table),
            "reliability": table,
            **({"test_day": held_out[0]} if len(held_out) == 1 else {}),
            "eval_days": held_out,
            # What was scored: another dataset's test day (--data) is as valid a score.
            "data_url": url,
            "dataset_digest": dataset_digest(manifest),
            "checkpoint": str(path),
            "step": step,
            "eval_seconds": seconds,
            "world_size": env.world_size,
            "batch_size": config.eval.batch_size,  # each rank's
            "peak_rss_bytes": peaks,
        }
    )
    if looked_up:
        # Dynamic tables: how many of the day's lookups found no row of their own.
        metrics["id_maps"] = {
            name: {**c, "default_share": c["default_lookups"] / max(c["lookups"], 1)}
            for name, c in looked_up.items()
        }
    write_atomic(run_dir / EVAL_FILE, json.dumps(metrics, indent=2) + "\n")
    plot_reliability(table, run_dir / RELIABILITY_FILE)
    return metrics

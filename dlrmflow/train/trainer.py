"""The single-process training loop: reader -> DLRM -> BCE loss -> optimizers.

Every knob comes from ``RunConfig``; the loop stays flat so it can be read top to bottom.
Metrics go to ``RUN_DIR/metrics.jsonl`` every ``train.log_every`` steps and a checkpoint
to ``RUN_DIR/checkpoint.pt`` at the end.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from dlrmflow.config import RunConfig
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.train.checkpoint import save_checkpoint
from dlrmflow.train.data import batch_loader, fit_features
from dlrmflow.train.model import DLRM, embedding_optimizer

METRICS_FILE = "metrics.jsonl"


@dataclass
class TrainResult:
    """What a training run did, for the summary and the flow's report."""

    steps: int
    rows: int
    seconds: float
    samples_per_s: float
    final_loss: float
    checkpoint: str

    def to_dict(self) -> dict:
        return asdict(self)


def dense_optimizer(model: DLRM, config: RunConfig) -> torch.optim.Optimizer:
    """The torch optimizer of the MLPs and the interaction (every parameter of the model:
    the embedding weights are buffers updated by their own fused backward)."""
    if config.train.optimizer == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=config.train.lr)
    return torch.optim.SGD(model.parameters(), lr=config.train.lr)


def compute_threads(config: RunConfig) -> int:
    """torch's intra-op threads: ``train.threads``, else the cores the readers leave free.

    Oversubscribed cores are far worse than idle ones: OpenMP threads that spin while a
    reader holds their core slowed training twentyfold in measurements on 2 cores.
    """
    if config.train.threads is not None:
        return config.train.threads
    return max(1, (os.cpu_count() or 1) - config.train.num_workers)


def seed_everything(seed: int, threads: int) -> None:
    """Same seed, data and thread count -> bitwise-identical weights."""
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)


def train(
    config: RunConfig,
    progress: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train a DLRM on every day but the test day and save the checkpoint.

    ``progress`` receives each metrics record as it is written (the CLI and the Prefect
    flow show it); it must not be slow.
    """
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(config.train.seed, compute_threads(config))
    manifest = read_manifest(config.data.url)
    spec, ids = fit_features(config, manifest, run_dir)
    dataset, loader = batch_loader(
        manifest.day_paths(config.data.url, manifest.train_days()),
        spec,
        ids,
        batch_size=config.train.batch_size,
        num_workers=config.train.num_workers,
        shuffle=config.train.shuffle,
        shuffle_window=config.train.shuffle_window,
        seed=config.train.seed,
    )
    model = DLRM(spec, config.model, embedding_optimizer(config.train), seed=config.train.seed)
    optimizer = dense_optimizer(model, config)
    loss_fn = nn.BCEWithLogitsLoss()

    metrics_path = run_dir / METRICS_FILE
    metrics_path.unlink(missing_ok=True)
    metrics_file = metrics_path.open("a")
    step = rows = 0
    epoch = 0
    window = {"loss": 0.0, "steps": 0, "rows": 0}
    last_loss = float("nan")
    start = window_start = time.perf_counter()

    def log_window() -> None:
        """Append one metrics record for the steps since the last one."""
        nonlocal last_loss, window_start
        now = time.perf_counter()
        last_loss = window["loss"] / window["steps"]
        record = {
            "step": step,
            "epoch": epoch,
            "rows": rows,
            "loss": last_loss,
            "samples_per_s": window["rows"] / max(now - window_start, 1e-9),
            "elapsed_s": now - start,
        }
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        if progress is not None:
            progress(record)
        window.update(loss=0.0, steps=0, rows=0)
        window_start = now

    max_steps = config.train.max_steps or float("inf")
    model.train()
    with metrics_file:
        while epoch < config.train.epochs and step < max_steps:
            dataset.set_epoch(epoch)
            for batch in loader:
                logits = model(batch.dense, batch.sparse)
                loss = loss_fn(logits, batch.labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # also updates the touched embedding rows (fused optimizer)
                optimizer.step()
                step += 1
                rows += len(batch)
                window["loss"] += loss.item()
                window["steps"] += 1
                window["rows"] += len(batch)
                if step % config.train.log_every == 0:
                    log_window()
                if step >= max_steps:
                    break
            epoch += 1
        if window["steps"]:
            log_window()
    seconds = time.perf_counter() - start
    if step == 0:
        raise ValueError(f"{config.data.url}: the training days hold no rows to train on")
    checkpoint = save_checkpoint(
        run_dir,
        model=model,
        optimizer=optimizer,
        config=config,
        spec=spec,
        step=step,
        rows=rows,
        loader_state=loader.state_dict(),
    )
    return TrainResult(
        steps=step,
        rows=rows,
        seconds=seconds,
        samples_per_s=rows / seconds,
        final_loss=last_loss,
        checkpoint=str(checkpoint),
    )

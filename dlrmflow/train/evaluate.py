"""Evaluation on the held-out test day: AUC, log loss, NE and calibration to ``eval.json``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.train.checkpoint import load_checkpoint
from dlrmflow.train.data import batch_loader, load_ids
from dlrmflow.train.metrics import click_metrics
from dlrmflow.train.trainer import compute_threads

EVAL_FILE = "eval.json"


def evaluate(
    run_dir: str | Path,
    *,
    data_url: str | None = None,
    checkpoint: str | Path | None = None,
    max_rows: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Score the checkpoint of ``run_dir`` on the test day of its dataset (or ``data_url``).

    The ID mapping (hash sizes or vocabulary) is the one saved with the run, so test IDs map
    to the same rows as in training; IDs never seen in training hit untrained or OOV rows,
    exactly as they would in serving. ``progress(n)`` receives the rows scored per batch.
    """
    run_dir = Path(run_dir)
    ckpt = load_checkpoint(checkpoint if checkpoint is not None else run_dir)
    config = ckpt.config
    torch.set_num_threads(compute_threads(config))
    url = data_url or config.data.url
    manifest = read_manifest(url)
    ids = load_ids(config.features.ids, ckpt.spec, run_dir)
    _, loader = batch_loader(
        manifest.day_paths(url, [manifest.test_day]),
        ckpt.spec,
        ids,
        batch_size=config.eval.batch_size,
        num_workers=config.train.num_workers,
        shuffle=False,
    )
    limit = max_rows if max_rows is not None else config.eval.max_rows
    probs, labels = [], []
    seen = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in loader:
            take = len(batch) if limit is None else min(len(batch), limit - seen)
            logits = ckpt.model(batch.dense, batch.sparse)
            probs.append(torch.sigmoid(logits[:take]))
            labels.append(batch.labels[:take])
            seen += take
            if progress is not None:
                progress(take)
            if limit is not None and seen >= limit:
                break
    seconds = time.perf_counter() - start
    metrics = click_metrics(torch.cat(probs), torch.cat(labels))
    metrics.update(
        {
            "test_day": manifest.test_day,
            "checkpoint": str(ckpt.path),
            "step": ckpt.step,
            "eval_seconds": seconds,
        }
    )
    (run_dir / EVAL_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics

"""Precision benchmark: ``train.precision`` bf16 against fp32, speed and AUC, on this device.

Two model configurations train one epoch each on the demo's dataset (the default data
configuration: 5 training days of 200k synthetic rows and a held-out test day) and are
then evaluated on the test day:

- ``demo``: the demo's model and global batch (the default ``RunConfig``: dim 16, bottom
  MLP 64-16, top MLP 128-64, batch 2048) in one process;
- ``train_benchmark``: the training benchmark's model (``dlrmflow.bench.train``: dim 64,
  bottom MLP 512-256-64, top MLP 512-256, batch 4096, row-wise Adagrad at lr 0.01).

The baseline of each bf16 run is the fp32 run of the same configuration: the same data,
seed, threads, allocator setting and process, the two taking turns (the order alternates
between rounds), each after an untimed warm-up run of a few steps in both precisions.
Ratios: bf16 samples/s ÷ fp32 samples/s; the AUCs are listed side by side (bf16 rounds
the MLPs' activations to 8 bits of mantissa; the embeddings and every optimizer state
stay fp32). Only the dense arch changes precision, so the speed-up is bounded by its
share of a step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from dlrmflow.bench.machine import describe_machine
from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.runtime.glibc_malloc import applied_threshold, tune_allocator
from dlrmflow.train.model.device import autocast_supported
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.trainer import train

BASELINE = (
    "the same configuration with train.precision=fp32: same data, seed, threads, allocator "
    "and process, in turn with bf16 after an untimed warm-up of both; ratio = bf16 "
    "samples/s ÷ fp32 samples/s (> 1: bf16 faster)"
)
CONFIGS = {
    "demo": {"model": {}, "train": {}},
    "train_benchmark": {
        "model": {"embedding_dim": 64, "bottom_mlp": [512, 256, 64], "top_mlp": [512, 256]},
        "train": {"batch_size": 4096, "dense_optimizer": "adagrad", "lr": 0.01},
    },
}
QUICK_DATA = {"days": 3, "rows_per_day": 4_000, "row_group_size": 2_000}
QUICK_MODEL = {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]}
WARMUP_STEPS = 5


def _config(name: str, data_url: str, run_dir: Path, precision: str, quick: bool) -> RunConfig:
    overrides = CONFIGS[name]
    model = QUICK_MODEL if quick else overrides["model"]
    train_options = {**overrides["train"], "batch_size": 256} if quick else overrides["train"]
    return RunConfig.model_validate(
        {
            "run_dir": str(run_dir),
            "data": {"url": data_url, **(QUICK_DATA if quick else {})},
            "model": model,
            "train": {
                **train_options,
                "precision": precision,
                "device": "cpu",
                "resume": "never",
                "log_every": 1000,
            },
        }
    )


def _run(name: str, data_url: str, work: Path, precision: str, quick: bool, steps=None) -> dict:
    run_dir = work / f"{name}_{precision}"
    config = _config(name, data_url, run_dir, precision, quick)
    config.train.max_steps = steps
    result = train(config)
    if steps is not None:  # a warm-up: nothing to score
        return {}
    metrics = evaluate(run_dir, device="cpu")
    return {
        "samples_per_s": result.samples_per_s,
        "seconds": result.seconds,
        "steps": result.steps,
        "final_loss": result.final_loss,
        "auc": metrics["auc"],
        "logloss": metrics["logloss"],
        "ne": metrics["ne"],
    }


def run_precision_benchmark(
    data_url: str | None = None, *, rounds: int = 1, quick: bool = False
) -> dict[str, object]:
    """Train and evaluate each configuration in fp32 and bf16 (``rounds`` times each, the
    best samples/s counting); return the JSON record. ``data_url``: an existing dataset
    (default: the demo's, generated in a temporary directory)."""
    tune_allocator()
    with tempfile.TemporaryDirectory(prefix="dlrmflow-precision-") as tmp:
        work = Path(tmp)
        if data_url is None:
            data_url = str(work / "data")
            generate_dataset(DataConfig(url=data_url, **(QUICK_DATA if quick else {})))
        manifest = read_manifest(data_url)
        results: dict[str, dict[str, dict]] = {}
        ratios: dict[str, float] = {}
        for name in CONFIGS:
            for precision in ("fp32", "bf16") if not quick else ():  # quick: no speed
                _run(name, data_url, work, precision, quick, steps=WARMUP_STEPS)
            runs: dict[str, list[dict]] = {"fp32": [], "bf16": []}
            for round_index in range(rounds):
                order = ("fp32", "bf16") if round_index % 2 == 0 else ("bf16", "fp32")
                for precision in order:
                    runs[precision].append(_run(name, data_url, work, precision, quick))
            best = {p: max(r, key=lambda x: x["samples_per_s"]) for p, r in runs.items()}
            results[name] = {**best, "all_rounds": runs}
            ratios[f"{name}_bf16_samples_per_s"] = (
                best["bf16"]["samples_per_s"] / best["fp32"]["samples_per_s"]
            )
    return {
        "benchmark": "precision",
        "baseline": BASELINE,
        "configs": {
            name: _config(name, "", Path(), "fp32", quick).model_dump(
                include={
                    "model": True,
                    "train": {"batch_size", "lr", "optimizer", "dense_optimizer"},
                }
            )
            for name in CONFIGS
        },
        "train_rows": sum(f.rows for f in manifest.files if f.day != manifest.test_day),
        "rounds": rounds,
        "device": "cpu",
        "bf16_native": autocast_supported(torch.device("cpu")),
        "torch_threads": torch.get_num_threads(),
        "malloc_mmap_threshold": applied_threshold(),
        "results": results,
        "ratios": ratios,
        "machine": describe_machine(),
    }

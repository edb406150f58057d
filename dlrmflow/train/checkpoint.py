"""Single-process checkpoints: one ``torch.save`` file with everything needed to evaluate.

The file carries the model (embedding weights with their fused optimizer state) and the
dense optimizer's state, the run configuration, the feature spec
(so table sizes need no dataset to rebuild) and the reader's state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlrmflow.config import RunConfig, build_config
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.train.model import DLRM, embedding_optimizer

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model ready for inference plus what produced it."""

    model: DLRM
    config: RunConfig
    spec: FeatureSpec
    step: int
    rows: int
    path: Path


def save_checkpoint(
    run_dir: Path,
    *,
    model: DLRM,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    spec: FeatureSpec,
    step: int,
    rows: int,
    loader_state: dict[str, Any],
) -> Path:
    """Write ``RUN_DIR/checkpoint.pt`` atomically (temporary file, then rename)."""
    path = run_dir / CHECKPOINT_FILE
    tmp = path.with_suffix(".pt.tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "config": config.model_dump(),
            "spec": spec.to_dict(),
            "step": step,
            "rows": rows,
            "loader": loader_state,
        },
        tmp,
    )
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Rebuild the model of a checkpoint file (or of ``DIR/checkpoint.pt`` for a run dir)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint; train first (`dlrmflow train`)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
        config = build_config(data["config"])
        spec = FeatureSpec.from_dict(data["spec"])
        model = DLRM(spec, config.model, embedding_optimizer(config.train))
        model.load_state_dict(data["model"])
    except (KeyError, RuntimeError, EOFError) as e:
        raise ValueError(f"{path}: unreadable or incompatible checkpoint ({e})") from e
    model.eval()
    return Checkpoint(model, config, spec, int(data["step"]), int(data["rows"]), path)

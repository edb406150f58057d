"""What scores the rows: a checkpoint's model or a servable export, behind one interface.

``--model`` names a run directory (its newest intact checkpoint), a checkpoint directory,
or a servable export file (``dlrmflow export --format torch-export``). ``identify_model``
pins which model that is and its digest without loading it (the output directory is
checked against the digest before any work); ``load_model`` loads it for one process.
Both give what batching needs: the feature spec, the run's configuration and ID mapping.

The digest is what says two outputs came from the same model: a checkpoint's is the
SHA-256 of its manifest's per-file checksums (so the same weights wherever the
checkpoint lies), an export's that of its file's bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlrmflow.config import RunConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.train.run.checkpoint import CheckpointInfo, find_checkpoint
from dlrmflow.train.run.data import VOCAB_FILE, IdMapper, load_ids

CHECKPOINT = "checkpoint"
SERVABLE = "servable"


class ModelNotFound(DlrmflowError, FileNotFoundError):
    """``--model`` names nothing that can score: no such path, or not a model."""


@dataclass(frozen=True)
class ModelIdentity:
    """Which model scores: its kind, the checkpoint directory or export file, its digest."""

    kind: str  # CHECKPOINT or SERVABLE
    path: str
    digest: str
    step: int | None = None  # a servable's is known once loaded

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "step": self.step, "digest": self.digest}


@dataclass
class ScoringModel:
    """A loaded model: ``predict(batch)`` gives float32 probabilities ``[len(batch)]`` on
    the CPU, NaN where the model's output is not finite."""

    identity: ModelIdentity
    config: RunConfig
    spec: FeatureSpec
    ids: IdMapper
    predict: Callable[[Batch], torch.Tensor]
    # Rows of a batch at most: a model with tables on disk has a cache sized for a
    # training batch's rows, so it scores in batches no larger (as evaluation does).
    largest_batch: int | None = None


def _checkpoint_digest(info: CheckpointInfo) -> str:
    files = info.manifest.get("files", {})
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _missing(path: Path) -> ModelNotFound:
    return ModelNotFound(
        f"{path}: no such model; give a run directory, a checkpoint directory or a servable "
        "export (`dlrmflow export --format torch-export`)"
    )


def identify_model(path: str | Path) -> ModelIdentity:
    """The model ``path`` names, pinned: a run directory resolves to its newest intact
    checkpoint (verified against its checksums), so every process loads that one."""
    path = Path(path)
    if not path.exists():
        raise _missing(path)
    if path.is_file():
        from dlrmflow.train.run.exported_model import is_servable

        if not is_servable(path):
            raise ModelNotFound(
                f"{path}: not a servable export; give a run directory, a checkpoint directory "
                "or a `dlrmflow export --format torch-export` file"
            )
        return ModelIdentity(SERVABLE, str(path.resolve()), _file_digest(path))
    info = find_checkpoint(path)
    return ModelIdentity(CHECKPOINT, str(info.path.resolve()), _checkpoint_digest(info), info.step)


def trained_on_multi_hot(identity: ModelIdentity) -> bool | None:
    """Whether the model ``identity`` pins trained on multi-hot data (None: not recorded),
    read from its checkpoint's manifest or its export's metadata without loading it."""
    if identity.kind == SERVABLE:
        from dlrmflow.train.run.exported_model import archive_metadata

        recorded = (archive_metadata(Path(identity.path)) or {}).get("trained_multi_hot")
        return None if recorded is None else bool(recorded)
    from dlrmflow.train.run.checkpoint import trained_multi_hot

    return trained_multi_hot(find_checkpoint(identity.path).manifest)


def _run_dir_of(checkpoint: Path) -> Path:
    """The run directory of a checkpoint directory (``RUN_DIR/checkpoints/step_N``)."""
    return checkpoint.parent.parent


def _ids(config: RunConfig, spec: FeatureSpec, run_dir: Path | None, model: str) -> IdMapper:
    """The run's ID mapping: hashing needs only the spec; a vocabulary (the run's
    ``features.ids``, or a feature's own ``ids: vocab``) is the run's file, which an
    export does not carry (its metadata names the run directory it came from)."""
    looked_up = [f.name for f in spec.sparse if f.mapping(config.features.ids) == "vocab"]
    if looked_up:
        where = run_dir / VOCAB_FILE if run_dir is not None else None
        if where is None or not where.is_file():
            why = (
                "features.ids=vocab"
                if config.features.ids == "vocab"
                else f"feature {looked_up[0]}: ids vocab"
            )
            raise ModelNotFound(
                f"{model}: its IDs map through a vocabulary ({why}), and "
                f"{where or 'no run directory'} holds none; score the run directory instead"
            )
    return load_ids(config.features.ids, spec, run_dir if run_dir is not None else Path("."))


def load_model(
    identity: ModelIdentity,
    device: torch.device,
    kernels: str = "auto",
    scratch: Path | None = None,
) -> ScoringModel:
    """The model ``identity`` pinned, loaded in this process on ``device`` (a servable
    runs on the CPU, as its program does). ``scratch``: where a run trained under an
    embedding memory budget keeps the rows beyond it (see ``load_checkpoint``)."""
    path = Path(identity.path)
    if identity.kind == SERVABLE:
        from dlrmflow.train.run.exported_model import load_servable

        servable = load_servable(path)
        step = servable.metadata.get("step")
        run_dir = servable.metadata.get("run_dir")
        ids = _ids(
            servable.config, servable.spec, Path(run_dir) if run_dir else None, identity.path
        )

        def predict_servable(batch: Batch) -> torch.Tensor:
            probs = servable.predict_batch(batch).float()
            return probs.masked_fill(~torch.isfinite(probs), torch.nan)

        pinned = ModelIdentity(SERVABLE, identity.path, identity.digest, step)
        return ScoringModel(pinned, servable.config, servable.spec, ids, predict_servable)

    from dlrmflow.train.run.checkpoint import load_checkpoint

    ckpt = load_checkpoint(path, device, kernels, scratch=scratch)
    model = ckpt.model
    model.eval()
    ids = _ids(ckpt.config, ckpt.spec, _run_dir_of(ckpt.path), identity.path)

    @torch.no_grad()
    def predict_checkpoint(batch: Batch) -> torch.Tensor:
        batch = batch.to(device, non_blocking=True)
        logits = model(batch.dense, batch.sparse)
        # As evaluation does: an infinite logit would be a confident 0 or 1; NaN marks it.
        probs = torch.sigmoid(logits).masked_fill(~torch.isfinite(logits), torch.nan)
        return probs.float().cpu()

    largest = ckpt.config.train.batch_size if model.embeddings.rows_on_disk else None
    return ScoringModel(identity, ckpt.config, ckpt.spec, ids, predict_checkpoint, largest)

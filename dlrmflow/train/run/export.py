"""Export a checkpoint as one safetensors file: the whole model, by parameter name.

For serving and for comparing runs: every embedding table whole (``embeddings.<table>``,
``[rows, dim]``) whatever the sharding and world size that trained it, and every dense
parameter (``dense_arch.<name>``). The optimizer state stays in the checkpoint. The
file's metadata carries the configuration, the feature spec and the step, so the model
can be rebuilt from the file alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from dlrmflow.atomic_writes import atomic_path, output_target
from dlrmflow.train.model.dynamic_ids import refuse_dynamic_ids
from dlrmflow.train.run.checkpoint import load_checkpoint


def export_model(checkpoint: str | Path, out: str | Path) -> dict[str, object]:
    """Write the model of ``checkpoint`` (a checkpoint or run directory) to ``out``.

    Written beside ``out`` and renamed over it (see ``dlrmflow.atomic_writes``): a directory,
    device or other special file there is refused before any work, a symlink is written
    through, and a full disk leaves whatever was at ``out`` as it was.
    """
    output_target(out)
    ckpt = load_checkpoint(checkpoint)
    refuse_dynamic_ids(ckpt.spec, "an export (the map of raw IDs to rows)")
    bag = ckpt.model.embeddings
    tensors = {f"embeddings.{name}": bag.table(name).contiguous() for name in bag.names}
    tensors.update(
        {f"dense_arch.{k}": v.contiguous() for k, v in ckpt.model.dense_arch.state_dict().items()}
    )
    out = Path(out)
    metadata = {
        "config": json.dumps(ckpt.config.model_dump()),
        "spec": json.dumps(ckpt.spec.to_dict()),
        "step": str(ckpt.step),
        "checkpoint": str(ckpt.path),
    }
    with atomic_path(out) as temporary:
        save_file(tensors, str(temporary), metadata=metadata)
    return {
        "out": str(out),
        "checkpoint": str(ckpt.path),
        "step": ckpt.step,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": out.stat().st_size,
    }

"""Export a checkpoint as one safetensors file: the whole model, by parameter name.

For serving and for comparing runs: every embedding table whole (``embeddings.<table>``,
``[rows, dim]``) whatever the sharding and world size that trained it, and every dense
parameter (``dense_arch.<name>``); a dynamic table's map of raw IDs to its rows too
(``id_maps.<table>.<array>``, or ``id_maps.<table>.<shard>.<array>`` for a map of
several shards; int64, ``ShardedIdMap.arrays``), without which its rows mean nothing.
The optimizer state stays in the checkpoint. The file's metadata carries the
configuration, the feature spec and the step, so the model can be rebuilt from the file
alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dlrmflow.atomic_writes import atomic_path, output_target
from dlrmflow.train.model.dynamic_ids import id_map_arrays
from dlrmflow.train.run.checkpoint import load_checkpoint


def export_model(checkpoint: str | Path, out: str | Path) -> dict[str, object]:
    """Write the model of ``checkpoint`` (a checkpoint or run directory) to ``out``.

    Written beside ``out`` and renamed over it (see ``dlrmflow.atomic_writes``): a directory,
    device or other special file there is refused before any work, a symlink is written
    through, and a full disk leaves whatever was at ``out`` as it was.
    """
    output_target(out)
    ckpt = load_checkpoint(checkpoint)
    bag = ckpt.model.embeddings
    tensors = {f"embeddings.{name}": bag.table(name).contiguous() for name in bag.names}
    # Dynamic tables: the map of raw IDs to those rows, without which they mean nothing
    # (``ShardedIdMap.arrays``: int64, IDs as their bit patterns).
    for name, arrays in id_map_arrays(bag).items():
        for key, array in arrays.items():
            tensors[f"id_maps.{name}.{key}"] = torch.from_numpy(array.copy())
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

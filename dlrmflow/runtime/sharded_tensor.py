"""A table sharded over ranks as one checkpointable tensor: torch's ``ShardedTensor``.

A model-parallel table is split by the plan into uneven row ranges and column blocks, and
each shard is checkpointed in row chunks. ``torch.distributed.checkpoint`` (DCP) reshards
on load when it is given one tensor per table that says where every piece of it lies
(global offsets and sizes, and the rank holding it): a checkpoint then loads under any
other plan or world size, each rank reading the rows and columns it now holds.
``ShardedTensor`` says exactly that. The public ``DTensor`` cannot: its placements shard
a dimension into even parts or replicate it, not into a plan's uneven ranges and blocks.

What it reaches into, written against torch 2.13.0: ``torch.distributed._shard``'s
``ShardMetadata``, ``sharded_tensor.Shard``, ``ShardedTensor``, ``ShardedTensorMetadata``
and ``TensorProperties``, and ``ShardedTensor._init_from_local_shards_and_global_metadata``,
which builds one from this rank's shards and every rank's metadata without a collective
(each rank knows the plan; the public ``init_from_local_shards`` gathers the metadata over
the process group for every tensor of a checkpoint). Gain: checkpoints that reshard on
load, with no table gathered onto one rank and no shard copied (the local shards are
views of the bags' memory).

Fallback: none public. Where torch no longer has the module, ``sharded_tensor`` raises
``MissingPiece`` in one line naming the torch version; the import of this module does
not fail, so everything that writes no sharded checkpoint still runs.
``tests/runtime/test_sharded_tensor.py`` saves and reshards a table through it and fails
when the installed torch no longer has the pieces.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from dlrmflow.runtime.missing import MissingPiece

# torch marks ShardedTensor deprecated in favour of DTensor, which cannot say a plan's
# uneven shards (above): the choice is deliberate, and the warning a resume printed on
# every rank told the user nothing to do.
warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)

CHECKED_AGAINST = "torch 2.13.0"
PIECE = "torch.distributed._shard's ShardedTensor._init_from_local_shards_and_global_metadata"

try:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
except ImportError:  # moved or removed: sharded_tensor() says so when called
    ShardMetadata = Shard = ShardedTensor = ShardedTensorMetadata = TensorProperties = None

__all__ = [
    "CHECKED_AGAINST",
    "PIECE",
    "ShardMetadata",
    "ShardedTensor",
    "shard_metadata",
    "sharded_tensor",
]


def shard_metadata(offsets: Sequence[int], sizes: Sequence[int], placement: str) -> ShardMetadata:
    """Where one piece of a tensor lies: its global ``offsets`` and ``sizes`` (one each per
    dimension) and ``placement``, ``"rank:R/DEVICE"``."""
    _require()
    return ShardMetadata(list(offsets), list(sizes), placement)


def sharded_tensor(
    local: Sequence[tuple[torch.Tensor, ShardMetadata]],
    every: Sequence[ShardMetadata],
    size: Sequence[int],
) -> ShardedTensor:
    """A tensor of ``size`` made of the pieces ``every`` describes (every rank's, in the
    same order on every rank), of which ``local`` are this rank's: each its tensor (used as
    it is, not copied) and its metadata. Needs the default process group (its rank is
    where ``local`` lives)."""
    _require()
    shards = [Shard(tensor, metadata) for tensor, metadata in local]
    properties = ShardedTensorMetadata(list(every), torch.Size(size), TensorProperties())
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, properties)


def _require() -> None:
    if not hasattr(ShardedTensor, "_init_from_local_shards_and_global_metadata"):
        raise MissingPiece(
            PIECE,
            f"torch {torch.__version__}",
            CHECKED_AGAINST,
            "a sharded checkpoint of model-parallel tables",
        )

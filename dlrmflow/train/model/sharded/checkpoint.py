"""A sharded collection's tables as ``torch.distributed.checkpoint`` state: each
model-parallel table a ``ShardedTensor`` of views of its shards (global offsets from the
plan, so a load under any other plan or world size reads the right rows and columns),
replicated tables as plain tensors; and what a load leaves to do."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from dlrmflow.runtime.sharded_tensor import (
    ShardedTensor,
    ShardMetadata,
    shard_metadata,
    sharded_tensor,
)
from dlrmflow.train.model.plan import Shard
from dlrmflow.train.model.sharded.lookup import ShardLookup

# Rows per checkpoint item of a shard: 64 MiB of weights at dim 64. A shard's items pass
# through a rank's memory one at a time when it lives on disk.
CHECKPOINT_CHUNK_ROWS = 1 << 18


def checkpoint_state(lookup: ShardLookup) -> dict[str, torch.Tensor | ShardedTensor]:
    """Every table's weight and optimizer state by table name (see the module docstring).

    Loading writes into the views, i.e. straight into the bags; call
    ``after_checkpoint_load`` afterwards. Each shard is given in chunks of at most
    ``CHECKPOINT_CHUNK_ROWS`` rows, each chunk a tensor that is the whole of its storage
    (an alias of the bag's memory, or of the file's for shards on disk): DCP then writes
    every chunk as it is, with no copy, and a rank's shards on disk pass through memory one
    chunk at a time (``drop_pages`` of the tiered bag after each).
    """
    routing, optimizer, device = lookup.routing, lookup.optimizer, lookup.device
    state: dict[str, torch.Tensor | ShardedTensor] = {}
    mine = {route.table.name: route for route in routing.local}
    on_disk = {route.table.name for route in lookup.tiered_routes}
    if lookup.tiered is not None:
        lookup.tiered.flush()
    for table in routing.plan.tables:
        if table.sharding == "data_parallel":
            continue
        route = mine.get(table.name)
        stored: dict[str, list[torch.Tensor]] = {}
        if route is None:
            pass
        else:
            bag = lookup.tiered if table.name in on_disk else lookup.local
            chunks = [
                bag.checkpoint_views(table.name, bounds) for bounds in _chunks(route.shard.rows)
            ]
            stored = {key: [c[key] for c in chunks] for key in chunks[0]}
        shard = route.shard if route else None
        state[f"{table.name}.weight"] = _sharded(
            stored.get("weight"), table.shards, shard, (table.rows, table.dim), device
        )
        for part in optimizer.state_parts:
            value = stored.get(part.name)
            if part.per_row:
                # One value per row: the column shards starting at column 0 own it.
                owners = [s for s in table.shards if s.col_start == 0]
                own = shard if shard is not None and shard.col_start == 0 else None
                state[f"{table.name}.{part.name}"] = _sharded(
                    value if own else None, owners, own, (table.rows,), device
                )
            else:
                state[f"{table.name}.{part.name}"] = _sharded(
                    value, table.shards, shard, (table.rows, table.dim), device
                )
    if lookup.replicated is not None:
        for k in routing.replicated_features:
            name = routing.names[k]
            for key, value in lookup.replicated.checkpoint_views(name).items():
                state[f"{name}.{key}"] = value
    step_key = optimizer.step_key
    if step_key is not None:
        # Every bag of the rank counts the same steps: the in-memory bags' count, or a
        # copy of the tiered bag's, which ``after_checkpoint_load`` reads back.
        bags = [b for b in (lookup.local, lookup.replicated) if b is not None]
        if bags:
            state[step_key] = bags[0].step
        elif lookup.tiered is not None:
            state[step_key] = torch.tensor(lookup.tiered.step, dtype=torch.int64, device="cpu")
    return state


def after_checkpoint_load(
    lookup: ShardLookup, state: Mapping[str, torch.Tensor | ShardedTensor] | None = None
) -> None:
    """Make the loaded values the live ones: the column shards that do not own the
    row-wise state get it (a collective over each column-wise table's ranks), the shards on
    disk (loaded in place, into their file) drop their cached rows, and every bag takes the
    loaded optimizer step count (from ``state``, what ``checkpoint_state`` returned, when
    no bag is in memory)."""
    routing, optimizer = lookup.routing, lookup.optimizer
    on_disk = {route.table.name for route in lookup.tiered_routes}
    for table in routing.plan.tables:
        process_group = lookup.column_groups.get(table.name)
        if process_group is None or routing.rank not in table.ranks:
            continue
        owner = next(s.rank for s in table.shards if s.col_start == 0)
        for part in optimizer.state_parts:
            if part.per_row:
                value = (
                    lookup.tiered.checkpoint_views(table.name)[part.name]
                    if table.name in on_disk
                    else lookup.local.state(table.name)[part.name]
                )
                dist.broadcast(value, owner, process_group)
    if lookup.tiered is not None:
        lookup.tiered.reload()  # unmaps the pages the load wrote, too
    step_key = optimizer.step_key
    if step_key is not None:
        bags = [b for b in (lookup.local, lookup.replicated) if b is not None]
        step = bags[0].step if bags else None
        if step is None and state is not None and step_key in state:
            step = state[step_key]
        if step is not None:
            for bag in bags:
                bag.step.copy_(step)
            if lookup.tiered is not None:
                lookup.tiered.step = int(step)


def _chunks(rows: int) -> list[tuple[int, int]]:
    """The row ranges ``[lo, hi)`` a shard of ``rows`` rows is checkpointed in."""
    if rows == 0:
        return [(0, 0)]
    return [
        (lo, min(lo + CHECKPOINT_CHUNK_ROWS, rows)) for lo in range(0, rows, CHECKPOINT_CHUNK_ROWS)
    ]


def _sharded(
    local: list[torch.Tensor] | None,
    shards: Sequence[Shard],
    mine: Shard | None,
    size: tuple[int, ...],
    device: torch.device,
) -> ShardedTensor:
    """A ``ShardedTensor`` over ``shards`` (1-D: row ranges; 2-D: row and column ranges),
    each in the row chunks of ``_chunks``, whose local shards are ``local`` (views of the
    chunks of ``mine``, not copies) on the rank holding ``mine``.

    The placements only say where each shard lives now (this rank's exact device, the
    others' device type); the checkpoint stores no device, so it loads on any.
    """

    def metadata(s: Shard, lo: int, hi: int) -> ShardMetadata:
        where = device if s == mine else torch.device(device.type)
        placement = f"rank:{s.rank}/{where}"
        if len(size) == 1:
            return shard_metadata([s.row_start + lo], [hi - lo], placement)
        return shard_metadata([s.row_start + lo, s.col_start], [hi - lo, s.cols], placement)

    local_shards = []
    if mine is not None:
        assert local is not None
        local_shards = [
            (tensor, metadata(mine, lo, hi))
            for tensor, (lo, hi) in zip(local, _chunks(mine.rows), strict=True)
        ]
    every = [metadata(s, lo, hi) for s in shards for lo, hi in _chunks(s.rows)]
    return sharded_tensor(local_shards, every, size)

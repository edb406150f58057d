"""``plan_sharding``: the planning steps in order, from tables and a topology to a
validated ``ShardingPlan`` with the cost model's estimates.

It is the only module that knows the order of the steps (each in its own module), as
TorchRec's ``planners.py`` runs its enumerator, proposer and partitioner; it also checks
the inputs (names, sharding types, total capacity) before any step runs. The algorithm:

1. Tiny tables whose allreduce costs less than their all-to-all become data-parallel
   (``proposers``).
2. Tiers: tables hottest per byte (IDs looked up per step per stored byte, times the share
   a cache would miss) go to the fastest tier with room across the job, filling
   ``TIER_FILL`` of it (the rest is slack for packing shards onto ranks) (``tiering``).
3. Sharding: each table takes its cheapest option (least total seconds); a table whose
   largest shard would cost more than ``MAX_SHARD_SHARE`` of the mean rank load is split
   further (more column pieces, row-wise in one host, row-wise over all ranks) until the
   pieces are small enough to balance. Options whose shards take more than
   ``MAX_SHARD_MEMORY_SHARE`` of a rank's tier are avoided, so that packing stays easy
   (``proposers``).
4. Placement: largest shard first onto the rank where the load ends lowest (LPT), in the
   fastest tier from its table's with room there. A table some of whose shards had to go
   to a slower tier is planned again in that tier (its load there may need more pieces)
   (``placement``).
5. Promotion: shards hottest per byte (cache misses counted) move up into fast memory
   left free on their rank (``tiering``).
6. Refinement: table-wise and column-wise shards are moved or swapped off the busiest
   rank while that lowers its load (row-wise kinds stay where they are: their shards go
   one per rank of their group anyway) (``refine``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from dlrmflow.train.model.plan import (
    SHARDING_TYPES,
    TIERS,
    Shard,
    ShardingPlan,
    ShardingType,
    TablePlan,
)
from dlrmflow.train.planner.estimators import _CostModel, _estimates
from dlrmflow.train.planner.placement import _place
from dlrmflow.train.planner.proposers import _choose_options, _data_parallel_by_cost
from dlrmflow.train.planner.refine import _Refiner
from dlrmflow.train.planner.tiering import _assign_tiers, _promote
from dlrmflow.train.planner.types import (
    ROW_WISE_ADAGRAD_STATE,
    OptimizerState,
    PlanningError,
    TableSpec,
    Topology,
    _format_bytes,
)

MAX_REPLANS = 4


def _check_inputs(
    tables: Sequence[TableSpec],
    constraints: Mapping[str, str],
    force: str | None,
    batch_size: int,
    weight_bytes: int,
) -> None:
    names = [t.name for t in tables]
    if not tables:
        raise PlanningError("there are no tables to plan")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise PlanningError(f"table names must be unique; repeated: {dup}")
    if batch_size < 1 or weight_bytes < 1:
        raise PlanningError(
            f"batch_size and weight_bytes must be >= 1, got {batch_size} and {weight_bytes}"
        )
    unknown = sorted(set(constraints) - set(names))
    if unknown:
        raise PlanningError(f"constraints name tables that do not exist: {unknown}")
    for name, kind in [*constraints.items(), ("force", force)]:
        if kind is not None and kind not in SHARDING_TYPES:
            raise PlanningError(f"{name}: unknown sharding type {kind!r} (one of {SHARDING_TYPES})")


def _check_capacity(model: _CostModel, tables: Sequence[TableSpec], kinds: list[str | None]):
    W = model.topo.world_size
    needed = sum(
        model.memory(t.rows, t.dim) * (W if k == "data_parallel" else 1)
        for t, k in zip(tables, kinds, strict=True)
    )
    have = W * float(model.capacity.sum())
    if needed > have:
        raise PlanningError(
            f"the model needs {_format_bytes(needed)} but the {W} ranks have "
            f"{_format_bytes(have)} across device, DRAM and SSD: "
            f"{_format_bytes(needed - have)} short"
        )


def plan_sharding(
    tables: Sequence[TableSpec],
    topology: Topology,
    batch_size: int,
    *,
    constraints: Mapping[str, ShardingType] | None = None,
    force: ShardingType | None = None,
    optimizer: OptimizerState = ROW_WISE_ADAGRAD_STATE,
    weight_bytes: int = 4,
) -> ShardingPlan:
    """A validated plan for ``tables`` on ``topology`` with ``batch_size`` samples per rank.

    ``constraints`` pins tables to a sharding type and wins over ``force``, which imposes one
    type on every other table (column-wise then splits each table over ``min(world_size,
    dim)`` ranks; row-wise kinds use at most one rank per row). ``weight_bytes`` is the size
    of one stored weight (4 for float32). Same inputs, same plan.
    """
    started = time.perf_counter()
    constraints = dict(constraints or {})
    _check_inputs(tables, constraints, force, batch_size, weight_bytes)
    model = _CostModel(topology, batch_size, weight_bytes, optimizer, tables)
    W = topology.world_size
    kinds: list[str | None] = [constraints.get(t.name, force) for t in tables]
    forced = [t.name not in constraints and force is not None for t in tables]
    _check_capacity(model, tables, kinds)
    kinds = _data_parallel_by_cost(model, tables, kinds)
    tiers = _assign_tiers(model, tables, kinds)
    # A shard that found no room in its table's tier went to a slower one and may now be
    # too big a load to balance: plan those tables again in the tier they ended in. Tiers
    # only ever get slower, so this ends.
    for _ in range(MAX_REPLANS):
        choice = _choose_options(model, tables, kinds, forced, tiers)
        placement = _place(model, tables, choice)
        ended = [max(d.tier for d in o.drafts) for o in choice]
        if ended == tiers:
            break
        tiers = [max(a, b) for a, b in zip(tiers, ended, strict=True)]
    _promote(placement, choice)
    rounds = _Refiner(placement, choice).run()

    plan = ShardingPlan(
        world_size=W,
        ranks_per_host=topology.ranks_per_host,
        tables=tuple(
            TablePlan(
                name=t.name,
                rows=t.rows,
                dim=t.dim,
                sharding=o.kind,
                shards=tuple(
                    Shard(d.rank, d.row_start, d.row_end, d.col_start, d.col_end, TIERS[d.tier])
                    for d in o.drafts
                ),
            )
            for t, o in zip(tables, choice, strict=True)
        ),
    )
    plan.validate()
    plan.estimates.update(
        _estimates(model, tables, [o.kind for o in choice], [o.drafts for o in choice])
    )
    plan.estimates["refine_rounds"] = rounds
    plan.estimates["planning_seconds"] = time.perf_counter() - started
    return plan

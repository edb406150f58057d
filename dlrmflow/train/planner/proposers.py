"""Which sharding each table takes: data-parallel when replicating it is cheaper, else
the cheapest option (sharding type and number of pieces) whose shards are small enough to
balance.

TorchRec's planner splits this into an enumerator (every option of a table) and a
proposer (one option per table); here both are ``_choose_options``, pricing options with
the cost model (``estimators``) and leaving where their shards go to ``placement``.
"""

from __future__ import annotations

from collections.abc import Sequence

from dlrmflow.train.planner.estimators import _CostModel
from dlrmflow.train.planner.types import TableSpec, _Option

# Splitting a table costs traffic, so only tables whose largest shard would weigh more than
# this share of the mean rank load are split further; LPT balances the rest.
MAX_SHARD_SHARE = 0.25
MAX_SHARD_MEMORY_SHARE = 0.5
# Data-parallel tables live on every rank: only tables this small (a share of one rank's
# device memory, each and together) may be replicated without being pinned or forced.
DATA_PARALLEL_TABLE_SHARE = 0.01
DATA_PARALLEL_TOTAL_SHARE = 0.1


def _data_parallel_by_cost(
    model: _CostModel, tables: Sequence[TableSpec], kinds: list[str | None]
) -> list[str | None]:
    """Free tables become data-parallel when replicating them is cheaper in total than one
    table-wise shard and they are tiny (their copies on every rank stay within budget)."""
    W = model.topo.world_size
    budget = DATA_PARALLEL_TOTAL_SHARE * model.topo.device_bytes
    used = sum(
        model.memory(t.rows, t.dim)
        for t, k in zip(tables, kinds, strict=True)
        if k == "data_parallel"
    )
    out = list(kinds)
    for i, t in enumerate(tables):
        memory = model.memory(t.rows, t.dim)
        if (
            kinds[i] is not None
            or W == 1
            or memory > DATA_PARALLEL_TABLE_SHARE * model.topo.device_bytes
        ):
            continue
        replicated = model.option(i, t, "data_parallel", 1, 0).total
        if replicated < model.option(i, t, "table_wise", 1, 0).total and used + memory <= budget:
            out[i] = "data_parallel"
            used += memory
    return out


def _choose_options(
    model: _CostModel,
    tables: Sequence[TableSpec],
    kinds: list[str | None],
    forced: list[bool],
    tiers: list[int],
) -> list[_Option]:
    """Each table's cheapest option whose shards are small enough (in load and memory) to
    balance; see the module docstring."""
    topo = model.topo
    kinds_auto = ["table_wise", "column_wise", "row_wise"]
    if topo.hosts > 1 and topo.ranks_per_host > 1:
        kinds_auto.insert(2, "table_row_wise")

    candidates: list[list[_Option]] = []
    for i, t in enumerate(tables):
        kind = kinds[i]
        if forced[i] and kind == "column_wise":
            pieces = [(kind, min(topo.world_size, t.dim))]
        elif kind is not None:
            pieces = [(kind, p) for p in model.pieces(t, kind)]
        else:
            pieces = [(k, p) for k in kinds_auto for p in model.pieces(t, k)]
        options = [model.option(i, t, k, p, tiers[i]) for k, p in pieces]
        candidates.append(sorted(options, key=lambda o: o.total))

    def roomy(o: _Option) -> bool:
        limit = MAX_SHARD_MEMORY_SHARE * model.capacity[o.tier]
        return o.kind == "data_parallel" or o.largest_memory <= limit

    def fits(o: _Option) -> bool:
        return o.largest_memory <= model.capacity[o.tier :].max()

    # the options to choose from: those easy to pack, else those that fit at all, else all
    # (placement then says which shard does not fit and by how much)
    pools = [
        [o for o in options if roomy(o)] or [o for o in options if fits(o)] or options
        for options in candidates
    ]
    choice = [pool[0] for pool in pools]
    # Splitting raises the total, hence the mean and the cap: tables split in one round may
    # let others stay whole. Each table only ever moves to an option with a smaller largest
    # shard, so the loop ends.
    while True:
        cap = MAX_SHARD_SHARE * sum(o.total for o in choice) / topo.world_size
        changed = False
        for i, pool in enumerate(pools):
            if choice[i].largest <= cap or choice[i].kind == "data_parallel":
                continue
            small = [o for o in pool if o.largest <= cap]
            best = small[0] if small else min(pool, key=lambda o: o.largest)
            if best.largest < choice[i].largest:
                choice[i] = best
                changed = True
        if not changed:
            return choice

"""Which memory tier (device, DRAM, SSD) each table and shard lives in: tables hottest per
byte to the fastest tier with room across the job before placement, and shards hottest per
byte up into the fast memory left free on their rank after it.

Tiers are decided job-wide, apart from choosing shardings and ranks, because the tier a
table is in sets what its lookups cost and so how finely it must be split.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dlrmflow.train.planner.estimators import _CostModel
from dlrmflow.train.planner.placement import _Placement
from dlrmflow.train.planner.types import TableSpec, _Option

# Tiers are assigned job-wide up to this fill; the rest is slack for packing onto ranks.
TIER_FILL = 0.95


def _assign_tiers(
    model: _CostModel, tables: Sequence[TableSpec], kinds: list[str | None]
) -> list[int]:
    """Hottest per byte first, each table to the fastest tier with room left across the
    job (data-parallel tables need room for a copy per rank). Heat counts only the lookups
    a cache would miss: a skewed table loses less than a uniform one in a slower tier.

    The caches of the tables in slower tiers are set aside in device memory first; as that
    leaves less room there, more tables may go slower and need caches: the reserve grows
    until it holds them all. Less room never puts more bytes in device memory, so the
    reserve only grows, through finitely many values: this ends."""
    W = model.topo.world_size
    memory = np.array([model.memory(t.rows, t.dim) for t in tables])
    need = memory * np.array([W if k == "data_parallel" else 1 for k in kinds])
    heat = np.array([t.ids_per_sample for t in tables]) * (1.0 - model.hit) / memory
    order = np.argsort(-heat, kind="stable")
    reserve = 0.0
    while True:
        free = W * model.capacity * TIER_FILL
        free[0] -= reserve
        tiers = [0] * len(tables)
        for i in order:
            room = np.flatnonzero(free >= need[i])
            tier = int(room[0]) if room.size else int(np.argmax(free))
            free[tier] -= need[i]
            tiers[i] = tier
        caches = sum(model.cache(need[i], tier) for i, tier in enumerate(tiers))
        if caches <= reserve:
            return tiers
        reserve = caches


def _promote(p: _Placement, choice: list[_Option]) -> None:
    """Fill the fast memory planning left free (slack, and room freed by tables that had to
    go slower): on every rank, hottest shards per byte first, each into the fastest tier
    with room."""
    model = p.model
    drafts = [d for o in choice for d in o.drafts if d.tier > 0 and d.memory > 0]
    heat = np.array([d.lookup_bytes * (1.0 - model.hit[d.table]) / d.memory for d in drafts])
    for i in np.argsort(-heat, kind="stable"):
        d = drafts[i]
        cache = model.cache(d.memory, d.tier)
        # Its cache stays in device memory unless the shard moves there itself.
        room = [p.used[d.rank, 0] - cache + d.memory <= model.capacity[0]] + [
            p.used[d.rank, t] + d.memory <= model.capacity[t] for t in range(1, d.tier)
        ]
        faster = [t for t in range(d.tier) if room[t]]
        if faster:
            p.load[d.rank] -= model.seconds(d)
            p.used[d.rank, d.tier] -= d.memory
            p.used[d.rank, 0] -= cache
            p.put(d, d.rank, faster[0])

"""Where shards go: each onto a rank, in the fastest memory tier with room there, largest
first onto the rank where the load ends lowest (LPT).

``_Placement`` is the running state of a plan being built (load and memory per rank, which
ranks hold which table); promotion (``tiering``) and refinement (``refine``) change it
afterwards, so it is its own module beneath both. A shard that finds no room raises a
``PlanningError`` saying by how much.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dlrmflow.train.model.plan import TIERS
from dlrmflow.train.planner.estimators import _CostModel
from dlrmflow.train.planner.types import PlanningError, TableSpec, _Draft, _format_bytes, _Option


class _Placement:
    """Loads and memory per rank while shards are placed; enforces one shard of a table per
    rank and the memory of every tier."""

    def __init__(self, model: _CostModel, tables: Sequence[TableSpec]) -> None:
        self.model = model
        self.tables = tables
        W = model.topo.world_size
        self.load = np.zeros(W)
        self.used = np.zeros((W, len(TIERS)))
        self.held = np.zeros((len(tables), W), dtype=bool)

    def fits(self, tier: int, memory: float, ranks: np.ndarray | None = None) -> np.ndarray:
        """Which ranks (all, or ``ranks``) have room for ``memory`` bytes in ``tier`` and,
        in a slower tier, for its cache in device memory."""
        used = self.used if ranks is None else self.used[ranks]
        capacity = self.model.capacity
        ok = used[..., tier] + memory <= capacity[tier]
        if tier and self.model.cache_factor:
            ok &= used[..., 0] + self.model.cache(memory, tier) <= capacity[0]
        return ok

    def put(self, d: _Draft, rank: int, tier: int) -> None:
        d.rank, d.tier = rank, tier
        self.load[rank] += self.model.seconds(d)
        self.used[rank, tier] += d.memory
        self.used[rank, 0] += self.model.cache(d.memory, tier)
        self.held[d.table, rank] = True

    def no_room(
        self, d: _Draft, kind: str, memory: float, needed: int, ranks: str
    ) -> PlanningError:
        """Why ``needed`` shards of up to ``memory`` bytes found no room on ``ranks``."""
        tiers = "/".join(TIERS[d.tier :])
        free = self.model.capacity[d.tier :] - self.used[:, d.tier :]
        most = max(float(free.max()), 0.0)
        found = int((free >= memory).any(axis=1).sum())
        if most < memory:
            short = _format_bytes(memory - most)
            why = f"the most free on one rank is {_format_bytes(most)}: {short} short"
        else:
            why = f"only {found} rank(s) have that much free"
        cache = self.model.cache(memory, 1)
        with_cache = f" (and {_format_bytes(cache)} of device memory for a cache)" if cache else ""
        return PlanningError(
            f"table {self.tables[d.table].name}: {needed} {kind} shard(s) of up to "
            f"{_format_bytes(memory)} need room in {tiers}{with_cache} on {ranks}; {why}"
        )

    def put_on(self, d: _Draft, rank: int, kind: str) -> None:
        """On ``rank`` in the fastest tier from the draft's with room."""
        for tier in range(d.tier, len(TIERS)):
            if self.fits(tier, d.memory)[rank]:
                self.put(d, rank, tier)
                return
        raise self.no_room(d, kind, d.memory, 1, f"rank {rank}")

    def put_spread(self, drafts: list[_Draft], kind: str) -> None:
        """A table's shards (largest first) on distinct ranks where the loads end lowest,
        each rank storing them in its fastest tier with room (from the drafts')."""
        d = drafts[0]
        memory = max(x.memory for x in drafts)
        tier = np.full(len(self.load), -1)
        for t in reversed(range(d.tier, len(TIERS))):
            tier[self.fits(t, memory)] = t
        ok = (tier >= 0) & ~self.held[d.table]
        if ok.sum() < len(drafts):
            ranks = "a rank" if len(drafts) == 1 else f"{len(drafts)} distinct ranks"
            raise self.no_room(d, kind, memory, len(drafts), ranks)
        seconds = np.array([self.model.seconds(d, t) for t in range(len(TIERS))])
        after = np.where(ok, self.load + seconds[tier], np.inf)
        ranks = np.argsort(after, kind="stable")[: len(drafts)]
        for x, rank in zip(drafts, ranks.tolist(), strict=True):
            self.put(x, rank, int(tier[rank]))

    def put_on_host(self, option: _Option) -> None:
        """Row-wise over one host (shard j on the host's j-th rank): the host whose busiest
        rank ends up least loaded, each rank storing its shard in its fastest tier with room
        (from the option's)."""
        R, hosts = self.model.topo.ranks_per_host, self.model.topo.hosts
        drafts = option.drafts
        ranks = np.arange(hosts)[:, None] * R + np.arange(len(drafts))[None, :]
        memory = np.array([d.memory for d in drafts])
        tier = np.full(ranks.shape, -1)
        for t in reversed(range(option.tier, len(TIERS))):
            tier[self.fits(t, memory, ranks)] = t
        seconds = np.array([[self.model.seconds(d, t) for t in range(len(TIERS))] for d in drafts])
        after = self.load[ranks] + seconds[np.arange(len(drafts)), tier]
        peak = np.where((tier >= 0).all(axis=1), after.max(axis=1), np.inf)
        host = int(np.argmin(peak))
        if not np.isfinite(peak[host]):
            raise self.no_room(
                drafts[0], option.kind, float(memory.max()), len(drafts), "the ranks of one host"
            )
        for j, d in enumerate(drafts):
            self.put(d, int(ranks[host, j]), int(tier[host, j]))


def _place(model: _CostModel, tables: Sequence[TableSpec], choice: list[_Option]) -> _Placement:
    """Fixed shards (data-parallel, row-wise) first, then the other tables, largest shard
    first (LPT; a column-wise table's pieces go out together, as they weigh the same)."""
    W = model.topo.world_size
    p = _Placement(model, tables)
    movable: list[tuple[float, int, _Option]] = []
    for o in choice:
        t = tables[o.table]
        if o.kind == "data_parallel":
            o.drafts = [model.drafts(o, t)[0] for _ in range(W)]
            for rank, d in enumerate(o.drafts):
                p.put_on(d, rank, o.kind)
        elif o.kind == "row_wise":
            o.drafts = model.drafts(o, t)
            for rank, d in enumerate(o.drafts):
                p.put_on(d, rank, o.kind)
        else:
            o.drafts = model.drafts(o, t)
            movable.append((o.largest, len(movable), o))
    for _, _, o in sorted(movable, key=lambda m: (-m[0], m[1])):
        if o.kind == "table_row_wise":
            p.put_on_host(o)
        else:
            p.put_spread(o.drafts, o.kind)
    return p

"""Balancing after placement: table-wise and column-wise shards moved or swapped off the
busiest rank while that lowers its load.

Placement (LPT) is greedy and never revisits a shard; this step does, and is where the
max/mean load ratio of a large plan is won, so it is kept apart with its own limits.
"""

from __future__ import annotations

import numpy as np

from dlrmflow.train.planner.placement import _Placement
from dlrmflow.train.planner.types import _Option

MAX_REFINE_ROUNDS = 5_000
SWAP_CANDIDATES = 1024
# Past this max/mean the estimates are finer than the cost model is right: stop refining.
REFINE_TOLERANCE = 0.01


class _Refiner:
    """Moves or swaps table-wise and column-wise shards off the busiest rank while that lowers
    it and the rank it trades with stays below the old peak. Each round looks at every move
    and every swap of the busiest rank's shards at once (numpy), and takes the best."""

    def __init__(self, p: _Placement, choice: list[_Option]) -> None:
        self.p = p
        self.drafts = [
            d for o in choice if o.kind in ("table_wise", "column_wise") for d in o.drafts
        ]
        self.load = np.array([p.model.seconds(d) for d in self.drafts])
        self.memory = np.array([d.memory for d in self.drafts])
        self.rank = np.array([d.rank for d in self.drafts], dtype=np.int64)
        self.table = np.array([d.table for d in self.drafts], dtype=np.int64)
        self.tier = np.array([d.tier for d in self.drafts], dtype=np.int64)
        # device bytes of each shard's cache (0 in device memory), and all it holds there
        self.cache = np.where(self.tier > 0, p.model.cache_factor * self.memory, 0.0)
        self.device = np.where(self.tier > 0, self.cache, self.memory)

    def run(self) -> int:
        """Refine until no move or swap helps, or the busiest rank is within
        ``REFINE_TOLERANCE`` of the mean; returns the rounds taken."""
        rounds = 0
        load = self.p.load
        while (
            self.drafts
            and rounds < MAX_REFINE_ROUNDS
            and load.max() > load.mean() * (1 + REFINE_TOLERANCE)
            and self._step()
        ):
            rounds += 1
        return rounds

    def _step(self) -> bool:
        """One move off the busiest rank, or else one swap, that lowers it; False if none."""
        top = int(np.argmax(self.p.load))
        mine = np.flatnonzero(self.rank == top)
        # a relative margin keeps float noise from trading shards back and forth forever
        bar = self.p.load[top] * (1 - 1e-9)
        if mine.size == 0:
            return False
        score, i, dest = self._best_move(top, mine)
        if score < bar:
            self._move(i, dest)
            return True
        score, a, b = self._best_swap(top, mine)
        if score >= bar:
            return False
        dest = int(self.rank[b])
        self._move(b, top)
        self._move(a, dest)
        # moving b then a may have cleared a mark the other set: restore both
        self.p.held[self.table[a], dest] = True
        self.p.held[self.table[b], top] = True
        return True

    def _best_move(self, top: int, mine: np.ndarray) -> tuple[float, int, int]:
        """The move of a shard from ``top`` that leaves the two ranks' larger load lowest."""
        p, capacity = self.p, self.p.model.capacity
        x, tier = self.load[mine], self.tier[mine]
        fits = p.used[:, tier].T + self.memory[mine, None] <= capacity[tier, None]
        if p.model.cache_factor:
            fits &= p.used[None, :, 0] + self.cache[mine, None] <= capacity[0]
        ok = fits & ~p.held[self.table[mine]]
        score = np.where(ok, np.maximum(p.load[top] - x[:, None], p.load + x[:, None]), np.inf)
        a, dest = np.unravel_index(np.argmin(score), score.shape)
        return float(score[a, dest]), int(mine[a]), int(dest)

    def _best_swap(self, top: int, mine: np.ndarray) -> tuple[float, int, int]:
        """The swap of a shard on ``top`` with a lighter one elsewhere that leaves the two
        ranks' larger load lowest."""
        p, capacity = self.p, self.p.model.capacity
        other = self._partners(top)
        if other.size == 0:
            return np.inf, -1, -1
        tier_a, table_a, memory_a = self.tier[mine], self.table[mine], self.memory[mine]
        s, tier_b, table_b = self.rank[other], self.tier[other], self.table[other]
        delta = self.load[mine, None] - self.load[other]
        same_tier = tier_a[:, None] == tier_b
        free_s = capacity[tier_a, None] - p.used[s[None, :], tier_a[:, None]]
        free_top = capacity[tier_b] - p.used[top, tier_b]
        ok = (
            (delta > 0)
            & (
                (table_a[:, None] == table_b)
                | (~p.held[table_a[:, None], s[None, :]] & ~p.held[table_b, top])
            )
            & (memory_a[:, None] <= free_s + np.where(same_tier, self.memory[other], 0.0))
            & (self.memory[other] <= free_top + np.where(same_tier, memory_a[:, None], 0.0))
        )
        if p.model.cache_factor:
            # caches of shards in slower tiers trade device memory too
            change = self.device[mine, None] - self.device[other]
            ok &= (p.used[s, 0] + change <= capacity[0]) & (p.used[top, 0] - change <= capacity[0])
        score = np.where(ok, np.maximum(p.load[top] - delta, p.load[s] + delta), np.inf)
        a, b = np.unravel_index(np.argmin(score), score.shape)
        return float(score[a, b]), int(mine[a]), int(other[b])

    def _partners(self, top: int) -> np.ndarray:
        """Shards to swap with: those on the least-loaded ranks, about ``SWAP_CANDIDATES``
        of them, so that a round stays cheap with tens of thousands of shards."""
        order = np.argsort(self.p.load, kind="stable")
        order = order[order != top]
        counts = np.bincount(self.rank, minlength=len(self.p.load))[order]
        enough = int(np.searchsorted(np.cumsum(counts), SWAP_CANDIDATES)) + 1
        return np.flatnonzero(np.isin(self.rank, order[:enough]))

    def _move(self, i: int, dest: int) -> None:
        p, d = self.p, self.drafts[i]
        p.load[d.rank] -= self.load[i]
        p.used[d.rank, d.tier] -= d.memory
        p.used[d.rank, 0] -= self.cache[i]
        p.held[d.table, d.rank] = False
        p.load[dest] += self.load[i]
        p.used[dest, d.tier] += d.memory
        p.used[dest, 0] += self.cache[i]
        p.held[d.table, dest] = True
        d.rank = dest
        self.rank[i] = dest

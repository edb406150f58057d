"""What an LRU cache of a feature's hot rows would hit, from its IDs' access counts.

The sharding planner keeps tables in DRAM or on SSD behind a cache of hot rows, and needs
the share of lookups that cache serves. ``SparseStats.cache_hits`` records the expected hit
rate of an LRU cache holding each of ``CACHE_FRACTIONS`` of the distinct IDs, by Che's
approximation over one training pass (``lru_hit_rates``), from the access counts that the
skew summaries keep (``sketches.SkewTotals``); ``interpolate_hit_rate`` reads the rate of a
cache of any size from those points.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Cache sizes, as fractions of a feature's distinct IDs, at which ``cache_hits`` is recorded
# (log-spaced: hit rates of skewed accesses grow about with the log of the cache size).
CACHE_FRACTIONS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
_CHE_BISECTIONS = 60  # halvings of the bracket on each LRU window: far below the noise


def lru_hit_rates(
    counts: np.ndarray,
    weights: np.ndarray | None = None,
    fractions: Sequence[float] = CACHE_FRACTIONS,
) -> tuple[tuple[float, float], ...]:
    """``(fraction, hit_rate)`` for an LRU cache holding each ``fraction`` of the distinct
    IDs, over one pass of accesses in which IDs were accessed ``counts`` times (each
    standing for ``weights`` IDs so accessed; default 1).

    Che's approximation: with IDs referenced independently with probabilities ``p``, an LRU
    cache of C entries holds an ID when it was referenced within the last T references,
    where T solves ``sum(1 - exp(-p T)) = C``; a reference to ID i hits with probability
    ``1 - exp(-p_i T)``. One pass: the first access to every ID misses whatever the cache,
    so only ``count - 1`` accesses of each can hit (a cache of every ID hits
    ``1 - distinct / accesses`` of them).
    """
    counts = np.asarray(counts, dtype=np.float64)
    weights = np.ones(len(counts)) if weights is None else np.asarray(weights, np.float64)
    total = float(np.sum(weights * counts))
    ids = float(weights.sum())
    p = counts / total
    wanted = np.array(fractions, dtype=np.float64)
    partial = wanted < 1.0  # a cache of every ID holds every ID: no T to solve for

    def held(t: np.ndarray) -> np.ndarray:
        """The share of IDs an LRU cache of window ``t`` (one per fraction) holds."""
        return (-np.expm1(-np.outer(t, p)) * weights).sum(axis=1) / ids

    # bisect every fraction's T at once, between 0 and a doubling that overshoots it
    low, high = np.zeros(len(wanted)), np.ones(len(wanted))
    while (short := partial & (held(high) < wanted)).any():
        high[short] *= 2.0
    for _ in range(_CHE_BISECTIONS):
        middle = 0.5 * (low + high)
        below = held(middle) < wanted
        low = np.where(below, middle, low)
        high = np.where(below, high, middle)
    resident = np.where(partial[:, None], -np.expm1(-np.outer(high, p)), 1.0)
    hits = (resident * (weights * np.maximum(counts - 1.0, 0.0))).sum(axis=1) / total
    return tuple((float(f), float(h)) for f, h in zip(wanted, hits, strict=True))


def interpolate_hit_rate(points: Sequence[Sequence[float]], fraction: float) -> float:
    """The hit rate of a cache holding ``fraction`` of the distinct IDs, from the
    ``(fraction, hit_rate)`` points of ``SparseStats.cache_hits``: linear in the log of the
    fraction between points (skewed accesses' hit rates grow about so), linear from no cache
    to the first point, and the last point's rate past it."""
    xs = np.array([x for x, _ in points], dtype=np.float64)
    hs = np.array([h for _, h in points], dtype=np.float64)
    if fraction <= 0:
        return 0.0
    if fraction < xs[0]:
        return float(hs[0] * fraction / xs[0])
    return float(np.interp(np.log(fraction), np.log(xs), hs))

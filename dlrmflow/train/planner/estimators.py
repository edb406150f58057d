"""The cost model: what a shard costs its rank per training step, and what a plan costs.

Every step of planning (proposal, tiers, placement, refinement) asks it the same
questions, and ``evaluate_plan`` asks them of any plan, so it is one module that knows the
bytes and bandwidths. Every shard costs its rank some seconds per training step (forward
and backward):

- **lookup**: every ID that hits the shard reads its row (forward), then the fused
  optimizer reads and writes the row back (backward): ``LOOKUP_PASSES`` passes over the
  row and ``STATE_PASSES`` over its optimizer state, at the bandwidth of the shard's tier
  (device memory, host DRAM read by the device, or SSD). A shard in DRAM or on SSD keeps
  ``Topology.cache_load_factor`` of its rows in an LRU cache in device memory (counted in
  the rank's device memory); the share of its lookups the cache serves (the table's
  ``TableSpec.hit_rate``) is charged at device bandwidth, the rest at its tier's.
- **all-to-all**: the owner receives the IDs of its rows (int64, plus an int32 length per
  sample) from every rank and sends back one pooled vector per sample (its gradient comes
  back in backward). Row-wise shards send a *partial sum* for every sample, so a table
  sharded row-wise over ``k`` ranks sends ``k`` times the table-wise bytes;
  table-row-wise reduces those partial sums inside the host first, so only one vector per
  sample crosses hosts. Bytes to ranks of the same host move at ``intra_host_bw``, the rest
  at ``inter_host_bw``. Only the owner's side is charged: the receiving side of the
  pooled vectors is the same for every rank.
- **allreduce** (data-parallel tables): a hierarchical allreduce of the dense table
  gradient, inside the host then across hosts, on every rank.

Memory: ``rows * cols * weight_bytes`` for the weights plus the optimizer state
(``OptimizerState``: row-wise Adagrad keeps one float32 per row, Adam two per element).
A column-wise shard keeps its own per-row state, so row state is counted once per shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dlrmflow.train.model.plan import SHARDING_TYPES, TIERS, ShardingPlan
from dlrmflow.train.planner.types import (
    ROW_WISE_ADAGRAD_STATE,
    OptimizerState,
    PlanningError,
    TableSpec,
    Topology,
    _Draft,
    _Option,
)

ID_BYTES = 8  # int64 IDs travel in the input all-to-all
LENGTH_BYTES = 4  # one int32 bag length per sample and table
LOOKUP_PASSES = 3  # forward read, then the fused optimizer's read and write of the row
STATE_PASSES = 2  # the optimizer state is read and written in backward


def _even_splits(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ranges tiling ``[0, n)``, the first ``n % k`` one longer."""
    base, extra = divmod(n, k)
    sizes = np.full(k, base, dtype=np.int64)
    sizes[:extra] += 1
    ends = np.cumsum(sizes)
    return list(zip((ends - sizes).tolist(), ends.tolist(), strict=True))


ROW_SPLIT = ("row_wise", "table_row_wise")


class _CostModel:
    """Traffic, seconds and bytes of shards, as the module docstring describes."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        weight_bytes: int,
        optimizer: OptimizerState,
        tables: Sequence[TableSpec],
    ) -> None:
        self.topo = topology
        self.batch = batch_size
        self.wb = weight_bytes
        self.opt = optimizer
        self.bw = topology.tier_bw
        self.capacity = topology.tier_bytes
        self.cache_factor = topology.cache_load_factor
        # per table (by index): the share of a DRAM or SSD shard's lookups its cache serves
        self.hit = np.array([t.hit_rate(self.cache_factor) for t in tables], dtype=np.float64)

    def cache(self, memory: float, tier: int) -> float:
        """Device bytes of the cache of a shard of ``memory`` bytes in ``tier``."""
        return self.cache_factor * memory if tier else 0.0

    def memory(self, rows: float, cols: float) -> float:
        per_row = cols * (self.wb + self.opt.bytes_per_element) + self.opt.bytes_per_row
        return float(rows * per_row)

    def _touched(self, cols: float) -> float:
        state = self.opt.bytes_per_row + cols * self.opt.bytes_per_element
        return LOOKUP_PASSES * cols * self.wb + STATE_PASSES * state

    def traffic(
        self, t: TableSpec, kind: str, pieces: int, rows: float, cols: float
    ) -> tuple[float, float, float]:
        """Lookup, intra-host and inter-host bytes per step of one shard of ``rows`` x
        ``cols``. Each is affine in the shard's size, so the mean shard times ``pieces`` is
        the option's total."""
        W, R, B, H = self.topo.world_size, self.topo.ranks_per_host, self.batch, self.topo.hosts
        ids_local = B * t.ids_per_sample
        frac = rows / t.rows
        ids_in = ids_local * frac * ID_BYTES + B * LENGTH_BYTES
        pooled = B * cols * self.wb
        if kind == "data_parallel":
            # hierarchical allreduce of the dense gradient: inside the host, then across
            table_bytes = t.rows * t.dim * self.wb
            intra = 2 * (R - 1) / R * table_bytes
            inter = 2 * (H - 1) / H * table_bytes / R
            return ids_local * self._touched(cols), intra, inter
        lookup = W * ids_local * frac * self._touched(cols)
        if kind in ("table_wise", "column_wise", "row_wise"):
            # IDs in from every other rank, a (partial, for row-wise) pooled vector back to
            # each, and its gradient in again
            per_rank = ids_in + 2 * pooled
            return lookup, (R - 1) * per_rank, (W - R) * per_rank
        # table_row_wise: the partial sums are reduce-scattered inside the host, then this
        # shard sends its 1/pieces of the summed vectors to their owners
        intra = (R - 1) * ids_in + 2 * (W * pooled * (pieces - 1) + (R - 1) * pooled) / pieces
        inter = (W - R) * (ids_in + 2 * pooled / pieces)
        return lookup, intra, inter

    def seconds(self, d: _Draft, tier: int | None = None) -> float:
        return self._seconds(
            d.lookup_bytes, d.intra_bytes, d.inter_bytes, d.tier if tier is None else tier, d.table
        )

    def _seconds(self, lookup: float, intra: float, inter: float, tier: int, table: int) -> float:
        t = self.topo
        hit = self.hit[table] if tier else 0.0
        if hit:
            reads = lookup * hit / self.bw[0] + lookup * (1.0 - hit) / self.bw[tier]
        else:
            reads = lookup / self.bw[tier]
        return reads + intra / t.intra_host_bw + inter / t.inter_host_bw

    def _shape(self, t: TableSpec, kind: str, pieces: int, largest: bool) -> tuple[float, float]:
        rows, cols = float(t.rows), float(t.dim)
        if kind in ROW_SPLIT:
            rows = -(-t.rows // pieces) if largest else rows / pieces
        elif kind == "column_wise":
            cols = -(-t.dim // pieces) if largest else cols / pieces
        return rows, cols

    def option(self, index: int, t: TableSpec, kind: str, pieces: int, tier: int) -> _Option:
        mean = self._shape(t, kind, pieces, largest=False)
        big = self._shape(t, kind, pieces, largest=True)
        copies = self.topo.world_size if kind == "data_parallel" else pieces
        return _Option(
            table=index,
            kind=kind,
            pieces=pieces,
            tier=tier,
            total=copies * self._seconds(*self.traffic(t, kind, pieces, *mean), tier, index),
            largest=self._seconds(*self.traffic(t, kind, pieces, *big), tier, index),
            largest_memory=self.memory(*big),
        )

    def drafts(self, o: _Option, t: TableSpec) -> list[_Draft]:
        """The option's shards in row (or column) order; one for data-parallel."""
        row_ranges = _even_splits(t.rows, o.pieces) if o.kind in ROW_SPLIT else [(0, t.rows)]
        col_ranges = _even_splits(t.dim, o.pieces) if o.kind == "column_wise" else [(0, t.dim)]
        out = []
        for r0, r1 in row_ranges:
            for c0, c1 in col_ranges:
                traffic = self.traffic(t, o.kind, o.pieces, r1 - r0, c1 - c0)
                out.append(
                    _Draft(o.table, r0, r1, c0, c1, *traffic, self.memory(r1 - r0, c1 - c0), o.tier)
                )
        return out

    def pieces(self, t: TableSpec, kind: str) -> list[int]:
        """The piece counts worth trying for ``kind``: one shard per rank at most, and no
        empty shard."""
        W, R = self.topo.world_size, self.topo.ranks_per_host
        if kind == "column_wise":
            top = min(W, t.dim)
            return sorted(
                {p for p in (2**i for i in range(1, top.bit_length())) if p < top} | {top}
            )
        if kind == "row_wise":
            return [min(W, t.rows)]
        if kind == "table_row_wise":
            return [min(R, t.rows)]
        return [1]


def _estimates(
    model: _CostModel, tables: Sequence[TableSpec], kinds: list[str], drafts: list[list[_Draft]]
) -> dict:
    """Per-rank load and memory, the cost model's totals per step, and per table the load
    and memory of each shard (in the plan's shard order) and, when some of its shards are
    in DRAM or on SSD, the hit rate expected of their caches. Device memory includes the
    caches, which ``cache_bytes`` also gives alone."""
    W = model.topo.world_size
    flat = [d for ds in drafts for d in ds]
    ranks = np.array([d.rank for d in flat], dtype=np.int64)
    tiers = np.array([d.tier for d in flat], dtype=np.int64)
    seconds = [model.seconds(d) for d in flat]
    load = np.bincount(ranks, seconds, minlength=W)
    used = np.zeros((W, len(TIERS)))
    np.add.at(used, (ranks, tiers), [d.memory for d in flat])
    caches = np.bincount(ranks, [model.cache(d.memory, d.tier) for d in flat], minlength=W)
    used[:, 0] += caches
    per_table = {}
    start = 0
    for i, (t, ds) in enumerate(zip(tables, drafts, strict=True)):
        tiered = any(d.tier for d in ds)
        per_table[t.name] = {
            "load_seconds": seconds[start : start + len(ds)],
            "memory_bytes": [d.memory for d in ds],
            "cache_hit_rate": float(model.hit[i]) if tiered else None,
        }
        start += len(ds)
    a2a = [d for kind, ds in zip(kinds, drafts, strict=True) if kind != "data_parallel" for d in ds]
    copies = [
        d for kind, ds in zip(kinds, drafts, strict=True) if kind == "data_parallel" for d in ds
    ]
    mean = float(load.mean())
    return {
        "batch_size_per_rank": model.batch,
        "load_seconds": load.tolist(),
        "memory_bytes": {tier: used[:, i].tolist() for i, tier in enumerate(TIERS)},
        "max_over_mean_load": float(load.max()) / mean if mean > 0 else 1.0,
        "tables_per_sharding": {k: kinds.count(k) for k in SHARDING_TYPES},
        "cache_load_factor": model.cache_factor,
        "cache_bytes": caches.tolist(),
        "tables": per_table,
        "totals": {
            "load_seconds": float(load.sum()),
            "lookup_bytes": float(sum(d.lookup_bytes for d in flat)),
            "all_to_all_intra_host_bytes": float(sum(d.intra_bytes for d in a2a)),
            "all_to_all_inter_host_bytes": float(sum(d.inter_bytes for d in a2a)),
            "allreduce_bytes": float(sum(d.intra_bytes + d.inter_bytes for d in copies)),
            "memory_bytes": {tier: float(used[:, i].sum()) for i, tier in enumerate(TIERS)},
        },
    }


def evaluate_plan(
    plan: ShardingPlan,
    tables: Sequence[TableSpec],
    topology: Topology,
    batch_size: int,
    *,
    optimizer: OptimizerState = ROW_WISE_ADAGRAD_STATE,
    weight_bytes: int = 4,
) -> dict:
    """The cost model's estimates (as in ``plan.estimates``) of any plan of ``tables``: one
    edited by hand, loaded from JSON, or a baseline to compare the planner with."""
    if (plan.world_size, plan.ranks_per_host) != (topology.world_size, topology.ranks_per_host):
        raise PlanningError(
            f"the plan is for {plan.world_size} ranks, {plan.ranks_per_host} a host; the "
            f"topology has {topology.world_size}, {topology.ranks_per_host} a host"
        )
    plan.validate()
    specs = {t.name: t for t in tables}
    for tp in plan.tables:
        t = specs.get(tp.name)
        if t is None or (t.rows, t.dim) != (tp.rows, tp.dim):
            raise PlanningError(f"table {tp.name}: the plan's {tp.rows}x{tp.dim} is not in tables")
    ordered = [specs[tp.name] for tp in plan.tables]
    model = _CostModel(topology, batch_size, weight_bytes, optimizer, ordered)
    drafts = []
    for index, (tp, t) in enumerate(zip(plan.tables, ordered, strict=True)):
        pieces = len(tp.shards)
        drafts.append(
            [
                _Draft(
                    index,
                    s.row_start,
                    s.row_end,
                    s.col_start,
                    s.col_end,
                    *model.traffic(t, tp.sharding, pieces, s.rows, s.cols),
                    model.memory(s.rows, s.cols),
                    TIERS.index(s.tier),
                    s.rank,
                )
                for s in tp.shards
            ]
        )
    return _estimates(model, ordered, [tp.sharding for tp in plan.tables], drafts)

"""The sharding planner: which rank holds which rows and columns of every table, and where.

A plan is chosen with a cost model, as in the papers (Mudigere et al. 2021, section 4.2):
every shard costs its rank some seconds per training step, and the step lasts as long as
the busiest rank, so the planner minimises the largest per-rank load and reports the
max/mean ratio. What a shard costs, per step (forward and backward):

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

What the data says: the IDs a step looks up come from each table's pooling factor (IDs per
non-empty bag) and access frequency (the share of samples with a bag), and a cache's hit
rate from how skewed the accesses are. ``tables_from_spec`` takes them from the dataset's
``stats.json`` (``dlrmflow.ingest.stats``) when there is one; without it every table is
one-hot, always accessed, and accessed uniformly (a cache of a fraction of the rows serves
that fraction of the lookups). ``plan_for_config`` records which in the plan's estimates
(``statistics``). ``plan_for_job`` plans on rank 0 only and broadcasts the plan, so ranks
that see different files (or compute in a different order) still run one plan.

The algorithm, in order:

1. Tiny tables whose allreduce costs less than their all-to-all become data-parallel.
2. Tiers: tables hottest per byte (IDs looked up per step per stored byte, times the share
   a cache would miss) go to the fastest tier with room across the job, filling
   ``TIER_FILL`` of it (the rest is slack for packing shards onto ranks).
3. Sharding: each table takes its cheapest option (least total seconds); a table whose
   largest shard would cost more than ``MAX_SHARD_SHARE`` of the mean rank load is split
   further (more column pieces, row-wise in one host, row-wise over all ranks) until the
   pieces are small enough to balance. Options whose shards take more than
   ``MAX_SHARD_MEMORY_SHARE`` of a rank's tier are avoided, so that packing stays easy.
4. Placement: largest shard first onto the rank where the load ends lowest (LPT), in the
   fastest tier from its table's with room there. A table some of whose shards had to go
   to a slower tier is planned again in that tier (its load there may need more pieces).
5. Promotion: shards hottest per byte (cache misses counted) move up into fast memory
   left free on their rank.
6. Refinement: table-wise and column-wise shards are moved or swapped off the busiest
   rank while that lowers its load (row-wise kinds stay where they are: their shards go
   one per rank of their group anyway).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dlrmflow.config import RunConfig
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.ingest.manifest import join_url
from dlrmflow.ingest.stats import STATS_NAME, DatasetStats, interpolate_hit_rate, read_stats
from dlrmflow.train.sharding import (
    SHARDING_TYPES,
    TIERS,
    Shard,
    ShardingPlan,
    ShardingType,
    TablePlan,
)

ID_BYTES = 8  # int64 IDs travel in the input all-to-all
LENGTH_BYTES = 4  # one int32 bag length per sample and table
LOOKUP_PASSES = 3  # forward read, then the fused optimizer's read and write of the row
STATE_PASSES = 2  # the optimizer state is read and written in backward
# Tiers are assigned job-wide up to this fill; the rest is slack for packing onto ranks.
TIER_FILL = 0.95
# Splitting a table costs traffic, so only tables whose largest shard would weigh more than
# this share of the mean rank load are split further; LPT balances the rest.
MAX_SHARD_SHARE = 0.25
MAX_SHARD_MEMORY_SHARE = 0.5
# Data-parallel tables live on every rank: only tables this small (a share of one rank's
# device memory, each and together) may be replicated without being pinned or forced.
DATA_PARALLEL_TABLE_SHARE = 0.01
DATA_PARALLEL_TOTAL_SHARE = 0.1
MAX_REFINE_ROUNDS = 5_000
SWAP_CANDIDATES = 1024
# Past this max/mean the estimates are finer than the cost model is right: stop refining.
REFINE_TOLERANCE = 0.01
MAX_REPLANS = 4


class PlanningError(ValueError):
    """The model cannot be placed on the topology; the message says by how much."""


@dataclass(frozen=True)
class TableSpec:
    """One embedding table as the planner sees it.

    ``pooling_factor`` is the mean number of IDs in a bag and ``access_frequency`` the
    fraction of samples with a non-empty bag: together they say how many rows a step reads.
    ``distinct_ids`` (None: as many as rows) and ``cache_hits`` (the ``(fraction of the
    distinct IDs cached, hit rate)`` points of ``SparseStats.cache_hits``; empty: uniform
    access) say how well a cache of its hottest rows works.
    """

    name: str
    rows: int
    dim: int
    pooling_factor: float = 1.0
    access_frequency: float = 1.0
    distinct_ids: int | None = None
    cache_hits: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1:
            raise ValueError(f"table {self.name}: rows and dim must be >= 1")
        if self.pooling_factor < 0 or not 0 <= self.access_frequency <= 1:
            raise ValueError(
                f"table {self.name}: pooling_factor must be >= 0 and access_frequency in [0, 1]"
            )
        if self.distinct_ids is not None and self.distinct_ids < 1:
            raise ValueError(f"table {self.name}: distinct_ids must be >= 1 (or None)")
        if any(not (0 < f <= 1 and 0 <= h <= 1) for f, h in self.cache_hits):
            raise ValueError(f"table {self.name}: cache_hits must be (0-1 fraction, 0-1 rate)")

    @property
    def ids_per_sample(self) -> float:
        return self.pooling_factor * self.access_frequency

    def hit_rate(self, cache_fraction: float) -> float:
        """The expected share of lookups served by a cache of ``cache_fraction`` of the
        table's rows (of each shard's rows, alike: hashing spreads hot IDs over the rows).

        The cache holds ``cache_fraction * rows`` of the ``distinct_ids`` IDs; where rows
        are hash buckets shared by several IDs this counts a cached row as one ID, which
        underestimates the hit rate a little rather than overestimating it.
        """
        if cache_fraction <= 0:
            return 0.0
        ids_fraction = min(1.0, cache_fraction * self.rows / (self.distinct_ids or self.rows))
        if not self.cache_hits:
            return ids_fraction
        return interpolate_hit_rate(self.cache_hits, ids_fraction)


@dataclass(frozen=True)
class Topology:
    """The job's ranks and, per rank, memory per tier and bandwidths (bytes, bytes/s).

    The default bandwidths are those of a ZionEX-like GPU host: HBM at 2 TB/s, host DRAM
    read by the GPU over PCIe 4 (UVM) at 25 GB/s, NVMe at 3 GB/s, NVLink at 250 GB/s and one
    200 Gb/s NIC per GPU (25 GB/s) between hosts.

    ``cache_load_factor``: the share of the rows of each DRAM or SSD shard cached in device
    memory (as UVM caching does, and the tiered bag of ``dlrmflow.kernels.tiered``); the
    cache takes that share of the shard's bytes from the rank's device memory. 0: no cache.
    """

    world_size: int
    ranks_per_host: int
    device_bytes: float
    dram_bytes: float
    ssd_bytes: float
    device_bw: float = 2.0e12
    dram_bw: float = 2.5e10
    ssd_bw: float = 3.0e9
    intra_host_bw: float = 2.5e11
    inter_host_bw: float = 2.5e10
    cache_load_factor: float = 0.0

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_host < 1:
            raise ValueError("world_size and ranks_per_host must be >= 1")
        if self.world_size % self.ranks_per_host:
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of "
                f"ranks_per_host {self.ranks_per_host}"
            )
        if min(self.device_bytes, self.dram_bytes, self.ssd_bytes) < 0:
            raise ValueError("memory per tier must be >= 0")
        bandwidths = (
            self.device_bw,
            self.dram_bw,
            self.ssd_bw,
            self.intra_host_bw,
            self.inter_host_bw,
        )
        if min(bandwidths) <= 0:
            raise ValueError("bandwidths must be > 0")
        if not 0 <= self.cache_load_factor <= 1:
            raise ValueError(f"cache_load_factor must be in [0, 1], got {self.cache_load_factor}")

    @property
    def hosts(self) -> int:
        return self.world_size // self.ranks_per_host

    @property
    def tier_bytes(self) -> np.ndarray:
        """Bytes per rank, in ``TIERS`` order."""
        return np.array([self.device_bytes, self.dram_bytes, self.ssd_bytes], dtype=np.float64)

    @property
    def tier_bw(self) -> np.ndarray:
        return np.array([self.device_bw, self.dram_bw, self.ssd_bw], dtype=np.float64)


@dataclass(frozen=True)
class OptimizerState:
    """Bytes of optimizer state the fused optimizer keeps beside the weights."""

    bytes_per_row: float = 0.0
    bytes_per_element: float = 0.0


SGD_STATE = OptimizerState()
ROW_WISE_ADAGRAD_STATE = OptimizerState(bytes_per_row=4.0)
ADAM_STATE = OptimizerState(bytes_per_element=8.0)
# The embedding optimizer each ``train.optimizer`` setting fuses into backward.
OPTIMIZER_STATES = {"adagrad": ROW_WISE_ADAGRAD_STATE, "sgd": SGD_STATE}


# A CPU job with ``train.embedding_memory_bytes``: the disk tier is bounded by the file
# system, not by the planner.
DISK_BYTES = 1e15
# The share of ``train.embedding_memory_bytes`` kept for the cache of hot rows when some
# shards must go to disk (the in-memory shards get the rest).
CACHE_SHARE = 0.25


def cpu_topology(
    world_size: int,
    ranks_per_host: int,
    embedding_memory_bytes: float | None = None,
    *,
    cache_share: float = 0.0,
) -> Topology:
    """A CPU job (gloo): the "device" tier is the process's RAM. Budgets are generous so that
    any model a CPU can train fits; bandwidths are those of a commodity server.

    ``embedding_memory_bytes`` (``train.embedding_memory_bytes``, per rank) bounds that
    memory instead, less ``cache_share`` of it kept for the cache of the shards on disk,
    and adds a disk ("ssd") tier for the rest: the trainer keeps the shards planned there in
    a tiered bag (``dlrmflow.kernels.tiered``)."""
    if not 0 <= cache_share < 1:
        raise ValueError(f"cache_share must be in [0, 1), got {cache_share}")
    budget = embedding_memory_bytes
    return Topology(
        world_size=world_size,
        ranks_per_host=ranks_per_host,
        device_bytes=64e9 if budget is None else budget * (1 - cache_share),
        dram_bytes=0.0,
        ssd_bytes=0.0 if budget is None else DISK_BYTES,
        device_bw=2e10,
        dram_bw=2e10,
        ssd_bw=1e9,
        intra_host_bw=5e9,
        inter_host_bw=1.25e9,
    )


def tables_from_spec(spec: FeatureSpec, stats: DatasetStats | None = None) -> list[TableSpec]:
    """The spec's tables. With the dataset's ``stats``, each table's pooling factor, access
    frequency, distinct IDs and cache hit rates are its feature's; without, every table is
    one-hot, always accessed and accessed uniformly. Stats lacking a table's feature raise
    ``PlanningError`` naming both."""
    if stats is None:
        return [TableSpec(f.name, f.num_embeddings, f.embedding_dim) for f in spec.sparse]
    by_name = {s.name: s for s in stats.sparse}
    tables = []
    for f in spec.sparse:
        s = by_name.get(f.name)
        if s is None:
            raise PlanningError(
                f"table {f.name}: {stats.url} statistics have no feature {f.name}; "
                "run `dlrmflow stats` on the dataset again"
            )
        tables.append(
            TableSpec(
                f.name,
                f.num_embeddings,
                f.embedding_dim,
                pooling_factor=s.mean_length,
                access_frequency=s.access_rate,
                distinct_ids=max(s.distinct, 1),
                cache_hits=s.cache_hits,
            )
        )
    return tables


# -- the cost model -----------------------------------------------------------------------


@dataclass
class _Draft:
    """One shard during placement: its ranges, traffic per step, and where it went."""

    table: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    lookup_bytes: float  # read and written in its tier
    intra_bytes: float  # all-to-all (or allreduce) bytes to ranks of the same host
    inter_bytes: float  # ... and to other hosts
    memory: float
    tier: int
    rank: int = -1


@dataclass
class _Option:
    """One way to shard one table, summarised; its drafts are built only once chosen."""

    table: int
    kind: str
    pieces: int  # column pieces for column-wise, row pieces for the row-wise kinds
    tier: int
    total: float  # seconds per step over every rank (every copy, when data-parallel)
    largest: float  # seconds per step of its costliest shard
    largest_memory: float
    drafts: list[_Draft] = field(default_factory=list)


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


# -- choosing a sharding per table ---------------------------------------------------------


def _format_bytes(n: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


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


# -- placement -----------------------------------------------------------------------------


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


# -- the public API ------------------------------------------------------------------------


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


def load_plan_stats(root: str) -> DatasetStats | None:
    """The feature statistics beside the dataset at ``root`` (``stats.json``, which the
    ingest flow and ``dlrmflow stats`` write), or None when there are none. A file that is
    there but unreadable raises, naming it: planning on defaults would hide it."""
    try:
        return read_stats(root)
    except FileNotFoundError:
        return None


def plan_for_config(
    config: RunConfig,
    spec: FeatureSpec,
    world_size: int,
    ranks_per_host: int,
    *,
    topology: Topology | None = None,
    stats_root: str | None = None,
) -> ShardingPlan:
    """The plan the sharded trainer runs: the spec's tables on ``topology`` (default: a CPU
    topology, ``cpu_topology``), ``train.batch_size`` samples per rank,
    ``distributed.sharding`` forced on every table when set, and the state of the configured
    embedding optimizer.

    The tables' statistics come from ``stats.json`` under ``stats_root`` (default: the
    dataset, ``data.url``) when it is there, else from defaults (``tables_from_spec``);
    ``estimates["statistics"]`` says which: the file's URL, or ``"defaults"``. Each rank
    calling this may see other files: a job plans with ``plan_for_job``.

    With ``train.embedding_memory_bytes`` (and no ``topology``) each rank's memory is that
    budget, and shards beyond it go to disk. When some do, the plan is made again with
    ``CACHE_SHARE`` of the budget kept for their cache of hot rows; a model that fits
    keeps all of the budget for its shards.
    """
    root = config.data.url if stats_root is None else stats_root
    stats = load_plan_stats(root)
    budget = config.train.embedding_memory_bytes

    def plan_on(chosen: Topology) -> ShardingPlan:
        return plan_sharding(
            tables_from_spec(spec, stats),
            chosen,
            config.train.batch_size,
            force=config.distributed.sharding,
            optimizer=OPTIMIZER_STATES[config.train.optimizer],
        )

    if topology is not None:
        plan = plan_on(topology)
    else:
        plan = plan_on(cpu_topology(world_size, ranks_per_host, budget))
        on_disk = any(s.tier != "device" for t in plan.tables for s in t.shards)
        if budget is not None and on_disk:
            plan = plan_on(
                cpu_topology(world_size, ranks_per_host, budget, cache_share=CACHE_SHARE)
            )
    plan.estimates["statistics"] = join_url(root, STATS_NAME) if stats is not None else "defaults"
    return plan


def plan_for_job(
    config: RunConfig,
    spec: FeatureSpec,
    world_size: int,
    ranks_per_host: int,
    *,
    stats_root: str | None = None,
) -> ShardingPlan:
    """``plan_for_config`` computed by rank 0 alone and broadcast to every rank, so that all
    ranks run rank 0's plan even where they would plan differently (another host that sees
    another ``stats.json``, or none). Every rank of the job must call it (a collective).
    Outside a ``torch.distributed`` job it is ``plan_for_config``.

    A failure to plan on rank 0 is broadcast too: rank 0 raises it, the others raise a
    ``PlanningError`` quoting it, instead of waiting in the broadcast until the job times out.

    The job is about to allocate the plan's tables, so the plan is checked against the
    memory of each host first (``dlrmflow.train.tiers.check_memory``, also a collective):
    a model its hosts cannot hold fails on every rank, in one line naming
    ``train.embedding_memory_bytes``. The memory is measured before any rank plans or
    allocates; the tables' even share is checked before planning too (a model far too
    large for the host needs no plan to say so).
    """
    import torch.distributed as dist  # here: planning alone needs only numpy, and is quick

    from dlrmflow.memory import available_memory
    from dlrmflow.train.tiers import check_memory

    available = available_memory()
    if not (dist.is_available() and dist.is_initialized()):
        plan = plan_for_config(config, spec, world_size, ranks_per_host, stats_root=stats_root)
        check_memory(config, spec, plan, available=available)
        return plan
    check_memory(config, spec, ranks_per_host=ranks_per_host, available=available)
    if dist.get_world_size() != world_size:
        raise PlanningError(
            f"plan_for_job: world_size {world_size}, but the process group has "
            f"{dist.get_world_size()} ranks"
        )
    message: list[dict | None] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            plan = plan_for_config(config, spec, world_size, ranks_per_host, stats_root=stats_root)
            message[0] = {"plan": plan.to_dict()}
        except Exception as e:  # every rank must hear of it, or the others wait forever
            failure = e
            message[0] = {"error": f"rank 0 could not plan: {e}"}
    dist.broadcast_object_list(message, src=0)
    if failure is not None:
        raise failure
    received = message[0]
    if received is None or "error" in received:
        raise PlanningError(received["error"] if received else "rank 0 sent no plan")
    plan = ShardingPlan.from_dict(received["plan"])
    plan.validate()
    check_memory(config, spec, plan, available=available)
    return plan


PAPER_BATCH_SIZE = 512  # per rank: 64K samples a step on 128 ranks


def paper_12t() -> tuple[list[TableSpec], Topology, int]:
    """A paper-scale model (Mudigere et al. 2021: 12T parameters on 128 GPUs of 16 ZionEX
    hosts), fixed by a seed so that benchmarks and tests see the same one.

    600 tables whose rows spread evenly on a log scale from 4K to 1.73G (a density of sizes
    proportional to 1/rows, Zipf-like: most tables are small, a few dozen hold most of the
    parameters), dims 64 to 256, Zipf-distributed pooling factors (most features one-hot,
    a few with bags of up to 200 IDs) and access frequencies from 10% to 100%: 12.05T
    float32 parameters, 48.2 TB. Per rank: 80 GB HBM (A100 80GB), 192 GB DRAM (1.5 TB per
    host of 8 GPUs) and 2 TB of NVMe: 10.2 TB of HBM and 24.6 TB of DRAM across the job,
    so the coldest ~20 TB live on SSD.
    """
    n = 600
    rng = np.random.default_rng(12)
    log_rows = np.linspace(np.log(4e3), np.log(1.73e9), n)
    rows = np.round(np.exp(log_rows)).astype(np.int64)[rng.permutation(n)]
    dims = rng.choice([64, 128, 192, 256], size=n, p=[0.3, 0.3, 0.2, 0.2])
    pooling = np.minimum(rng.zipf(1.6, size=n), 200)
    access = rng.uniform(0.1, 1.0, size=n)
    tables = [
        TableSpec(f"t{i:03d}", int(rows[i]), int(dims[i]), float(pooling[i]), float(access[i]))
        for i in range(n)
    ]
    topology = Topology(
        world_size=128, ranks_per_host=8, device_bytes=80e9, dram_bytes=192e9, ssd_bytes=2e12
    )
    return tables, topology, PAPER_BATCH_SIZE


# -- printing ------------------------------------------------------------------------------


def _span(start: int, end: int, size: int) -> str:
    """A shard's row or column range, ``all`` when it is the whole table's."""
    return "all" if (start, end) == (0, size) else f"{start}:{end}"


def _hit_text(hit: float | None, tier: str, cache_load_factor: float | None) -> str:
    """A shard's expected cache hit rate: ``-`` in device memory (or unknown), ``no cache``
    in a slower tier of a topology without caches."""
    if tier == "device" or hit is None:
        return "-"
    return f"{hit:.1%}" if cache_load_factor else "no cache"


def format_plan(plan: ShardingPlan, max_shards: int = 12) -> str:
    """A plain-text report, one block per rank: its estimated load, memory per tier (device
    memory includes caches) and shard count, then its shards, heaviest first: table,
    sharding, rows and columns held, tier, memory, estimated load, and for a shard in DRAM or
    on SSD the hit rate expected of its cache. Past ``max_shards`` a rank's lightest shards
    are summed up in one line. A plan without estimates (edited by hand) prints ``-`` for
    them; ``--json`` carries every shard."""
    est = plan.estimates
    kinds = {k: sum(t.sharding == k for t in plan.tables) for k in SHARDING_TYPES}
    hosts = plan.world_size // plan.ranks_per_host
    lines = [
        f"{len(plan.tables)} tables on {plan.world_size} ranks ({hosts} host"
        f"{'s' if hosts > 1 else ''} of {plan.ranks_per_host}): "
        + ", ".join(f"{n} {k}" for k, n in kinds.items() if n)
    ]
    if "statistics" in est:
        source = est["statistics"]
        lines.append(
            "statistics: "
            + (
                "defaults (no stats.json: one-hot, always accessed, uniform access)"
                if source == "defaults"
                else source
            )
        )
    if est.get("cache_load_factor"):
        lines.append(
            f"cache: {est['cache_load_factor']:.0%} of the rows of each DRAM or SSD shard, "
            "in device memory"
        )
    per_table = est.get("tables", {})
    loads = est.get("load_seconds")
    memory = est.get("memory_bytes", {})
    header = (
        f"  {'table':<20} {'sharding':<15} {'rows':>21} {'cols':>9}  {'tier':<6} "
        f"{'memory':>9} {'load ms':>10} {'cache hit':>9}"
    )
    for r in range(plan.world_size):
        shards = []
        for t in plan.tables:
            numbers = per_table.get(t.name)
            for j, s in enumerate(t.shards):
                if s.rank != r:
                    continue
                load = numbers["load_seconds"][j] if numbers else None
                mem = numbers["memory_bytes"][j] if numbers else None
                hit = numbers["cache_hit_rate"] if numbers else None
                shards.append((t, s, load, mem, hit))
        if per_table:  # (a plan saved before per-shard estimates keeps its table order)
            shards.sort(key=lambda x: -x[2])
        load_text = f"{loads[r] * 1e3:.4g} ms" if loads else "-"
        mem_text = ", ".join(
            f"{tier} {_format_bytes(memory[tier][r]) if tier in memory else '-'}" for tier in TIERS
        )
        lines += ["", f"rank {r}: load {load_text}; {mem_text}; {len(shards)} shards", header]
        for t, s, load, mem, hit in shards[:max_shards]:
            rows, cols = _span(s.row_start, s.row_end, t.rows), _span(s.col_start, s.col_end, t.dim)
            lines.append(
                f"  {t.name:<20} {t.sharding:<15} {rows:>21} {cols:>9}  {s.tier:<6} "
                f"{_format_bytes(mem) if mem is not None else '-':>9} "
                f"{f'{load * 1e3:.4g}' if load is not None else '-':>10} "
                f"{_hit_text(hit, s.tier, est.get('cache_load_factor')):>9}"
            )
        rest = shards[max_shards:]
        if rest:
            summed = ""
            if per_table:
                rest_load = sum(x[2] for x in rest) * 1e3
                rest_mem = _format_bytes(sum(x[3] for x in rest))
                summed = f": {rest_load:.4g} ms, {rest_mem}"
            lines.append(f"  ... {len(rest)} more shards{summed}")
    if "max_over_mean_load" in est:
        lines += ["", f"max/mean load: {est['max_over_mean_load']:.3f}"]
    return "\n".join(lines)

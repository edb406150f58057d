"""The planner's nouns: its inputs (tables, topology, optimizer state), its error, and the
working records of shards and options that every step of planning passes along.

They sit at the bottom of the package, importing none of its modules, so that the cost
model, the steps and the report can all use them without an import cycle. The records
(``_Draft``, ``_Option``) and ``_format_bytes`` (which words both the errors and the
printed plan) keep their leading underscore: they are shared by the package's modules but
are not its API. The plan the planner writes (``ShardingPlan`` and its shards) is not
here: it is the train stage's (``dlrmflow.train.model.plan``), read by the sharded
embeddings as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from dlrmflow.ingest.stats.cache_hits import interpolate_hit_rate
from dlrmflow.kernels.optimizers import SGD, Adam, EmbeddingOptimizer, RowWiseAdagrad


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

    The default bandwidths are the cost model's assumed figures for a ZionEX-like GPU host,
    nominal hardware figures rather than anything measured here: HBM at 2 TB/s, host DRAM
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

    def with_memory(
        self,
        *,
        device_bytes: float | None = None,
        dram_bytes: float | None = None,
        ssd_bytes: float | None = None,
        cache_load_factor: float | None = None,
    ) -> Topology:
        """This topology with the memory per tier and cache share given (None: kept), so
        that a plan can be asked for other hardware (``dlrmflow plan --device-memory ...``)
        without restating its ranks and bandwidths; checked as any topology is."""
        given = {
            "device_bytes": device_bytes,
            "dram_bytes": dram_bytes,
            "ssd_bytes": ssd_bytes,
            "cache_load_factor": cache_load_factor,
        }
        return replace(self, **{key: value for key, value in given.items() if value is not None})

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
    """Bytes of optimizer state the fused optimizer keeps beside the weights, as the
    optimizer describes it (``of``)."""

    bytes_per_row: float = 0.0
    bytes_per_element: float = 0.0

    @classmethod
    def of(cls, optimizer: type[EmbeddingOptimizer]) -> OptimizerState:
        per_row, per_element = optimizer.state_bytes()
        return cls(bytes_per_row=per_row, bytes_per_element=per_element)


SGD_STATE = OptimizerState.of(SGD)
ROW_WISE_ADAGRAD_STATE = OptimizerState.of(RowWiseAdagrad)
ADAM_STATE = OptimizerState.of(Adam)
# The embedding optimizer each ``train.optimizer`` setting fuses into backward.
OPTIMIZER_STATES = {"adagrad": ROW_WISE_ADAGRAD_STATE, "sgd": SGD_STATE}


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


def _format_bytes(n: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"

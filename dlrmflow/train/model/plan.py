"""The nouns of a sharding plan: which rank holds which rows and columns of which table.

The planner (``dlrmflow.train.planner``) writes a ``ShardingPlan``; the sharded embedding
collection (``dlrmflow.train.model.sharded``) executes one. Keeping the plan
plain data (it round-trips through JSON) lets a plan be printed, saved next to a
checkpoint, edited by hand, and loaded at another world size for resharding.

Sharding types, as in the papers and TorchRec:

- ``data_parallel``: every rank holds the whole table; gradients are allreduced.
- ``table_wise``: one rank holds the whole table.
- ``row_wise``: the rows are split into contiguous ranges, one per rank of a group.
- ``column_wise``: the columns are split, each shard holding every row of its columns.
- ``table_row_wise``: row-wise over the ranks of one host (table-wise across hosts), so
  the partial sums of a bag never leave the host's fast interconnect.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

from dlrmflow.config import ShardingType

SHARDING_TYPES: tuple[str, ...] = get_args(ShardingType)

Tier = Literal["device", "dram", "ssd"]
TIERS: tuple[str, ...] = get_args(Tier)


@dataclass(frozen=True)
class Shard:
    """Rows ``[row_start, row_end)`` and columns ``[col_start, col_end)`` of a table on
    ``rank``, stored in ``tier``."""

    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    tier: Tier = "device"

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def cols(self) -> int:
        return self.col_end - self.col_start


@dataclass(frozen=True)
class TablePlan:
    """How one table is sharded. A data-parallel table has one full shard per rank."""

    name: str
    rows: int
    dim: int
    sharding: ShardingType
    shards: tuple[Shard, ...]

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING_TYPES:
            raise ValueError(f"table {self.name}: unknown sharding type {self.sharding!r}")
        if not self.shards:
            raise ValueError(f"table {self.name}: a plan needs at least one shard")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.shards)


@dataclass(frozen=True)
class ShardingPlan:
    """Every table's sharding for a job of ``world_size`` ranks, ``ranks_per_host`` a host."""

    world_size: int
    tables: tuple[TablePlan, ...]
    ranks_per_host: int = 1
    estimates: dict = field(default_factory=dict, compare=False)

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"the sharding plan has no table {name!r}")

    def shards_on(self, rank: int) -> list[tuple[TablePlan, Shard]]:
        """The (table, shard) pairs ``rank`` stores, in plan order (its local table order)."""
        return [(t, s) for t in self.tables for s in t.shards if s.rank == rank]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ShardingPlan:
        tables = tuple(
            TablePlan(
                name=t["name"],
                rows=t["rows"],
                dim=t["dim"],
                sharding=t["sharding"],
                shards=tuple(Shard(**s) for s in t["shards"]),
            )
            for t in data["tables"]
        )
        return cls(
            world_size=data["world_size"],
            tables=tables,
            ranks_per_host=data.get("ranks_per_host", 1),
            estimates=data.get("estimates", {}),
        )

    def validate(self) -> None:
        """Check that every shard lies on a real rank and the shards of each table tile it
        exactly (data-parallel: one full copy per rank), so no row is lost or doubled."""
        for t in self.tables:
            for s in t.shards:
                if not 0 <= s.rank < self.world_size:
                    raise ValueError(
                        f"table {t.name}: shard on rank {s.rank}, world size {self.world_size}"
                    )
                if not (
                    0 <= s.row_start < s.row_end <= t.rows and 0 <= s.col_start < s.col_end <= t.dim
                ):
                    raise ValueError(f"table {t.name}: shard {s} is outside {t.rows}x{t.dim}")
            if t.sharding == "data_parallel":
                full = all(s.rows == t.rows and s.cols == t.dim for s in t.shards)
                if not full or sorted(t.ranks) != list(range(self.world_size)):
                    raise ValueError(f"table {t.name}: data-parallel needs a full copy per rank")
                continue
            cells = sum(s.rows * s.cols for s in t.shards)
            if cells != t.rows * t.dim or len(set(t.ranks)) != len(t.ranks):
                raise ValueError(
                    f"table {t.name}: its {t.sharding} shards do not tile {t.rows}x{t.dim} "
                    "exactly once with one shard per rank"
                )

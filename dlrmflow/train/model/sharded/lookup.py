"""Step 2 of a sharded lookup: every received sample looked up in the rank's own shards.

The rank holds the shards the plan gives it in one table-batched bag (row ranges shifted
to start at 0, column ranges as narrower tables) and a replica of every data-parallel
table in another. Given a ``TierStorage``, the shards the plan puts in DRAM or on SSD live
in a ``TieredEmbeddingBag`` instead (rows and optimizer state in a file per rank, hot rows
cached in what the rank's memory budget leaves after its in-memory shards); the received
IDs are then split by key between the two bags and their pooled columns put back in route
order. Both bags run the same TBE code, so the weights are bitwise those of an
all-in-memory run.

The fused optimizer of each bag updates the touched rows in backward, with two hooks for
what one rank cannot know alone: data-parallel tables allreduce their reduced row
gradients first, and the column shards of a column-wise table sum their columns' squared
gradients across the table's ranks (row-wise Adagrad keeps one value per row, the mean
over the whole row). The shards of a column-wise table split over ranks go to disk
together or not at all: their square-sum collectives must come in one order on every rank.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.kernels.row_cache import CacheTooSmall
from dlrmflow.kernels.row_file import DiskSpaceError
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag, init_table_rows
from dlrmflow.kernels.tiered import TieredEmbeddingBag
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.comms import CommStats
from dlrmflow.train.model.sharded.input_dist import ReceivedInput
from dlrmflow.train.model.sharded.routing import Route, Routing, select_keys
from dlrmflow.train.model.sharded.tiers import (
    TierBudgetError,
    TierStorage,
    cache_budget_error,
    cache_rows_left,
    in_memory_bytes,
)


class ShardLookup(nn.Module):
    """The rank's bags: ``local`` (its shards in memory), ``tiered`` (its shards on disk)
    and ``replicated`` (the data-parallel tables), each None when it has none."""

    def __init__(
        self,
        routing: Routing,
        optimizer: EmbeddingOptimizer,
        *,
        seed: int,
        group: dist.ProcessGroup | None,
        stats: CommStats,
        kernels: str,
        tiers: TierStorage | None,
        timeout: timedelta | None,
    ) -> None:
        super().__init__()
        self.routing = routing
        self.optimizer = optimizer
        self.group = group
        self.stats = stats
        self.device = routing.device
        self.tiers = tiers
        # One process group per set of ranks (not per table): every rank creates them in
        # the same order, and few groups keep start-up cheap.
        by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.column_groups: dict[str, dist.ProcessGroup] = {}
        for t in routing.plan.tables:
            if t.sharding == "column_wise" and len(t.shards) > 1:
                ranks = tuple(sorted(t.ranks))
                if ranks not in by_ranks:
                    by_ranks[ranks] = dist.new_group(ranks=list(ranks), timeout=timeout)
                self.column_groups[t.name] = by_ranks[ranks]
        local = routing.local
        on_disk = [tiers is not None and self._on_disk(route) for route in local]
        self.memory_routes = [r for r, d in zip(local, on_disk, strict=True) if not d]
        self.tiered_routes = [r for r, d in zip(local, on_disk, strict=True) if d]
        memory = self.memory_routes
        self.local = (
            TableBatchedEmbeddingBag(
                [self._local_table(route) for route in memory],
                optimizer,
                init=lambda j, out: _init_shard(memory[j], out, seed),
                kernels=kernels,
            ).to(self.device)
            if memory
            else None
        )
        if self.local is not None and any(r.table.name in self.column_groups for r in memory):
            self.local.square_sum_hook = self._column_square_means
        replicated = [routing.features[k] for k in routing.replicated_features]
        self.tiered: TieredEmbeddingBag | None = None
        if tiers is not None:
            self._make_tiered(tiers, optimizer, seed, kernels, replicated)
        # Where each local shard's pooled columns are in [in-memory bag's | tiered bag's].
        block_start = {}
        column = 0
        for route in memory + self.tiered_routes:
            block_start[id(route)] = column
            column += route.shard.cols
        self.pooled_order = torch.tensor(
            [block_start[id(route)] + c for route in local for c in range(route.shard.cols)],
            dtype=torch.int64,
            device=self.device,
        )
        self.replicated = None
        if replicated:
            self.replicated = TableBatchedEmbeddingBag(
                replicated, optimizer, seed=seed, kernels=kernels
            ).to(self.device)
            self.replicated.gradient_hook = self._allreduce_rows

    # -- construction -------------------------------------------------------------------

    def _make_tiered(
        self,
        tiers: TierStorage,
        optimizer: EmbeddingOptimizer,
        seed: int,
        kernels: str,
        replicated: list[SparseFeature],
    ) -> None:
        routes = self.tiered_routes
        tables = [self._local_table(route) for route in routes]
        kept = in_memory_bytes(self.local.tables if self.local else [], optimizer)
        kept += in_memory_bytes(replicated, optimizer)
        problem, cache_rows = "", 0
        if tables:
            try:
                cache_rows = cache_rows_left(tiers, kept, tables, optimizer, self.routing.rank)
            except TierBudgetError as e:
                problem = str(e)
        # A collective: when any rank's budget leaves no room, every rank raises its
        # error, none waits for the others.
        self._raise_first(problem, TierBudgetError)
        problem = ""
        try:
            if routes:
                self.tiered = TieredEmbeddingBag(
                    tables,
                    optimizer,
                    tiers.directory,
                    cache_rows=cache_rows,
                    init=lambda j, out, first: _init_shard(routes[j], out, seed, first),
                    kernels=kernels,
                    fill=tiers.fill,
                )
        except DiskSpaceError as e:
            problem = str(e)
        # Every rank's file on disk, or none: when a rank could not create its file (a
        # full disk), every rank removes its own and raises that rank's error.
        self._raise_first(problem, DiskSpaceError)
        if self.tiered is not None and any(r.table.name in self.column_groups for r in routes):
            self.tiered.square_sum_hook = self._tiered_square_means

    def _raise_first(self, problem: str, error: type[Exception]) -> None:
        """Gather every rank's ``problem`` (a collective); when any has one, drop this
        rank's file on disk and raise the first rank's as ``error``."""
        problems: list[str] = [""] * self.routing.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        first = next((p for p in problems if p), "")
        if first:
            if self.tiered is not None:
                self.tiered.discard()
                self.tiered = None
            raise error(first)

    def _local_table(self, route: Route) -> SparseFeature:
        feature = self.routing.features[route.feature]
        pooling = "sum" if route.partial else feature.pooling
        return SparseFeature(feature.name, route.shard.rows, route.shard.cols, pooling)

    def _on_disk(self, route: Route) -> bool:
        """Whether a local shard lives on disk: the plan put it in DRAM or on SSD. The
        shards of a column-wise table split over ranks go together, on disk only when the
        plan puts all of them there: each bag's backward runs their square-sum collectives
        in its own table order, and both bags must be in the same order on every rank."""
        if route.table.name in self.column_groups:
            return all(s.tier != "device" for s in route.table.shards)
        return route.shard.tier != "device"

    # -- lookup ---------------------------------------------------------------------------

    def split(
        self, received: ReceivedInput
    ) -> tuple[KeyedJaggedTensor | None, KeyedJaggedTensor | None]:
        """The received IDs of the in-memory and of the tiered shards (None: no such bag),
        made once per input."""
        if received.split is None:
            kjt = received.kjt
            assert kjt is not None
            if self.tiered is None:
                received.split = (kjt, None)
            elif self.local is None:
                received.split = (None, kjt)
            else:
                received.split = (
                    select_keys(kjt, self.local.names),
                    select_keys(kjt, self.tiered.names),
                )
        return received.split

    def forward(self, received: ReceivedInput) -> torch.Tensor:
        """Every local shard's pooled vectors, in route order (both bags' columns)."""
        in_memory, on_disk = self.split(received)
        if on_disk is None:
            return self.local(in_memory)
        try:
            from_disk = self.tiered(on_disk)
        except CacheTooSmall as e:
            raise cache_budget_error(e, self.routing.rank) from e
        if in_memory is None:
            return from_disk
        both = torch.cat([self.local(in_memory), from_disk], dim=1)
        return both.index_select(1, self.pooled_order)

    def look_up_replicated(self, source: KeyedJaggedTensor) -> torch.Tensor:
        """The data-parallel tables' pooled vectors of this rank's own batch."""
        keys = [self.routing.names[k] for k in self.routing.replicated_features]
        return self.replicated(select_keys(source, keys))

    # -- the optimizer's hooks ------------------------------------------------------------

    def _column_square_means(
        self, group_index: int, rows: torch.Tensor, sums: torch.Tensor
    ) -> torch.Tensor:
        """The in-memory bag's square-sum hook (see ``_square_means``)."""
        return self._square_means(self.local, self.memory_routes, group_index, rows, sums)

    def _tiered_square_means(
        self,
        working_set: TableBatchedEmbeddingBag,
        group_index: int,
        rows: torch.Tensor,
        sums: torch.Tensor,
    ) -> torch.Tensor:
        """The tiered bag's square-sum hook: the same, in the batch's working set."""
        return self._square_means(working_set, self.tiered_routes, group_index, rows, sums)

    def _square_means(
        self,
        bag: TableBatchedEmbeddingBag,
        routes: list[Route],
        group_index: int,
        rows: torch.Tensor,
        sums: torch.Tensor,
    ) -> torch.Tensor:
        """Each row's mean squared gradient over all its table's columns. Every column shard
        of a table got the same bags, so its touched rows, sorted, line up across ranks,
        whether the shard is in memory or on disk (a working set numbers a batch's rows in
        table row order). ``routes[k]`` is the shard of ``bag``'s table ``k``."""
        group = bag.groups[group_index]
        means = sums / group.dim
        for key in range(group.first_key, group.end_key):
            route = routes[key]
            process_group = self.column_groups.get(route.table.name)
            if process_group is None:
                continue
            start = int(bag._local_start[key])
            end = start + bag.tables[key].num_embeddings
            inside = ((rows >= start) & (rows < end)).nonzero().squeeze(1)
            if inside.numel() == 0:  # the same on every shard of the table: no collective
                continue
            total = sums.index_select(0, inside)
            dist.all_reduce(total, group=process_group)
            means.index_copy_(0, inside, total / route.table.dim)
        return means

    def _allreduce_rows(
        self, group_index: int, rows: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's reduced row gradients of a data-parallel group, summed, then scaled
        to the mean over the global batch; a row is updated when any rank touched it."""
        group = self.replicated.groups[group_index]
        dense = torch.zeros(group.num_rows, group.dim + 1, device=self.device)
        dense[rows, : group.dim] = grads
        dense[rows, group.dim] = 1.0
        world_size = self.routing.world_size
        self.stats.add_allreduce("replicated", dense.numel() * 4, world_size)
        dist.all_reduce(dense, group=self.group)
        touched = dense[:, group.dim].nonzero().squeeze(1)
        return touched, dense[touched, : group.dim] / world_size


def _init_shard(route: Route, out: torch.Tensor, seed: int, first: int = 0) -> None:
    """Rows ``[first, first + len(out))`` of the shard, as the whole table draws them."""
    init_table_rows(
        out,
        route.table.name,
        seed,
        table_rows=route.table.rows,
        row_start=route.shard.row_start + first,
        col_start=route.shard.col_start,
        table_dim=route.table.dim,
    )

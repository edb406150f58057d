"""The sharded embedding collection: a ``ShardingPlan`` executed with all-to-all.

Each rank holds the shards the plan gives it in one table-batched bag (row ranges shifted
to start at 0, column ranges as narrower tables) and a replica of every data-parallel
table. A step, for the batch each rank read:

1. **Input distribution.** Every rank sends each other rank the IDs of the features that
   rank holds: whole bags for table-wise and column-wise shards, only the IDs inside its
   row range (shifted) for row-wise ones. One-hot batches travel as a ``[B, n]`` ID matrix
   (-1 for an empty bag or an ID outside the range); jagged ones as lengths, then values.
2. **Local lookup** of every received sample in the rank's bag, one call for all shards.
3. **Output distribution.** The pooled vectors go back to the rank that owns each sample,
   encoded with the forward codec (fp32, fp16, bf16, fp8 or int8 row-wise). The owner puts
   table-wise ones in place, concatenates column-wise ones, and sums the partial sums of
   row-wise ones in rank order (a fixed order: runs are bitwise repeatable).
4. **Backward** mirrors 3: each owner sends every shard the gradient of its columns
   (through the backward codec), scaled by 1 / world size so that the update is that of
   the mean loss over the global batch, as DDP does for the dense layers; the bag's fused
   optimizer then updates the touched rows. Data-parallel tables allreduce their reduced
   row gradients before the same fused update.

Mean pooling of a row-wise table is a sum on every shard, divided by the whole bag's
length at the owner, since no shard sees the whole bag.

**Tiers.** Given a ``TierStorage``, the shards the plan puts in DRAM or on SSD live in a
``TieredEmbeddingBag`` (rows and optimizer state in a file per rank, hot rows cached in
what the rank's memory budget leaves after its in-memory shards) and the others in the
table-batched bag. Step 2 then splits the received IDs by key between the two bags and
puts their pooled columns back in route order; both bags run the same TBE code, so the
weights are bitwise those of an all-in-memory run. The shards of a column-wise table
split over ranks go to disk together or not at all (their square-sum collectives must
come in one order on every rank). Without a ``TierStorage`` every shard is in memory,
whatever tier the plan names (plans printed for another machine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as ShardedTensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from dlrmflow.errors import DlrmflowError
from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels.codecs import Codec, Encoded, get_codec
from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag, init_table_rows
from dlrmflow.kernels.tiered import (
    SLOT_BOOKKEEPING_BYTES,
    CacheStats,
    CacheTooSmall,
    DiskSpaceError,
    TieredEmbeddingBag,
    cache_rows_for,
    record_width,
)
from dlrmflow.memory import format_bytes
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.comms import CommStats, PendingAllToAll, all_gather_ints, all_to_all
from dlrmflow.train.model.plan import Shard, ShardingPlan, TablePlan

PARTIAL_SUM_TYPES = ("row_wise", "table_row_wise")


@dataclass(frozen=True)
class _Route:
    """One shard of a model-parallel table, as a destination of input IDs."""

    feature: int  # index of the feature in the collection (global order)
    table: TablePlan
    shard: Shard

    @property
    def partial(self) -> bool:
        return self.table.sharding in PARTIAL_SUM_TYPES


class TierBudgetError(DlrmflowError):
    """A rank's memory budget leaves no room for the cache of its shards on disk."""


def cache_budget_error(error: CacheTooSmall, rank: int | None = None) -> TierBudgetError:
    """A batch that did not fit a tiered bag's cache, told in configuration keys: the
    cache is what ``train.embedding_memory_bytes`` leaves, and a smaller batch needs fewer
    rows at once."""
    where = "" if rank is None else f"on rank {rank}, "
    return TierBudgetError(
        f"train.embedding_memory_bytes: {where}{error}; raise it by at least "
        f"{format_bytes(error.missing_bytes)} or lower train.batch_size"
    )


@dataclass(frozen=True)
class TierStorage:
    """Where a rank keeps the shards its plan puts in DRAM or on SSD, and its memory.

    ``memory_bytes`` is the rank's budget for embedding rows and optimizer state
    (``train.embedding_memory_bytes``): the shards kept in memory and the replicas of
    data-parallel tables take theirs first; the cache of hot rows of the shards on disk
    gets the rest, its slots' bookkeeping included. The cache's row map (4 bytes per row on
    disk) is not counted.
    ``fill=False`` leaves the new file's rows unwritten (zeros, sparse on disk): for a
    model that a checkpoint load fills at once (evaluation), drawing them would be waste.
    """

    directory: Path
    memory_bytes: int
    fill: bool = True


@dataclass
class ReceivedInput:
    """What a rank got from the input distribution: its shards' IDs for every sample of
    every rank (source after source), and each source's batch size."""

    kjt: KeyedJaggedTensor | None
    batch_sizes: list[int]
    source: KeyedJaggedTensor  # this rank's own batch, for data-parallel tables and means
    # ``kjt`` split between the in-memory and the tiered bag, made once: the tiered bag
    # knows a prefetched batch by its object.
    split: tuple[KeyedJaggedTensor | None, KeyedJaggedTensor | None] | None = field(
        default=None, repr=False
    )


class PendingInput:
    """An input distribution in flight (the pipeline overlaps it with the previous step).

    ``wait`` may be called again and returns the same ``ReceivedInput``: the trainer waits
    early to prefetch the rows of shards on disk, then hands it to the forward."""

    def __init__(self, finish, batch_sizes: list[int], source: KeyedJaggedTensor) -> None:
        self._finish = finish
        self._batch_sizes = batch_sizes
        self._source = source
        self._received: ReceivedInput | None = None

    def wait(self) -> ReceivedInput:
        if self._received is None:
            self._received = ReceivedInput(self._finish(), self._batch_sizes, self._source)
        return self._received


class ShardedEmbeddingCollection(nn.Module):
    """Pooled embeddings ``[B, sum of dims]`` of the local batch, in feature order, from
    tables sharded over the ranks of ``group`` as ``plan`` says."""

    def __init__(
        self,
        features: Sequence[SparseFeature],
        plan: ShardingPlan,
        optimizer: EmbeddingOptimizer,
        *,
        seed: int = 0,
        comms: str = "fp32",
        backward_comms: str = "fp32",
        group: dist.ProcessGroup | None = None,
        input_group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        device: torch.device | str = "cpu",
        kernels: str = "auto",
        tiers: TierStorage | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        """``group`` carries the output all-to-all and its backward; ``input_group`` the
        input distribution, which the pipeline runs in the background, so it needs its own
        group to be ordered independently. ``seed`` draws the same initial rows as a
        single-process model with that seed. The shards, their optimizer state and the
        routing tensors live on ``device``; ``kernels`` picks the bags' implementation.
        ``tiers``: where the shards the plan puts in DRAM or on SSD live (a new file, with
        the seed's rows), and this rank's memory budget; None keeps every shard in memory.
        ``timeout``: the collective timeout of the column-wise tables' groups (torch's
        default for a new group is 30 minutes, not the default group's).
        """
        super().__init__()
        self.device = torch.device(device)
        if tiers is not None and self.device.type != "cpu":
            raise ValueError(f"shards on disk are served from host memory, not {self.device}")
        self.tiers = tiers
        # Whether a step's input all-to-all runs in the background (``start_input``):
        # ``distributed.pipeline``, set by ``parallelize``.
        self.pipelined = False
        self.group = group
        self.input_group = input_group if input_group is not None else group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if plan.world_size != self.world_size:
            raise ValueError(
                f"the sharding plan is for {plan.world_size} ranks, the job has {self.world_size}"
            )
        plan.validate()
        self.features = list(features)
        self.names = [f.name for f in self.features]
        self._check_plan(plan)
        self.plan = plan
        self.optimizer = optimizer
        self.codec: Codec = get_codec(comms)
        self.backward_codec: Codec = get_codec(backward_comms)
        if self.backward_codec.name not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"backward_comms must be fp32, fp16 or bf16, got {backward_comms!r}")
        self.stats = stats or CommStats()
        starts = [0]
        for f in self.features:
            starts.append(starts[-1] + f.embedding_dim)
        self._feature_start = starts
        self.output_dim = starts[-1]

        index = {name: k for k, name in enumerate(self.names)}
        self.routes = [
            [
                _Route(index[t.name], t, s)
                for t, s in plan.shards_on(r)
                if t.sharding != "data_parallel"
            ]
            for r in range(self.world_size)
        ]
        local = self.routes[self.rank]
        self._local_names = [self.features[r.feature].name for r in local]
        # Row-wise Adagrad keeps one value per row, the mean of the squared gradient over
        # the row's columns: the shards of a column-wise table sum their columns' squares
        # over the table's ranks so that every shard keeps the whole row's value.
        # One process group per set of ranks (not per table): every rank creates them in
        # the same order, and few groups keep start-up cheap.
        by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._column_groups = {}
        for t in plan.tables:
            if t.sharding == "column_wise" and len(t.shards) > 1:
                ranks = tuple(sorted(t.ranks))
                if ranks not in by_ranks:
                    by_ranks[ranks] = dist.new_group(ranks=list(ranks), timeout=timeout)
                self._column_groups[t.name] = by_ranks[ranks]
        on_disk = [tiers is not None and self._tiered(route) for route in local]
        self._memory_routes = [r for r, d in zip(local, on_disk, strict=True) if not d]
        self._tiered_routes = [r for r, d in zip(local, on_disk, strict=True) if d]
        memory = self._memory_routes
        self.local = (
            TableBatchedEmbeddingBag(
                [self._local_table(route) for route in memory],
                optimizer,
                init=lambda j, out: self._init_shard(memory[j], out, seed),
                kernels=kernels,
            ).to(self.device)
            if memory
            else None
        )
        if self.local is not None and any(r.table.name in self._column_groups for r in memory):
            self.local.square_sum_hook = self._column_square_means
        self._replicated_features = [
            index[t.name] for t in plan.tables if t.sharding == "data_parallel"
        ]
        self.tiered: TieredEmbeddingBag | None = None
        if tiers is not None:
            routes = self._tiered_routes
            tables = [self._local_table(route) for route in routes]
            cache_rows = self._cache_rows(tiers, tables)
            problem = ""
            try:
                if routes:
                    self.tiered = TieredEmbeddingBag(
                        tables,
                        optimizer,
                        tiers.directory,
                        cache_rows=cache_rows,
                        init=lambda j, out, first: self._init_shard(routes[j], out, seed, first),
                        kernels=kernels,
                        fill=tiers.fill,
                    )
            except DiskSpaceError as e:
                problem = str(e)
            self._all_or_none(problem)
            if self.tiered is not None and any(r.table.name in self._column_groups for r in routes):
                self.tiered.square_sum_hook = self._tiered_square_means
        # Where each local shard's pooled columns are in [in-memory bag's | tiered bag's].
        block_start = {}
        column = 0
        for route in memory + self._tiered_routes:
            block_start[id(route)] = column
            column += route.shard.cols
        self._pooled_order = torch.tensor(
            [block_start[id(route)] + c for route in local for c in range(route.shard.cols)],
            dtype=torch.int64,
            device=self.device,
        )
        self.replicated = None
        if self._replicated_features:
            self.replicated = TableBatchedEmbeddingBag(
                [self.features[k] for k in self._replicated_features],
                optimizer,
                seed=seed,
                kernels=kernels,
            ).to(self.device)
            self.replicated.gradient_hook = self._allreduce_rows
        self._build_maps()

    # -- construction -------------------------------------------------------------------

    def _check_plan(self, plan: ShardingPlan) -> None:
        planned = {t.name: t for t in plan.tables}
        if sorted(planned) != sorted(self.names):
            raise ValueError(
                f"the sharding plan covers tables {sorted(planned)}, the model has "
                f"{sorted(self.names)}"
            )
        for f in self.features:
            t = planned[f.name]
            if (t.rows, t.dim) != (f.num_embeddings, f.embedding_dim):
                raise ValueError(
                    f"table {f.name}: the plan says {t.rows}x{t.dim}, the model "
                    f"{f.num_embeddings}x{f.embedding_dim}"
                )

    def _local_table(self, route: _Route) -> SparseFeature:
        feature = self.features[route.feature]
        pooling = "sum" if route.partial else feature.pooling
        return SparseFeature(feature.name, route.shard.rows, route.shard.cols, pooling)

    def _tiered(self, route: _Route) -> bool:
        """Whether a local shard lives on disk: the plan put it in DRAM or on SSD. The
        shards of a column-wise table split over ranks go together, on disk only when the
        plan puts all of them there: each bag's backward runs their square-sum collectives
        in its own table order, and both bags must be in the same order on every rank."""
        if route.table.name in self._column_groups:
            return all(s.tier != "device" for s in route.table.shards)
        return route.shard.tier != "device"

    def _cache_rows(self, tiers: TierStorage, tables: list[SparseFeature]) -> int:
        """The rows of the tiered bag's cache (of ``tables``; 0 without): what the budget
        leaves after the in-memory shards and replicated tables (rows and optimizer
        state), in slots as wide as the widest record. A collective: when any rank's
        budget leaves no room, every rank raises its error, none waits for the others."""
        problem = ""
        try:
            rows = self._rows_left(tiers, tables) if tables else 0
        except TierBudgetError as e:
            problem, rows = str(e), 0
        problems: list[str] = [""] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        first = next((p for p in problems if p), "")
        if first:
            raise TierBudgetError(first)
        return rows

    def _all_or_none(self, problem: str) -> None:
        """Every rank's file on disk, or none: when a rank could not create its file (a
        full disk), every rank removes its own and raises that rank's error (a
        collective), rather than leaving files behind and waiting for the failed rank."""
        problems: list[str] = [""] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        first = next((p for p in problems if p), "")
        if first:
            if self.tiered is not None:
                self.tiered.discard()
                self.tiered = None
            raise DiskSpaceError(first)

    def _rows_left(self, tiers: TierStorage, tables: list[SparseFeature]) -> int:
        optimizer = self.optimizer
        kept = sum(
            4 * r.shard.rows * record_width(optimizer, r.shard.cols) for r in self._memory_routes
        )
        replicated = [self.features[k] for k in self._replicated_features]
        kept += sum(
            4 * f.num_embeddings * record_width(optimizer, f.embedding_dim) for f in replicated
        )
        rows = cache_rows_for(tiers.memory_bytes - kept, tables, optimizer)
        if rows < 1:
            slot = 4 * max(record_width(optimizer, t.embedding_dim) for t in tables)
            raise TierBudgetError(
                f"train.embedding_memory_bytes: rank {self.rank} keeps {kept} bytes of "
                f"embeddings in memory, so {tiers.memory_bytes} bytes leave no room for a "
                f"cache of its {sum(t.num_embeddings for t in tables)} rows on disk "
                f"({slot} bytes a row, plus {SLOT_BOOKKEEPING_BYTES} to track it); raise it"
            )
        return rows

    @staticmethod
    def _init_shard(route: _Route, out: torch.Tensor, seed: int, first: int = 0) -> None:
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

    def _build_maps(self) -> None:
        """Index tensors of the routing, built once: which input columns go to each rank and
        with which row range, and where each rank's returned columns land in the output."""
        device = self.device

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self._send_keys, self._send_lo, self._send_hi, self._out_columns = [], [], [], []
        for routes in self.routes:
            self._send_keys.append(ints([r.feature for r in routes]))
            self._send_lo.append(ints([r.shard.row_start for r in routes]))
            self._send_hi.append(ints([r.shard.row_end for r in routes]))
            columns = [
                self._feature_start[r.feature] + c
                for r in routes
                for c in range(r.shard.col_start, r.shard.col_end)
            ]
            self._out_columns.append(ints(columns))
        self._replicated_columns = ints(
            [
                c
                for k in self._replicated_features
                for c in range(self._feature_start[k], self._feature_start[k + 1])
            ]
        )
        # Features whose shards return partial sums of a mean-pooled bag: divided at the owner.
        self._mean_partial = sorted(
            {
                route.feature
                for routes in self.routes
                for route in routes
                if route.partial and self.features[route.feature].pooling == "mean"
            }
        )
        self._widths = [int(c.numel()) for c in self._out_columns]
        # Without partial sums every output column comes from exactly one block (a rank's, or
        # the replicated tables'): the output is then their concatenation, permuted into
        # feature order (or as is, when that order is already the features'), not a sum.
        self._permutation: torch.Tensor | None = None
        self._concatenated_in_order = False
        if not any(r.partial for routes in self.routes for r in routes):
            order = torch.cat([*self._out_columns, self._replicated_columns])
            if torch.equal(order.cpu(), torch.arange(self.output_dim, device="cpu")):
                self._concatenated_in_order = True
            else:
                self._permutation = torch.empty_like(order)
                self._permutation[order] = torch.arange(order.numel(), device=device)
        # The quantization row: one table's vector when every shard has the same width (row-wise
        # codecs then scale each embedding on its own), else one sample's block.
        widths = {r.shard.cols for routes in self.routes for r in routes}
        self._codec_width = widths.pop() if len(widths) == 1 else None

    # -- input distribution -------------------------------------------------------------

    def start_input_dist(self, kjt: KeyedJaggedTensor, *, async_op: bool = False) -> PendingInput:
        """Send every rank the IDs of its shards for this rank's batch ``kjt``.

        The batch sizes (and whether any rank's batch is jagged) are exchanged first and
        synchronously; the IDs themselves travel in the background when ``async_op``.
        """
        if kjt.keys != self.names:
            raise ValueError(f"batch keys {kjt.keys} differ from the tables {self.names}")
        jagged = kjt.one_hot_rows is None
        sizes = all_gather_ints([kjt.stride, int(jagged)], self.input_group)
        batch_sizes = sizes[:, 0].tolist()
        if bool(sizes[:, 1].any()):
            finish = self._send_jagged(kjt, batch_sizes, async_op)
        else:
            finish = self._send_one_hot(kjt.one_hot_rows, batch_sizes, async_op)
        return PendingInput(finish, batch_sizes, kjt)

    def _send_one_hot(self, rows: torch.Tensor, batch_sizes: list[int], async_op: bool):
        rows = rows.long()
        parts = []
        for keys, lo, hi in zip(self._send_keys, self._send_lo, self._send_hi, strict=True):
            ids = rows.index_select(1, keys)
            inside = (ids >= lo) & (ids < hi)
            parts.append(torch.where(inside, ids - lo, -1).reshape(-1))
        n_local = len(self.routes[self.rank])
        pending = all_to_all(
            parts,
            [b * n_local for b in batch_sizes],
            self.input_group,
            kind="input",
            stats=self.stats,
            async_op=async_op,
        )

        def finish() -> KeyedJaggedTensor | None:
            received = pending.wait()
            if not n_local:
                return None
            local_rows = torch.cat(received).view(-1, n_local)
            return KeyedJaggedTensor.from_one_hot(self._local_names, local_rows)

        return finish

    def _send_jagged(self, kjt: KeyedJaggedTensor, batch_sizes: list[int], async_op: bool):
        batch = kjt.stride
        values = kjt.values
        lengths = kjt.lengths.view(len(self.names), batch)
        key_start = _key_starts(kjt)
        weights = kjt.weights
        send_lengths, send_values, send_weights = [], [], []
        for routes in self.routes:
            lens, vals, wts = [], [], []
            for route in routes:
                k = route.feature
                v = values[key_start[k] : key_start[k + 1]]
                n = lengths[k]
                w = None if weights is None else weights[key_start[k] : key_start[k + 1]]
                if route.partial:
                    inside = (v >= route.shard.row_start) & (v < route.shard.row_end)
                    bag = torch.arange(batch, device=v.device)
                    bag = bag.repeat_interleave(n.long(), output_size=v.numel())
                    n = torch.zeros(batch, dtype=torch.int64, device=v.device)
                    n = n.index_add_(0, bag, inside.long())
                    v = v[inside] - route.shard.row_start
                    w = None if w is None else w[inside]
                lens.append(n.to(torch.int32))
                vals.append(v)
                if w is not None:
                    wts.append(w)
            send_lengths.append(torch.cat(lens) if lens else values.new_zeros(0, dtype=torch.int32))
            send_values.append(torch.cat(vals) if vals else values.new_zeros(0))
            send_weights.append(torch.cat(wts) if wts else values.new_zeros(0, dtype=torch.float32))
        n_local = len(self.routes[self.rank])
        # How many IDs each rank receives from each: exchanged before the IDs themselves, on
        # the host (gloo): the receiver needs them there to size its buffers.
        counts = torch.tensor([v.numel() for v in send_values], dtype=torch.int64, device="cpu")
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.input_group)
        recv_counts_list = recv_counts.tolist()

        def exchange(parts: list[torch.Tensor], recv_rows: list[int]) -> PendingAllToAll:
            return all_to_all(
                parts,
                recv_rows,
                self.input_group,
                kind="input",
                stats=self.stats,
                async_op=async_op,
            )

        pending = [
            exchange(send_lengths, [b * n_local for b in batch_sizes]),
            exchange(send_values, recv_counts_list),
        ]
        if weights is not None:
            pending.append(exchange(send_weights, recv_counts_list))

        def finish() -> KeyedJaggedTensor | None:
            received = [p.wait() for p in pending]
            if not n_local:
                return None
            parts = [
                KeyedJaggedTensor(
                    self._local_names,
                    received[1][s],
                    received[0][s],
                    received[2][s] if weights is not None else None,
                )
                for s in range(self.world_size)
            ]
            return KeyedJaggedTensor.concat(parts)

        return finish

    # -- lookup and output distribution -------------------------------------------------

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.forward_received(self.start_input_dist(kjt).wait())

    # -- the interface every embedding collection offers (``EmbeddingCollection``) -------

    @property
    def rows_on_disk(self) -> bool:
        """Whether the job keeps rows on disk: the same answer on every rank (``tiers``
        follows the configuration, not the rank's shards)."""
        return self.tiers is not None

    @property
    def begins_ahead(self) -> bool:
        return self.pipelined

    def start_input(self, kjt: KeyedJaggedTensor, *, ahead: bool = False) -> PendingInput | None:
        """The input all-to-all of ``kjt``: in the background when ``pipelined``, so the
        next batch's (``ahead``) overlaps this step; not pipelined, nothing starts ahead."""
        if ahead and not self.pipelined:
            return None
        return self.start_input_dist(kjt, async_op=self.pipelined)

    def look_up(self, received: ReceivedInput) -> torch.Tensor:
        return self.forward_received(received)

    def input_rows(self, received: ReceivedInput) -> int:
        return sum(received.batch_sizes)

    def prefetch_next(self, started: PendingInput | None) -> None:
        """With shards on disk, the next batch's rows load during this step's backward,
        once its IDs are in."""
        if self.tiers is not None and started is not None:
            self.prefetch(started.wait())

    def lookup_modules(self) -> list[nn.Module]:
        return [b for b in (self.local, self.replicated) if b is not None]

    def forward_received(self, received: ReceivedInput) -> torch.Tensor:
        """The pooled embeddings of this rank's batch from an input distribution's result."""
        total = sum(received.batch_sizes)
        if received.kjt is not None:
            pooled = self._look_up(received)
        else:
            pooled = torch.zeros(total, 0, device=self.device)
        training = self.training and torch.is_grad_enabled()
        trigger = torch.empty(0, requires_grad=training, device=self.device)
        blocks = list(_OutputDist.apply(trigger, pooled, self, received.batch_sizes))
        if self.replicated is not None:
            keys = [self.names[k] for k in self._replicated_features]
            blocks.append(self.replicated(_select_keys(received.source, keys)))
        if self._concatenated_in_order:
            return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if self._permutation is not None:
            return torch.cat(blocks, dim=1).index_select(1, self._permutation)
        batch = received.batch_sizes[self.rank]
        out = torch.zeros(batch, self.output_dim, device=self.device)
        # Rank order: partial sums of row-wise tables always add up the same way.
        columns = list(self._out_columns)
        if self.replicated is not None:
            columns.append(self._replicated_columns)
        for cols, block in zip(columns, blocks, strict=True):
            if cols.numel():
                out = out.index_add(1, cols, block)
        if self._mean_partial:
            out = out * self._mean_scale(received.source)
        return out

    def _split(
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
                    _select_keys(kjt, self.local.names),
                    _select_keys(kjt, self.tiered.names),
                )
        return received.split

    def _look_up(self, received: ReceivedInput) -> torch.Tensor:
        """Every local shard's pooled vectors, in route order (both bags' columns)."""
        in_memory, on_disk = self._split(received)
        if on_disk is None:
            return self.local(in_memory)
        try:
            from_disk = self.tiered(on_disk)
        except CacheTooSmall as e:
            raise cache_budget_error(e, self.rank) from e
        if in_memory is None:
            return from_disk
        both = torch.cat([self.local(in_memory), from_disk], dim=1)
        return both.index_select(1, self._pooled_order)

    # -- shards on disk ------------------------------------------------------------------

    def prefetch(self, received: ReceivedInput) -> None:
        """Start reading from disk the rows a later input (the next step's) needs of this
        rank's tiered shards; they load in the background while this step computes.
        Nothing without such shards. Weights never depend on whether or when it runs."""
        if self.tiered is not None and received.kjt is not None:
            self.tiered.prefetch(self._split(received)[1])

    def flush(self) -> None:
        """Write every updated row of the shards on disk to their file."""
        if self.tiered is not None:
            self.tiered.flush()

    def cache_stats(self) -> CacheStats | None:
        """The caches' counters summed over the ranks of ``group`` (a collective), None
        when the collection keeps everything in memory (``tiers`` not given)."""
        if self.tiers is None:
            return None
        mine = self.tiered.stats if self.tiered is not None else CacheStats()
        names = [f.name for f in fields(CacheStats)]
        # Host values (the tiered bags serve from host memory): gloo.
        counts = torch.tensor([getattr(mine, n) for n in names], dtype=torch.int64, device="cpu")
        dist.all_reduce(counts, group=self.group)
        return CacheStats(**dict(zip(names, counts.tolist(), strict=True)))

    def _mean_scale(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """1 / bag length on the columns of mean-pooled row-wise features, 1 elsewhere."""
        scale = torch.ones(kjt.stride, self.output_dim, device=self.device)
        lengths = kjt.lengths.view(len(self.names), kjt.stride)
        for k in self._mean_partial:
            cols = slice(self._feature_start[k], self._feature_start[k + 1])
            scale[:, cols] = lengths[k].clamp(min=1).reciprocal()[:, None]
        return scale

    def _encode(self, codec: Codec, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, dim] as the codec's bytes, flat (rows of ``_codec_width`` values)."""
        if x.numel() == 0:
            return torch.zeros(0, dtype=torch.uint8, device=self.device)
        width = self._codec_width or x.shape[1]
        return codec.encode(x.reshape(-1, width)).data.reshape(-1)

    def _decode(self, codec: Codec, data: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
        """The ``[rows, dim]`` floats of flat bytes from ``_encode``."""
        if rows == 0 or dim == 0:
            return torch.zeros(rows, dim, device=self.device)
        width = self._codec_width or dim
        encoded = Encoded(data.view(rows * (dim // width), codec.row_nbytes(width)), width)
        return codec.decode(encoded).view(rows, dim)

    def _exchange(
        self, codec: Codec, parts: list[torch.Tensor], recv: list[tuple[int, int]], kind: str
    ) -> list[torch.Tensor]:
        """Encode ``parts[r]`` for rank r, all-to-all, decode: ``recv[s]`` = (rows, dim) of
        what rank s sends. Each rank's piece travels as one flat byte stream, whatever its
        dims (any of them may be empty: a rank with no batch or no shards)."""
        # The piece a rank keeps never travels: it skips the codec and the collective.
        me = self.rank
        flat = [
            torch.zeros(0, dtype=torch.uint8, device=self.device)
            if r == me
            else self._encode(codec, p)
            for r, p in enumerate(parts)
        ]
        recv_bytes = [
            0 if s == me else rows * self._row_bytes(codec, dim)
            for s, (rows, dim) in enumerate(recv)
        ]
        if self.world_size == 1:
            return [parts[me]]
        pending: PendingAllToAll = all_to_all(
            flat, recv_bytes, self.group, kind=kind, stats=self.stats
        )
        return [
            parts[me] if s == me else self._decode(codec, data, rows, dim)
            for s, (data, (rows, dim)) in enumerate(zip(pending.wait(), recv, strict=True))
        ]

    def _row_bytes(self, codec: Codec, dim: int) -> int:
        if dim == 0:
            return 0
        width = self._codec_width or dim
        return codec.row_nbytes(width) * (dim // width)

    def _column_square_means(
        self, group_index: int, rows: torch.Tensor, sums: torch.Tensor
    ) -> torch.Tensor:
        """The in-memory bag's square-sum hook (see ``_square_means``)."""
        return self._square_means(self.local, self._memory_routes, group_index, rows, sums)

    def _tiered_square_means(
        self,
        working_set: TableBatchedEmbeddingBag,
        group_index: int,
        rows: torch.Tensor,
        sums: torch.Tensor,
    ) -> torch.Tensor:
        """The tiered bag's square-sum hook: the same, in the batch's working set."""
        return self._square_means(working_set, self._tiered_routes, group_index, rows, sums)

    def _square_means(
        self,
        bag: TableBatchedEmbeddingBag,
        routes: list[_Route],
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
            process_group = self._column_groups.get(route.table.name)
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

    # -- replicated tables ---------------------------------------------------------------

    def _allreduce_rows(
        self, group_index: int, rows: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's reduced row gradients of a data-parallel group, summed, then scaled
        to the mean over the global batch; a row is updated when any rank touched it."""
        group = self.replicated.groups[group_index]
        dense = torch.zeros(group.num_rows, group.dim + 1, device=self.device)
        dense[rows, : group.dim] = grads
        dense[rows, group.dim] = 1.0
        self.stats.add_allreduce("replicated", dense.numel() * 4, self.world_size)
        dist.all_reduce(dense, group=self.group)
        touched = dense[:, group.dim].nonzero().squeeze(1)
        return touched, dense[touched, : group.dim] / self.world_size

    # -- checkpoints ----------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, torch.Tensor | ShardedTensor]:
        """Every table's weight and optimizer state by table name, for
        ``torch.distributed.checkpoint``: model-parallel tables as ``ShardedTensor`` views
        of this rank's shards (global offsets from the plan, so a load under any other plan
        or world size reads the right rows and columns), replicated tables as plain tensors.

        Loading writes into the views, i.e. straight into the bags; call
        ``after_checkpoint_load`` afterwards. Each shard is given in chunks of at most
        ``CHECKPOINT_CHUNK_ROWS`` rows, each chunk a tensor that is the whole of its storage
        (an alias of the bag's memory, or of the file's for shards on disk): DCP then
        writes every chunk as it is, with no copy, and a rank's shards on disk pass through
        memory one chunk at a time (``drop_file_pages`` after each).
        """
        state: dict[str, torch.Tensor | ShardedTensor] = {}
        mine = {route.table.name: route for route in self.routes[self.rank]}
        on_disk = {route.table.name for route in self._tiered_routes}
        if self.tiered is not None:
            self.tiered.flush()
        for table in self.plan.tables:
            if table.sharding == "data_parallel":
                continue
            route = mine.get(table.name)
            stored: dict[str, list[torch.Tensor]] = {}
            if route is None:
                pass
            elif table.name in on_disk:
                chunks = [
                    self.tiered.file_views(table.name, bounds, flush=False)
                    for bounds in _chunks(route.shard.rows)
                ]
                stored = {key: [c[key] for c in chunks] for key in chunks[0]}
            else:
                whole = {"weight": self.local.table(table.name), **self.local.state(table.name)}
                stored = {
                    key: [exact_storage(value[lo:hi]) for lo, hi in _chunks(route.shard.rows)]
                    for key, value in whole.items()
                }
            weight = stored.get("weight")
            state[f"{table.name}.weight"] = _sharded(
                weight,
                table.shards,
                route.shard if route else None,
                (table.rows, table.dim),
                self.device,
            )
            for part in self.optimizer.state_parts:
                key = part.name
                value = stored.get(key)
                if part.per_row:
                    # One value per row: the column shards starting at column 0 own it.
                    owners = [s for s in table.shards if s.col_start == 0]
                    own = route.shard if route and route.shard.col_start == 0 else None
                    state[f"{table.name}.{key}"] = _sharded(
                        value if own else None, owners, own, (table.rows,), self.device
                    )
                else:
                    shard = route.shard if route else None
                    state[f"{table.name}.{key}"] = _sharded(
                        value, table.shards, shard, (table.rows, table.dim), self.device
                    )
        if self.replicated is not None:
            for k in self._replicated_features:
                name = self.names[k]
                state[f"{name}.weight"] = exact_storage(self.replicated.table(name))
                for key, value in self.replicated.state(name).items():
                    state[f"{name}.{key}"] = exact_storage(value)
        step_key = self.optimizer.step_key
        if step_key is not None:
            # Every bag of the rank counts the same steps: the in-memory bags' count, or a
            # copy of the tiered bag's, which ``after_checkpoint_load`` reads back.
            bags = [b for b in (self.local, self.replicated) if b is not None]
            if bags:
                state[step_key] = bags[0].step
            elif self.tiered is not None:
                state[step_key] = torch.tensor(self.tiered.step, dtype=torch.int64, device="cpu")
        return state

    def drop_file_pages(self) -> None:
        """Unmap the pages of the shards' file that a checkpoint item read or wrote, so that
        saving or loading the shards on disk keeps no more than a chunk of them resident."""
        if self.tiered is not None:
            self.tiered.drop_pages()

    def after_checkpoint_load(
        self, state: Mapping[str, torch.Tensor | ShardedTensor] | None = None
    ) -> None:
        """Make the loaded values the live ones: the column shards that do not own the
        row-wise state get it (a collective over each column-wise table's ranks), the
        shards on disk (loaded in place, into their file) drop their cached rows, and every
        bag takes the loaded optimizer step count (from ``state``, what ``checkpoint_state``
        returned, when no bag is in memory)."""
        on_disk = {route.table.name for route in self._tiered_routes}
        for table in self.plan.tables:
            process_group = self._column_groups.get(table.name)
            if process_group is None or self.rank not in table.ranks:
                continue
            owner = next(s.rank for s in table.shards if s.col_start == 0)
            for part in self.optimizer.state_parts:
                if part.per_row:
                    value = (
                        self.tiered.file_views(table.name, flush=False)[part.name]
                        if table.name in on_disk
                        else self.local.state(table.name)[part.name]
                    )
                    dist.broadcast(value, owner, process_group)
        if self.tiered is not None:
            self.tiered.reload()  # unmaps the pages the load wrote, too
        step_key = self.optimizer.step_key
        if step_key is not None:
            bags = [b for b in (self.local, self.replicated) if b is not None]
            step = bags[0].step if bags else None
            if step is None and state is not None and step_key in state:
                step = state[step_key]
            if step is not None:
                for bag in bags:
                    bag.step.copy_(step)
                if self.tiered is not None:
                    self.tiered.step = int(step)


class _OutputDist(torch.autograd.Function):
    """Pooled vectors back to the ranks owning their samples; gradients the other way."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        trigger: torch.Tensor,
        pooled: torch.Tensor,
        module: ShardedEmbeddingCollection,
        batch_sizes: list[int],
    ) -> tuple[torch.Tensor, ...]:
        ctx.module = module
        ctx.batch_sizes = batch_sizes
        ctx.local_width = pooled.shape[1]
        parts = list(pooled.detach().split(batch_sizes))
        batch = batch_sizes[module.rank]
        recv = [(batch, width) for width in module._widths]
        return tuple(module._exchange(module.codec, parts, recv, "forward"))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        module = ctx.module
        scale = 1.0 / module.world_size
        rows = ctx.batch_sizes[module.rank]
        parts = [
            g if g is not None else torch.zeros(rows, w, device=module.device)
            for g, w in zip(grads, module._widths, strict=True)
        ]
        if module.world_size > 1:
            parts = [p * scale for p in parts]
        recv = [(rows, ctx.local_width) for rows in ctx.batch_sizes]
        received = module._exchange(module.backward_codec, parts, recv, "backward")
        return None, torch.cat(received), None, None


# Rows per checkpoint item of a shard: 64 MiB of weights at dim 64. A shard's items pass
# through a rank's memory one at a time when it lives on disk.
CHECKPOINT_CHUNK_ROWS = 1 << 18


def _chunks(rows: int) -> list[tuple[int, int]]:
    """The row ranges ``[lo, hi)`` a shard of ``rows`` rows is checkpointed in."""
    if rows == 0:
        return [(0, 0)]
    return [
        (lo, min(lo + CHECKPOINT_CHUNK_ROWS, rows)) for lo in range(0, rows, CHECKPOINT_CHUNK_ROWS)
    ]


def exact_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (contiguous, on the CPU) as a tensor whose storage is exactly its memory,
    sharing it: DCP copies a tensor whose storage is larger (a slice of a bag's weights)
    before writing it, which would hold a second copy of every in-memory shard."""
    if view.device.type != "cpu" or not view.is_contiguous():
        return view
    return torch.from_numpy(view.detach().numpy())


def _sharded(
    local: list[torch.Tensor] | None,
    shards: Sequence[Shard],
    mine: Shard | None,
    size: tuple[int, ...],
    device: torch.device,
) -> ShardedTensor:
    """A ``ShardedTensor`` over ``shards`` (1-D: row ranges; 2-D: row and column ranges),
    each in the row chunks of ``_chunks``, whose local shards are ``local`` (views of the
    chunks of ``mine``, not copies) on the rank holding ``mine``.

    The placements only say where each shard lives now (this rank's exact device, the
    others' device type); the checkpoint stores no device, so it loads on any.
    """

    def metadata(s: Shard, lo: int, hi: int) -> ShardMetadata:
        where = device if s == mine else torch.device(device.type)
        placement = f"rank:{s.rank}/{where}"
        if len(size) == 1:
            return ShardMetadata([s.row_start + lo], [hi - lo], placement)
        return ShardMetadata([s.row_start + lo, s.col_start], [hi - lo, s.cols], placement)

    local_shards = []
    if mine is not None:
        assert local is not None
        local_shards = [
            ShardedTensorShard(tensor, metadata(mine, lo, hi))
            for tensor, (lo, hi) in zip(local, _chunks(mine.rows), strict=True)
        ]
    every = [metadata(s, lo, hi) for s in shards for lo, hi in _chunks(s.rows)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, ShardedTensorMetadata(every, torch.Size(size), TensorProperties())
    )


def _key_starts(kjt: KeyedJaggedTensor) -> list[int]:
    """Where each key's values start in ``kjt.values`` (and where the last ends)."""
    if kjt.stride == 0:
        return [0] * (len(kjt.keys) + 1)
    return kjt.offsets()[:: kjt.stride].tolist()


def _select_keys(kjt: KeyedJaggedTensor, keys: list[str]) -> KeyedJaggedTensor:
    """The bags of ``keys`` only (in that order), keeping the one-hot form."""
    index = [kjt.keys.index(k) for k in keys]
    rows = kjt.one_hot_rows
    if rows is not None:
        return KeyedJaggedTensor.from_one_hot(keys, rows[:, index])
    batch = kjt.stride
    starts = _key_starts(kjt)
    lengths = kjt.lengths.view(len(kjt.keys), batch)
    values = torch.cat([kjt.values[starts[k] : starts[k + 1]] for k in index])
    weights = (
        None
        if kjt.weights is None
        else torch.cat([kjt.weights[starts[k] : starts[k + 1]] for k in index])
    )
    return KeyedJaggedTensor(keys, values, lengths[index].reshape(-1), weights)

"""The sharded embedding collection: a ``ShardingPlan`` executed with all-to-all.

A step, for the batch each rank read, runs the pieces of this package in turn, as
TorchRec splits a sharded module into input distribution, lookup and output distribution:

1. ``input_dist``: every rank sends each other rank the IDs of the shards that rank holds;
2. ``lookup``: every received sample is looked up in the rank's own shards (in memory, or
   on disk behind a cache), one call for all of them, and the data-parallel tables in the
   rank's replica;
3. ``output_dist``: the pooled vectors go back to the rank owning each sample, which
   assembles its output in feature order;
4. backward mirrors 3, and each bag's fused optimizer updates the touched rows.

``routing`` says who holds what; ``checkpoint`` saves and loads the shards in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels.codecs import Codec, get_codec
from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.kernels.row_cache import CacheStats
from dlrmflow.kernels.tiered import TieredEmbeddingBag
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.comms import CommStats
from dlrmflow.train.model.plan import ShardingPlan
from dlrmflow.train.model.sharded import checkpoint
from dlrmflow.train.model.sharded.input_dist import InputDist, PendingInput, ReceivedInput
from dlrmflow.train.model.sharded.lookup import ShardLookup
from dlrmflow.train.model.sharded.output_dist import OutputDist
from dlrmflow.train.model.sharded.routing import Routing
from dlrmflow.train.model.sharded.tiers import TierStorage


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
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.routing = Routing(features, plan, self.rank, self.world_size, self.device)
        self.features = self.routing.features
        self.names = self.routing.names
        self.plan = plan
        self.output_dim = self.routing.output_dim
        self.optimizer = optimizer
        codec: Codec = get_codec(comms)
        backward_codec: Codec = get_codec(backward_comms)
        if backward_codec.name not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"backward_comms must be fp32, fp16 or bf16, got {backward_comms!r}")
        self.stats = stats or CommStats()
        self.input_dist = InputDist(
            self.routing, input_group if input_group is not None else group, self.stats
        )
        self.lookup = ShardLookup(
            self.routing,
            optimizer,
            seed=seed,
            group=group,
            stats=self.stats,
            kernels=kernels,
            tiers=tiers,
            timeout=timeout,
        )
        self.output_dist = OutputDist(self.routing, group, codec, backward_codec, self.stats)

    @property
    def tiered(self) -> TieredEmbeddingBag | None:
        """The bag of this rank's shards on disk (None: it keeps none there)."""
        return self.lookup.tiered

    # -- one step ---------------------------------------------------------------------------

    def start_input_dist(self, kjt: KeyedJaggedTensor, *, async_op: bool = False) -> PendingInput:
        """Send every rank the IDs of its shards for this rank's batch ``kjt``
        (``InputDist.start``)."""
        return self.input_dist.start(kjt, async_op=async_op)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.forward_received(self.start_input_dist(kjt).wait())

    def forward_received(self, received: ReceivedInput) -> torch.Tensor:
        """The pooled embeddings of this rank's batch from an input distribution's result."""
        if received.kjt is not None:
            pooled = self.lookup(received)
        else:
            pooled = torch.zeros(sum(received.batch_sizes), 0, device=self.device)
        training = self.training and torch.is_grad_enabled()
        blocks = self.output_dist.send(pooled, received.batch_sizes, training)
        if self.lookup.replicated is not None:
            blocks.append(self.lookup.look_up_replicated(received.source))
        batch = received.batch_sizes[self.rank]
        return self.output_dist.assemble(blocks, received.source, batch)

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
        return [b for b in (self.lookup.local, self.lookup.replicated) if b is not None]

    def reset_rows(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """``EmbeddingBagBase.reset_rows`` of table ``name``'s global ``rows`` (``values``
        full width): each rank writes the part its shard holds (the rows in its range, its
        columns), every rank its replica of a data-parallel table. Called by every rank
        with the same rows, as a dynamic table's replicated maps free them."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device="cpu")
        if name not in self.names:
            raise KeyError(f"no table {name!r} among {self.names}")
        if self.lookup.replicated is not None and name in self.lookup.replicated.names:
            self.lookup.replicated.reset_rows(name, rows, values)
            return
        on_disk = {id(route) for route in self.lookup.tiered_routes}
        for route in self.routing.local:
            if route.table.name != name:
                continue
            shard = route.shard
            inside = ((rows >= shard.row_start) & (rows < shard.row_end)).nonzero().squeeze(1)
            if inside.numel() == 0:
                continue
            bag = self.lookup.tiered if id(route) in on_disk else self.lookup.local
            assert bag is not None
            bag.reset_rows(
                name,
                rows[inside] - shard.row_start,
                values[inside][:, shard.col_start : shard.col_end],
            )

    # -- shards on disk ------------------------------------------------------------------

    def prefetch(self, received: ReceivedInput) -> None:
        """Start reading from disk the rows a later input (the next step's) needs of this
        rank's tiered shards; they load in the background while this step computes.
        Nothing without such shards. Weights never depend on whether or when it runs."""
        if self.tiered is not None and received.kjt is not None:
            self.tiered.prefetch(self.lookup.split(received)[1])

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

    # -- checkpoints ----------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Every table's weight and optimizer state by table name, for
        ``torch.distributed.checkpoint`` (``checkpoint.checkpoint_state``)."""
        return checkpoint.checkpoint_state(self.lookup)

    def drop_file_pages(self) -> None:
        """Unmap the pages of the shards' file that a checkpoint item read or wrote, so that
        saving or loading the shards on disk keeps no more than a chunk of them resident."""
        if self.tiered is not None:
            self.tiered.drop_pages()

    def after_checkpoint_load(self, state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Make the loaded values the live ones (``checkpoint.after_checkpoint_load``)."""
        checkpoint.after_checkpoint_load(self.lookup, state)

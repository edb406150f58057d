"""Step 3 of a sharded lookup, and its backward: the pooled vectors go back to the rank
that owns each sample, encoded with the forward codec (fp32, fp16, bf16, fp8 or int8
row-wise), and the owner assembles its output.

The owner puts table-wise vectors in place, concatenates column-wise ones, and sums the
partial sums of row-wise ones in rank order (a fixed order: runs are bitwise repeatable);
mean pooling of a row-wise table is a sum on every shard, divided here by the whole bag's
length, since no shard sees the whole bag. Backward mirrors it: each owner sends every
shard the gradient of its columns (through the backward codec), scaled by 1 / world size
so that the update is that of the mean loss over the global batch, as DDP does for the
dense layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from dlrmflow.kernels.codecs import Codec, Encoded
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.comms import CommStats, PendingAllToAll, all_to_all
from dlrmflow.train.model.sharded.routing import Routing


class OutputDist:
    """The output all-to-all over ``group``, and the assembly of each rank's output."""

    def __init__(
        self,
        routing: Routing,
        group: dist.ProcessGroup | None,
        codec: Codec,
        backward_codec: Codec,
        stats: CommStats,
    ) -> None:
        self.routing = routing
        self.group = group
        self.codec = codec
        self.backward_codec = backward_codec
        self.stats = stats
        self.device = routing.device

    def send(
        self, pooled: torch.Tensor, batch_sizes: list[int], training: bool
    ) -> list[torch.Tensor]:
        """This rank's pooled vectors of every rank's samples (``batch_sizes``, source
        after source) to their owners: the blocks each rank returned for this rank's
        samples, in rank order. In training, their backward returns the gradients."""
        trigger = torch.empty(0, requires_grad=training, device=self.device)
        return list(_OutputAllToAll.apply(trigger, pooled, self, batch_sizes))

    def assemble(
        self, blocks: list[torch.Tensor], source: KeyedJaggedTensor, batch: int
    ) -> torch.Tensor:
        """This rank's ``[batch, output_dim]`` output from the returned ``blocks`` (and the
        replicated tables' block last, when there are any) in feature order."""
        routing = self.routing
        if routing.concatenated_in_order:
            return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if routing.permutation is not None:
            return torch.cat(blocks, dim=1).index_select(1, routing.permutation)
        out = torch.zeros(batch, routing.output_dim, device=self.device)
        # Rank order: partial sums of row-wise tables always add up the same way.
        columns = list(routing.out_columns)
        if routing.replicated_features:  # their block comes last
            columns.append(routing.replicated_columns)
        for cols, block in zip(columns, blocks, strict=True):
            if cols.numel():
                out = out.index_add(1, cols, block)
        if routing.mean_partial:
            out = out * routing.mean_scale(source)
        return out

    def exchange(
        self, codec: Codec, parts: list[torch.Tensor], recv: list[tuple[int, int]], kind: str
    ) -> list[torch.Tensor]:
        """Encode ``parts[r]`` for rank r, all-to-all, decode: ``recv[s]`` = (rows, dim) of
        what rank s sends. Each rank's piece travels as one flat byte stream, whatever its
        dims (any of them may be empty: a rank with no batch or no shards)."""
        # The piece a rank keeps never travels: it skips the codec and the collective.
        me = self.routing.rank
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
        if self.routing.world_size == 1:
            return [parts[me]]
        pending: PendingAllToAll = all_to_all(
            flat, recv_bytes, self.group, kind=kind, stats=self.stats
        )
        return [
            parts[me] if s == me else self._decode(codec, data, rows, dim)
            for s, (data, (rows, dim)) in enumerate(zip(pending.wait(), recv, strict=True))
        ]

    def _encode(self, codec: Codec, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, dim] as the codec's bytes, flat (rows of ``codec_width`` values)."""
        if x.numel() == 0:
            return torch.zeros(0, dtype=torch.uint8, device=self.device)
        width = self.routing.codec_width or x.shape[1]
        return codec.encode(x.reshape(-1, width)).data.reshape(-1)

    def _decode(self, codec: Codec, data: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
        """The ``[rows, dim]`` floats of flat bytes from ``_encode``."""
        if rows == 0 or dim == 0:
            return torch.zeros(rows, dim, device=self.device)
        width = self.routing.codec_width or dim
        encoded = Encoded(data.view(rows * (dim // width), codec.row_nbytes(width)), width)
        return codec.decode(encoded).view(rows, dim)

    def _row_bytes(self, codec: Codec, dim: int) -> int:
        if dim == 0:
            return 0
        width = self.routing.codec_width or dim
        return codec.row_nbytes(width) * (dim // width)


class _OutputAllToAll(torch.autograd.Function):
    """Pooled vectors back to the ranks owning their samples; gradients the other way."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        trigger: torch.Tensor,
        pooled: torch.Tensor,
        dist_: OutputDist,
        batch_sizes: list[int],
    ) -> tuple[torch.Tensor, ...]:
        ctx.dist = dist_
        ctx.batch_sizes = batch_sizes
        ctx.local_width = pooled.shape[1]
        parts = list(pooled.detach().split(batch_sizes))
        batch = batch_sizes[dist_.routing.rank]
        recv = [(batch, width) for width in dist_.routing.widths]
        return tuple(dist_.exchange(dist_.codec, parts, recv, "forward"))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        dist_: OutputDist = ctx.dist
        routing = dist_.routing
        scale = 1.0 / routing.world_size
        rows = ctx.batch_sizes[routing.rank]
        parts = [
            g if g is not None else torch.zeros(rows, w, device=dist_.device)
            for g, w in zip(grads, routing.widths, strict=True)
        ]
        if routing.world_size > 1:
            parts = [p * scale for p in parts]
        recv = [(rows, ctx.local_width) for rows in ctx.batch_sizes]
        received = dist_.exchange(dist_.backward_codec, parts, recv, "backward")
        return None, torch.cat(received), None, None

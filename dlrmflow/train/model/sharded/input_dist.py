"""Step 1 of a sharded lookup: every rank sends each other rank the IDs of the shards that
rank holds, for the batch it read.

Whole bags go to table-wise and column-wise shards, only the IDs inside its row range
(shifted to start at 0) to row-wise ones. One-hot batches travel as a ``[B, n]`` ID matrix
(-1 for an empty bag or an ID outside the range); jagged ones as lengths, then values (and
per-ID weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.comms import CommStats, PendingAllToAll, all_gather_ints, all_to_all
from dlrmflow.train.model.sharded.routing import Routing, key_starts


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

    def __init__(
        self,
        finish: Callable[[], KeyedJaggedTensor | None],
        batch_sizes: list[int],
        source: KeyedJaggedTensor,
    ) -> None:
        self._finish = finish
        self._batch_sizes = batch_sizes
        self._source = source
        self._received: ReceivedInput | None = None

    def wait(self) -> ReceivedInput:
        if self._received is None:
            self._received = ReceivedInput(self._finish(), self._batch_sizes, self._source)
        return self._received


class InputDist:
    """The input all-to-all over ``group`` (its own process group: the pipeline runs it
    in the background, ordered independently of the output all-to-all)."""

    def __init__(self, routing: Routing, group: dist.ProcessGroup | None, stats: CommStats):
        self.routing = routing
        self.group = group
        self.stats = stats

    def start(self, kjt: KeyedJaggedTensor, *, async_op: bool = False) -> PendingInput:
        """Send every rank the IDs of its shards for this rank's batch ``kjt``.

        The batch sizes (and whether any rank's batch is jagged) are exchanged first and
        synchronously; the IDs themselves travel in the background when ``async_op``.
        """
        if kjt.keys != self.routing.names:
            raise ValueError(f"batch keys {kjt.keys} differ from the tables {self.routing.names}")
        jagged = kjt.one_hot_rows is None
        sizes = all_gather_ints([kjt.stride, int(jagged)], self.group)
        batch_sizes = sizes[:, 0].tolist()
        if bool(sizes[:, 1].any()):
            finish = self._send_jagged(kjt, batch_sizes, async_op)
        else:
            finish = self._send_one_hot(kjt.one_hot_rows, batch_sizes, async_op)
        return PendingInput(finish, batch_sizes, kjt)

    def _send_one_hot(
        self, rows: torch.Tensor, batch_sizes: list[int], async_op: bool
    ) -> Callable[[], KeyedJaggedTensor | None]:
        routing = self.routing
        rows = rows.long()
        parts = []
        for keys, lo, hi in zip(routing.send_keys, routing.send_lo, routing.send_hi, strict=True):
            ids = rows.index_select(1, keys)
            inside = (ids >= lo) & (ids < hi)
            parts.append(torch.where(inside, ids - lo, -1).reshape(-1))
        n_local = len(routing.local)
        pending = all_to_all(
            parts,
            [b * n_local for b in batch_sizes],
            self.group,
            kind="input",
            stats=self.stats,
            async_op=async_op,
        )

        def finish() -> KeyedJaggedTensor | None:
            received = pending.wait()
            if not n_local:
                return None
            local_rows = torch.cat(received).view(-1, n_local)
            return KeyedJaggedTensor.from_one_hot(routing.local_names, local_rows)

        return finish

    def _send_jagged(
        self, kjt: KeyedJaggedTensor, batch_sizes: list[int], async_op: bool
    ) -> Callable[[], KeyedJaggedTensor | None]:
        routing = self.routing
        batch = kjt.stride
        values = kjt.values
        lengths = kjt.lengths.view(len(routing.names), batch)
        key_start = key_starts(kjt)
        weights = kjt.weights
        send_lengths, send_values, send_weights = [], [], []
        for routes in routing.routes:
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
        n_local = len(routing.local)
        # How many IDs each rank receives from each: exchanged before the IDs themselves, on
        # the host (gloo): the receiver needs them there to size its buffers.
        counts = torch.tensor([v.numel() for v in send_values], dtype=torch.int64, device="cpu")
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts_list = recv_counts.tolist()

        def exchange(parts: list[torch.Tensor], recv_rows: list[int]) -> PendingAllToAll:
            return all_to_all(
                parts, recv_rows, self.group, kind="input", stats=self.stats, async_op=async_op
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
                    routing.local_names,
                    received[1][s],
                    received[0][s],
                    received[2][s] if weights is not None else None,
                )
                for s in range(routing.world_size)
            ]
            return KeyedJaggedTensor.concat(parts)

        return finish

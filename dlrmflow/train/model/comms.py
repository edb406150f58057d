"""The collectives of the sharded trainer, with the bytes each rank sends counted by kind.

Everything goes through ``torch.distributed`` (gloo on CPU, NCCL on GPU); this module only
packs per-destination pieces into the one flat tensor ``all_to_all_single`` wants and
counts what leaves the rank, so the benchmark can report bytes per step per codec.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# What the bytes were for: input IDs and lengths, pooled embeddings forward, their
# gradients backward, the dense gradient allreduce, and replicated tables' allreduce.
KINDS = ("input", "forward", "backward", "dense", "replicated")


class CommStats:
    """Bytes this rank sent, per kind, since it was created (or last ``reset``).

    All-to-all counts the pieces sent to other ranks (the piece a rank keeps never leaves
    it). An allreduce of ``n`` bytes counts ``2 (W - 1) / W * n``, what each rank sends in
    a ring allreduce, the algorithm gloo and NCCL use for large buffers.
    """

    def __init__(self) -> None:
        self.sent: dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; expected one of {KINDS}")
        self.sent[kind] += int(nbytes)

    def add_allreduce(self, kind: str, nbytes: int, world_size: int) -> None:
        self.add(kind, 2 * (world_size - 1) * nbytes // max(world_size, 1))

    def snapshot(self) -> dict[str, int]:
        return {kind: self.sent.get(kind, 0) for kind in KINDS}

    def reset(self) -> None:
        self.sent.clear()


class PendingAllToAll:
    """An all-to-all in flight; ``wait`` returns the pieces received, one per source rank."""

    def __init__(self, work: dist.Work | None, output: torch.Tensor, recv_rows: list[int]):
        self._work = work
        self._output = output
        self._recv_rows = recv_rows

    def wait(self) -> list[torch.Tensor]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return list(self._output.split(self._recv_rows))


def all_to_all(
    send: Sequence[torch.Tensor],
    recv_rows: Sequence[int],
    group: dist.ProcessGroup | None,
    *,
    kind: str,
    stats: CommStats | None,
    async_op: bool = False,
) -> PendingAllToAll:
    """Send ``send[r]`` (rows along dim 0, the same trailing shape and dtype for every r) to
    rank ``r``, receiving ``recv_rows[s]`` rows from each rank ``s``.

    With ``async_op`` the exchange runs in the background until ``wait``: the train
    pipeline starts the next batch's input exchange this way while the current batch
    computes.
    """
    rank = dist.get_rank(group)
    trailing = send[0].shape[1:]
    send_rows = [int(t.shape[0]) for t in send]
    flat = (
        torch.cat([t.reshape(-1, *trailing) for t in send])
        if send
        else torch.empty(0, device="cpu")
    )
    output = flat.new_empty((sum(recv_rows), *trailing))
    if stats is not None:
        row_bytes = flat.element_size() * (flat[0].numel() if flat.dim() > 1 else 1)
        stats.add(kind, row_bytes * (sum(send_rows) - send_rows[rank]))
    work = dist.all_to_all_single(
        output,
        flat,
        output_split_sizes=list(recv_rows),
        input_split_sizes=send_rows,
        group=group,
        async_op=async_op,
    )
    return PendingAllToAll(work if async_op else None, output, list(recv_rows))


def all_gather_ints(values: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[world_size, len(values)]``: every rank's ``values``."""
    mine = torch.tensor(list(values), dtype=torch.int64, device="cpu")
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out)


def dense_comm_hook(
    precision: str, stats: CommStats, world_size: int
) -> tuple[Callable, dist.ProcessGroup | None]:
    """A DDP comm hook allreducing the dense gradients in ``precision`` (PyTorch's own fp16
    and bf16 compression hooks, or its plain allreduce), counting the bytes sent."""
    hooks = {
        "fp32": (default_hooks.allreduce_hook, 4),
        "fp16": (default_hooks.fp16_compress_hook, 2),
        "bf16": (default_hooks.bf16_compress_hook, 2),
    }
    if precision not in hooks:
        raise ValueError(f"dense_comms must be one of {sorted(hooks)}, got {precision!r}")
    inner, element_size = hooks[precision]

    # Unannotated on purpose: DDP checks annotations against the classes, and this module's
    # postponed annotations would be strings.
    def hook(process_group, bucket):  # noqa: ANN001
        stats.add_allreduce("dense", bucket.buffer().numel() * element_size, world_size)
        return inner(process_group, bucket)

    return hook, None

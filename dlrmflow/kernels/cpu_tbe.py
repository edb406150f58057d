"""The TBE's fused backward on the CPU, compiled (numba): reduce by row, then update.

Three passes over one group's looked-up IDs, each a plain loop:

1. give every distinct row a slot, in order of first occurrence (``slot`` is a per-row
   scratch the module keeps at -1 between steps, so no sort is needed);
2. add each occurrence's bag gradient (times its scale) into its row's slot, in input
   order: each row's gradient is the sum of its occurrences in the order the torch path's
   stable sort gives, so the result does not depend on anything but the batch;
3. update each touched row of the weight (and its row-wise state) from its slot, and
   put its scratch entry back to -1.

The torch path (sort, CSR product, index_select/index_copy) makes several passes over
every ID and gradient and builds the sorted rows the sharded trainer's hooks need; this
one touches each ID twice and each distinct row once. It runs on one thread, so the
result is the same whatever the thread count (the tests check it bitwise against itself
at 1 and 2 threads and against the torch path within float tolerance).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

_SGD, _ROWWISE_ADAGRAD = 0, 1


@numba.njit(nogil=True, cache=True)
def _assign_slots(ids: np.ndarray, slot: np.ndarray, rows: np.ndarray, where: np.ndarray) -> int:
    """Pass 1: a slot per distinct row in order of first occurrence; returns their count.

    ``rows[j]`` is slot ``j``'s row; ``where[i]`` is occurrence ``i``'s slot, negated
    minus one for a row's first occurrence (so pass 2 reads no per-row scratch at all).
    """
    unique = 0
    for i in range(ids.shape[0]):
        r = ids[i]
        if slot[r] < 0:
            slot[r] = unique
            rows[unique] = r
            where[i] = -unique - 1
            unique += 1
        else:
            where[i] = slot[r]
    return unique


@numba.njit(nogil=True, cache=True)
def _reduce_and_update(
    where: np.ndarray,
    rows: np.ndarray,
    unique: int,
    bags: np.ndarray,
    scale: np.ndarray,
    grads: np.ndarray,
    acc: np.ndarray,
    weight: np.ndarray,
    state: np.ndarray,
    slot: np.ndarray,
    kind: int,
    lr: float,
    weight_decay: float,
    eps: float,
) -> None:
    """Passes 2 and 3: sum each row's gradients into ``acc``, then update the rows.

    ``bags[i]`` is the row of ``grads`` occurrence ``i`` pooled into (empty: ``i``);
    ``scale[i]`` multiplies its gradient (empty: 1). A row's first occurrence stores
    instead of adding, so ``acc`` (scratch, reused across steps) needs no zeroing.
    ``where`` is pass 1's slot of each occurrence.
    ``state`` is the row-wise Adagrad sum of squares (unused for SGD).
    """
    dim = grads.shape[1]
    has_bags, has_scale = bags.shape[0] != 0, scale.shape[0] != 0
    for i in range(where.shape[0]):
        j = where[i]
        target = acc[j if j >= 0 else -j - 1]
        source = grads[bags[i] if has_bags else i]
        c = scale[i] if has_scale else np.float32(1)
        if j < 0:
            for d in range(dim):
                target[d] = c * source[d]
        else:
            for d in range(dim):
                target[d] += c * source[d]
    step = np.float32(lr)
    decay = np.float32(weight_decay)
    for j in range(unique):
        r = rows[j]
        slot[r] = -1
        w, g = weight[r], acc[j]
        if decay != 0:
            for d in range(dim):
                g[d] += decay * w[d]
        if kind == _SGD:
            for d in range(dim):
                w[d] -= step * g[d]
        else:
            square = np.float32(0)
            for d in range(dim):
                square += g[d] * g[d]
            s = state[r] + square / np.float32(dim)
            state[r] = s
            denominator = np.sqrt(s) + np.float32(eps)
            for d in range(dim):
                w[d] -= step * (g[d] / denominator)


_EMPTY_INDEX = np.zeros(0, np.int64)
_EMPTY_SCALE = np.zeros(0, np.float32)


def supports(weight: torch.Tensor) -> bool:
    """Whether the compiled step can update ``weight`` (a float32 CPU tensor)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


class Scratch:
    """Per-module buffers of the compiled step, kept between steps.

    ``slot`` has an entry per row, -1 between steps; ``acc`` holds the reduced gradients
    and grows to the most distinct rows a step has touched. Kept rather than allocated per
    step: a fresh buffer of that size costs a page fault per 4 KiB on first touch.
    """

    def __init__(self, num_rows: int) -> None:
        self.slot = np.full(num_rows, -1, np.int32)
        self.acc = np.empty(0, np.float32)

    def rows_for(self, unique: int, dim: int) -> np.ndarray:
        if self.acc.size < unique * dim:
            self.acc = np.empty(unique * dim, np.float32)
        return self.acc[: unique * dim].reshape(unique, dim)


def fused_step(
    weight: torch.Tensor,
    state: torch.Tensor | None,
    scratch: Scratch,
    ids: torch.Tensor,
    bag_grads: torch.Tensor,
    bags: torch.Tensor | None,
    scale: torch.Tensor | None,
    *,
    rowwise_adagrad: bool,
    lr: float,
    weight_decay: float,
    eps: float = 0.0,
) -> None:
    """Reduce ``bag_grads`` by row of ``weight`` (a [rows, dim] view) and update in place.

    ``ids`` are rows of ``weight``, one per looked-up ID; ``bags`` the row of
    ``bag_grads`` each pooled into (None: ID ``i`` into bag ``i``); ``scale`` a factor per
    ID (mean pooling's divisor, per-sample weights) or None. ``state`` is row-wise
    Adagrad's per-row sum of squares; ``scratch.slot`` must cover ``weight``'s rows.
    """
    n = ids.numel()
    if n == 0:
        return
    slot = scratch.slot[: weight.shape[0]]
    rows, where = np.empty(n, np.int64), np.empty(n, np.int64)
    unique = _assign_slots(ids.numpy(), slot, rows, where)
    _reduce_and_update(
        where,
        rows,
        unique,
        _EMPTY_INDEX if bags is None else bags.numpy(),
        _EMPTY_SCALE if scale is None else scale.to(torch.float32).contiguous().numpy(),
        bag_grads.contiguous().numpy(),
        scratch.rows_for(unique, weight.shape[1]),
        weight.numpy(),
        _EMPTY_SCALE if state is None else state.numpy(),
        slot,
        _ROWWISE_ADAGRAD if rowwise_adagrad else _SGD,
        lr,
        weight_decay,
        eps,
    )


@numba.njit(nogil=True, cache=True)
def _jagged_rows(
    values: np.ndarray,
    offsets: np.ndarray,
    first_row: np.ndarray,
    num_rows: np.ndarray,
    batch: int,
    ids: np.ndarray,
    positions: np.ndarray,
) -> int:
    """Group rows and sample-major bag positions of key-major jagged IDs, in one pass.

    Returns -1, or the index of the first ID outside its table's rows (nothing after it
    is written).
    """
    n_keys = first_row.shape[0]
    base = offsets[0]
    for k in range(n_keys):
        start, size = first_row[k], num_rows[k]
        for b in range(batch):
            bag = b * n_keys + k
            for j in range(offsets[k * batch + b], offsets[k * batch + b + 1]):
                v = values[j]
                if v < 0 or v >= size:
                    return j - base
                ids[j - base] = v + start
                positions[j - base] = bag
    return -1


def jagged_rows(
    values: torch.Tensor,
    offsets: torch.Tensor,
    first_row: torch.Tensor,
    num_rows: torch.Tensor,
    batch: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(ids, positions, bad)`` for the IDs ``values[offsets[0]:offsets[-1]]``.

    ``offsets`` are one group's bag offsets (key-major, ``n_keys * batch + 1``) into the
    whole ``values``; key ``k``'s IDs become rows ``first_row[k] + id`` of the group and
    each ID's position is its bag's row in the sample-major output (``sample * n_keys +
    key``). ``bad`` is -1, or the index (from ``offsets[0]``) of the first ID outside
    ``[0, num_rows[k])``, in which case the rest is unfilled.
    """
    n = int(offsets[-1] - offsets[0])
    ids = torch.empty(n, dtype=torch.int64)
    positions = torch.empty(n, dtype=torch.int64)
    bad = _jagged_rows(
        values.numpy(),
        offsets.numpy(),
        first_row.numpy(),
        num_rows.numpy(),
        batch,
        ids.numpy(),
        positions.numpy(),
    )
    return ids, positions, int(bad)

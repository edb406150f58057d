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
one touches each ID twice and each distinct row once.

Passes 2 and 3 are split over torch's intra-op threads by row: thread ``t`` of ``T``
sums and updates the rows whose slot is ``t`` modulo ``T``, so no two threads touch one
row and each row's arithmetic is the same whatever ``T`` is: the result is bitwise the
same at any thread count (the tests check it bitwise split in 1, 2 and 3 parts, and
against the torch path within float tolerance). Steps below 16 MB of gradients stay on
one thread (see ``_MIN_SPLIT``). The threads are a small pool of Python
threads running the compiled loops without the GIL, not numba's parallel mode, whose
default thread layer refuses calls from two threads at once (the readers make such
calls). Most of the time goes to fetching weight rows scattered over a table far larger
than the caches; two threads keep twice as many of those fetches in flight.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_SGD, _ROWWISE_ADAGRAD = 0, 1

# Rows fetched ahead of use: the rows a step touches are scattered over tables far larger
# than the caches, so each costs a trip to memory; asking for them this many rows early
# keeps several trips in flight (measured at dim 128: the update pass alone 25-35%
# faster, the whole compiled step 5-10%).
_AHEAD = 8
_LINE = 64


@intrinsic
def _prefetch(typingctx, address):  # noqa: ARG001 - numba's intrinsic signature
    """Ask the CPU to start loading the cache line at ``address`` (LLVM's prefetch)."""

    def codegen(context, builder, signature, args):  # noqa: ARG001
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]),
            "llvm.prefetch.p0",
        )
        # For writing (1), kept in all cache levels (3), a data line (1).
        pointer = builder.inttoptr(args[0], byte_pointer)
        builder.call(
            function, [pointer, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        )
        return context.get_dummy_value()

    return types.void(types.uintp), codegen


@numba.njit(nogil=True, cache=True, inline="always")
def _prefetch_row(array: np.ndarray, row: int) -> None:
    """Prefetch every cache line of ``array[row]`` (a C-contiguous 2-D array)."""
    start = array.ctypes.data + row * array.strides[0]
    for offset in range(0, array.shape[1] * array.itemsize, _LINE):
        _prefetch(start + offset)


@numba.njit(nogil=True, cache=True)
def _assign_slots(
    ids: np.ndarray,
    slot: np.ndarray,
    rows: np.ndarray,
    where: np.ndarray,
    parts: int,
    owner: np.ndarray,
    mine: np.ndarray,
    counts: np.ndarray,
) -> int:
    """Pass 1: a slot per distinct row in order of first occurrence; returns their count.

    ``rows[j]`` is slot ``j``'s row; ``where[i]`` is occurrence ``i``'s slot, negated
    minus one for a row's first occurrence (so pass 2 reads no per-row scratch at all).
    With ``parts > 1``, slot ``j`` belongs to part ``j % parts`` (``owner[j]``) and each
    part's occurrences are listed in input order: ``mine[p, :counts[p]]``.
    """
    unique = 0
    turn = 0
    for i in range(ids.shape[0]):
        r = ids[i]
        j = slot[r]
        if j < 0:
            j = unique
            slot[r] = j
            rows[j] = r
            where[i] = -j - 1
            unique += 1
            if parts > 1:
                owner[j] = turn
                turn = turn + 1 if turn + 1 < parts else 0
        else:
            where[i] = j
        if parts > 1:
            p = owner[j]
            mine[p, counts[p]] = i
            counts[p] += 1
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
    part: int,
    parts: int,
    mine: np.ndarray,
) -> None:
    """Passes 2 and 3 for the slots ``j`` with ``j % parts == part``.

    Sums each such row's gradients into ``acc``, then updates those rows. The slots of
    different parts are distinct rows, so the parts can run at once on several threads,
    and each row's result is the same whatever ``parts`` is. ``mine`` lists the part's
    occurrences (pass 1's ``mine[part, :counts[part]]``); with one part, it is unused.

    ``bags[i]`` is the row of ``grads`` occurrence ``i`` pooled into (empty: ``i``);
    ``scale[i]`` multiplies its gradient (empty: 1). A row's first occurrence stores
    instead of adding, so ``acc`` (scratch, reused across steps) needs no zeroing.
    ``where`` is pass 1's slot of each occurrence.
    ``state`` is the row-wise Adagrad sum of squares (unused for SGD).
    """
    every = parts == 1
    if bags.shape[0] == 0 and scale.shape[0] == 0:
        _accumulate_one_to_one(where, grads, acc, every, mine)
    else:
        _accumulate_pooled(where, bags, scale, grads, acc, every, mine)
    step = np.float32(lr)
    decay = np.float32(weight_decay)
    epsilon = np.float32(eps)
    dim = acc.shape[1]
    ahead = _AHEAD * parts  # this part's slots are every parts-th
    for j in range(part, unique, parts):
        if j + ahead < unique:
            _prefetch_row(weight, rows[j + ahead])
            if kind != _SGD:
                _prefetch(state.ctypes.data + rows[j + ahead] * state.itemsize)
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
            s = state[r] + _square_sum(g) / np.float32(dim)
            state[r] = s
            denominator = np.sqrt(s) + epsilon
            for d in range(dim):
                w[d] -= step * (g[d] / denominator)


@numba.njit(nogil=True, cache=True)
def _accumulate_one_to_one(
    where: np.ndarray, grads: np.ndarray, acc: np.ndarray, every: bool, mine: np.ndarray
) -> None:
    """Pass 2 when occurrence ``i``'s gradient is ``grads[i]`` (one-hot bags, unscaled)."""
    dim = grads.shape[1]
    for k in range(where.shape[0] if every else mine.shape[0]):
        i = k if every else mine[k]
        j = where[i]
        target, source = acc[j if j >= 0 else -j - 1], grads[i]
        if j < 0:
            for d in range(dim):
                target[d] = source[d]
        else:
            for d in range(dim):
                target[d] += source[d]


@numba.njit(nogil=True, cache=True)
def _accumulate_pooled(
    where: np.ndarray,
    bags: np.ndarray,
    scale: np.ndarray,
    grads: np.ndarray,
    acc: np.ndarray,
    every: bool,
    mine: np.ndarray,
) -> None:
    """Pass 2 in general: occurrence ``i``'s gradient is its bag's, times its scale."""
    dim = grads.shape[1]
    has_bags, has_scale = bags.shape[0] != 0, scale.shape[0] != 0
    for k in range(where.shape[0] if every else mine.shape[0]):
        i = k if every else mine[k]
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


@numba.njit(nogil=True, cache=True, inline="always")
def _square_sum(g: np.ndarray) -> np.float32:
    """Sum of ``g[d]**2`` in a fixed order: eight interleaved partial sums, then a tree.

    One running sum is a chain of dependent adds the compiler may not reorder (that would
    change the result); eight independent ones keep the vector units busy, and the order
    is still fixed, so the result is the same on every run and thread count.
    """
    dim = g.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0)
    full = dim - dim % 8
    for b in range(0, full, 8):
        s0 += g[b] * g[b]
        s1 += g[b + 1] * g[b + 1]
        s2 += g[b + 2] * g[b + 2]
        s3 += g[b + 3] * g[b + 3]
        s4 += g[b + 4] * g[b + 4]
        s5 += g[b + 5] * g[b + 5]
        s6 += g[b + 6] * g[b + 6]
        s7 += g[b + 7] * g[b + 7]
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for d in range(full, dim):
        total += g[d] * g[d]
    return total


_EMPTY_INDEX = np.zeros(0, np.int64)
_EMPTY_SCALE = np.zeros(0, np.float32)
_NO_PARTS = np.zeros(0, np.int32)


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
    parts = _parts(n * weight.shape[1])
    rows, where = np.empty(n, np.int64), np.empty(n, np.int64)
    if parts == 1:
        owner, mine, counts = _NO_PARTS, _NO_PARTS.reshape(1, 0), _NO_PARTS
    else:
        owner, mine, counts = (
            np.empty(n, np.int32),
            np.empty((parts, n), np.int32),
            np.zeros(parts, np.int64),
        )
    unique = _assign_slots(ids.numpy(), slot, rows, where, parts, owner, mine, counts)
    arguments = (
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
    if parts == 1:
        calls = [(*arguments, 0, 1, _NO_PARTS)]
    else:
        calls = [(*arguments, p, parts, mine[p, : counts[p]]) for p in range(parts)]
    _in_parts(_reduce_and_update, calls)


# Below this many gradient elements (IDs x dim: 16 MB of float32) a step stays on one
# thread. Handing part of a step to another thread costs tens of microseconds, and that
# thread competes with the readers and torch's own workers: the one-process demo (dim 16,
# batch 2048: 0.85M elements a step) showed no gain from splitting, while the kernel
# benchmark's steps (6.8M elements and up) run faster split.
_MIN_SPLIT = 1 << 22

_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)
_pool_lock = threading.Lock()


def _parts(elements: int) -> int:
    """How many threads share a step: torch's intra-op thread count, for large steps."""
    return 1 if elements < _MIN_SPLIT else max(1, torch.get_num_threads())


def _helpers(workers: int) -> ThreadPoolExecutor:
    """The threads that run a step's other parts; made again after a fork or to grow."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] < workers:
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, "dlrmflow-tbe"))
        return _pool[2]


def _in_parts(kernel, calls: list[tuple]) -> None:
    """``kernel(*c)`` for each of ``calls``, the first on this thread, the rest on helpers."""
    helpers = []
    if len(calls) > 1:
        pool = _helpers(len(calls) - 1)
        helpers = [pool.submit(kernel, *c) for c in calls[1:]]
    kernel(*calls[0])
    for helper in helpers:
        helper.result()


@numba.njit(nogil=True, cache=True)
def _one_hot_ids(
    rows: np.ndarray,
    first_key: int,
    first_row: np.ndarray,
    num_rows: np.ndarray,
    ids: np.ndarray,
) -> tuple[int, int]:
    """Group rows of keys ``first_key:first_key + len(first_row)`` of a one-hot batch.

    ``ids[b * keys + k] = first_row[k] + rows[b, first_key + k]``, or 0 where the ID is
    missing (-1). Returns ``(missing, bad)``: the number of missing IDs, and -1 or the
    flat index (into ``ids``) of the first ID outside ``[-1, num_rows[k])``, after which
    nothing is written.
    """
    keys = first_row.shape[0]
    missing = 0
    for b in range(rows.shape[0]):
        for k in range(keys):
            v = rows[b, first_key + k]
            if v < 0:
                if v != -1:
                    return missing, b * keys + k
                ids[b * keys + k] = 0
                missing += 1
            elif v >= num_rows[k]:
                return missing, b * keys + k
            else:
                ids[b * keys + k] = v + first_row[k]
    return missing, -1


def one_hot_ids(
    rows: torch.Tensor, first_key: int, first_row: torch.Tensor, num_rows: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """``(ids, missing, bad)`` of one group of a one-hot batch, checked, in one pass.

    ``rows`` is the batch's [B, all keys] IDs; the group's keys start at ``first_key``,
    key ``k``'s IDs become rows ``first_row[k] + id`` of the group (0 where missing).
    ``bad`` is -1, or the flat index of the first ID out of range (the rest unfilled).
    """
    ids = torch.empty(rows.shape[0] * first_row.shape[0], dtype=torch.int64)
    missing, bad = _one_hot_ids(
        rows.numpy(), first_key, first_row.numpy(), num_rows.numpy(), ids.numpy()
    )
    return ids, int(missing), int(bad)


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

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

Large steps are split over torch's intra-op threads by key: each part takes a run of
consecutive keys (about as many IDs each) and runs all three passes for their IDs. A row
belongs to one table and so to one key, so no two parts touch one row, and each row's
arithmetic is the same however the keys were split: the result is bitwise the same at
any thread count (the tests check it at 1, 2 and 3 threads, and against the torch path
within float tolerance). A part's gradient rows are its keys' columns of each sample's
row of the output gradient, a contiguous stretch, which the CPU streams in faster than
the scattered rows a split by row would read. Steps below 16 MB of gradients stay on
one thread (see ``_MIN_SPLIT``).

The parts run on torch's own OpenMP threads (``runtime.gomp``), or where that runtime is not
reachable, on a small pool of Python threads; either way the compiled loops run without
the GIL. Not numba's parallel mode: its default thread layer refuses calls from two
threads at once (the readers make such calls), and its OpenMP layer would be a second
team of threads competing with torch's for the same cores.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch

from dlrmflow.runtime import gomp
from dlrmflow.runtime.llvm_prefetch import prefetch as _prefetch

_SGD, _ROWWISE_ADAGRAD = 0, 1

# Rows fetched ahead of use: the rows a step touches are scattered over tables far larger
# than the caches, so each costs a trip to memory; asking for them this many rows early
# keeps several trips in flight (the whole backward gains, more with row-wise Adagrad than
# with SGD; see ``dlrmflow.runtime.llvm_prefetch``).
_AHEAD = 8
_LINE = 64
# Pass 1 looks up each row's slot in a per-row array as large as the group's tables; the
# entries of rows seen later in the batch are asked for this many IDs early.
_SLOT_AHEAD = 32


@numba.njit(nogil=True, cache=True, inline="always")
def _prefetch_row(array: np.ndarray, row: int) -> None:
    """Prefetch every cache line of ``array[row]`` (a C-contiguous 2-D array)."""
    start = array.ctypes.data + row * array.strides[0]
    for offset in range(0, array.shape[1] * array.itemsize, _LINE):
        _prefetch(start + offset)


@numba.njit(nogil=True, cache=True, inline="always")
def _slot_of(i: int, r: int, slot: np.ndarray, rows: np.ndarray, where: np.ndarray, unique: int):
    """Record occurrence ``i`` of row ``r``; returns the new count of distinct rows."""
    j = slot[r]
    if j < 0:
        slot[r] = unique
        rows[unique] = r
        where[i] = -unique - 1
        return unique + 1
    where[i] = j
    return unique


@numba.njit(nogil=True, cache=True)
def _assign_slots(
    ids: np.ndarray,
    bags: np.ndarray,
    n_keys: int,
    lo: int,
    hi: int,
    first_key: int,
    end_key: int,
    slot: np.ndarray,
    rows: np.ndarray,
    where: np.ndarray,
    mine: np.ndarray,
) -> tuple[int, int]:
    """Pass 1 for one part: a slot per distinct row, in order of first occurrence.

    The part is the occurrences ``lo <= i < hi`` of keys ``[first_key, end_key)``; with
    every key, that is all of ``[lo, hi)``, else they are listed in order in ``mine``
    (the IDs are sample-major then: ID ``i`` pooled into bag ``bags[i]``, or ``i``, whose
    key is that modulo ``n_keys``). Returns the count of distinct rows and of listed
    occurrences. ``rows[j]`` is slot ``j``'s row and ``where[i]`` occurrence ``i``'s
    slot, negated minus one for a row's first occurrence (so pass 2 reads no per-row
    scratch at all).
    """
    unique = listed = 0
    if first_key == 0 and end_key == n_keys:
        for i in range(lo, hi):
            if i + _SLOT_AHEAD < hi:
                _prefetch(slot.ctypes.data + ids[i + _SLOT_AHEAD] * slot.itemsize)
            unique = _slot_of(i, ids[i], slot, rows, where, unique)
    elif bags.shape[0] == 0:  # ID b * n_keys + k is sample b's of key k
        for b in range(lo // n_keys, hi // n_keys):
            if (b + 1) * n_keys + end_key <= hi:
                for k in range(first_key, end_key):
                    _prefetch(slot.ctypes.data + ids[(b + 1) * n_keys + k] * slot.itemsize)
            for i in range(b * n_keys + first_key, b * n_keys + end_key):
                unique = _slot_of(i, ids[i], slot, rows, where, unique)
                mine[listed] = i
                listed += 1
    else:
        for i in range(lo, hi):
            key = bags[i] % n_keys
            if first_key <= key < end_key:
                unique = _slot_of(i, ids[i], slot, rows, where, unique)
                mine[listed] = i
                listed += 1
    return unique, listed


@numba.njit(nogil=True, cache=True)
def _reduce_and_update(
    where: np.ndarray,
    rows: np.ndarray,
    bags: np.ndarray,
    scale: np.ndarray,
    grads: np.ndarray,
    grads16: np.ndarray,
    acc: np.ndarray,
    weight: np.ndarray,
    state: np.ndarray,
    slot: np.ndarray,
    kind: int,
    lr: float,
    weight_decay: float,
    eps: float,
    lo: int,
    hi: int,
    mine: np.ndarray,
) -> None:
    """Passes 2 and 3 for the part pass 1 saw: ``[lo, hi)``, or the occurrences it
    listed in ``mine`` (when not empty).

    Sums each of its rows' gradients into ``acc`` (its slots, ``len(rows)`` of them),
    then updates those rows. No row belongs to two parts (a row is one table's, a table
    one key's), so the parts can run at once on several threads, and each row's result is
    the same however the keys were split.

    ``bags[i]`` is the row of ``grads`` occurrence ``i`` pooled into (empty: ``i``);
    ``grads16`` holds them instead as bfloat16 bit patterns when not empty (``grads`` is
    then empty), widened to float32 row by row as they are summed (exactly: every
    bfloat16 is a float32);
    ``scale[i]`` multiplies its gradient (empty: 1). A row's first occurrence stores
    instead of adding, so ``acc`` (scratch, reused across steps) needs no zeroing.
    ``state`` is the row-wise Adagrad sum of squares (unused for SGD).
    """
    if bags.shape[0] == 0 and scale.shape[0] == 0:
        _accumulate_one_to_one(where, grads, grads16, acc, lo, hi, mine)
    else:
        _accumulate_pooled(where, bags, scale, grads, grads16, acc, lo, hi, mine)
    step = np.float32(lr)
    decay = np.float32(weight_decay)
    epsilon = np.float32(eps)
    dim = acc.shape[1]
    unique = rows.shape[0]
    for j in range(unique):
        if j + _AHEAD < unique:
            _prefetch_row(weight, rows[j + _AHEAD])
            if kind != _SGD:
                _prefetch(state.ctypes.data + rows[j + _AHEAD] * state.itemsize)
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


@numba.njit(nogil=True, cache=True, inline="always")
def _widened(grads16: np.ndarray, row: int, into: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """``into`` (float32, ``bits`` its uint32 view) holding bfloat16 row ``row`` of
    ``grads16`` (uint16 bit patterns): each the high half of its float32."""
    source = grads16[row]
    for d in range(source.shape[0]):
        bits[d] = np.uint32(source[d]) << np.uint32(16)
    return into


@numba.njit(nogil=True, cache=True)
def _accumulate_one_to_one(
    where: np.ndarray,
    grads: np.ndarray,
    grads16: np.ndarray,
    acc: np.ndarray,
    lo: int,
    hi: int,
    mine: np.ndarray,
) -> None:
    """Pass 2 when occurrence ``i``'s gradient is ``grads[i]`` (one-hot bags, unscaled)."""
    dim = acc.shape[1]
    half = grads16.shape[0] != 0
    row = np.empty(dim, np.float32)
    bits = row.view(np.uint32)
    listed = mine.shape[0] != 0
    for k in range(mine.shape[0] if listed else hi - lo):
        i = mine[k] if listed else lo + k
        j = where[i]
        target = acc[j if j >= 0 else -j - 1]
        source = _widened(grads16, i, row, bits) if half else grads[i]
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
    grads16: np.ndarray,
    acc: np.ndarray,
    lo: int,
    hi: int,
    mine: np.ndarray,
) -> None:
    """Pass 2 in general: occurrence ``i``'s gradient is its bag's, times its scale."""
    dim = acc.shape[1]
    has_bags, has_scale = bags.shape[0] != 0, scale.shape[0] != 0
    half = grads16.shape[0] != 0
    row = np.empty(dim, np.float32)
    bits = row.view(np.uint32)
    listed = mine.shape[0] != 0
    for k in range(mine.shape[0] if listed else hi - lo):
        i = mine[k] if listed else lo + k
        j = where[i]
        target = acc[j if j >= 0 else -j - 1]
        bag = bags[i] if has_bags else i
        source = _widened(grads16, bag, row, bits) if half else grads[bag]
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
_EMPTY_GRADS = np.zeros((0, 1), np.float32)
_EMPTY_GRADS16 = np.zeros((0, 1), np.uint16)


def _bits16(t: torch.Tensor) -> np.ndarray:
    """A bfloat16 tensor's values as their uint16 bit patterns (no copy; numpy has no
    bfloat16)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def supports(weight: torch.Tensor) -> bool:
    """Whether the compiled step can update ``weight`` (a float32 CPU tensor)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


class Scratch:
    """Per-module buffers of the compiled step, kept between steps.

    ``slot`` has an entry per row, -1 between steps; each part of a step sums its rows'
    gradients in its own ``acc`` buffer, which grows to the most distinct rows that part
    has touched. Kept rather than allocated per step: a fresh buffer of that size costs a
    page fault per 4 KiB on first touch.
    """

    def __init__(self, num_rows: int) -> None:
        self.slot = np.full(num_rows, -1, np.int32)
        self.acc: list[np.ndarray] = []

    def rows_for(self, part: int, unique: int, dim: int) -> np.ndarray:
        """Part ``part``'s buffer for ``unique`` rows of ``dim`` (a view, not zeroed)."""
        while len(self.acc) <= part:
            self.acc.append(np.empty(0, np.float32))
        if self.acc[part].size < unique * dim:
            self.acc[part] = np.empty(unique * dim, np.float32)
        return self.acc[part][: unique * dim].reshape(unique, dim)


def fused_step(
    weight: torch.Tensor,
    state: torch.Tensor | None,
    scratch: Scratch,
    ids: torch.Tensor,
    bag_grads: torch.Tensor,
    bags: torch.Tensor | None,
    scale: torch.Tensor | None,
    *,
    n_keys: int,
    key_counts: Sequence[int] | None,
    rowwise_adagrad: bool,
    lr: float,
    weight_decay: float,
    eps: float = 0.0,
) -> None:
    """Reduce ``bag_grads`` by row of ``weight`` (a [rows, dim] view) and update in place.

    ``bag_grads`` is float32, or bfloat16 (the gradient of ``gather_bf16``'s output),
    which is summed in float32 as the float32 gradient of the same values would be.

    ``ids`` are rows of ``weight``, one per looked-up ID, of ``n_keys`` tables; ``bags``
    the row of ``bag_grads`` each pooled into, sample-major (None: ID ``i`` into bag
    ``i``); ``scale`` a factor per ID (mean pooling's divisor, per-sample weights) or
    None. ``key_counts`` is the number of IDs of each key when ``ids`` are key-major (all
    of the first key's, then the second's: the jagged form), None when they are
    sample-major (the one-hot form). ``state`` is row-wise Adagrad's per-row sum of
    squares; ``scratch.slot`` must cover ``weight``'s rows.
    """
    n = ids.numel()
    if n == 0:
        return
    threads = _threads(n * weight.shape[1])
    spans = _spans(n, n_keys, key_counts, threads)
    ids_np, where = ids.numpy(), np.empty(n, np.int64)
    bags_np = _EMPTY_INDEX if bags is None else bags.numpy()
    slot = scratch.slot[: weight.shape[0]]
    grads = bag_grads.contiguous()
    half = grads.dtype == torch.bfloat16
    arguments = (
        bags_np,
        _EMPTY_SCALE if scale is None else scale.to(torch.float32).contiguous().numpy(),
        _EMPTY_GRADS if half else grads.numpy(),
        _bits16(grads) if half else _EMPTY_GRADS16,
    )
    update = (
        weight.numpy(),
        _EMPTY_SCALE if state is None else state.numpy(),
        slot,
        _ROWWISE_ADAGRAD if rowwise_adagrad else _SGD,
        lr,
        weight_decay,
        eps,
    )

    def run(part: int) -> None:
        first_key, end_key, lo, hi = spans[part]
        every = first_key == 0 and end_key == n_keys
        bound = hi - lo if every or bags is not None else (end_key - first_key) * (n // n_keys)
        rows, mine = np.empty(bound, np.int64), np.empty(0 if every else bound, np.int64)
        unique, listed = _assign_slots(
            ids_np, bags_np, n_keys, lo, hi, first_key, end_key, slot, rows, where, mine
        )
        acc = scratch.rows_for(part, unique, weight.shape[1])
        _reduce_and_update(where, rows[:unique], *arguments, acc, *update, lo, hi, mine[:listed])

    _share(run, len(spans), threads)


def _spans(
    n: int, n_keys: int, key_counts: Sequence[int] | None, parts: int
) -> list[tuple[int, int, int, int]]:
    """``(first_key, end_key, lo, hi)`` of each part: runs of keys with about as many IDs.

    A part takes the IDs of keys ``[first_key, end_key)`` among the occurrences
    ``[lo, hi)``. With key-major IDs, ``[lo, hi)`` holds just its keys' IDs, so the key
    range given is every key (nothing to filter); with sample-major ones, it is all IDs.
    """
    parts = max(1, min(parts, n_keys))
    if parts == 1:
        return [(0, n_keys, 0, n)]
    if key_counts is None:  # sample-major: every key has up to one ID per sample
        cuts = [p * n_keys // parts for p in range(parts + 1)]
        return [(cuts[p], cuts[p + 1], 0, n) for p in range(parts)]
    starts = np.concatenate([[0], np.cumsum(key_counts)])  # where each key's IDs start
    cuts = [0]
    for p in range(1, parts):
        # The key boundary nearest p/parts of the IDs, leaving each part a key at least.
        low, high = cuts[-1] + 1, n_keys - (parts - p)
        cuts.append(low + int(np.argmin(np.abs(starts[low : high + 1] - p * n / parts))))
    cuts.append(n_keys)
    return [(0, n_keys, int(starts[cuts[p]]), int(starts[cuts[p + 1]])) for p in range(parts)]


# Below this many gradient elements (IDs x dim: 16 MB of float32) a step stays on one
# thread. Handing part of a step to another thread has a fixed cost, and that thread
# competes with the readers and torch's own workers: the one-process demo (dim 16, batch
# 2048: 0.85M elements a step) showed no gain from splitting, while the kernel benchmark's
# steps (6.8M elements and up) run faster split.
_MIN_SPLIT = 1 << 22

_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)
_pool_lock = threading.Lock()


def _threads(elements: int, least: int = _MIN_SPLIT) -> int:
    """How many threads share a step: torch's intra-op thread count, from ``least``
    elements."""
    return 1 if elements < least else max(1, torch.get_num_threads())


def _by_rows(rows: int, threads: int, run: Callable[[int, int], None]) -> None:
    """``run(lo, hi)`` over ``rows`` rows cut into one run of rows per thread."""
    cuts = [p * rows // threads for p in range(threads + 1)]
    _share(lambda p: run(cuts[p], cuts[p + 1]), threads, threads)


def _helpers(workers: int) -> ThreadPoolExecutor:
    """The threads that run a step's other parts; made again after a fork or to grow."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] < workers:
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, "dlrmflow-tbe"))
        return _pool[2]


def _share(run: Callable[[int], None], parts: int, threads: int) -> None:
    """``run(p)`` for every part ``p``, on this thread and up to ``threads - 1`` helpers.

    The threads take parts in turn until none is left; this thread returns once every
    part is done. A helper that starts late (torch's own workers may still hold the other
    cores, spinning after their last op) finds fewer parts left or none, rather than
    holding the step up: which thread runs a part does not change its result.
    """
    if threads == 1 or parts == 1:
        for p in range(parts):
            run(p)
        return
    lock = threading.Lock()
    done = threading.Event()
    state = {"next": 0, "finished": 0, "error": None}

    def work() -> None:
        while True:
            with lock:
                p = state["next"]
                if p >= parts or state["error"] is not None:
                    return
                state["next"] = p + 1
            try:
                run(p)
            except BaseException as error:  # noqa: BLE001 - handed to the caller below
                with lock:
                    state["error"] = error
                done.set()
                return
            with lock:
                state["finished"] += 1
                if state["finished"] == parts:
                    done.set()

    runner = gomp.omp_runner()
    if runner is not None:
        try:
            runner(work, threads)
        except Exception:  # noqa: BLE001 - the runtime failed: the pool takes over
            gomp.give_up()
            runner = None
    if runner is None:
        pool = _helpers(threads - 1)
        for _ in range(threads - 1):
            pool.submit(work)
    work()  # whatever is left: nothing, unless the region did not run the work
    done.wait()
    if state["error"] is not None:
        raise state["error"]


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


@numba.njit(nogil=True, cache=True)
def _gather_bf16(bits: np.ndarray, ids: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``out[i] = bits[ids[i]]`` for ``i`` in ``[lo, hi)``, float32 bit patterns rounded to
    bfloat16 ones: to nearest, ties to even, as torch converts (NaN stays NaN)."""
    for i in range(lo, hi):
        if i + _AHEAD < hi:
            _prefetch_row(bits, ids[i + _AHEAD])
        source, target = bits[ids[i]], out[i]
        for d in range(source.shape[0]):
            b = source[d]
            rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> 16
            nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
            target[d] = np.uint16(0x7FC0) if nan else np.uint16(rounded)


def gather_bf16(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``weight.index_select(0, ids).to(torch.bfloat16)`` in one pass: the rows are read
    once and only their bfloat16 form is written (a float32 gather and a cast write the
    rows and read them again). Bitwise the same for every value but NaN's payload."""
    n, dim = ids.numel(), weight.shape[1]
    out = torch.empty((n, dim), dtype=torch.bfloat16)
    if n == 0:
        return out
    bits, ids_np, out_np = weight.numpy().view(np.uint32), ids.numpy(), _bits16(out)
    _by_rows(n, _threads(n * dim), lambda lo, hi: _gather_bf16(bits, ids_np, out_np, lo, hi))
    return out


@numba.njit(nogil=True, cache=True)
def _select_columns(x: np.ndarray, columns: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``out[r, k] = x[r, columns[k]]`` (0 where ``columns[k]`` is negative), rows
    ``[lo, hi)``; any element type, copied as its bits."""
    for r in range(lo, hi):
        source, target = x[r], out[r]
        for k in range(columns.shape[0]):
            c = columns[k]
            target[k] = source[c] if c >= 0 else 0


# A column selection of at least this many elements is split over torch's threads: a row
# of the interaction's Gram matrix is a few hundred bytes, so the parts stay independent.
_MIN_SELECT_SPLIT = 1 << 20
_BITS = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}


def select_columns(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``x[:, columns]`` of a C-contiguous CPU matrix of 2- or 4-byte elements, where a
    negative column gives zeros (a +0.0 of any float type): one pass copying bits.

    torch's ``index_select`` along the columns and its ``gather`` of 16-bit elements are
    slower at the dot interaction's shapes (a Gram row of 729 columns, a few hundred
    picked)."""
    rows, width = x.shape[0], columns.numel()
    out = torch.empty((rows, width), dtype=x.dtype)
    if rows == 0 or width == 0:
        return out
    as_int, bits = _BITS[x.element_size()]
    source, target = x.view(as_int).numpy().view(bits), out.view(as_int).numpy().view(bits)
    cols = columns.numpy()
    threads = _threads(rows * width, _MIN_SELECT_SPLIT)
    _by_rows(rows, threads, lambda lo, hi: _select_columns(source, cols, target, lo, hi))
    return out


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

"""Compiled loops of the feature transform (numba): one pass where numpy needs ten.

Hashing an ID is about ten dependent integer operations. As numpy calls, each one is a
pass over the whole array (reading and writing it again); compiled as one loop, every ID
stays in registers from load to store and the array is read and written once. The
loops release the GIL, so the reader's threads hash in parallel.

Each function computes exactly what ``ids.HashIds`` documents, in the same wrapping uint64
arithmetic, so results are bitwise those of the numpy formulation (which the tests keep
as the reference). Compiled code is cached on disk beside this module (or in numba's
user cache when that is read-only): only a new machine pays the compile.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from dlrmflow.runtime.llvm_prefetch import prefetch, prefetch_read

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S32 = np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)
_FULL32 = np.uint64(1 << 32)
_NO_MASK = np.zeros(0, np.bool_)
_NO_SLOTS = np.zeros((0, 2), np.uint64)


def frozen(a: np.ndarray) -> np.ndarray:
    """``a``, or a read-only view of it.

    Arrow's buffers are read-only, and a tuple of arrays compiles to one loop only when
    every array has one type, the read-only flag included.
    """
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def masks(valid: Sequence[np.ndarray | None]) -> tuple[np.ndarray, ...]:
    """The kernels' form of per-column validity: a bool per slot, or empty for no nulls."""
    return tuple(frozen(_NO_MASK if v is None else v) for v in valid)


@numba.njit(nogil=True, cache=True, inline="always")
def _row(raw: np.uint64, salt: np.uint64, rows: np.uint64) -> np.uint64:
    """The top 32 bits of ``stable_hash(raw, salt)``, range-reduced into ``[0, rows)``.

    ``(top * rows) >> 32`` for ``rows`` in ``[1, 2**32]``. Below ``2**32``, ``rows`` is
    masked to 32 bits (a no-op there): the compiler then knows both factors fit in 32 bits
    and multiplies with one fast 32x32->64 vector instruction instead of a 64-bit one,
    which makes hashing faster. ``rows == 2**32`` gives ``top`` itself.
    """
    z = raw + salt
    z ^= z >> _S32
    z *= _M1
    z ^= z >> _S32
    z *= _M2
    top = z >> _S32
    return top if rows == _FULL32 else (top * (rows & _LOW32)) >> _S32


@numba.njit(nogil=True, cache=True)
def hash_rows(ids: np.ndarray, salt: np.uint64, rows: np.uint64, out: np.ndarray) -> None:
    """``out[i] = row of ids[i]`` for uint64 ``ids`` (two's-complement bit patterns).

    ``out`` may be strided (a column of a sample-major [B, keys] array) and int32 or int64.
    """
    for i in range(ids.shape[0]):
        out[i] = np.int64(_row(ids[i], salt, rows))


# Samples per block of the sample-major kernels below. Their inputs are one array per
# column and their output is [n, columns]. Each block is computed column by column into a
# contiguous scratch [columns, block] (loops the compiler vectorizes), then transposed
# into the output while both are in cache: storing straight down each output column is
# slower, every column touching every output cache line again.
#
# The per-column loops are functions of their own, not inlined: inside the block loop the
# compiler left them scalar, and hashing there was slower than as a function of its own.
# Nulls are chosen branch-free (a select per slot the compiler vectorizes): a branch per
# slot mispredicted on every null, which cost more than the hashing itself where a tenth
# of the slots were null.
_BLOCK = 512


@numba.njit(nogil=True, cache=True)
def _hash_block(
    ids: np.ndarray, salt: np.uint64, rows: np.uint64, valid: np.ndarray, part: np.ndarray
) -> None:
    """``part[i] = row of ids[i]``, or -1 where ``valid[i]`` is False (``valid`` empty:
    no nulls)."""
    for i in range(part.shape[0]):
        part[i] = _row(ids[i], salt, rows)
    if valid.shape[0] != 0:
        for i in range(part.shape[0]):
            part[i] = part[i] if valid[i] else -1


@numba.njit(nogil=True, cache=True)
def _clamp_block(values: np.ndarray, valid: np.ndarray, part: np.ndarray, limit: float) -> int:
    """``part[i] = max(values[i], 0)`` as float32; 0 for nulls (``valid[i]`` False) and NaN.

    Returns how many values (nulls aside) have a magnitude above ``limit``, ±inf included:
    counted in the same loop, as values are converted, and in ``values``' own type, so
    the count does not rest on what a float32 conversion makes of them. An infinite
    ``limit`` (integer columns) counts nothing and costs nothing.
    """
    beyond = 0
    check = limit < np.inf
    if valid.shape[0] == 0:
        if check:
            for i in range(part.shape[0]):
                v = values[i]
                beyond += np.abs(v) > limit  # False for NaN: NaN is missing, like a null
                x = np.float32(v)
                # ``x > 0`` is False for NaN, so NaN becomes 0 like a null.
                part[i] = x if x > 0 else np.float32(0)
        else:
            for i in range(part.shape[0]):
                x = np.float32(values[i])
                part[i] = x if x > 0 else np.float32(0)
    elif check:
        for i in range(part.shape[0]):
            v = values[i]
            beyond += (np.abs(v) > limit) & valid[i]
            x = np.float32(v)
            part[i] = x if (x > 0) & valid[i] else np.float32(0)
    else:
        for i in range(part.shape[0]):
            x = np.float32(values[i])
            part[i] = x if (x > 0) & valid[i] else np.float32(0)
    return beyond


@numba.njit(nogil=True, cache=True, inline="always")
def _prefetch_block(a: np.ndarray, first: int, end: int) -> None:
    """Ask for ``a[first:end]`` (a 1-D array) from memory, a line at a time."""
    end = min(end, a.shape[0])
    if first < end:
        start = a.ctypes.data + first * a.itemsize
        for address in range(start - start % 64, a.ctypes.data + end * a.itemsize, 64):
            prefetch_read(address)


@numba.njit(nogil=True, cache=True, inline="always")
def _vocab_row(raw: np.uint64, slots: np.ndarray, base: np.uint64, shift: np.uint64) -> np.int64:
    """The row of ``raw`` in a vocabulary's probe table (``ids._ProbeTable``), 0 when absent.

    ``slots`` is the table as uint64 [size, 2] of (ID, row), row 0 marking an empty slot;
    the ID's home slot is the top bits of its unsalted hash (``ids._home_hash``) past
    ``base``, and its probe runs on until it finds the ID or an empty slot.
    """
    z = raw
    z ^= z >> _S32
    z *= _M1
    z ^= z >> _S32
    z *= _M2
    at = (z >> shift) + base
    while True:
        row = slots[at, 1]
        if row == 0 or slots[at, 0] == raw:
            return np.int64(row)
        at += np.uint64(1)


@numba.njit(nogil=True, cache=True)
def vocab_rows(
    ids: np.ndarray, slots: np.ndarray, base: np.uint64, shift: np.uint64, out: np.ndarray
) -> None:
    """``out[i] = vocabulary row of ids[i]`` for uint64 ``ids`` (0: out of vocabulary)."""
    for i in range(ids.shape[0]):
        out[i] = _vocab_row(ids[i], slots, base, shift)


@numba.njit(nogil=True, cache=True)
def _vocab_block(
    ids: np.ndarray,
    slots: np.ndarray,
    base: np.uint64,
    shift: np.uint64,
    valid: np.ndarray,
    part: np.ndarray,
) -> None:
    """``_hash_block`` for a vocabulary: ``part[i] = row of ids[i]``, -1 for nulls."""
    for i in range(part.shape[0]):
        part[i] = _vocab_row(ids[i], slots, base, shift)
    if valid.shape[0] != 0:
        for i in range(part.shape[0]):
            part[i] = part[i] if valid[i] else -1


@numba.njit(nogil=True, cache=True)
def one_hot_rows(
    ids: tuple[np.ndarray, ...],
    valid: tuple[np.ndarray, ...],
    salts: np.ndarray,
    rows: np.ndarray,
    out: np.ndarray,
    dest: np.ndarray,
) -> None:
    """Hash key ``k``'s ``ids[k][i]`` into ``out[dest[i], k]``; -1 for nulls.

    ``valid[k]`` is a bool per ID, or empty when key ``k`` has no nulls. ``out`` is the
    sample-major [B, keys] one-hot form (int32 or int64); ``dest`` (int64) says where
    each sample goes, so that a shuffle costs no pass of its own.
    """
    _one_hot(ids, valid, salts, rows, _NO_SLOTS, out, dest)


@numba.njit(nogil=True, cache=True)
def one_hot_vocab_rows(
    ids: tuple[np.ndarray, ...],
    valid: tuple[np.ndarray, ...],
    bases: np.ndarray,
    shifts: np.ndarray,
    slots: np.ndarray,
    out: np.ndarray,
    dest: np.ndarray,
) -> None:
    """``one_hot_rows`` with a vocabulary's rows: key ``k`` probes its region of ``slots``
    (``bases[k]``, ``shifts[k]``; see ``_vocab_row``)."""
    _one_hot(ids, valid, bases, shifts, slots, out, dest)


@numba.njit(nogil=True, cache=True)
def _one_hot(
    ids: tuple[np.ndarray, ...],
    valid: tuple[np.ndarray, ...],
    first: np.ndarray,
    second: np.ndarray,
    slots: np.ndarray,
    out: np.ndarray,
    dest: np.ndarray,
) -> None:
    """The block loop of both one-hot kernels: hashing (``slots`` empty; ``first`` and
    ``second`` are salts and row counts) or a vocabulary (bases and shifts)."""
    n, keys = ids[0].shape[0], len(ids)
    scratch = np.empty((keys, _BLOCK), out.dtype)
    for start in range(0, n, _BLOCK):
        end = min(start + _BLOCK, n)
        # The next block of every column, asked for now: each is a page of its own, where
        # the hardware prefetcher would start cold (it helps on uncached columns).
        for k in range(keys):
            _prefetch_block(ids[k], end, end + _BLOCK)
            _prefetch_block(valid[k], end, end + _BLOCK)
        for k in range(keys):
            ok = valid[k][start:end] if valid[k].shape[0] != 0 else valid[k]
            part = scratch[k, : end - start]
            if slots.shape[0] == 0:
                _hash_block(ids[k][start:end], first[k], second[k], ok, part)
            else:
                _vocab_block(ids[k][start:end], slots, first[k], second[k], ok, part)
        _transpose_into(scratch, end - start, out, dest[start:])


@numba.njit(nogil=True, cache=True)
def clamp_columns(
    columns: tuple[np.ndarray, ...],
    valid: tuple[np.ndarray, ...],
    first: int,
    out: np.ndarray,
    limit: float,
    beyond: np.ndarray,
) -> None:
    """``out[k, i] = max(columns[k][first + i], 0)`` as float32, 0 for nulls and NaN.

    ``valid[k]`` is a bool per value, or empty when column ``k`` has no nulls. ``out`` is
    feature-major [columns, rows], so that the log after it runs over contiguous rows.
    ``beyond[k]`` (int64) is increased by how many of column ``k``'s values (nulls aside)
    have a magnitude above ``limit`` (``np.inf``: none are looked for).
    """
    size = out.shape[1]
    for k in range(len(columns)):
        ok = valid[k][first : first + size] if valid[k].shape[0] != 0 else valid[k]
        beyond[k] += _clamp_block(columns[k][first : first + size], ok, out[k], limit)


@numba.njit(nogil=True, cache=True)
def scatter_rows(values: np.ndarray, out: np.ndarray, dest: np.ndarray) -> None:
    """``out[dest[i], k] = values[k, i]`` (converted to ``out``'s dtype): feature-major rows
    into their places in ``out``."""
    _transpose_into(values, values.shape[1], out, dest)


# Rows are written to a shuffled window: each goes to one of ~64 batches, the next row of
# a batch some rows later. The hardware prefetcher cannot follow that many streams, so a
# first write to a line would wait for memory; each row's lines are asked for this many
# rows ahead (``dest`` says where), so that writing into an uncached window goes about as
# fast as into a cached one.
_OUT_AHEAD = 64


@numba.njit(nogil=True, cache=True, inline="always")
def _transpose_into(scratch: np.ndarray, size: int, out: np.ndarray, dest: np.ndarray) -> None:
    """``out[dest[i], k] = scratch[k, i]`` for the first ``size`` samples (``dest`` may run
    on past them: its later rows are prefetched)."""
    base, stride, last = out.ctypes.data, out.strides[0], out.shape[1] * out.itemsize - 1
    for i in range(size):
        if i + _OUT_AHEAD < dest.shape[0]:
            at = base + dest[i + _OUT_AHEAD] * stride
            prefetch(at)
            prefetch(at + last)
        row = dest[i]
        for k in range(scratch.shape[0]):
            out[row, k] = scratch[k, i]


@numba.njit(nogil=True, cache=True)
def inverse_permutation(order: np.ndarray, dest: np.ndarray) -> bool:
    """``dest[order[j]] = j``; False if ``order`` is not a permutation of its positions.

    An entry out of range stops the first pass; a repeated one leaves some ``dest[r]``
    pointing at its other position, which the second pass finds.
    """
    n = order.shape[0]
    for j in range(n):
        r = order[j]
        if r < 0 or r >= n:
            return False
        dest[r] = j
    for j in range(n):  # noqa: SIM110 - numba compiles a loop, not all() of a generator
        if dest[order[j]] != j:
            return False
    return True


# Bags gathered in emission order read their rows' lengths and starts from anywhere in the
# window (a batch's rows ascend through it): asked for this many bags ahead, and the
# bags' values half as far ahead (by then their start is cached).
_BAGS_AHEAD = 32


@numba.njit(nogil=True, cache=True)
def bag_starts(
    lengths: np.ndarray, first: int, base: int, out_lengths: np.ndarray, out_starts: np.ndarray
) -> int:
    """A jagged block's bags (``lengths``, key-major [keys, n]; their values key-major from
    ``base`` of the window's values) as rows ``first:first + n`` of the window's
    ``out_lengths`` and ``out_starts`` ([keys, window rows]); returns where the next
    block's values start."""
    for k in range(lengths.shape[0]):
        row, into_lengths, into_starts = lengths[k], out_lengths[k], out_starts[k]
        for i in range(lengths.shape[1]):
            into_lengths[first + i] = row[i]
            into_starts[first + i] = base
            base += row[i]
    return base


@numba.njit(nogil=True, cache=True)
def gather_bags(
    order: np.ndarray,
    lengths: np.ndarray,
    starts: np.ndarray,
    values: np.ndarray,
    weights: np.ndarray,
    out_lengths: np.ndarray,
    out_values: np.ndarray,
    out_weights: np.ndarray,
) -> None:
    """The jagged window in emission order: bag ``(k, order[j])`` (``lengths`` and
    ``starts`` [keys, rows] into ``values`` and ``weights``, or empty for none) becomes bag
    ``(k, j)``, key-major, its values (and weights) one after another.

    The writes are one sequential stream; the reads follow each batch's rows up through the
    window, asked for ahead (see ``_BAGS_AHEAD``).
    """
    weighted = weights.shape[0] != 0
    n = order.shape[0]
    values_base, weights_base = values.ctypes.data, weights.ctypes.data
    to = 0
    for k in range(lengths.shape[0]):
        row_lengths, row_starts, into = lengths[k], starts[k], out_lengths[k]
        lengths_base, starts_base = row_lengths.ctypes.data, row_starts.ctypes.data
        for j in range(n):
            if j + 2 * _BAGS_AHEAD < n:
                r = order[j + 2 * _BAGS_AHEAD]
                prefetch_read(lengths_base + r * 4)
                prefetch_read(starts_base + r * 8)
            if j + _BAGS_AHEAD < n:
                at = row_starts[order[j + _BAGS_AHEAD]]
                prefetch_read(values_base + at * 8)
                if weighted:
                    prefetch_read(weights_base + at * 4)
            r = order[j]
            size, at = row_lengths[r], row_starts[r]
            into[j] = size
            for m in range(size):
                out_values[to + m] = values[at + m]
            if weighted:
                for m in range(size):
                    out_weights[to + m] = weights[at + m]
            to += size


@numba.njit(nogil=True, cache=True)
def gather_samples(values: np.ndarray, order: np.ndarray, out: np.ndarray) -> None:
    """``out[j] = values[order[j]]`` for sample-major rows (dense features, labels as one
    column, one-hot IDs), each row asked for ``_BAGS_AHEAD`` rows ahead."""
    n = order.shape[0]
    base, stride = values.ctypes.data, values.strides[0]
    for j in range(n):
        if j + _BAGS_AHEAD < n:
            prefetch_read(base + order[j + _BAGS_AHEAD] * stride)
        r = order[j]
        for k in range(values.shape[1]):
            out[j, k] = values[r, k]


@numba.njit(nogil=True, cache=True)
def scatter_samples(values: np.ndarray, dest: np.ndarray, out: np.ndarray) -> None:
    """``out[dest[i]] = values[i]`` for sample-major rows (``dest`` may run on past
    ``values``: its later rows are prefetched, see ``_OUT_AHEAD``)."""
    base, stride, last = out.ctypes.data, out.strides[0], out.shape[1] * out.itemsize - 1
    for i in range(values.shape[0]):
        if i + _OUT_AHEAD < dest.shape[0]:
            at = base + dest[i + _OUT_AHEAD] * stride
            prefetch(at)
            prefetch(at + last)
        row = dest[i]
        for k in range(values.shape[1]):
            out[row, k] = values[i, k]


# Indices the compiler cannot prove non-negative (sums, offsets) cost a wrap-around check on
# every access as signed integers; the placed window's loops count in uint64, which halved
# them.
_ONE = np.uint64(1)


@numba.njit(nogil=True, cache=True)
def place_bags(
    lengths: np.ndarray,
    values: np.ndarray,
    weights: np.ndarray,
    weighted: bool,
    scalar: np.ndarray,
    dest: np.ndarray,
    base: int,
    out_lengths: np.ndarray,
    out_slots: np.ndarray,
    out_weights: np.ndarray,
) -> bool:
    """A jagged block's bags (``lengths`` key-major [keys, n] over ``values`` and, where
    ``weighted``, ``weights``) placed at window rows ``dest[i]`` of row-major [rows, keys]
    arrays: each bag's length, and in its slot, for a ``scalar`` key (a bag of at most
    one ID), that ID (and its weight), else where its IDs start in the window's values
    (this block's from ``base`` on). False, with the block only partly placed, if a
    ``scalar`` key has a bag of more than one ID.

    A scalar key's ID is kept in place so that gathering it later reads no other memory
    (``gather_placed_bags``); an empty bag's slot holds whatever the next ID is, never
    read. Rows are placed one at a time with every key of a row together: one line of
    each output a row, asked for ahead (see ``_OUT_AHEAD``).
    """
    keys, n = lengths.shape
    at = np.empty(keys, np.uint64)  # where key k's next bag starts in ``values``
    total = np.uint64(0)
    for k in range(keys):
        at[k] = total
        for i in range(n):
            total += np.uint64(lengths[k, i])
    for k in range(keys):
        if scalar[k] and total:
            for i in range(n):
                if lengths[k, i] > 1:
                    return False
    # An empty bag's slot reads an ID in bounds (any: it is never read back).
    last = total - _ONE if total else np.uint64(0)
    no_values = values.shape[0] == 0
    offset = np.uint64(base)
    lengths_base, lengths_stride = out_lengths.ctypes.data, out_lengths.strides[0]
    slots_base, slots_stride = out_slots.ctypes.data, out_slots.strides[0]
    weights_base, weights_stride = out_weights.ctypes.data, out_weights.strides[0]
    ahead_end = dest.shape[0]
    for i in range(n):
        if i + _OUT_AHEAD < ahead_end:
            ahead = dest[i + _OUT_AHEAD]
            prefetch(lengths_base + ahead * lengths_stride)
            prefetch(slots_base + ahead * slots_stride)
            if weighted:
                prefetch(weights_base + ahead * weights_stride)
        row = np.uint64(dest[i])
        for k in range(keys):
            size = lengths[k, i]
            start = at[k]
            out_lengths[row, k] = size
            if scalar[k]:
                own = min(start, last)
                out_slots[row, k] = 0 if no_values else values[own]
                if weighted:
                    out_weights[row, k] = weights[own]
            else:
                out_slots[row, k] = offset + start
            at[k] = start + np.uint64(size)
    return True


@numba.njit(nogil=True, cache=True)
def gather_placed_bags(
    first: int,
    last: int,
    lengths: np.ndarray,
    slots: np.ndarray,
    slot_weights: np.ndarray,
    scalar: np.ndarray,
    values: np.ndarray,
    weights: np.ndarray,
    weighted: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``first:last`` of a placed window (``place_bags``) as a jagged batch:
    (lengths int32 [keys * rows], values int64, weights float32, empty unless
    ``weighted``), key-major as ``KeyedJaggedTensor`` holds them.

    The rows are read in order. A scalar key's ID is written whatever its bag's length
    (an empty bag's is overwritten by the next ID), which spares a branch a row that
    mispredicts; only a list key's bags read elsewhere, from ``values`` (and
    ``weights``), asked for ``_BAGS_AHEAD`` rows ahead.
    """
    rows, keys = last - first, lengths.shape[1]
    total = 0
    for j in range(first, last):
        for k in range(keys):
            total += lengths[j, k]
    out_lengths = np.empty(keys * rows, np.int32)
    out_values = np.empty(total, np.int64)
    out_weights = np.empty(total if weighted else 0, np.float32)
    values_base, weights_base = values.ctypes.data, weights.ctypes.data
    to, end = np.uint64(0), np.uint64(total)
    start, stop = np.uint64(first), np.uint64(last)
    ahead_by = np.uint64(_BAGS_AHEAD)
    for k in range(keys):
        into = np.uint64(k * rows)
        key = np.uint64(k)
        j = start
        if scalar[k]:
            while j < stop:
                size = lengths[j, key]
                out_lengths[into + j - start] = size
                if to < end:  # false only past the last ID
                    out_values[to] = slots[j, key]
                    if weighted:
                        out_weights[to] = slot_weights[j, key]
                to += np.uint64(size)
                j += _ONE
            continue
        while j < stop:
            if j + ahead_by < stop:
                ahead = slots[j + ahead_by, key]
                prefetch_read(values_base + ahead * 8)
                if weighted:
                    prefetch_read(weights_base + ahead * 4)
            size = np.uint64(lengths[j, key])
            out_lengths[into + j - start] = size
            at = np.uint64(slots[j, key])
            m = np.uint64(0)
            if weighted:
                while m < size:
                    out_values[to + m] = values[at + m]
                    out_weights[to + m] = weights[at + m]
                    m += _ONE
            else:
                while m < size:
                    out_values[to + m] = values[at + m]
                    m += _ONE
            to += size
            j += _ONE
    return out_lengths, out_values, out_weights


@numba.njit(nogil=True, cache=True)
def fill_float32(values: np.ndarray, valid: np.ndarray, fill: np.float32, out: np.ndarray) -> None:
    """``out[i] = values[i]`` as float32, or ``fill`` where ``valid[i]`` is False (``valid``
    empty: no nulls) or the float32 is NaN: a declared dense column's fill in one pass,
    where numpy takes a cast, a NaN test, a null mask and a masked write. The conversions
    are numpy's (the same instructions), so the values are bitwise its."""
    checked = valid.shape[0] != 0
    for i in range(out.shape[0]):
        x = np.float32(values[i])
        missing = x != x
        if checked:
            missing |= not valid[i]
        out[i] = fill if missing else x

"""String IDs as int64: a stable 64-bit hash of each string's UTF-8 bytes.

A team's logs name users, items and tags by strings; the embedding tables take int64 IDs.
Each string becomes one by a hash that never changes: the same on every machine, process
and release, because a dataset's distinct counts (``ingest.stats``), a vocabulary built
once (``features.ids``) and the rows a trained model learned all rest on it. Python's
``hash`` is salted per process, so it is never used. Changing this function changes every
string ID of every dataset: the tests pin known strings to their values.

The hash is FNV-1a 64 over the bytes, then splitmix64's finalizer. FNV-1a alone leaves
strings that differ in their last byte a small multiple of its prime apart, so its low and
high bits are poorly mixed; the finalizer (a bijection) spreads every input bit over every
output bit, as ``features.ids.stable_hash`` needs of the IDs it salts and reduces.

It is computed by a compiled loop (numba) straight over the Arrow array's offsets and data
buffers: no Python string is made, nothing is copied, and a sliced array (whose offsets
start past its buffer's beginning) reads only its own strings.
"""

from __future__ import annotations

import numba
import numpy as np
import pyarrow as pa

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_OFFSET = np.uint64(FNV_OFFSET)
_PRIME = np.uint64(FNV_PRIME)
_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


def is_string(t: pa.DataType) -> bool:
    """Whether ``string_ids`` takes arrays of type ``t``."""
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def holds_strings(t: pa.DataType) -> bool:
    """Whether a column of type ``t`` holds strings, alone or in lists."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return is_string(t)


@numba.njit(nogil=True, cache=True, inline="always")
def _finish(h: np.uint64) -> np.uint64:
    """splitmix64's finalizer."""
    h ^= h >> _S30
    h *= _M1
    h ^= h >> _S27
    h *= _M2
    h ^= h >> _S31
    return h


@numba.njit(nogil=True, cache=True, inline="always")
def _fnv(h: np.uint64, data: np.ndarray, start: int, end: int) -> np.uint64:
    for j in range(start, end):
        h ^= np.uint64(data[j])
        h *= _PRIME
    return h


@numba.njit(nogil=True, cache=True)
def _hash_strings(offsets: np.ndarray, data: np.ndarray, out: np.ndarray) -> bool:
    """``out[i]`` = the hash of ``data[offsets[i]:offsets[i + 1]]``; False (and ``out``
    unfinished) if the offsets are not ascending within ``data``, which would read
    outside it.

    Four strings are hashed at once, byte by byte over their common length, then each
    one's rest alone: FNV's multiply per byte waits on the one before it, so four
    independent chains keep the multiplier busy where one leaves it idle most cycles.
    The hashes are the one-at-a-time ones exactly.

    Every constant and shift is uint64: numba would turn a mix of uint64 and int64 into
    float64.
    """
    n = out.shape[0]
    if offsets[0] < 0 or offsets[n] > data.shape[0]:
        return False
    for i in range(n):
        if offsets[i + 1] < offsets[i]:
            return False
    i = 0
    while i + 4 <= n:
        s0, s1, s2, s3 = offsets[i], offsets[i + 1], offsets[i + 2], offsets[i + 3]
        e3 = offsets[i + 4]
        common = min(s1 - s0, s2 - s1, s3 - s2, e3 - s3)
        h0 = h1 = h2 = h3 = _OFFSET
        for j in range(common):
            h0 ^= np.uint64(data[s0 + j])
            h1 ^= np.uint64(data[s1 + j])
            h2 ^= np.uint64(data[s2 + j])
            h3 ^= np.uint64(data[s3 + j])
            h0 *= _PRIME
            h1 *= _PRIME
            h2 *= _PRIME
            h3 *= _PRIME
        out[i] = _finish(_fnv(h0, data, s0 + common, s1))
        out[i + 1] = _finish(_fnv(h1, data, s1 + common, s2))
        out[i + 2] = _finish(_fnv(h2, data, s2 + common, s3))
        out[i + 3] = _finish(_fnv(h3, data, s3 + common, e3))
        i += 4
    for k in range(i, n):
        out[k] = _finish(_fnv(_OFFSET, data, offsets[k], offsets[k + 1]))
    return True


def string_ids(array: pa.Array) -> np.ndarray:
    """The int64 ID of each string of a ``string`` or ``large_string`` array.

    A null slot gets some value (the hash of whatever bytes its offsets span, usually
    none): callers drop nulls by the array's validity. Raises ``TypeError`` for any other
    type.
    """
    if not is_string(array.type):
        raise TypeError(f"string_ids: expected a string or large_string array, got {array.type}")
    n = len(array)
    out = np.empty(n, np.uint64)
    buffers = array.buffers()
    if n == 0 or buffers[1] is None:
        out[:] = 0
        return out.view(np.int64)
    off_dtype = np.dtype(np.int64 if pa.types.is_large_string(array.type) else np.int32)
    offsets = np.frombuffer(
        buffers[1], off_dtype, count=n + 1, offset=array.offset * off_dtype.itemsize
    )
    data = buffers[2]
    values = np.zeros(0, np.uint8) if data is None else np.frombuffer(data, np.uint8)
    if not _hash_strings(offsets, values, out):
        raise ValueError("string_ids: the array's offsets lie outside its data")
    return out.view(np.int64)

"""The bounded summaries a statistics pass keeps, each merging exactly in any order.

Distinct IDs are estimated with a HyperLogLog sketch rather than counted exactly: real
Criteo features reach hundreds of millions of distinct IDs over a month, which an exact set
would hold in gigabytes, while a sketch is 16 KiB per feature whatever the data size. Row
groups merge by an element-wise maximum, so the result does not depend on the reading order
and is bitwise reproducible; the relative standard error is 1.04 / sqrt(2**14), about 0.8%.

How skewed each feature's accesses are decides how well a cache of hot rows works, which the
sharding planner needs for tables kept in DRAM or on SSD. An exact count per ID would again
take gigabytes, so each feature keeps two bounded summaries, both exact under any grouping or
order of the row groups (``SkewTotals``; unless ``MAX_HOT_IDS`` is reached):

- the *hot IDs*: up to ``HOT_IDS_PER_ROW_GROUP`` most accessed IDs of every row group (and
  at least 4 times as often as its mean ID), with those accesses summed over row groups
  (IDs hot anywhere are few: hot IDs stay hot);
- a *sample of the distinct IDs chosen by hash* (``IdSample``), with the exact count of
  every sampled ID: at most ``SKEW_SAMPLE_IDS`` of them, halving the sampling rate whenever
  the sample outgrows that, so it describes the many rarely seen IDs.

A sample of IDs alone misses the few IDs that take a large share of the accesses (in click
logs, a Zipf-like head), so the hot IDs are counted apart (how close the hit rates come
is measured in docs/design.md). What a cache would hit, from these counts, is
``cache_hits``'s.

Dense columns get what the declared transforms need: the standard deviation beside the mean
(``standardize``), from sums of squares kept exact (``exact_sum``, ``integer_square_sum``),
and a quantile sketch (``bucketize`` with ``buckets``). The sketch is a log-linear histogram
of the values' float64 bit patterns, the sign, the exponent and the top
``SKETCH_MANTISSA_BITS`` bits of the mantissa as each bucket's key (HDR Histogram's
layout): integer arithmetic only, so every CPU puts a value in the same bucket; counts per
key merge by addition, exactly and in any order; and a quantile read from it is within
``2**-SKETCH_MANTISSA_BITS`` (0.8%) of the true one, relative (subnormal values share the
bucket of zero), while integers below 256 keep buckets of their own (exact quantiles for
counts and codes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# 2**14 registers: 0.8% error for 16 KiB a feature; more buys little for table sizing.
HLL_PRECISION = 14
_HLL_SUFFIX_BITS = 64 - HLL_PRECISION  # hash bits left after the register index
# Distinct IDs sampled per feature for its access skew: 32 KiB a feature in memory; the
# hit rates it gives are within a few percent where caches are sized (1%-50% of the IDs).
SKEW_SAMPLE_IDS = 2048
# The most accessed IDs of each row group counted as hot: ~1-2K hot IDs in all, 16 B each.
HOT_IDS_PER_ROW_GROUP = 1024
# A hard bound on hot IDs kept (1 MiB a feature): past it the coldest are dropped, the only
# case where the totals depend on the order row groups come in.
MAX_HOT_IDS = 65536
# Mantissa bits a dense quantile sketch's bucket keeps: 128 buckets an octave.
SKETCH_MANTISSA_BITS = 7
_SKETCH_SHIFT = 52 - SKETCH_MANTISSA_BITS
_ABS_BITS = np.int64(0x7FFF_FFFF_FFFF_FFFF)
# Every float64 is an integer multiple of 2**-1074 (the smallest subnormal): sums of squares
# are kept as such integers, exact, so they merge alike in any order.
EXACT_SCALE = 1 << 1074


class SkewTotals:
    """How a feature's accesses spread over its IDs, in bounded memory: its hot IDs (the
    ``HOT_IDS_PER_ROW_GROUP`` most accessed of each row group, those accesses summed) and an
    ``IdSample`` of all its distinct IDs. Both merge exactly, in any order."""

    def __init__(self, sample: IdSample, hot_hashes: np.ndarray, hot_counts: np.ndarray) -> None:
        self.sample = sample
        self.hot_hashes = hot_hashes  # sorted, unique
        self.hot_counts = hot_counts

    def add_hashes(self, hashed: np.ndarray) -> None:
        """Count one row group's accesses, whose ID hashes (``hash_ids``) are ``hashed``."""
        keys, counts = np.unique(hashed, return_counts=True)
        counts = counts.astype(np.int64)
        self.sample.add_counts(keys, counts)
        # Hot: accessed more often than the row group's K-th most accessed ID (so at most
        # K of them, ties decided by the row group alone) and than 4 times its mean ID:
        # without that, accesses spread evenly would make every row group's K new noise.
        top = len(counts) - HOT_IDS_PER_ROW_GROUP
        kth = int(np.partition(counts, top)[top]) if top > 0 else 0
        hot = counts > max(kth, 4 * len(hashed) // len(keys), 1)
        self._add_hot(keys[hot], counts[hot])

    def merge(self, other: SkewTotals) -> None:
        self.sample.merge(other.sample)
        self._add_hot(other.hot_hashes, other.hot_counts)

    def _add_hot(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self.hot_hashes, self.hot_counts = sum_by_key(
            np.concatenate([self.hot_hashes, keys]), np.concatenate([self.hot_counts, counts])
        )
        if len(self.hot_hashes) > MAX_HOT_IDS:
            keep = np.sort(np.argsort(-self.hot_counts, kind="stable")[: MAX_HOT_IDS // 2])
            self.hot_hashes, self.hot_counts = self.hot_hashes[keep], self.hot_counts[keep]

    def representatives(self, accesses: int, distinct: int) -> tuple[np.ndarray, np.ndarray]:
        """Access counts of representative IDs and how many IDs each stands for, so that
        ``sum(weights)`` is about ``distinct`` and ``sum(weights * counts)`` is ``accesses``.

        While the sample holds every ID (level 0) it is the answer, exactly. Otherwise the
        hot IDs stand for themselves (with the sample's exact count where it has them), and
        the sample's other IDs for the rest, their counts scaled to the accesses the hot IDs
        leave: the sample only has to describe IDs too rarely accessed to be hot anywhere.
        """
        sample = self.sample
        if sample.level == 0:
            return sample.counts.astype(np.float64), np.ones(len(sample.counts))
        hot = self.hot_counts.astype(np.float64)
        in_sample = np.isin(self.hot_hashes, sample.hashes, assume_unique=True)
        if in_sample.any():
            where = np.searchsorted(sample.hashes, self.hot_hashes[in_sample])
            hot[in_sample] = sample.counts[where]
        rest = sample.counts[~np.isin(sample.hashes, self.hot_hashes, assume_unique=True)]
        rest = rest.astype(np.float64)
        rest_accesses = accesses - hot.sum()
        if len(rest) == 0 or rest_accesses <= 0:
            return hot, np.ones(len(hot))
        rest_ids = max(distinct - len(hot), len(rest))
        weights = np.full(len(rest), rest_ids / len(rest))
        rest *= rest_accesses / float(np.sum(weights * rest))
        return np.concatenate([hot, rest]), np.concatenate([np.ones(len(hot)), weights])


def sum_by_key(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` made unique (sorted), each with the sum of its ``counts``."""
    if len(keys) == 0:
        return keys, counts
    order = np.argsort(keys, kind="stable")
    keys, counts = keys[order], counts[order]
    first = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    return keys[first], np.add.reduceat(counts, first)


class IdSample:
    """Distinct IDs chosen by hash, each with its exact count of accesses: a uniform random
    sample of a feature's distinct IDs (not of its accesses), in bounded memory.

    At ``level`` L an ID is in the sample when the low L bits of its hash are zero (a rate of
    2**-L); the level rises whenever more than ``SKEW_SAMPLE_IDS`` IDs are in. Rates only fall,
    so an ID still in was in from its first access and its count is exact; and the final
    level is the lowest at which the whole data's sampled IDs fit, so two samples merge to
    exactly the sample of their union, in any order.
    """

    def __init__(
        self, level: int = 0, hashes: np.ndarray | None = None, counts: np.ndarray | None = None
    ) -> None:
        self.level = level
        self.hashes = np.empty(0, np.uint64) if hashes is None else hashes  # sorted, unique
        self.counts = np.empty(0, np.int64) if counts is None else counts

    def add_counts(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Count ``counts`` accesses of the IDs whose hashes (``hash_ids``) are ``keys``."""
        kept = _sampled(keys, self.level)
        self._combine(keys[kept], counts[kept])

    def merge(self, other: IdSample) -> None:
        """Make this the sample of both samples' accesses."""
        self._raise_to(max(self.level, other.level))
        keep = _sampled(other.hashes, self.level)
        self._combine(other.hashes[keep], other.counts[keep])

    def unseen_share(self, before: Sequence[IdSample]) -> float | None:
        """The share of this sample's distinct IDs that none of the samples ``before`` has
        (None when it has none): each side is taken at the coarsest level of all, where
        every sample still holds every distinct ID of its data that the level keeps, so
        membership is exact and the share is that of a uniform sample of the IDs."""
        level = max([self.level, *(b.level for b in before)])
        ids = self.hashes[_sampled(self.hashes, level)]
        if len(ids) == 0:
            return None
        seen = [b.hashes[_sampled(b.hashes, level)] for b in before]
        known = np.isin(ids, np.concatenate(seen)) if seen else np.zeros(len(ids), bool)
        return float(1.0 - known.mean())

    def _combine(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self.hashes, self.counts = sum_by_key(
            np.concatenate([self.hashes, keys]), np.concatenate([self.counts, counts])
        )
        while len(self.hashes) > SKEW_SAMPLE_IDS:
            self._raise_to(self.level + 1)

    def _raise_to(self, level: int) -> None:
        self.level = level
        keep = _sampled(self.hashes, level)
        self.hashes, self.counts = self.hashes[keep], self.counts[keep]


def _sampled(hashed: np.ndarray, level: int) -> np.ndarray:
    """Which hashes a sample at ``level`` keeps: those whose low ``level`` bits are zero
    (the sketch's register index is in the high bits, so the two stay independent)."""
    return (hashed & np.uint64((1 << level) - 1)) == 0


def bucket_counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each sketch key of finite float64 ``values``, sorted, and how many values it has).

    Counted by ``bincount`` over each sign's key range apart (zeros aside): a row group's
    values of one sign span a few thousand buckets (128 an octave), while zero and 1.0
    lie 130 thousand keys apart.
    """
    keys, counts = [], []
    negative = -values[values < 0]
    positive = values[values > 0]
    zeros = len(values) - len(negative) - len(positive)
    for side, sign in ((negative, -1), (positive, 1)):
        if not len(side):
            continue
        magnitude = side.view(np.int64) >> np.int64(_SKETCH_SHIFT)
        low = int(magnitude.min())
        found = np.bincount(magnitude - low)
        present = np.flatnonzero(found)
        side_keys = present + low if sign > 0 else -(present + low) - 1
        keys.append(side_keys if sign > 0 else side_keys[::-1])
        counts.append(found[present] if sign > 0 else found[present][::-1])
        if sign < 0 and zeros:
            keys.append(np.zeros(1, np.int64))
            counts.append(np.array([zeros]))
    if zeros and not len(negative):
        keys.insert(0, np.zeros(1, np.int64))
        counts.insert(0, np.array([zeros]))
    if not keys:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(keys).astype(np.int64), np.concatenate(counts).astype(np.int64)


def integer_square_sum(values: np.ndarray) -> int:
    """The exact sum of int64 ``values``' squares: in uint64 halves below 2**32 (exact for
    magnitudes below 2**32 and fewer than 2**32 values), else in Python integers."""
    magnitude = np.abs(values).astype(np.uint64)  # abs(-2**63) wraps to 2**63: still exact
    if not len(values) or int(magnitude.max()) >= 1 << 32:
        return sum(int(v) * int(v) for v in values.tolist())
    squares = magnitude * magnitude
    high = int((squares >> np.uint64(32)).sum(dtype=np.uint64))
    low = int((squares & np.uint64(0xFFFF_FFFF)).sum(dtype=np.uint64))
    return (high << 32) + low


# Values summed per bincount: below 2**21, sums of 32-bit halves stay exact in float64.
_EXACT_BLOCK = 1 << 20


def exact_sum(values: np.ndarray) -> int | None:
    """The exact sum of non-negative float64 ``values`` in units of 2**-1074 (None if one
    is not finite): the same integer in any order and on any CPU, unlike a float sum,
    whose rounding depends on the order (and the SIMD width) it adds in.

    Each value is ``mantissa * 2**(exponent - 53)`` with a 53-bit integer mantissa; the
    mantissas' 21- and 32-bit halves are summed per exponent by ``bincount`` (float64
    sums of integers that stay below 2**53, hence exact), then shifted into place as
    Python integers.
    """
    if not len(values):
        return 0
    if not np.isfinite(values).all():
        return None
    total = 0
    for start in range(0, len(values), _EXACT_BLOCK):
        fraction, exponent = np.frexp(values[start : start + _EXACT_BLOCK])
        mantissa = np.ldexp(fraction, 53).astype(np.int64)
        low_exponent = int(exponent.min())
        where = exponent - low_exponent
        high = np.bincount(where, (mantissa >> 32).astype(np.float64))
        low = np.bincount(where, (mantissa & 0xFFFF_FFFF).astype(np.float64))
        for offset in np.flatnonzero(high + low):
            units = (int(high[offset]) << 32) + int(low[offset])
            shift = int(offset) + low_exponent - 53 + 1074
            total += units << shift if shift >= 0 else units >> -shift
    return total


def sketch_keys(values: np.ndarray) -> np.ndarray:
    """The quantile sketch's bucket key (int64, ordered as the values) of each finite
    float64 value: the sign, exponent and top ``SKETCH_MANTISSA_BITS`` mantissa bits of its
    bit pattern; 0 for both zeros, negatives below -1."""
    bits = np.ascontiguousarray(values, np.float64).view(np.int64)
    absolute = bits & _ABS_BITS
    magnitude = absolute >> np.int64(_SKETCH_SHIFT)
    return np.where((bits < 0) & (absolute != 0), -magnitude - 1, magnitude)  # -0.0 is 0


def sketch_values(keys: np.ndarray) -> np.ndarray:
    """Each sketch key's value nearest zero (exact for values the bucket holds alone)."""
    keys = np.asarray(keys, np.int64)
    magnitude = np.where(keys < 0, -keys - 1, keys)
    values = (magnitude << np.int64(_SKETCH_SHIFT)).view(np.float64)
    return np.where(keys < 0, -values, values)


def hash_ids(values: np.ndarray) -> np.ndarray:
    """The 64-bit hashes of int64 IDs (a bijection, so equal hashes are equal IDs)."""
    return _splitmix64(values.astype(np.int64, copy=False).view(np.uint64))


class HyperLogLog:
    """A mergeable distinct-count sketch of int64 values (Flajolet et al., 2007).

    Each value is hashed; the top ``HLL_PRECISION`` bits pick a register, which keeps the
    longest run of leading zeros (plus one) seen in the remaining bits. The estimate is
    Ertl's improved estimator ("New cardinality estimation algorithms for HyperLogLog
    sketches", 2017), which needs no empirical bias tables and is unbiased from a handful
    of values up to far beyond any feature's cardinality.
    """

    def __init__(self) -> None:
        self.registers = np.zeros(1 << HLL_PRECISION, dtype=np.uint8)

    def add(self, values: np.ndarray) -> None:
        """Add int64 ``values`` (any order, repeats allowed)."""
        self.add_hashes(hash_ids(values))

    def add_hashes(self, hashed: np.ndarray) -> None:
        """Add values by their ``hash_ids`` hashes (``hashed`` is overwritten)."""
        if hashed.size == 0:
            return
        index = (hashed >> np.uint64(_HLL_SUFFIX_BITS)).astype(np.intp)
        hashed &= np.uint64((1 << _HLL_SUFFIX_BITS) - 1)
        # The suffix has at most 50 bits, so float64 holds it exactly and frexp's exponent
        # is its bit length (0 for 0): leading zeros within the suffix, plus one.
        bit_length = np.frexp(hashed.astype(np.float64))[1]
        rank = (_HLL_SUFFIX_BITS + 1 - bit_length).astype(np.uint8)
        np.maximum.at(self.registers, index, rank)

    def merge(self, other: HyperLogLog) -> None:
        """Make this sketch count the union of both sketches' values."""
        np.maximum(self.registers, other.registers, out=self.registers)

    def estimate(self) -> float:
        """The estimated number of distinct values added."""
        m = self.registers.size
        q = _HLL_SUFFIX_BITS
        counts = np.bincount(self.registers, minlength=q + 2).astype(np.float64)
        z = m * _tau(1.0 - counts[q + 1] / m)
        for k in range(q, 0, -1):
            z = 0.5 * (z + counts[k])
        z += m * _sigma(counts[0] / m)
        return m * m / (2.0 * np.log(2.0) * z)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer (a new array): IDs that are small or sequential still spread
    evenly over all 64 bits, which the register index and the zero runs both rely on.
    In place after the first step, since temporaries dominated its cost."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    shifted = z >> np.uint64(30)
    z ^= shifted
    z *= np.uint64(0xBF58476D1CE4E5B9)
    np.right_shift(z, np.uint64(27), out=shifted)
    z ^= shifted
    z *= np.uint64(0x94D049BB133111EB)
    np.right_shift(z, np.uint64(31), out=shifted)
    z ^= shifted
    return z


def _sigma(x: float) -> float:
    """Ertl's sigma(x) = x + sum_k x**(2**k) * 2**(k-1), the empty-register correction."""
    if x == 1.0:
        return float("inf")
    y, z = 1.0, x
    while True:
        x *= x
        previous, z = z, z + x * y
        y += y
        if z == previous:
            return z


def _tau(x: float) -> float:
    """Ertl's tau(x), the correction for registers that saturated (the zero suffix)."""
    if x in (0.0, 1.0):
        return 0.0
    y, z = 1.0, 1.0 - x
    while True:
        x = np.sqrt(x)
        previous = z
        y *= 0.5
        z -= (1.0 - x) ** 2 * y
        if z == previous:
            return z / 3.0

"""Sparse ID columns to embedding rows: one-hot slots and lists (bags of IDs), cut to a
feature's maximum length, weighted per ID, crossed or bucketized, in the one-hot form
(a row of IDs per sample) or ``KeyedJaggedTensor``'s key-major jagged form.

Every ID of a row group goes to the feature's ``IdMapper`` in one call (``_map``); nulls
are dropped before mapping (a null list or null element is no ID), strings are hashed
first (``ingest.strings``) and a dictionary's entries are mapped once each, the rows
gathering them by index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dlrmflow.features.columns import (
    combined,
    id_valid,
    ids_of,
    is_list,
    offsets_of,
    primitive,
    valid_mask,
)
from dlrmflow.features.dense import bucket_rows
from dlrmflow.features.ids import IdMapper, stable_hash
from dlrmflow.features.spec import FeatureSpec, SparseFeature


def _bags(arr: pa.Array) -> tuple[pa.Array, np.ndarray | None, np.ndarray]:
    """(the IDs of a list array's bags, which of them to keep or None, bag lengths)."""
    offsets = offsets_of(arr)
    start, end = int(offsets[0]), int(offsets[-1])
    # ``values`` is the whole child (a slice sees all of the parent's IDs): cut it to this
    # array's range before touching its buffers.
    child = arr.values.slice(start, end - start)
    lengths = np.diff(offsets)
    keep = id_valid(child)  # null elements are not IDs: drop them from their bags
    lists_valid = valid_mask(arr)
    if lists_valid is not None:
        # Arrow allows a null list to own a non-empty segment; its IDs are in no bag.
        if lengths[~lists_valid].any():
            in_valid_list = np.repeat(lists_valid, lengths)
            keep = in_valid_list if keep is None else keep & in_valid_list
        lengths = lengths * lists_valid
    if keep is not None:
        kept_before = np.zeros(len(keep) + 1, np.int64)
        np.cumsum(keep, out=kept_before[1:])
        rel = offsets - start
        lengths = kept_before[rel[1:]] - kept_before[rel[:-1]]
    return child, keep, lengths


def _truncated(
    lengths: np.ndarray, keep: np.ndarray | None, size: int, max_length: int, last: bool
) -> tuple[np.ndarray | None, np.ndarray]:
    """ListSlice: (which of a list array's ``size`` leaf IDs to keep, the bags' lengths)
    once each bag keeps only its first (``last`` False) or last ``max_length`` kept IDs.

    ``keep`` and ``lengths`` are ``_bags``' (``keep`` None: every leaf ID is kept). Each
    kept ID's rank in its bag is its running position minus its bag's start.
    """
    if not len(lengths) or int(lengths.max()) <= max_length:
        return keep, lengths
    lengths = lengths.astype(np.int64)
    ends = np.cumsum(lengths)
    rank = np.arange(int(ends[-1])) - np.repeat(ends - lengths, lengths)
    # The last N: a rank at least the bag's length minus N.
    floor = np.repeat(lengths - max_length, lengths) if last else None
    chosen = rank >= floor if floor is not None else rank < max_length
    kept = np.arange(size) if keep is None else np.flatnonzero(keep)
    mask = np.zeros(size, np.bool_)
    mask[kept[chosen]] = True
    return mask, np.minimum(lengths, max_length)


def _bag_of(arr: pa.Array, f: SparseFeature) -> tuple[pa.Array, np.ndarray | None, np.ndarray]:
    """(leaf IDs, which of them to keep or None, bag lengths) of one chunk of a feature's
    ID column: a list's bags (``_bags``) cut to ``max_length``, or one-hot slots, each a
    bag of one ID or none."""
    if not is_list(arr.type):
        keep = id_valid(arr)
        return arr, keep, np.ones(len(arr), np.int32) if keep is None else keep
    leaf, keep, lengths = _bags(arr)
    if f.max_length is not None:
        keep, lengths = _truncated(lengths, keep, len(leaf), f.max_length, f.keep == "last")
    return leaf, keep, lengths


def _scalar_ids(arr: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """(an int64 ID per slot of a one-hot ID array, garbage under nulls; which slots hold
    an ID, None: all), dictionaries decoded."""
    if not pa.types.is_dictionary(arr.type):
        return ids_of(arr), id_valid(arr)
    dictionary = ids_of(arr.dictionary)
    if len(dictionary) == 0:
        return np.zeros(len(arr), np.int64), id_valid(arr)
    return dictionary.take(primitive(arr.indices), mode="clip"), id_valid(arr)


def cross_ids(columns: Sequence[np.ndarray]) -> np.ndarray:
    """The raw int64 ID of each row's cross of ``columns`` (int64 IDs, in the cross's
    order): ``h = stable_hash(c0)``, then ``h = stable_hash(c_i + h)`` for each next
    column (wrapping uint64), a bijection of each column given the others, so distinct
    crosses collide only as hashed IDs do. The cross's table then maps it like any ID."""
    hashed = stable_hash(columns[0])
    for ids in columns[1:]:
        hashed = stable_hash((np.asarray(ids, np.int64).view(np.uint64) + hashed).view(np.int64))
    return hashed.view(np.int64)


def _cross(arrays: list[pa.Array]) -> tuple[np.ndarray, np.ndarray | None]:
    """(each row's cross ID, garbage where a crossed ID is null; which rows have every
    crossed ID, None: all)."""
    parts = [_scalar_ids(a) for a in arrays]
    valid = None
    for _, ok in parts:
        if ok is not None:
            valid = ok if valid is None else valid & ok
    return cross_ids([ids for ids, _ in parts]), valid


def _list_weights(ids: pa.Array, weights: pa.Array, keep: np.ndarray | None) -> np.ndarray:
    """The per-ID weights (float32) of ``ids``' leaf IDs that ``keep`` keeps (of the leaf
    slice ``_bags`` cuts; None: all of them), read at the same place of the same row's
    weight list.

    When the weight lists lie exactly as the ID lists do (the same offsets, shifted by
    where each slice starts: as a writer lays out two lists of equal lengths) an ID's
    weight is at its own position plus that shift, so no ID needs its row looked up.
    """
    id_offsets = offsets_of(ids)
    w_offsets = offsets_of(weights)
    leaf = weights.values
    size = int(id_offsets[-1] - id_offsets[0])
    kept = None if keep is None else np.flatnonzero(keep)
    count = size if kept is None else len(kept)
    if len(leaf) == 0:
        return np.zeros(count, np.float32)
    values = primitive(leaf)
    shift = int(w_offsets[0])
    # copy=False: a view of float32 weights, which the caller joins (copies) anyway.
    if np.array_equal(w_offsets - shift, id_offsets - id_offsets[0]):
        if kept is None:
            return values[shift : shift + size].astype(np.float32, copy=False)
        return values.take(kept + shift, mode="clip").astype(np.float32, copy=False)
    if kept is None:
        kept = np.arange(size)
    id_offsets = id_offsets - id_offsets[0]
    rows = np.searchsorted(id_offsets, kept, side="right") - 1
    at = w_offsets[rows] + (kept - id_offsets[rows])
    # clip: ``validate`` has matched the lists' lengths; unvalidated ones stay in bounds.
    return values.take(at, mode="clip").astype(np.float32, copy=False)


@dataclass(frozen=True)
class _Segment:
    """The IDs of one feature in one chunk, ready for the mapper.

    Plain: ``ids`` are the IDs themselves. Dictionary-encoded: ``ids`` is the dictionary
    and ``indices`` the position of each ID in it, so that mapping ``ids`` and gathering
    by ``indices`` gives the rows. ``direct``: ``ids`` are rows already (a bucketized
    column's bucket indices), which the mapper never sees.
    """

    name: str
    ids: np.ndarray
    indices: np.ndarray | None = None
    direct: bool = False

    @property
    def size(self) -> int:
        return len(self.ids) if self.indices is None else len(self.indices)


def _segment(name: str, arr: pa.Array, keep: np.ndarray | None) -> _Segment:
    """The kept IDs of an int64, string or dictionary array (``keep`` None: all of them).

    Strings are hashed first, all of them (nulls too: hashing a slot costs less than
    compacting the strings), and a dictionary's entries only once each.
    """
    if not pa.types.is_dictionary(arr.type):
        ids = ids_of(arr)
        # np.compress, not ids[keep]: boolean indexing is slower on random masks.
        return _Segment(name, ids if keep is None else np.compress(keep, ids))
    indices = primitive(arr.indices)
    if keep is not None:
        indices = np.compress(keep, indices)
    dictionary = ids_of(arr.dictionary)
    if len(dictionary) == 0:
        # No entry, so no slot holds an ID: whatever is mapped here is dropped as null.
        return _Segment(name, np.zeros(len(indices), np.int64))
    if len(dictionary) >= len(indices):
        # A dictionary as large as its uses (unique IDs, or a small slice of a big
        # dictionary): mapping the gathered IDs is less work than mapping the dictionary.
        return _Segment(name, dictionary.take(indices, mode="clip"))
    return _Segment(name, dictionary, indices)


def _map(mapper: IdMapper, segments: list[_Segment]) -> np.ndarray:
    """The rows of every segment, key-major: one mapper call for all that need one."""
    wanted = [s for s in segments if not s.direct]
    if not wanted:
        mapped = np.zeros(0, np.int64)
    else:
        mapped = mapper.map_keyed([s.name for s in wanted], [s.ids for s in wanted])
    return _gather(segments, mapped)


def _gather(segments: list[_Segment], mapped: np.ndarray) -> np.ndarray:
    """The rows of every segment, key-major, from the mapper's output for their ``ids``
    (the segments that are not ``direct``, in order)."""
    if all(s.indices is None and not s.direct for s in segments):
        return mapped  # already in place
    out = np.empty(sum(s.size for s in segments), np.int64)
    src = dst = 0
    for s in segments:
        if s.direct:
            out[dst : dst + s.size] = s.ids
            dst += s.size
            continue
        rows, into = mapped[src : src + len(s.ids)], out[dst : dst + s.size]
        if s.indices is None:
            into[:] = rows
        else:
            # mode="clip" writes into ``out`` directly (mode="raise" buffers); ``validate``
            # rejects out-of-range indices, and unvalidated ones still give rows in range.
            np.take(rows, s.indices, out=into, mode="clip")
        src, dst = src + len(s.ids), dst + s.size
    return out


def one_hot_rows(
    spec: FeatureSpec,
    mapper: IdMapper,
    columns: list[list[pa.Array]],
    sources: Sequence[tuple[int, ...]],
    n: int,
    row_dtype: type,
) -> np.ndarray:
    """Rows [n, n_keys] of one-hot features, sample-major, -1 where the bag is empty.

    Every slot is mapped, nulls included (their garbage is overwritten: dropping them
    first and scattering back would cost more than it saves).
    """
    segments, nulls = [], []
    for k, (f, source) in enumerate(zip(spec.sparse, sources, strict=True)):
        start = k * n
        if f.bucketize is not None:
            rows = bucket_rows(columns[source[0]], n, f.bucketize)
            segments.append(_Segment(f.name, rows, direct=True))
            continue
        if f.cross is not None:
            ids, valid = _cross([combined(columns[i]) for i in source])
            segments.append(_Segment(f.name, ids))
            if valid is not None:
                nulls.append((start, valid))
            continue
        for arr in columns[source[0]]:
            segments.append(_segment(f.name, arr, None))
            valid = id_valid(arr)
            if valid is not None:
                nulls.append((start, valid))
            start += len(arr)
    key_major = _map(mapper, segments)
    for start, valid in nulls:
        # putmask: faster than copyto(where=...) or boolean assignment here.
        np.putmask(key_major[start : start + len(valid)], ~valid, -1)
    rows = np.empty((n, len(spec.sparse)), row_dtype)
    np.copyto(rows, key_major.reshape(len(spec.sparse), n).T, casting="unsafe")
    return rows


def jagged(
    spec: FeatureSpec,
    mapper: IdMapper,
    columns: list[list[pa.Array]],
    sources: Sequence[tuple[int, ...]],
    n: int,
    weighted: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rows, lengths, per-ID weights or None) in the ``KeyedJaggedTensor`` layout:
    key-major, nulls dropped, lists cut to ``max_length``."""
    lengths = np.empty(len(spec.sparse) * n, np.int32)
    segments: list[_Segment] = []
    weights: list[np.ndarray | int] = []  # per segment: its weights, or its size (1s)
    for k, (f, source) in enumerate(zip(spec.sparse, sources, strict=True)):
        bags = lengths[k * n : (k + 1) * n]
        if f.bucketize is not None:
            rows = bucket_rows(columns[source[0]], n, f.bucketize)
            bags[:] = 1
            segments.append(_Segment(f.name, rows, direct=True))
            weights.append(n)
        elif f.cross is not None:
            ids, valid = _cross([combined(columns[i]) for i in source])
            bags[:] = 1 if valid is None else valid
            segments.append(_Segment(f.name, ids if valid is None else np.compress(valid, ids)))
            weights.append(segments[-1].size)
        elif f.weights is not None:
            ids_array, weight_array = (combined(columns[i]) for i in source)
            leaf, keep, bag_lengths = _bag_of(ids_array, f)
            bags[:] = bag_lengths
            segments.append(_segment(f.name, leaf, keep))
            if is_list(ids_array.type):
                weights.append(_list_weights(ids_array, weight_array, keep))
            elif keep is None:
                weights.append(primitive(weight_array).astype(np.float32))
            else:
                weights.append(np.compress(keep, primitive(weight_array)).astype(np.float32))
        else:
            start = 0
            for arr in columns[source[0]]:
                leaf, keep, bag_lengths = _bag_of(arr, f)
                bags[start : start + len(arr)] = bag_lengths
                start += len(arr)
                segments.append(_segment(f.name, leaf, keep))
                weights.append(segments[-1].size)
    values = _map(mapper, segments)
    if not weighted:
        return values, lengths, None
    # One array, each segment's weights (or 1s) written into place.
    joined = np.empty(len(values), np.float32)
    start = 0
    for w in weights:
        size = w if isinstance(w, int) else len(w)
        joined[start : start + size] = 1 if isinstance(w, int) else w
        start += size
    return values, lengths, joined

"""Arrow row group -> ``Batch``: dense transforms, sparse IDs to rows, labels.

The reader transforms each decoded row group (~65k rows) once, as it is decoded, into a
shuffled window (``WindowWriter``), and cuts training batches out of the window as slices:
the compiled path writes each row straight to its place, other layouts gather the
transformed row groups in emission order (``_shuffled``). At that size
numpy's per-call cost is negligible, so the code works column by column on zero-copy
numpy views of the Arrow buffers (validity bitmaps, offsets, values, dictionaries), and
all IDs of a row group go to the mapper in one call. When every ID column is one-hot
(Criteo's layout) the sparse part comes out in ``KeyedJaggedTensor``'s one-hot form, a row
of IDs per sample, which ``take`` gathers cheaply; list columns give the jagged form,
nulls dropped before the IDs are mapped.

Input semantics (``validate`` enforces the types and values, once per row group):

* dense columns: any integer or floating type. With Criteo's transforms (the spec's
  ``dense_transforms`` None) a null or NaN is missing and becomes 0; every other value
  becomes ``log(1 + max(x, 0))`` in float32 (numpy's vectorized ``log1p``). With declared
  ones, each column's null or NaN becomes its ``fill`` and its transform follows
  (``_declared_dense``); they take the numpy path, never the compiled one, whose dense
  loop is Criteo's. A value float32 cannot hold is an error: ±inf, and any magnitude above
  float32's largest (~3.4e38), which the cast would make infinite (a float64 1e300, say;
  no integer is that large). ``validate`` checks it, and so does each transform path on
  its own (the compiled one in its loop), so no path ever hands training an inf.
* sparse columns: int64 or string / large_string (one ID per row; a null is an empty bag,
  length 0) or a list / large_list of them (a bag of IDs; a null list is an empty bag; a
  null element inside a list is not an ID and is dropped, so the bag is shorter, just as
  a one-hot null gives an empty bag). A string becomes an int64 ID by a stable hash of its
  UTF-8 bytes (``ingest.strings.string_ids``, which the dataset's statistics use too) and
  is then mapped like any int64 ID. In all of these the IDs may be dictionary-encoded
  (``dictionary<values=int64 or string, indices=any signed integer>``): then only the
  dictionary's distinct IDs are hashed and mapped and the rows gather them by index, with
  exactly the result of the plain column (a null dictionary entry is a null ID).
* label: integer or bool, exactly 0 or 1, or floating in [0, 1] (soft labels); never null
  or NaN.
* weight (the spec's ``weight``, when declared): any integer or floating type, each value
  finite, >= 0 and within float32's range, never null; it becomes ``Batch.sample_weights``
  (float32).

A ``pa.Table`` may hold several chunks per column, and dictionary chunks may each have
their own dictionary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from dlrmflow.features import jit
from dlrmflow.features.batch import Batch
from dlrmflow.features.ids import IdMapper, stable_hash
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.features.window import WindowWriter, _destinations, _shuffled
from dlrmflow.ingest.strings import is_string, string_ids
from dlrmflow.schema import DenseFeature
from dlrmflow.sparse import KeyedJaggedTensor

_ID_TYPES = "int64 or string IDs, or lists of them (optionally dictionary-encoded)"
# Rows of a row group whose dense values are clamped, logged and placed at a time: 8192
# rows of 13 features are 416 KiB, which stay in the core's cache between the steps.
_DENSE_SLICE = 8192
# The largest float32; a dense value of greater magnitude would become ±inf in float32.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _log1p(values: np.ndarray) -> None:
    """The dense features' log, in place on float32 values >= 0.

    numpy's float32 ``log1p`` is vectorized, and it gives every element the same result
    wherever it sits in the array (checked: slices at every offset, strided rows), so
    the compiled path, which logs a row group a slice at a time, and the vectorized path,
    which logs a whole table, agree bitwise.
    """
    np.log1p(values, out=values)


def _dense_type_ok(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _check_dense_range(name: str, chunks: Sequence[pa.Array]) -> None:
    """Raise ``ValueError`` if a dense column (its ``chunks``) holds a value float32 cannot.

    Only floating columns can (an int64 is below 1e19). The common case costs a NaN-
    skipping min and max over each chunk's raw values (Arrow's null-aware min/max is much
    slower). Those include whatever lies under nulls, so a bound out of range is looked at
    again with the nulls left out.
    """
    if not chunks or not pa.types.is_floating(chunks[0].type):
        return
    for chunk in chunks:
        values = _primitive(chunk)
        # As Python floats: numpy would compare a float16 with the bound cast to float16.
        if len(values) and (
            float(np.fmax.reduce(values)) > _FLOAT32_MAX
            or float(np.fmin.reduce(values)) < -_FLOAT32_MAX
        ):
            count, example = _beyond_float32(pa.chunked_array(chunks))
            if count:
                raise _range_error(name, count, example)
            return  # only values under nulls were out of range


def _failing(
    col: pa.Array | pa.ChunkedArray, bad: Callable[[pa.ChunkedArray], pa.ChunkedArray]
) -> tuple[int, float | None]:
    """How many values of a numeric column ``bad`` marks (given them as float64: exact, and
    Arrow has no float16 abs or compare), and the first of them."""
    wide = col.cast(pa.float64())
    marked = bad(wide)
    count = pc.sum(marked).as_py() or 0
    return count, pc.filter(wide, marked)[0].as_py() if count else None


def _beyond_float32(col: pa.Array | pa.ChunkedArray) -> tuple[int, float | None]:
    """How many values of a floating column float32 cannot hold, nulls and NaN aside, and
    the first of them (the rare path, once a bound is out of range)."""
    return _failing(col, lambda wide: pc.greater(pc.abs(wide), _FLOAT32_MAX))


def _range_error(name: str, count: int, example: float | None) -> ValueError:
    return ValueError(
        f"column {name}: {count} value(s) infinite or beyond float32's range "
        f"(e.g. {example!r}); dense values must be finite and within ±{_FLOAT32_MAX:.8g}"
    )


def _float32_or_none(value: float | None) -> np.float32 | None:
    return None if value is None else np.float32(value)


def _check_transform_range(t: DenseFeature) -> None:
    """A declared fill, clip bound, mean, deviation or boundary must be a float32, or it
    would hand training an inf."""
    values = [("fill", t.fill), ("clip_min", t.clip_min), ("clip_max", t.clip_max)]
    values += [("mean", t.mean), ("std", t.std)]
    values += [("boundaries", b) for b in t.boundaries or ()]
    for what, value in values:
        if value is not None and abs(value) > _FLOAT32_MAX:
            raise ValueError(
                f"column {t.column}: {what} {value!r} is beyond float32's range "
                f"(±{_FLOAT32_MAX:.8g})"
            )


def _declared_dense(
    columns: list[list[pa.Array]], n: int, transforms: Sequence[DenseFeature]
) -> np.ndarray:
    """Feature-major [columns, n] float32 dense features by each column's declared transform.

    Each value is cast to float32 first (values beyond its range were refused before), a
    null or NaN becomes the column's ``fill``, then ``log`` is ``log1p(max(x, 0))`` (the
    same ops as Criteo's path), ``clip`` is ``min(max(x, clip_min), clip_max)`` with
    float32 bounds, ``standardize`` is ``(x - mean) / std`` in float32 (``std`` 0 taken
    as 1: the column is only centred) and ``none`` leaves the value as it is. Every step
    works element by element, so the result does not depend on how the rows are chunked.
    """
    out = np.empty((len(columns), n), np.float32)
    for block, chunks, t in zip(out, columns, transforms, strict=True):
        _filled(chunks, block, t.fill)
        if t.transform == "log":
            np.fmax(block, np.float32(0), out=block)
            _log1p(block)
        elif t.transform == "clip":
            low, high = _float32_or_none(t.clip_min), _float32_or_none(t.clip_max)
            np.minimum(np.maximum(block, low, out=block), high, out=block)
        elif t.transform == "standardize":
            np.subtract(block, np.float32(t.mean), out=block)
            np.divide(block, np.float32(t.std or 1.0), out=block)
    return out


def _check_weights(name: str, col: pa.ChunkedArray) -> None:
    """Raise ``ValueError`` naming the weight column ``name`` if a weight is null, negative,
    NaN, infinite or beyond float32's range (each would scale a loss by nonsense)."""
    if col.null_count:
        raise ValueError(f"column {name}: {col.null_count} null weight(s)")
    if len(col) == 0:
        return
    if pa.types.is_integer(col.type):
        low = pc.min(col).as_py()
        if low < 0:
            count = pc.sum(pc.less(col, 0)).as_py()
            raise ValueError(f"column {name}: {count} negative weight(s) (e.g. {low!r})")
        return
    # A comparison with NaN is false, so NaN is among the bad ones.
    count, example = _failing(
        col,
        lambda wide: pc.invert(
            pc.and_(pc.greater_equal(wide, 0.0), pc.less_equal(wide, _FLOAT32_MAX))
        ),
    )
    if count:
        raise ValueError(
            f"column {name}: {count} weight(s) negative, NaN, infinite or beyond float32's "
            f"range (e.g. {example!r}); weights must be finite and >= 0"
        )


def _weights(chunks: list[pa.Array]) -> np.ndarray:
    """A weight column's values as float32 (``validate`` has refused nulls and bad values)."""
    out = np.empty(sum(len(a) for a in chunks), np.float32)
    start = 0
    for arr in chunks:
        with np.errstate(over="ignore", invalid="ignore"):  # unvalidated garbage stays quiet
            np.copyto(out[start : start + len(arr)], _primitive(arr), casting="unsafe")
        start += len(arr)
    return out


def _label_type_ok(t: pa.DataType) -> bool:
    return _dense_type_ok(t) or pa.types.is_boolean(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_plain_id(t: pa.DataType) -> bool:
    return t == pa.int64() or is_string(t)


def _is_id(t: pa.DataType) -> bool:
    """int64 or string, or such values behind signed dictionary indices."""
    if pa.types.is_dictionary(t):
        return _is_plain_id(t.value_type) and pa.types.is_signed_integer(t.index_type)
    return _is_plain_id(t)


def _id_type_ok(t: pa.DataType) -> bool:
    return _is_id(t) or (_is_list(t) and _is_id(t.value_type))


def _chunks(column: pa.Array | pa.ChunkedArray) -> list[pa.Array]:
    return column.chunks if isinstance(column, pa.ChunkedArray) else [column]


def _aligned(columns: list[list[pa.Array]]) -> list[int] | None:
    """The chunk lengths every column shares (a row group, or a concatenation of row
    groups, has them), or None when they differ or there are no columns."""
    if not columns:
        return None
    lengths = [len(a) for a in columns[0]]
    for col in columns[1:]:
        if [len(a) for a in col] != lengths:
            return None
    return lengths


def _valid(arr: pa.Array) -> np.ndarray | None:
    """A bool per slot (True = not null), or None when the array has no nulls."""
    if arr.null_count == 0:
        return None
    # Unpack only this slice's bytes: a sliced array starts deep inside its bitmap.
    first = arr.offset // 8
    skip = arr.offset - 8 * first
    bits = np.frombuffer(arr.buffers()[0], np.uint8, count=(skip + len(arr) + 7) // 8, offset=first)
    valid = np.unpackbits(bits, count=skip + len(arr), bitorder="little")
    return valid[skip:].view(np.bool_)


def _primitive(arr: pa.Array) -> np.ndarray:
    """Zero-copy numpy view of a fixed-width array's values (garbage under nulls)."""
    dtype = np.dtype(arr.type.to_pandas_dtype())
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:
        return np.zeros(len(arr), dtype)
    return np.frombuffer(buf, dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _ids_of(arr: pa.Array) -> np.ndarray:
    """The int64 IDs of a plain (not dictionary) ID array, garbage under nulls: a view of
    an int64 array's values, or a string array's strings hashed (``string_ids``)."""
    return string_ids(arr) if is_string(arr.type) else _primitive(arr)


def _bools(arr: pa.Array) -> np.ndarray:
    """A boolean array's values as uint8 0/1 (Arrow packs them into bits)."""
    first = arr.offset // 8
    skip = arr.offset - 8 * first
    bits = np.frombuffer(arr.buffers()[1], np.uint8, count=(skip + len(arr) + 7) // 8, offset=first)
    return np.unpackbits(bits, count=skip + len(arr), bitorder="little")[skip:]


def _label_values(arr: pa.Array) -> np.ndarray:
    """A label array's values as numpy (bools unpacked to 0/1), in its own dtype."""
    return _bools(arr) if pa.types.is_boolean(arr.type) else _primitive(arr)


def _id_valid(arr: pa.Array) -> np.ndarray | None:
    """Which slots of an int64 or dictionary array hold an ID (None: all of them)."""
    if not pa.types.is_dictionary(arr.type):
        return _valid(arr)
    valid = _valid(arr.indices)
    entry_valid = _valid(arr.dictionary)
    if entry_valid is None:
        return valid
    # A null dictionary entry is a null ID. Indices under null slots are undefined, hence
    # the clip; those slots are dropped by ``valid`` anyway.
    uses_valid = entry_valid.take(_primitive(arr.indices), mode="clip")
    return uses_valid if valid is None else valid & uses_valid


def _offsets(arr: pa.Array) -> np.ndarray:
    """A list array's offsets (``len(arr) + 1`` of them), a zero-copy view."""
    off_dtype = np.dtype(np.int64 if pa.types.is_large_list(arr.type) else np.int32)
    return np.frombuffer(
        arr.buffers()[1], off_dtype, count=len(arr) + 1, offset=arr.offset * off_dtype.itemsize
    )


def _bags(arr: pa.Array) -> tuple[pa.Array, np.ndarray | None, np.ndarray]:
    """(the IDs of a list array's bags, which of them to keep or None, bag lengths)."""
    offsets = _offsets(arr)
    start, end = int(offsets[0]), int(offsets[-1])
    # ``values`` is the whole child (a slice sees all of the parent's IDs): cut it to this
    # array's range before touching its buffers.
    child = arr.values.slice(start, end - start)
    lengths = np.diff(offsets)
    keep = _id_valid(child)  # null elements are not IDs: drop them from their bags
    lists_valid = _valid(arr)
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
    if not _is_list(arr.type):
        keep = _id_valid(arr)
        return arr, keep, np.ones(len(arr), np.int32) if keep is None else keep
    leaf, keep, lengths = _bags(arr)
    if f.max_length is not None:
        keep, lengths = _truncated(lengths, keep, len(leaf), f.max_length, f.keep == "last")
    return leaf, keep, lengths


def _check_id_weights(
    name: str, column: str, ids: pa.ChunkedArray, weights: pa.ChunkedArray
) -> None:
    """Raise ``ValueError`` naming the weight ``column`` if feature ``name``'s per-ID
    weights do not line up with its IDs (a list of another length, a missing weight beside
    an ID) or are null, NaN, infinite or beyond float32's range."""
    if _is_list(ids.type) and _id_weights_fine(ids, weights):
        return
    if _is_list(ids.type):
        id_lengths = pc.fill_null(pc.list_value_length(ids), 0)
        weight_lengths = pc.fill_null(pc.list_value_length(weights), 0)
        differ = pc.not_equal(id_lengths, weight_lengths)
        count = pc.sum(differ).as_py() or 0
        if count:
            row = pc.index(differ, True).as_py()
            raise ValueError(
                f"column {column}: {count} row(s) whose weights are not as many as feature "
                f"{name}'s IDs (e.g. row {row}: {id_lengths[row].as_py()} IDs, "
                f"{weight_lengths[row].as_py()} weights)"
            )
        values = pc.list_flatten(weights)
    else:
        values = pc.filter(weights, pc.is_valid(ids))
    if values.null_count:
        raise ValueError(f"column {column}: {values.null_count} null weight(s) of {name}'s IDs")
    if not pa.types.is_floating(values.type) or len(values) == 0:
        return
    # NaN compares false, so it is among the bad ones.
    count, example = _failing(
        values, lambda wide: pc.invert(pc.less_equal(pc.abs(wide), _FLOAT32_MAX))
    )
    if count:
        raise ValueError(
            f"column {column}: {count} weight(s) of {name}'s IDs NaN, infinite or beyond "
            f"float32's range (e.g. {example!r})"
        )


def _id_weights_fine(ids: pa.ChunkedArray, weights: pa.ChunkedArray) -> bool:
    """Whether list weights certainly pass ``_check_id_weights``, found on the buffers: True
    when each chunk's weight lists lie exactly as its ID lists (offsets, shifted, and
    nulls alike) and no weight in their range is null or beyond float32's range. False
    leaves the verdict, and its message, to the exact check.

    The layout a writer gives lists of equal lengths; it costs a comparison of offsets
    and one pass over the weights, where the exact check builds lengths and a float64
    copy of every weight.
    """
    if [len(c) for c in ids.chunks] != [len(c) for c in weights.chunks]:
        return False
    for id_chunk, weight_chunk in zip(ids.chunks, weights.chunks, strict=True):
        id_offsets, weight_offsets = _offsets(id_chunk), _offsets(weight_chunk)
        if not np.array_equal(id_offsets - id_offsets[0], weight_offsets - weight_offsets[0]):
            return False
        valid, id_valid = _valid(weight_chunk), _valid(id_chunk)
        if (valid is None) != (id_valid is None):
            return False
        if valid is not None and not np.array_equal(valid, id_valid):
            return False
        # Every weight of the chunk's range, those of null lists too (which the exact check
        # leaves out): all fine, then so are the ones it looks at.
        first = int(weight_offsets[0])
        values = weight_chunk.values.slice(first, int(weight_offsets[-1]) - first)
        if values.null_count:
            return False
        if pa.types.is_floating(values.type) and len(values):
            numbers = _primitive(values)
            if pa.types.is_float64(values.type):
                if not bool((np.abs(numbers) <= _FLOAT32_MAX).all()):
                    return False
            elif not bool(np.isfinite(numbers).all()):  # float16 and float32 are in range
                return False
    return True


def _combined(chunks: list[pa.Array]) -> pa.Array:
    """One array of a column's chunks (dictionaries unified), so that several columns'
    rows line up whatever their chunking."""
    if len(chunks) == 1:
        return chunks[0]
    return pa.chunked_array(chunks).combine_chunks()


def _scalar_ids(arr: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """(an int64 ID per slot of a one-hot ID array, garbage under nulls; which slots hold
    an ID, None: all), dictionaries decoded."""
    if not pa.types.is_dictionary(arr.type):
        return _ids_of(arr), _id_valid(arr)
    dictionary = _ids_of(arr.dictionary)
    if len(dictionary) == 0:
        return np.zeros(len(arr), np.int64), _id_valid(arr)
    return dictionary.take(_primitive(arr.indices), mode="clip"), _id_valid(arr)


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


def _filled(chunks: list[pa.Array], out: np.ndarray, fill: float) -> None:
    """A dense column's values into float32 ``out``, each null or NaN as ``fill``."""
    start = 0
    for arr in chunks:
        part = out[start : start + len(arr)]
        start += len(arr)
        # Garbage under a null may overflow the cast: quietly, it is replaced below.
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(part, _primitive(arr), casting="unsafe")
        missing = np.isnan(part)
        valid = _valid(arr)
        if valid is not None:
            missing |= ~valid
        np.putmask(part, missing, np.float32(fill))


def _bucket_rows(chunks: list[pa.Array], n: int, d: DenseFeature) -> np.ndarray:
    """Bucketize: each value's bucket, ``i`` with ``boundaries[i-1] <= x < boundaries[i]``,
    compared as float32 (the value after the fill, as every dense transform takes it)."""
    values = np.empty(n, np.float32)
    _filled(chunks, values, d.fill)
    boundaries = np.asarray(d.boundaries, np.float32)
    return np.searchsorted(boundaries, values, side="right").astype(np.int64)


def _list_weights(ids: pa.Array, weights: pa.Array, keep: np.ndarray | None) -> np.ndarray:
    """The per-ID weights (float32) of ``ids``' leaf IDs that ``keep`` keeps (of the leaf
    slice ``_bags`` cuts; None: all of them), read at the same place of the same row's
    weight list.

    When the weight lists lie exactly as the ID lists do (the same offsets, shifted by
    where each slice starts: as a writer lays out two lists of equal lengths) an ID's
    weight is at its own position plus that shift, so no ID needs its row looked up.
    """
    id_offsets = _offsets(ids)
    w_offsets = _offsets(weights)
    leaf = weights.values
    size = int(id_offsets[-1] - id_offsets[0])
    kept = None if keep is None else np.flatnonzero(keep)
    count = size if kept is None else len(kept)
    if len(leaf) == 0:
        return np.zeros(count, np.float32)
    values = _primitive(leaf)
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
        ids = _ids_of(arr)
        # np.compress, not ids[keep]: boolean indexing is slower on random masks.
        return _Segment(name, ids if keep is None else np.compress(keep, ids))
    indices = _primitive(arr.indices)
    if keep is not None:
        indices = np.compress(keep, indices)
    dictionary = _ids_of(arr.dictionary)
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


@dataclass(frozen=True)
class _Layout:
    """Where the spec's columns sit in one input schema, worked out once per schema."""

    schema: pa.Schema
    label: int
    weight: int | None  # the weight column, if the spec has one
    dense: tuple[int, ...]
    sparse: tuple[int, ...]  # each sparse feature's first column (its IDs, when plain)
    sources: tuple[tuple[int, ...], ...]  # each sparse feature's columns (``columns``)
    used: tuple[int, ...]  # every column above
    # No ID column is a list and no feature has per-ID weights: the sample-major one-hot
    # form (crosses and bucketized columns have a row, or none, a sample).
    one_hot: bool
    dense_one_type: bool  # dense columns can be concatenated into one array
    # The compiled path applies: one-hot plain int64 or string IDs (hashed to int64
    # first) and no cross, bucketized column or per-ID weights, a mapper with
    # ``map_one_hot``, Criteo's dense transform (``dense_transforms`` None) over columns of
    # one type numba handles (not float16), and no float16 label or weight.
    compiled: bool


@dataclass(frozen=True)
class _Rows:
    """The compiled path's output arrays, sample-major."""

    ids: np.ndarray  # [n, sparse keys], int32 or int64; -1 where the ID is null
    dense: np.ndarray  # [n, dense columns] float32: log1p(max(x, 0)), nulls and NaN as 0
    labels: np.ndarray  # [n] float32
    weights: np.ndarray | None  # [n] float32, where the spec has a weight column


@dataclass(frozen=True)
class _Checks:
    """What ``validate`` looks at in tables of one schema (whose types passed): the
    floating dense (and bucketized) columns (only they can hold values float32 cannot),
    the label, the sparse columns with dictionary-encoded IDs (only their indices can be
    out of range), as (name, position), the weight column and each per-ID weight column
    beside its IDs, as (feature, weight column, IDs' position, weights' position)."""

    schema: pa.Schema
    floating: tuple[tuple[str, int], ...]
    label: int
    dictionary: tuple[tuple[str, int], ...]
    weight: int | None
    id_weights: tuple[tuple[str, str, int, int], ...]

    @classmethod
    def of(cls, schema: pa.Schema, spec: FeatureSpec) -> _Checks:
        def leaf(t: pa.DataType) -> pa.DataType:
            return t.value_type if _is_list(t) else t

        def where(
            names: Sequence[str], keep: Callable[[pa.DataType], bool]
        ) -> tuple[tuple[str, int], ...]:
            found = ((name, schema.get_field_index(name)) for name in names)
            return tuple((name, i) for name, i in found if keep(schema.field(i).type))

        bucketized = [f.bucketize.column for f in spec.sparse if f.bucketize is not None]
        id_columns = [f.name for f in spec.sparse if f.cross is None and f.bucketize is None]
        return cls(
            schema=schema,
            floating=where([*spec.dense, *bucketized], pa.types.is_floating),
            label=schema.get_field_index(spec.label),
            dictionary=where(id_columns, lambda t: pa.types.is_dictionary(leaf(t))),
            weight=None if spec.weight is None else schema.get_field_index(spec.weight),
            id_weights=tuple(
                (
                    f.name,
                    f.weights,
                    schema.get_field_index(f.name),
                    schema.get_field_index(f.weights),
                )
                for f in spec.sparse
                if f.weights is not None
            ),
        )


class BatchTransform:
    """Turns Arrow tables or record batches of the spec's columns into ``Batch`` tensors.

    ``ids`` maps raw IDs to rows (``HashIds``, ``Vocabulary`` or both, ``FeatureIds``);
    its table sizes must be the spec's, so that every row it produces indexes the model's
    tables. A bucketized column's rows are its buckets: the mapper never sees them.
    """

    def __init__(self, spec: FeatureSpec, ids: IdMapper) -> None:
        for f in spec.sparse:
            if f.bucketize is not None:
                _check_transform_range(f.bucketize)
                continue
            n = ids.num_embeddings(f.name)
            if n != f.num_embeddings:
                raise ValueError(
                    f"feature {f.name}: the ID mapper has {n} rows but the spec's table has "
                    f"{f.num_embeddings}"
                )
        for t in spec.dense_transforms or ():
            _check_transform_range(t)
        self.spec = spec
        self.ids = ids
        self._names = spec.sparse_names
        # One-hot rows are stored as int32 when every row fits: half the bytes for the
        # reader to concatenate and gather.
        fits = all(f.num_embeddings <= 2**31 for f in spec.sparse)
        self._row_dtype = np.int32 if fits else np.int64
        # Replaced whole, never mutated, so concurrent calls (a thread-pool mapper) always
        # see one consistent layout.
        self._layout: _Layout | None = None
        # The checks of the last schema whose types passed, replaced whole like
        # ``_layout``: the readers validate every row group, and nearly all share one
        # schema.
        self._checks: _Checks | None = None
        # Per-ID weights travel as the KeyedJaggedTensor's: one a value, 1 where unweighted.
        self._weighted = any(f.weights is not None for f in spec.sparse)

    def validate(self, table: pa.Table) -> None:
        """Raise ``ValueError`` naming the column if ``table`` cannot be transformed.

        Checks types (schema drift), dense values float32 cannot hold (±inf, or beyond its
        range), non-0/1 or null labels, weights that are null, negative, NaN or beyond
        float32's range, per-ID weights that are null, not finite or not as many as their
        row's IDs, and dictionary indices outside their dictionary. It costs one pass over
        the label, the weights, floating dense columns and dictionary indices, nothing for
        plain IDs.
        """
        checks = self._checks
        if checks is None or not table.schema.equals(checks.schema):
            self._check_types(table.schema)
            checks = self._checks = _Checks.of(table.schema, self.spec)
        # Only the columns whose type can hold a bad value are looked at (by position: a
        # lookup by name is not free, and a row group paid it 40 times).
        for name, i in checks.floating:
            _check_dense_range(name, table.column(i).chunks)
        self._check_labels(table.column(checks.label))
        if checks.weight is not None:
            _check_weights(self.spec.weight, table.column(checks.weight))
        for name, i in checks.dictionary:
            self._check_indices(name, table.column(i))
        for name, column, ids, weights in checks.id_weights:
            _check_id_weights(name, column, table.column(ids), table.column(weights))

    def __call__(self, data: pa.Table | pa.RecordBatch) -> Batch:
        """The tensors of ``data`` (which ``validate`` has passed).

        Types are checked here too (once per schema), so unvalidated input can give wrong
        values but never a crash deep in numpy or a row outside its table.
        """
        return self._batch(data)

    def _batch(self, data: pa.Table | pa.RecordBatch, contiguous: bool = True) -> Batch:
        """``self(data)``; with ``contiguous`` False, its dense features may be a transposed
        view of feature-major memory, for a caller that copies them anyway (the window
        places each row): the transpose is then no pass of its own."""
        layout, columns, lengths = self._read(data)
        n = data.num_rows
        if n == 0:
            return self._empty()
        if lengths is not None:
            return self._compiled(columns, layout, lengths, np.arange(n))
        if layout.one_hot:
            rows = self._one_hot(columns, layout, n)
            sparse = KeyedJaggedTensor.from_one_hot(list(self._names), torch.from_numpy(rows))
        else:
            values, lengths, weights = self._jagged(columns, layout, n)
            sparse = KeyedJaggedTensor(
                list(self._names),
                torch.from_numpy(values),
                torch.from_numpy(lengths),
                None if weights is None else torch.from_numpy(weights),
            )
        for f, sources in zip(self.spec.sparse, layout.sources, strict=True):
            if f.bucketize is not None:
                _check_dense_range(f.bucketize.column, columns[sources[0]])
        dense_columns = [columns[i] for i in layout.dense]
        for name, chunks in zip(self.spec.dense, dense_columns, strict=True):
            _check_dense_range(name, chunks)
        if self.spec.dense_transforms is None:
            dense = self._dense(dense_columns, n, layout.dense_one_type)
        else:
            dense = _declared_dense(dense_columns, n, self.spec.dense_transforms)
        # numpy transposes this shape much faster than torch's .t().contiguous().
        return Batch(
            dense=torch.from_numpy(np.ascontiguousarray(dense.T) if contiguous else dense.T),
            sparse=sparse,
            labels=torch.from_numpy(self._labels(columns[layout.label])),
            sample_weights=None
            if layout.weight is None
            else torch.from_numpy(_weights(columns[layout.weight])),
        )

    def window(self, tables: Sequence[pa.Table], order: np.ndarray) -> Batch:
        """``Batch.concat([self(t) for t in tables]).take(order)``, in one pass where it can.

        The reader's shuffle: row ``j`` of the result is row ``order[j]`` of the tables
        one after another (``order`` is a permutation of their rows). On the compiled path
        every row is written straight to its place, so neither the concatenation nor the
        gather costs a pass of its own, and the batches cut from the result are views.
        Other layouts transform each table, then write its rows and bags to their places
        (``_shuffled``).
        """
        n = sum(t.num_rows for t in tables)
        order, dest = _destinations(order, n)
        try:
            table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        except pa.ArrowInvalid:  # schemas differ: transformed one by one below
            table = None
        if table is not None and n:
            layout, columns, lengths = self._read(table)
            if lengths is not None:
                return self._compiled(columns, layout, lengths, dest)
        return _shuffled([self(t) for t in tables], order)

    def window_writer(self, order: np.ndarray, dest: np.ndarray | None = None) -> WindowWriter:
        """A ``WindowWriter`` for ``window(tables, order)``: the same ``Batch``, built as
        the tables arrive (``add`` them in window order, then ``finish``).

        ``dest``, ``order``'s inverse, saves computing it where the caller has it (the
        reader's deal writes both); it is taken as given, not checked.
        """
        return WindowWriter(self, order, dest)

    def dictionary_columns(self, schema: pa.Schema) -> list[str]:
        """The string ID columns of ``schema`` (a file's) that this transform takes best as
        dictionaries, for a reader to decode them so (``pq.ParquetFile``'s
        ``read_dictionary``): then only each distinct string is hashed and mapped.

        None where the compiled path takes the schema (it hashes plain strings straight
        into place, and a dictionary would turn it off), nor for a schema the transform
        refuses (``validate`` names what is wrong).
        """
        try:
            layout = self._plan(schema)
        except ValueError:
            return []
        if layout.compiled:
            return []
        ids = [c for f in self.spec.sparse if f.bucketize is None for c in f.cross or (f.name,)]
        return [name for name in dict.fromkeys(ids) if is_string(schema.field(name).type)]

    def _read(
        self, data: pa.Table | pa.RecordBatch
    ) -> tuple[_Layout, list[list[pa.Array]], list[int] | None]:
        """``data``'s layout, its columns' chunks, and the chunk lengths when the compiled
        path applies (its columns are chunked alike), else None."""
        layout = self._layout_of(data.schema)
        columns = [_chunks(c) for c in data.columns]  # one call; no lookup by name per column
        lengths = _aligned([columns[i] for i in layout.used]) if layout.compiled else None
        return layout, columns, lengths

    def _layout_of(self, schema: pa.Schema) -> _Layout:
        layout = self._layout
        if layout is None or not schema.equals(layout.schema):
            layout = self._layout = self._plan(schema)
        return layout

    def _compiled(
        self, columns: list[list[pa.Array]], layout: _Layout, lengths: list[int], dest: np.ndarray
    ) -> Batch:
        """The compiled path: each chunk's row ``i`` goes to row ``dest[i]`` of the batch."""
        out = self._allocate(len(dest), layout)
        self._write(columns, layout, lengths, dest, out)
        return self._finish(out)

    def _allocate(self, n: int, layout: _Layout) -> _Rows:
        return _Rows(
            ids=np.empty((n, len(layout.sparse)), self._row_dtype),
            dense=np.empty((n, len(layout.dense)), np.float32),
            labels=np.empty(n, np.float32),
            weights=None if layout.weight is None else np.empty(n, np.float32),
        )

    def _write(
        self,
        columns: list[list[pa.Array]],
        layout: _Layout,
        lengths: list[int],
        dest: np.ndarray,
        out: _Rows,
    ) -> None:
        """Row ``i`` of the chunks (one after another) into row ``dest[i]`` of ``out``.

        The sparse IDs are hashed, marked where null and placed in one pass; the dense
        values are clamped, logged and placed a slice at a time; see ``jit``.
        """
        start = 0
        for c, size in enumerate(lengths):
            at = dest[start : start + size]
            start += size
            ids = [columns[i][c] for i in layout.sparse]
            valid = [_valid(a) for a in ids]
            self.ids.map_one_hot(self._names, [_ids_of(a) for a in ids], valid, out.ids, at)
            values = [columns[i][c] for i in layout.dense]
            frozen = tuple(jit.frozen(_primitive(a)) for a in values)
            masks = jit.masks([_valid(a) for a in values])
            # Floating columns are checked for values float32 cannot hold in the clamp's
            # own loop (integers never are such values).
            limit = _FLOAT32_MAX if pa.types.is_floating(values[0].type) else np.inf
            out_of_range = np.zeros(len(values), np.int64)
            # Clamped, logged and placed a slice at a time, so that the log reads values
            # still in the core's cache rather than the whole window from memory after.
            scratch = np.empty((len(values), min(size, _DENSE_SLICE)), np.float32)
            for first in range(0, size, _DENSE_SLICE):
                part = scratch[:, : min(_DENSE_SLICE, size - first)]
                jit.clamp_columns(frozen, masks, first, part, limit, out_of_range)
                _log1p(part)
                jit.scatter_rows(part, out.dense, at[first:])
            if out_of_range.any():
                k = int(np.flatnonzero(out_of_range)[0])
                _, example = _beyond_float32(values[k])
                raise _range_error(self.spec.dense[k], int(out_of_range[k]), example)
            labels = _label_values(columns[layout.label][c])
            jit.scatter_rows(labels.reshape(1, -1), out.labels.reshape(-1, 1), at)
            if out.weights is not None:
                assert layout.weight is not None
                weights = _primitive(columns[layout.weight][c])
                jit.scatter_rows(weights.reshape(1, -1), out.weights.reshape(-1, 1), at)

    def _finish(self, out: _Rows) -> Batch:
        return Batch(
            dense=torch.from_numpy(out.dense),
            sparse=KeyedJaggedTensor.from_one_hot(list(self._names), torch.from_numpy(out.ids)),
            labels=torch.from_numpy(out.labels),
            sample_weights=None if out.weights is None else torch.from_numpy(out.weights),
        )

    def _plan(self, schema: pa.Schema) -> _Layout:
        self._check_types(schema)
        spec = self.spec
        label = schema.get_field_index(spec.label)
        weight = None if spec.weight is None else schema.get_field_index(spec.weight)
        dense = tuple(schema.get_field_index(name) for name in spec.dense)
        sources = tuple(tuple(schema.get_field_index(c) for c in f.columns) for f in spec.sparse)
        sparse = tuple(s[0] for s in sources)
        one_hot = not self._weighted and not any(
            _is_list(schema.field(s[0]).type)
            for f, s in zip(spec.sparse, sources, strict=True)
            if f.cross is None and f.bucketize is None
        )
        dense_types = {schema.field(i).type for i in dense}
        used = [label] if weight is None else [label, weight]
        used += dense
        used += [i for s in sources for i in s if i not in used]
        compiled = (
            one_hot
            and spec.plain_sparse
            # Its dense loop is Criteo's transform; declared ones take the numpy path.
            and self.spec.dense_transforms is None
            and hasattr(self.ids, "map_one_hot")
            and bool(dense)
            and bool(sparse)
            and not any(pa.types.is_dictionary(schema.field(i).type) for i in sparse)
            and len(dense_types) == 1
            and not pa.types.is_float16(next(iter(dense_types)))
            and not pa.types.is_float16(schema.field(label).type)
            and (weight is None or not pa.types.is_float16(schema.field(weight).type))
        )
        return _Layout(
            schema=schema,
            label=label,
            weight=weight,
            dense=dense,
            sparse=sparse,
            sources=sources,
            used=tuple(used),
            one_hot=one_hot,
            dense_one_type=len(dense_types) == 1,
            compiled=compiled,
        )

    def _empty(self) -> Batch:
        return Batch(
            dense=torch.zeros(0, len(self.spec.dense)),
            sparse=KeyedJaggedTensor(
                keys=list(self._names),
                values=torch.zeros(0, dtype=torch.int64),
                lengths=torch.zeros(0, dtype=torch.int32),
                weights=torch.zeros(0) if self._weighted else None,
            ),
            labels=torch.zeros(0),
            sample_weights=None if self.spec.weight is None else torch.zeros(0),
        )

    @staticmethod
    def _dense(columns: list[list[pa.Array]], n: int, one_type: bool) -> np.ndarray:
        """Feature-major [columns, n] float32: ``log(1 + max(x, 0))``, nulls and NaN as 0."""
        # Feature-major so each column is written contiguously; one transpose at the end
        # (``_batch``) is cheaper than strided writes. When all columns share a type, one
        # C++ concatenation replaces a round of numpy calls per column and chunk.
        out = np.empty((len(columns), n), np.float32)
        if one_type:
            blocks = [(out.reshape(-1), pa.concat_arrays([a for col in columns for a in col]))]
        else:
            blocks = list(zip(out, (pa.concat_arrays(col) for col in columns), strict=True))
        for block, arr in blocks:
            valid = _valid(arr)
            # Garbage under a null may overflow the cast or be inf (values are checked
            # before, nulls aside): quietly, since it is masked right after.
            with np.errstate(over="ignore", invalid="ignore"):
                np.copyto(block, _primitive(arr), casting="unsafe")
                if valid is not None:
                    # Multiplying by 0 turns a garbage NaN/inf under a null into NaN, which
                    # the fmax below maps to 0 like every other NaN. uint8: a faster loop
                    # than bool.
                    np.multiply(block, valid.view(np.uint8), out=block)
        np.fmax(out, np.float32(0), out=out)  # fmax, not maximum: NaN -> 0
        _log1p(out)
        return out

    def _one_hot(self, columns: list[list[pa.Array]], layout: _Layout, n: int) -> np.ndarray:
        """Rows [n, n_keys] of one-hot features, sample-major, -1 where the bag is empty.

        Every slot is mapped, nulls included (their garbage is overwritten: dropping them
        first and scattering back would cost more than it saves).
        """
        segments, nulls = [], []
        for k, (f, sources) in enumerate(zip(self.spec.sparse, layout.sources, strict=True)):
            start = k * n
            if f.bucketize is not None:
                rows = _bucket_rows(columns[sources[0]], n, f.bucketize)
                segments.append(_Segment(f.name, rows, direct=True))
                continue
            if f.cross is not None:
                ids, valid = _cross([_combined(columns[i]) for i in sources])
                segments.append(_Segment(f.name, ids))
                if valid is not None:
                    nulls.append((start, valid))
                continue
            for arr in columns[sources[0]]:
                segments.append(_segment(f.name, arr, None))
                valid = _id_valid(arr)
                if valid is not None:
                    nulls.append((start, valid))
                start += len(arr)
        key_major = _map(self.ids, segments)
        for start, valid in nulls:
            # putmask: faster than copyto(where=...) or boolean assignment here.
            np.putmask(key_major[start : start + len(valid)], ~valid, -1)
        rows = np.empty((n, len(self._names)), self._row_dtype)
        np.copyto(rows, key_major.reshape(len(self._names), n).T, casting="unsafe")
        return rows

    def _jagged(
        self, columns: list[list[pa.Array]], layout: _Layout, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(rows, lengths, per-ID weights or None) in the ``KeyedJaggedTensor`` layout:
        key-major, nulls dropped, lists cut to ``max_length``."""
        lengths = np.empty(len(self._names) * n, np.int32)
        segments: list[_Segment] = []
        weights: list[np.ndarray | int] = []  # per segment: its weights, or its size (1s)
        for k, (f, sources) in enumerate(zip(self.spec.sparse, layout.sources, strict=True)):
            bags = lengths[k * n : (k + 1) * n]
            if f.bucketize is not None:
                rows = _bucket_rows(columns[sources[0]], n, f.bucketize)
                bags[:] = 1
                segments.append(_Segment(f.name, rows, direct=True))
                weights.append(n)
            elif f.cross is not None:
                ids, valid = _cross([_combined(columns[i]) for i in sources])
                bags[:] = 1 if valid is None else valid
                segments.append(_Segment(f.name, ids if valid is None else np.compress(valid, ids)))
                weights.append(segments[-1].size)
            elif f.weights is not None:
                ids_array, weight_array = (_combined(columns[i]) for i in sources)
                leaf, keep, bag_lengths = _bag_of(ids_array, f)
                bags[:] = bag_lengths
                segments.append(_segment(f.name, leaf, keep))
                if _is_list(ids_array.type):
                    weights.append(_list_weights(ids_array, weight_array, keep))
                elif keep is None:
                    weights.append(_primitive(weight_array).astype(np.float32))
                else:
                    weights.append(np.compress(keep, _primitive(weight_array)).astype(np.float32))
            else:
                start = 0
                for arr in columns[sources[0]]:
                    leaf, keep, bag_lengths = _bag_of(arr, f)
                    bags[start : start + len(arr)] = bag_lengths
                    start += len(arr)
                    segments.append(_segment(f.name, leaf, keep))
                    weights.append(segments[-1].size)
        values = _map(self.ids, segments)
        if not self._weighted:
            return values, lengths, None
        # One array, each segment's weights (or 1s) written into place.
        joined = np.empty(len(values), np.float32)
        start = 0
        for w in weights:
            size = w if isinstance(w, int) else len(w)
            joined[start : start + size] = 1 if isinstance(w, int) else w
            start += size
        return values, lengths, joined

    @staticmethod
    def _labels(chunks: list[pa.Array]) -> np.ndarray:
        return np.concatenate([_label_values(a) for a in chunks], dtype=np.float32)

    def _check_types(self, schema: pa.Schema) -> None:
        spec = self.spec
        for name in spec.columns:
            found = len(schema.get_all_field_indices(name))
            if found != 1:
                raise ValueError(
                    f"column {name}: " + ("missing" if not found else f"{found} times")
                )
        t = schema.field(spec.label).type
        if not _label_type_ok(t):
            raise ValueError(
                f"column {spec.label}: expected an integer, bool or float label, got {t}"
            )
        if spec.weight is not None:
            t = schema.field(spec.weight).type
            if not _dense_type_ok(t):
                raise ValueError(
                    f"column {spec.weight}: expected an integer or float weight, got {t}"
                )
        for name in spec.dense:
            t = schema.field(name).type
            if not _dense_type_ok(t):
                raise ValueError(
                    f"column {name}: expected an integer or float dense value, got {t}"
                )
        for f in spec.sparse:
            if f.bucketize is not None:
                t = schema.field(f.bucketize.column).type
                if not _dense_type_ok(t):
                    raise ValueError(
                        f"column {f.bucketize.column}: expected an integer or float value to "
                        f"bucketize, got {t}"
                    )
                continue
            for name in f.cross or (f.name,):
                t = schema.field(name).type
                if not _id_type_ok(t):
                    raise ValueError(f"column {name}: expected {_ID_TYPES}, got {t}")
                if f.cross is not None and _is_list(t):
                    raise ValueError(
                        f"cross {f.name}: column {name} is a list; a cross takes columns of "
                        "one ID a row"
                    )
            if f.weights is not None:
                t, ids = schema.field(f.weights).type, schema.field(f.name).type
                wanted = "a list of numbers" if _is_list(ids) else "a number"
                fits = _dense_type_ok(t.value_type) if _is_list(t) else _dense_type_ok(t)
                if not fits or _is_list(t) != _is_list(ids):
                    raise ValueError(
                        f"column {f.weights}: the weights of feature {f.name} must be "
                        f"{wanted} a row, like its IDs; got {t}"
                    )

    def _check_labels(self, col: pa.ChunkedArray) -> None:
        name = self.spec.label
        if col.null_count:
            raise ValueError(f"column {name}: {col.null_count} null label(s)")
        if pa.types.is_boolean(col.type):
            return
        if pa.types.is_integer(col.type) and len(col):
            # For integers, 0 <= min and max <= 1 is the whole check: one pass that
            # allocates nothing (the comparisons below cost far more on a row group).
            bounds = pc.min_max(col)
            if bounds["min"].as_py() >= 0 and bounds["max"].as_py() <= 1:
                return
        if pa.types.is_float16(col.type):
            col = col.cast(pa.float32())  # exact; Arrow has no float16 comparisons
        if pa.types.is_floating(col.type):
            # Soft labels: any value in [0, 1]. A comparison with NaN is false, so a NaN
            # label is among the bad ones.
            bad = pc.invert(pc.and_(pc.greater_equal(col, 0), pc.less_equal(col, 1)))
            wanted = "in [0, 1]"
        else:
            bad = pc.and_(pc.not_equal(col, 0), pc.not_equal(col, 1))
            wanted = "0 or 1"
        n_bad = pc.sum(bad).as_py() or 0
        if n_bad:
            example = pc.filter(col, bad)[0].as_py()
            raise ValueError(f"column {name}: {n_bad} label(s) not {wanted} (e.g. {example!r})")

    @staticmethod
    def _check_indices(name: str, col: pa.ChunkedArray) -> None:
        """Every dictionary index of ``col`` must point into its chunk's dictionary."""
        for chunk in col.chunks:
            leaf = chunk.values if _is_list(chunk.type) else chunk
            if not pa.types.is_dictionary(leaf.type) or leaf.indices.null_count == len(leaf):
                continue
            bounds = pc.min_max(leaf.indices)
            low, high = bounds["min"].as_py(), bounds["max"].as_py()
            if low < 0 or high >= len(leaf.dictionary):
                raise ValueError(
                    f"column {name}: dictionary index outside [0, {len(leaf.dictionary)}) "
                    f"(min {low}, max {high})"
                )

"""What ``BatchTransform.validate`` refuses: a column missing or of a type its role does
not take (schema drift), a dense value float32 cannot hold, a label outside {0, 1} or
[0, 1], a weight that is null, negative, NaN or beyond float32's range, per-ID weights
that do not line up with their IDs, a dictionary index outside its dictionary.

Each check raises ``ValueError`` naming the column (the reader adds the file and row
group: ``ingest.errors.DataError``). They run on every row group, so each first looks
where a bad value would show at the least cost (raw min and max, offsets compared) and
only then counts and shows the bad values exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrmflow.features.columns import (
    ID_TYPES,
    dense_type_ok,
    id_type_ok,
    is_list,
    label_type_ok,
    offsets_of,
    primitive,
    valid_mask,
)
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.schema import DenseFeature

# The largest float32; a dense value of greater magnitude would become ±inf in float32.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_dense_range(name: str, chunks: Sequence[pa.Array]) -> None:
    """Raise ``ValueError`` if a dense column (its ``chunks``) holds a value float32 cannot.

    Only floating columns can (an int64 is below 1e19). The common case costs a NaN-
    skipping min and max over each chunk's raw values (Arrow's null-aware min/max is much
    slower). Those include whatever lies under nulls, so a bound out of range is looked at
    again with the nulls left out.
    """
    if not chunks or not pa.types.is_floating(chunks[0].type):
        return
    for chunk in chunks:
        values = primitive(chunk)
        # As Python floats: numpy would compare a float16 with the bound cast to float16.
        if len(values) and (
            float(np.fmax.reduce(values)) > FLOAT32_MAX
            or float(np.fmin.reduce(values)) < -FLOAT32_MAX
        ):
            count, example = beyond_float32(pa.chunked_array(chunks))
            if count:
                raise range_error(name, count, example)
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


def beyond_float32(col: pa.Array | pa.ChunkedArray) -> tuple[int, float | None]:
    """How many values of a floating column float32 cannot hold, nulls and NaN aside, and
    the first of them (the rare path, once a bound is out of range)."""
    return _failing(col, lambda wide: pc.greater(pc.abs(wide), FLOAT32_MAX))


def range_error(name: str, count: int, example: float | None) -> ValueError:
    return ValueError(
        f"column {name}: {count} value(s) infinite or beyond float32's range "
        f"(e.g. {example!r}); dense values must be finite and within ±{FLOAT32_MAX:.8g}"
    )


def check_transform_range(t: DenseFeature) -> None:
    """A declared fill, clip bound, mean, deviation or boundary must be a float32, or it
    would hand training an inf."""
    values = [("fill", t.fill), ("clip_min", t.clip_min), ("clip_max", t.clip_max)]
    values += [("mean", t.mean), ("std", t.std)]
    values += [("boundaries", b) for b in t.boundaries or ()]
    for what, value in values:
        if value is not None and abs(value) > FLOAT32_MAX:
            raise ValueError(
                f"column {t.column}: {what} {value!r} is beyond float32's range "
                f"(±{FLOAT32_MAX:.8g})"
            )


def check_weights(name: str, col: pa.ChunkedArray) -> None:
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
            pc.and_(pc.greater_equal(wide, 0.0), pc.less_equal(wide, FLOAT32_MAX))
        ),
    )
    if count:
        raise ValueError(
            f"column {name}: {count} weight(s) negative, NaN, infinite or beyond float32's "
            f"range (e.g. {example!r}); weights must be finite and >= 0"
        )


def check_id_weights(
    name: str, column: str, ids: pa.ChunkedArray, weights: pa.ChunkedArray
) -> None:
    """Raise ``ValueError`` naming the weight ``column`` if feature ``name``'s per-ID
    weights do not line up with its IDs (a list of another length, a missing weight beside
    an ID) or are null, NaN, infinite or beyond float32's range."""
    if is_list(ids.type) and _id_weights_fine(ids, weights):
        return
    if is_list(ids.type):
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
        values, lambda wide: pc.invert(pc.less_equal(pc.abs(wide), FLOAT32_MAX))
    )
    if count:
        raise ValueError(
            f"column {column}: {count} weight(s) of {name}'s IDs NaN, infinite or beyond "
            f"float32's range (e.g. {example!r})"
        )


def _id_weights_fine(ids: pa.ChunkedArray, weights: pa.ChunkedArray) -> bool:
    """Whether list weights certainly pass ``check_id_weights``, found on the buffers: True
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
        id_offsets, weight_offsets = offsets_of(id_chunk), offsets_of(weight_chunk)
        if not np.array_equal(id_offsets - id_offsets[0], weight_offsets - weight_offsets[0]):
            return False
        valid, id_valid = valid_mask(weight_chunk), valid_mask(id_chunk)
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
            numbers = primitive(values)
            if pa.types.is_float64(values.type):
                if not bool((np.abs(numbers) <= FLOAT32_MAX).all()):
                    return False
            elif not bool(np.isfinite(numbers).all()):  # float16 and float32 are in range
                return False
    return True


@dataclass(frozen=True)
class Checks:
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
    def of(cls, schema: pa.Schema, spec: FeatureSpec) -> Checks:
        def leaf(t: pa.DataType) -> pa.DataType:
            return t.value_type if is_list(t) else t

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


def check_types(spec: FeatureSpec, schema: pa.Schema) -> None:
    """Raise ``ValueError`` naming the column if ``schema`` cannot hold ``spec``'s columns:
    each present once, of a type its role takes."""
    for name in spec.columns:
        found = len(schema.get_all_field_indices(name))
        if found != 1:
            raise ValueError(f"column {name}: " + ("missing" if not found else f"{found} times"))
    t = schema.field(spec.label).type
    if not label_type_ok(t):
        raise ValueError(f"column {spec.label}: expected an integer, bool or float label, got {t}")
    if spec.weight is not None:
        t = schema.field(spec.weight).type
        if not dense_type_ok(t):
            raise ValueError(f"column {spec.weight}: expected an integer or float weight, got {t}")
    for name in spec.dense:
        t = schema.field(name).type
        if not dense_type_ok(t):
            raise ValueError(f"column {name}: expected an integer or float dense value, got {t}")
    for f in spec.sparse:
        if f.bucketize is not None:
            t = schema.field(f.bucketize.column).type
            if not dense_type_ok(t):
                raise ValueError(
                    f"column {f.bucketize.column}: expected an integer or float value to "
                    f"bucketize, got {t}"
                )
            continue
        for name in f.cross or (f.name,):
            t = schema.field(name).type
            if not id_type_ok(t):
                raise ValueError(f"column {name}: expected {ID_TYPES}, got {t}")
            if f.cross is not None and is_list(t):
                raise ValueError(
                    f"cross {f.name}: column {name} is a list; a cross takes columns of "
                    "one ID a row"
                )
        if f.weights is not None:
            t, ids = schema.field(f.weights).type, schema.field(f.name).type
            wanted = "a list of numbers" if is_list(ids) else "a number"
            fits = dense_type_ok(t.value_type) if is_list(t) else dense_type_ok(t)
            if not fits or is_list(t) != is_list(ids):
                raise ValueError(
                    f"column {f.weights}: the weights of feature {f.name} must be "
                    f"{wanted} a row, like its IDs; got {t}"
                )


def check_labels(name: str, col: pa.ChunkedArray) -> None:
    """Raise ``ValueError`` naming the label column ``name`` if a label is null, NaN or
    not 0 or 1 (integers, bools) or in [0, 1] (floats)."""
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


def check_indices(name: str, col: pa.ChunkedArray) -> None:
    """Every dictionary index of ``col`` must point into its chunk's dictionary."""
    for chunk in col.chunks:
        leaf = chunk.values if is_list(chunk.type) else chunk
        if not pa.types.is_dictionary(leaf.type) or leaf.indices.null_count == len(leaf):
            continue
        bounds = pc.min_max(leaf.indices)
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if low < 0 or high >= len(leaf.dictionary):
            raise ValueError(
                f"column {name}: dictionary index outside [0, {len(leaf.dictionary)}) "
                f"(min {low}, max {high})"
            )

"""Dense columns to float32 features: Criteo's ``log(1 + max(x, 0))`` with nulls and NaN
as 0, or each column's declared transform (fill, then log, clip or standardize; bucketize
makes the column categorical), and labels and sample weights as float32.

Dense features are built feature-major ([columns, rows]): each column is written
contiguously, and whoever needs them sample-major transposes once (or, placing rows in a
window, reads them strided).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from dlrmflow.features import jit
from dlrmflow.features.columns import label_values, primitive, valid_mask
from dlrmflow.schema import DenseFeature

_NO_MASK = np.zeros(0, np.bool_)


def log1p(values: np.ndarray) -> None:
    """The dense features' log, in place on float32 values >= 0.

    numpy's float32 ``log1p`` is vectorized, and it gives every element the same result
    wherever it sits in the array (checked: slices at every offset, strided rows), so
    the compiled path, which logs a row group a slice at a time, and the vectorized path,
    which logs a whole table, agree bitwise.
    """
    np.log1p(values, out=values)


def _float32_or_none(value: float | None) -> np.float32 | None:
    return None if value is None else np.float32(value)


def declared_dense(
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
        filled(chunks, block, t.fill)
        if t.transform == "log":
            np.fmax(block, np.float32(0), out=block)
            log1p(block)
        elif t.transform == "clip":
            low, high = _float32_or_none(t.clip_min), _float32_or_none(t.clip_max)
            np.minimum(np.maximum(block, low, out=block), high, out=block)
        elif t.transform == "standardize":
            np.subtract(block, np.float32(t.mean), out=block)
            np.divide(block, np.float32(t.std or 1.0), out=block)
    return out


def filled(chunks: list[pa.Array], out: np.ndarray, fill: float) -> None:
    """A dense column's values into float32 ``out``, each null or NaN as ``fill``."""
    start = 0
    for arr in chunks:
        part = out[start : start + len(arr)]
        start += len(arr)
        values = primitive(arr)
        if values.dtype != np.float16:  # numba takes every other numeric type
            valid = valid_mask(arr)
            mask = _NO_MASK if valid is None else valid
            jit.fill_float32(jit.frozen(values), jit.frozen(mask), np.float32(fill), part)
            continue
        # Garbage under a null may overflow the cast: quietly, it is replaced below.
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(part, values, casting="unsafe")
        missing = np.isnan(part)
        valid = valid_mask(arr)
        if valid is not None:
            missing |= ~valid
        np.putmask(part, missing, np.float32(fill))


def bucket_rows(chunks: list[pa.Array], n: int, d: DenseFeature) -> np.ndarray:
    """Bucketize: each value's bucket, ``i`` with ``boundaries[i-1] <= x < boundaries[i]``,
    compared as float32 (the value after the fill, as every dense transform takes it)."""
    values = np.empty(n, np.float32)
    filled(chunks, values, d.fill)
    boundaries = np.asarray(d.boundaries, np.float32)
    return np.searchsorted(boundaries, values, side="right").astype(np.int64)


def sample_weight_values(chunks: list[pa.Array]) -> np.ndarray:
    """A weight column's values as float32 (``validate`` has refused nulls and bad values)."""
    out = np.empty(sum(len(a) for a in chunks), np.float32)
    start = 0
    for arr in chunks:
        with np.errstate(over="ignore", invalid="ignore"):  # unvalidated garbage stays quiet
            np.copyto(out[start : start + len(arr)], primitive(arr), casting="unsafe")
        start += len(arr)
    return out


def criteo_dense(columns: list[list[pa.Array]], n: int, one_type: bool) -> np.ndarray:
    """Feature-major [columns, n] float32: ``log(1 + max(x, 0))``, nulls and NaN as 0."""
    # Feature-major so each column is written contiguously; one transpose at the end
    # (``BatchTransform._batch``) is cheaper than strided writes. When all columns share a type, one
    # C++ concatenation replaces a round of numpy calls per column and chunk.
    out = np.empty((len(columns), n), np.float32)
    if one_type:
        blocks = [(out.reshape(-1), pa.concat_arrays([a for col in columns for a in col]))]
    else:
        blocks = list(zip(out, (pa.concat_arrays(col) for col in columns), strict=True))
    for block, arr in blocks:
        valid = valid_mask(arr)
        # Garbage under a null may overflow the cast or be inf (values are checked
        # before, nulls aside): quietly, since it is masked right after.
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(block, primitive(arr), casting="unsafe")
            if valid is not None:
                # Multiplying by 0 turns a garbage NaN/inf under a null into NaN, which
                # the fmax below maps to 0 like every other NaN. uint8: a faster loop
                # than bool.
                np.multiply(block, valid.view(np.uint8), out=block)
    np.fmax(out, np.float32(0), out=out)  # fmax, not maximum: NaN -> 0
    log1p(out)
    return out


def float_labels(chunks: list[pa.Array]) -> np.ndarray:
    """A label column's values as float32 (``validate`` has checked them)."""
    return np.concatenate([label_values(a) for a in chunks], dtype=np.float32)

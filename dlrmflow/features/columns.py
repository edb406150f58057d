"""Arrow columns as the feature transform reads them: zero-copy numpy views of their
buffers (validity bitmaps, offsets, values, dictionaries) and the types each role takes.

A row group holds tens of thousands of rows, so numpy's per-call cost is negligible and
the transform works column by column on these views instead of converting columns. A
sliced array starts inside its buffers: every view here reads only the slice's own
slots.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dlrmflow.ingest.strings import is_string, string_ids

ID_TYPES = "int64 or string IDs, or lists of them (optionally dictionary-encoded)"


def dense_type_ok(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def label_type_ok(t: pa.DataType) -> bool:
    return dense_type_ok(t) or pa.types.is_boolean(t)


def is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_plain_id(t: pa.DataType) -> bool:
    return t == pa.int64() or is_string(t)


def is_id(t: pa.DataType) -> bool:
    """int64 or string, or such values behind signed dictionary indices."""
    if pa.types.is_dictionary(t):
        return _is_plain_id(t.value_type) and pa.types.is_signed_integer(t.index_type)
    return _is_plain_id(t)


def id_type_ok(t: pa.DataType) -> bool:
    return is_id(t) or (is_list(t) and is_id(t.value_type))


def chunks_of(column: pa.Array | pa.ChunkedArray) -> list[pa.Array]:
    return column.chunks if isinstance(column, pa.ChunkedArray) else [column]


def aligned(columns: list[list[pa.Array]]) -> list[int] | None:
    """The chunk lengths every column shares (a row group, or a concatenation of row
    groups, has them), or None when they differ or there are no columns."""
    if not columns:
        return None
    lengths = [len(a) for a in columns[0]]
    for col in columns[1:]:
        if [len(a) for a in col] != lengths:
            return None
    return lengths


def valid_mask(arr: pa.Array) -> np.ndarray | None:
    """A bool per slot (True = not null), or None when the array has no nulls."""
    if arr.null_count == 0:
        return None
    # Unpack only this slice's bytes: a sliced array starts deep inside its bitmap.
    first = arr.offset // 8
    skip = arr.offset - 8 * first
    bits = np.frombuffer(arr.buffers()[0], np.uint8, count=(skip + len(arr) + 7) // 8, offset=first)
    valid = np.unpackbits(bits, count=skip + len(arr), bitorder="little")
    return valid[skip:].view(np.bool_)


def primitive(arr: pa.Array) -> np.ndarray:
    """Zero-copy numpy view of a fixed-width array's values (garbage under nulls)."""
    dtype = np.dtype(arr.type.to_pandas_dtype())
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:
        return np.zeros(len(arr), dtype)
    return np.frombuffer(buf, dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def ids_of(arr: pa.Array) -> np.ndarray:
    """The int64 IDs of a plain (not dictionary) ID array, garbage under nulls: a view of
    an int64 array's values, or a string array's strings hashed (``string_ids``)."""
    return string_ids(arr) if is_string(arr.type) else primitive(arr)


def _bools(arr: pa.Array) -> np.ndarray:
    """A boolean array's values as uint8 0/1 (Arrow packs them into bits)."""
    first = arr.offset // 8
    skip = arr.offset - 8 * first
    bits = np.frombuffer(arr.buffers()[1], np.uint8, count=(skip + len(arr) + 7) // 8, offset=first)
    return np.unpackbits(bits, count=skip + len(arr), bitorder="little")[skip:]


def label_values(arr: pa.Array) -> np.ndarray:
    """A label array's values as numpy (bools unpacked to 0/1), in its own dtype."""
    return _bools(arr) if pa.types.is_boolean(arr.type) else primitive(arr)


def id_valid(arr: pa.Array) -> np.ndarray | None:
    """Which slots of an int64 or dictionary array hold an ID (None: all of them)."""
    if not pa.types.is_dictionary(arr.type):
        return valid_mask(arr)
    valid = valid_mask(arr.indices)
    entry_valid = valid_mask(arr.dictionary)
    if entry_valid is None:
        return valid
    # A null dictionary entry is a null ID. Indices under null slots are undefined, hence
    # the clip; those slots are dropped by ``valid`` anyway.
    uses_valid = entry_valid.take(primitive(arr.indices), mode="clip")
    return uses_valid if valid is None else valid & uses_valid


def offsets_of(arr: pa.Array) -> np.ndarray:
    """A list array's offsets (``len(arr) + 1`` of them), a zero-copy view."""
    off_dtype = np.dtype(np.int64 if pa.types.is_large_list(arr.type) else np.int32)
    return np.frombuffer(
        arr.buffers()[1], off_dtype, count=len(arr) + 1, offset=arr.offset * off_dtype.itemsize
    )


def combined(chunks: list[pa.Array]) -> pa.Array:
    """One array of a column's chunks (dictionaries unified), so that several columns'
    rows line up whatever their chunking."""
    if len(chunks) == 1:
        return chunks[0]
    return pa.chunked_array(chunks).combine_chunks()

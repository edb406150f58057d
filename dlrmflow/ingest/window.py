"""A reader window of Arrow rows, built shuffled as each row group is decoded (no transform).

Without a transform the reader hands out Arrow record batches: the window's rows in the
deal's order (``shuffle.deal``), cut into batches. Arrow's ``take`` of the concatenated
window did that in one gather, but it cost more than the decode itself (a row group of
Criteo's 40 columns, one thread). Its chunked gather resolves every index to a chunk, and
on a nullable column it builds the validity bit by bit (far slower than numpy's gather
of the values alone). So the window is built the way the transform builds its
own (``features.transform.WindowWriter``): each row group, right after it is decoded, is
scattered into preallocated window columns, row ``i`` to its place in the deal, and the
batches are zero-copy slices of one record batch.

Fixed-width columns (integers, floats, booleans, dates, times, timestamps, durations) go
through the compiled scatter below, their values as unsigned integers of their width,
their validity (and a boolean's values) bit by bit into bitmaps of the window, which are
small enough to stay in cache. Any other column (strings, lists, dictionaries, ...) keeps
its row groups and is gathered by Arrow's ``take`` when the window is cut, as before.
Either way a batch holds the values ``take`` gave, under the same schema, in the same
order. A batch keeps its window's buffers alive, as a transformed batch keeps its
window's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import pyarrow as pa

from dlrmflow.runtime.llvm_prefetch import prefetch

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Rows left unused after each batch in the window's columns. Without them, with batches of
# 4096 rows, the ~64 places a column is written at are 4096 bytes apart or a multiple of
# that (one byte a row) or close to it (wider values), so they share one set of the L1
# cache, whose 12 ways cannot hold them: every write missed it. 72 rows shift each batch
# by a line and a bit for every width.
_GAP = 72
# Rows ahead whose line the scatter asks for (see ``_scatter``).
_AHEAD = 64
# The bitmap of an array without rows (Arrow may give it no buffer), read-only like the rest.
_NO_BITS = np.zeros(0, np.uint8)
_NO_BITS.flags.writeable = False
# A column with at most this share of nulls in a chunk gets its validity by clearing the
# nulls' bits alone (the bitmap starts with every bit set) rather than by a scatter of
# every row's bit.
_FEW_NULLS = 1 / 8


@numba.njit(nogil=True, cache=True)
def _scatter(src: tuple, dest: np.ndarray, out: tuple) -> None:
    """``out[c][dest[i]] = src[c][i]`` for every column ``c`` (arrays of one dtype).

    A column at a time: its writes follow ~64 streams (a batch each), whose lines stay in
    L1 until they are full. Each write first asks for the line of the write ``_AHEAD``
    rows on: the hardware prefetcher does not follow that many streams. On a row group of
    Criteo's columns this was faster than asking ahead for the 64-bit columns alone, and
    than interleaving the columns in blocks of 1024 rows. Gathering instead, each batch's
    share of a row group written as one sequential run read from the row group's column,
    was slower in the reader (more CPU per row).
    """
    n = dest.shape[0]
    for c in range(len(src)):
        s, o = src[c], out[c]
        base, width = o.ctypes.data, o.itemsize
        for i in range(n):
            if i + _AHEAD < n:
                prefetch(base + dest[i + _AHEAD] * width)
            o[dest[i]] = s[i]


@numba.njit(nogil=True, cache=True)
def _scatter_bits(bits: tuple, offsets: np.ndarray, dest: np.ndarray, out: tuple) -> None:
    """Bit ``offsets[c] + i`` of the bitmap ``bits[c]`` to bit ``dest[i]`` of the bitmap
    ``out[c]``, for every bitmap ``c`` (Arrow's little-endian bit order).

    A window's bitmap is an eighth of its rows in bytes, so it stays in L1 or L2 while
    its bits are set one by one, a read-modify-write of a byte each.
    """
    n = dest.shape[0]
    for c in range(len(bits)):
        b, o, first = bits[c], out[c], offsets[c]
        for i in range(n):
            j = first + i
            bit = (b[j >> 3] >> (j & 7)) & 1
            d = dest[i]
            shift = d & 7
            o[d >> 3] = (o[d >> 3] & ~np.uint8(1 << shift)) | np.uint8(bit << shift)


@numba.njit(nogil=True, cache=True)
def _clear_nulls(bits: np.ndarray, first: int, dest: np.ndarray, out: np.ndarray) -> None:
    """Bit ``dest[i]`` of the bitmap ``out`` cleared where bit ``first + i`` of the
    validity bitmap ``bits`` is 0: the nulls of a column with few, whose other bits are
    set already. A byte of eight valid rows is passed over whole (most are)."""
    n = dest.shape[0]
    i = 0
    while i < n:
        j = first + i
        if (j & 7) == 0 and i + 8 <= n and bits[j >> 3] == 0xFF:
            i += 8
            continue
        if not (bits[j >> 3] >> (j & 7)) & 1:
            d = dest[i]
            out[d >> 3] &= ~np.uint8(1 << (d & 7))
        i += 1


@numba.njit(nogil=True, cache=True)
def _places(order: np.ndarray, bounds: np.ndarray, gap: int, out: np.ndarray) -> None:
    """``out[order[j]] = j + b * gap`` for the ``j`` of batch ``b`` (rows ``bounds[b]`` to
    ``bounds[b + 1]`` of ``order``): where each row goes in columns with ``gap`` unused
    rows after every batch."""
    for b in range(bounds.shape[0] - 1):
        for j in range(bounds[b], bounds[b + 1]):
            out[order[j]] = j + b * gap


def _fixed_width(t: pa.DataType) -> bool:
    """Whether the compiled scatter takes a column of type ``t``: one buffer of fixed-width
    values (or of bits) beside its validity."""
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
        return True
    if pa.types.is_date(t) or pa.types.is_time(t):
        return True
    return pa.types.is_timestamp(t) or pa.types.is_duration(t)


def _nbytes(t: pa.DataType, rows: int) -> int:
    """Bytes of ``rows`` values of the fixed-width type ``t`` (booleans are bits)."""
    return (rows + 7) // 8 if pa.types.is_boolean(t) else rows * (t.bit_width // 8)


def _readonly(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only view: a tuple compiles to one loop only when every array in it
    has one type, the read-only flag included, and Arrow's buffers are read-only."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _bitmap(buffer: pa.Buffer | None) -> np.ndarray:
    """An Arrow bitmap's bytes (read-only), bits in little-endian order."""
    if buffer is None:  # no rows
        return _NO_BITS
    return np.frombuffer(buffer, np.uint8)


def _values(arr: pa.Array, buffer: pa.Buffer | None, width: int) -> np.ndarray:
    """A fixed-width array's values as unsigned integers of ``width`` bytes, zero-copy and
    read-only (whatever lies under nulls is moved along like any value)."""
    if buffer is None or len(arr) == 0:
        return _readonly(np.zeros(len(arr), _UNSIGNED[width]))
    return np.frombuffer(buffer, _UNSIGNED[width], count=len(arr), offset=arr.offset * width)


class _Column:
    """One fixed-width column of the window, in the gapped layout: its values (a boolean's
    as a bitmap) and, once a null shows, its validity bitmap."""

    def __init__(self, t: pa.DataType, rows: int, values: np.ndarray) -> None:
        self.type = t
        self.rows = rows
        self.boolean = pa.types.is_boolean(t)
        self.values = values
        self.validity: np.ndarray | None = None  # None: no null so far
        self.nulls = 0

    def validity_for(self, arr: pa.Array) -> np.ndarray | None:
        """Where ``arr``'s validity goes, or None when it has no null: rows without a null
        are valid already (the bitmap starts with every bit set, the gaps' too)."""
        nulls = arr.null_count
        if nulls == 0:
            return None
        if self.validity is None:
            self.validity = np.full((self.rows + 7) // 8, 0xFF, np.uint8)
        self.nulls += nulls
        return self.validity

    def array(self) -> pa.Array:
        """The column as one Arrow array, gaps included (no batch's slice shows them)."""
        validity = None if self.validity is None else pa.py_buffer(self.validity)
        return pa.Array.from_buffers(
            self.type, self.rows, [validity, pa.py_buffer(self.values)], null_count=self.nulls
        )


class ArrowWindow:
    """A window of rows, built as its row groups arrive: ``add`` each decoded table in
    window order, then ``batches`` cuts the window into record batches.

    ``order`` is the deal's emission order and ``bounds`` where its batches start and end
    in it (``shuffle.deal``). Every table has the schema of the first (the reader conforms
    them). In the window's columns, batch ``b`` starts at row ``bounds[b] + b * _GAP``.
    Used by one thread at a time.
    """

    def __init__(self, order: np.ndarray, bounds: Sequence[int]) -> None:
        self._order = order
        self._bounds = np.asarray(bounds, np.int64)
        self._rows = len(order)
        # Where each row goes in the gapped columns.
        self._dest = np.empty(self._rows, np.int64)
        _places(order, self._bounds, _GAP, self._dest)
        self._start = 0  # rows added so far
        self._schema: pa.Schema | None = None
        self._fixed: dict[int, _Column] = {}  # by column index
        self._other: dict[int, list[pa.Array]] = {}  # column index -> chunks, for ``take``

    def add(self, table: pa.Table) -> None:
        """Place ``table``'s rows, the next ``table.num_rows`` of the window."""
        n, start = table.num_rows, self._start
        if start + n > self._rows:
            raise ValueError(f"window: {start + n} rows added, but it holds {self._rows}")
        if self._schema is None:
            self._plan(table.schema)
        self._start += n
        if n == 0:
            return
        columns = table.columns
        for i, chunks in self._other.items():
            chunks.extend(columns[i].chunks)
        if not self._fixed:
            return
        fixed = {i: columns[i].chunks for i in self._fixed}
        lengths = [len(a) for a in next(iter(fixed.values()))]
        if any([len(a) for a in chunks] != lengths for chunks in fixed.values()):
            # Chunked differently (never so in a decoded row group): one chunk each.
            fixed = {i: [pa.concat_arrays(chunks)] for i, chunks in fixed.items()}
            lengths = [n]
        at = start
        for k, size in enumerate(lengths):
            dest = self._dest[at : at + size]
            at += size
            # Values by width; bits (a boolean's values, validity) as bytes.
            groups: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
            bits: list[tuple[np.ndarray, int, np.ndarray]] = []
            for i, column in self._fixed.items():
                arr = fixed[i][k]
                buffers = arr.buffers()
                if column.boolean:
                    bits.append((_bitmap(buffers[1]), arr.offset, column.values))
                else:
                    width = column.values.itemsize
                    src, out = groups.setdefault(width, ([], []))
                    src.append(_values(arr, buffers[1], width))
                    out.append(column.values)
                validity = column.validity_for(arr)
                if validity is None:
                    continue
                if arr.null_count <= _FEW_NULLS * len(arr):
                    _clear_nulls(_bitmap(buffers[0]), arr.offset, dest, validity)
                else:
                    bits.append((_bitmap(buffers[0]), arr.offset, validity))
            for src, out in groups.values():
                _scatter(tuple(src), dest, tuple(out))
            if bits:
                maps, offsets, outs = zip(*bits, strict=True)
                _scatter_bits(maps, np.array(offsets, np.int64), dest, outs)

    def batches(self, pieces: Sequence[tuple[int, int]]) -> list[pa.RecordBatch]:
        """The record batches of the emitted rows ``a:b`` of each piece, a batch of the
        window's (a pair of consecutive ``bounds``) each."""
        if self._start != self._rows:
            raise ValueError(f"window: it holds {self._rows} rows, but {self._start} were added")
        schema = self._schema
        assert schema is not None
        batch = {int(a): b for b, a in enumerate(self._bounds[:-1])}
        fixed = {i: column.array() for i, column in self._fixed.items()}
        if not self._other:
            arrays = [fixed[i] for i in range(len(schema))]
            window = pa.RecordBatch.from_arrays(arrays, schema=schema)
            return [window.slice(a + batch[a] * _GAP, b - a) for a, b in pieces]
        # The columns the compiled scatter does not take: Arrow's gather, a chunk per piece.
        indices = pa.chunked_array([self._order[a:b] for a, b in pieces], type=pa.int64())
        taken = {
            i: pa.chunked_array(chunks, type=schema.field(i).type).take(indices).chunks
            for i, chunks in self._other.items()
        }
        return [
            pa.RecordBatch.from_arrays(
                [
                    taken[i][j] if i in taken else fixed[i].slice(a + batch[a] * _GAP, b - a)
                    for i in range(len(schema))
                ],
                schema=schema,
            )
            for j, (a, b) in enumerate(pieces)
        ]

    def _plan(self, schema: pa.Schema) -> None:
        self._schema = schema
        rows = self._rows + _GAP * (len(self._bounds) - 1)
        fixed = [i for i, field in enumerate(schema) if _fixed_width(field.type)]
        self._other = {i: [] for i in range(len(schema)) if i not in fixed}
        # One allocation for every column's values, each at a cache-line boundary: numpy
        # backs an allocation this large with huge pages, which keeps the scattered writes
        # to ~64 batches of every column within the TLB's reach.
        types = [schema.field(i).type for i in fixed]
        sizes = [_nbytes(t, rows) for t in types]
        starts = np.cumsum([0, *(-(-size // 64) * 64 for size in sizes)])
        memory = np.empty(int(starts[-1]), np.uint8)
        for i, t, start, size in zip(fixed, types, starts, sizes, strict=False):
            values = memory[start : start + size]
            if not pa.types.is_boolean(t):
                values = values.view(_UNSIGNED[t.bit_width // 8])
            self._fixed[i] = _Column(t, rows, values)

"""Arrow row group -> ``Batch``: dense transforms, sparse IDs to rows, labels.

The reader transforms each decoded row group (~65k rows) once, as it is decoded, into a
shuffled window (``features.window.WindowWriter``), and cuts training batches out of the
window: the compiled path writes each row straight to its place, other layouts place each
transformed row group's rows. At that size numpy's per-call cost is negligible, so the
code works column by column on zero-copy numpy views of the Arrow buffers
(``features.columns``), and all IDs of a row group go to the mapper in one call
(``features.bags``). When every ID column is one-hot (Criteo's layout) the sparse part
comes out in ``KeyedJaggedTensor``'s one-hot form, a row of IDs per sample; list columns
give the jagged form, nulls dropped before the IDs are mapped. Dense transforms are in
``features.dense``, what ``validate`` refuses in ``features.checks``.

Input semantics (``validate`` enforces the types and values, once per row group, by
``features.checks``):

* dense columns: any integer or floating type. With Criteo's transforms (the spec's
  ``dense_transforms`` None) a null or NaN is missing and becomes 0; every other value
  becomes ``log(1 + max(x, 0))`` in float32 (numpy's vectorized ``log1p``). With declared
  ones, each column's null or NaN becomes its ``fill`` and its transform follows
  (``features.dense``); they take the numpy path, never the compiled one, whose dense
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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from dlrmflow.features import jit
from dlrmflow.features.bags import jagged, one_hot_rows
from dlrmflow.features.batch import Batch
from dlrmflow.features.checks import (
    FLOAT32_MAX,
    Checks,
    beyond_float32,
    check_dense_range,
    check_id_weights,
    check_indices,
    check_labels,
    check_transform_range,
    check_types,
    check_weights,
    range_error,
)
from dlrmflow.features.columns import (
    aligned,
    chunks_of,
    ids_of,
    is_list,
    label_values,
    primitive,
    valid_mask,
)
from dlrmflow.features.dense import (
    criteo_dense,
    declared_dense,
    float_labels,
    log1p,
    sample_weight_values,
)
from dlrmflow.features.ids import IdMapper
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.window import PlacedWindow, destinations, shuffled
from dlrmflow.ingest.strings import holds_strings
from dlrmflow.sparse import KeyedJaggedTensor

# Rows of a row group whose dense values are clamped, logged and placed at a time: 8192
# rows of 13 features are 416 KiB, which stay in the core's cache between the steps.
_DENSE_SLICE = 8192


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
class CompiledRows:
    """The compiled path's output arrays, sample-major."""

    ids: np.ndarray  # [n, sparse keys], int32 or int64; -1 where the ID is null
    dense: np.ndarray  # [n, dense columns] float32: log1p(max(x, 0)), nulls and NaN as 0
    labels: np.ndarray  # [n] float32
    weights: np.ndarray | None  # [n] float32, where the spec has a weight column


class BatchTransform:
    """Turns Arrow tables or record batches of the spec's columns into ``Batch`` tensors.

    ``ids`` maps raw IDs to rows (``HashIds``, ``Vocabulary`` or both, ``FeatureIds``);
    its table sizes must be the spec's, so that every row it produces indexes the model's
    tables. A bucketized column's rows are its buckets: the mapper never sees them.
    """

    def __init__(self, spec: FeatureSpec, ids: IdMapper) -> None:
        for f in spec.sparse:
            if f.bucketize is not None:
                check_transform_range(f.bucketize)
                continue
            n = ids.num_embeddings(f.name)
            if n != f.num_embeddings:
                raise ValueError(
                    f"feature {f.name}: the ID mapper has {n} rows but the spec's table has "
                    f"{f.num_embeddings}"
                )
        for t in spec.dense_transforms or ():
            check_transform_range(t)
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
        self._checks: Checks | None = None
        # Per-ID weights travel as the KeyedJaggedTensor's: one a value, 1 where unweighted.
        self._weighted = any(f.weights is not None for f in spec.sparse)
        # Raw IDs for the trainer's dynamic maps travel jagged and int64: -1 is an ID there,
        # so the one-hot form's empty-bag sentinel cannot carry them.
        self._raw = any(f.ids == "dynamic" for f in spec.sparse)
        if self._raw:
            self._row_dtype = np.int64

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
            check_types(self.spec, table.schema)
            checks = self._checks = Checks.of(table.schema, self.spec)
        # Only the columns whose type can hold a bad value are looked at (by position: a
        # lookup by name is not free, and a row group paid it 40 times).
        for name, i in checks.floating:
            check_dense_range(name, table.column(i).chunks)
        check_labels(self.spec.label, table.column(checks.label))
        if checks.weight is not None:
            check_weights(self.spec.weight, table.column(checks.weight))
        for name, i in checks.dictionary:
            check_indices(name, table.column(i))
        for name, column, ids, weights in checks.id_weights:
            check_id_weights(name, column, table.column(ids), table.column(weights))

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
            rows = one_hot_rows(self.spec, self.ids, columns, layout.sources, n, self._row_dtype)
            sparse = KeyedJaggedTensor.from_one_hot(list(self._names), torch.from_numpy(rows))
        else:
            values, lengths, weights = jagged(
                self.spec, self.ids, columns, layout.sources, n, self._weighted
            )
            sparse = KeyedJaggedTensor(
                list(self._names),
                torch.from_numpy(values),
                torch.from_numpy(lengths),
                None if weights is None else torch.from_numpy(weights),
            )
        for f, sources in zip(self.spec.sparse, layout.sources, strict=True):
            if f.bucketize is not None:
                check_dense_range(f.bucketize.column, columns[sources[0]])
        dense_columns = [columns[i] for i in layout.dense]
        for name, chunks in zip(self.spec.dense, dense_columns, strict=True):
            check_dense_range(name, chunks)
        if self.spec.dense_transforms is None:
            dense = criteo_dense(dense_columns, n, layout.dense_one_type)
        else:
            dense = declared_dense(dense_columns, n, self.spec.dense_transforms)
        # numpy transposes this shape much faster than torch's .t().contiguous().
        return Batch(
            dense=torch.from_numpy(np.ascontiguousarray(dense.T) if contiguous else dense.T),
            sparse=sparse,
            labels=torch.from_numpy(float_labels(columns[layout.label])),
            sample_weights=None
            if layout.weight is None
            else torch.from_numpy(sample_weight_values(columns[layout.weight])),
        )

    def window(self, tables: Sequence[pa.Table], order: np.ndarray) -> Batch:
        """``Batch.concat([self(t) for t in tables]).take(order)``, in one pass where it can.

        The reader's shuffle: row ``j`` of the result is row ``order[j]`` of the tables
        one after another (``order`` is a permutation of their rows). On the compiled path
        every row is written straight to its place, so neither the concatenation nor the
        gather costs a pass of its own, and the batches cut from the result are views.
        Other layouts transform each table, then write its rows and bags to their places
        (``shuffled``).
        """
        n = sum(t.num_rows for t in tables)
        order, dest = destinations(order, n)
        try:
            table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        except pa.ArrowInvalid:  # schemas differ: transformed one by one below
            table = None
        if table is not None and n:
            layout, columns, lengths = self._read(table)
            if lengths is not None:
                return self._compiled(columns, layout, lengths, dest)
        return shuffled([self(t) for t in tables], order)

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
        return [name for name in dict.fromkeys(ids) if holds_strings(schema.field(name).type)]

    def _read(
        self, data: pa.Table | pa.RecordBatch
    ) -> tuple[_Layout, list[list[pa.Array]], list[int] | None]:
        """``data``'s layout, its columns' chunks, and the chunk lengths when the compiled
        path applies (its columns are chunked alike), else None."""
        layout = self._layout_of(data.schema)
        columns = [chunks_of(c) for c in data.columns]  # one call; no lookup by name per column
        lengths = aligned([columns[i] for i in layout.used]) if layout.compiled else None
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

    def _allocate(self, n: int, layout: _Layout) -> CompiledRows:
        return CompiledRows(
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
        out: CompiledRows,
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
            valid = [valid_mask(a) for a in ids]
            self.ids.map_one_hot(self._names, [ids_of(a) for a in ids], valid, out.ids, at)
            values = [columns[i][c] for i in layout.dense]
            frozen = tuple(jit.frozen(primitive(a)) for a in values)
            masks = jit.masks([valid_mask(a) for a in values])
            # Floating columns are checked for values float32 cannot hold in the clamp's
            # own loop (integers never are such values).
            limit = FLOAT32_MAX if pa.types.is_floating(values[0].type) else np.inf
            out_of_range = np.zeros(len(values), np.int64)
            # Clamped, logged and placed a slice at a time, so that the log reads values
            # still in the core's cache rather than the whole window from memory after.
            scratch = np.empty((len(values), min(size, _DENSE_SLICE)), np.float32)
            for first in range(0, size, _DENSE_SLICE):
                part = scratch[:, : min(_DENSE_SLICE, size - first)]
                jit.clamp_columns(frozen, masks, first, part, limit, out_of_range)
                log1p(part)
                jit.scatter_rows(part, out.dense, at[first:])
            if out_of_range.any():
                k = int(np.flatnonzero(out_of_range)[0])
                _, example = beyond_float32(values[k])
                raise range_error(self.spec.dense[k], int(out_of_range[k]), example)
            labels = label_values(columns[layout.label][c])
            jit.scatter_rows(labels.reshape(1, -1), out.labels.reshape(-1, 1), at)
            if out.weights is not None:
                assert layout.weight is not None
                weights = primitive(columns[layout.weight][c])
                jit.scatter_rows(weights.reshape(1, -1), out.weights.reshape(-1, 1), at)

    def _finish(self, out: CompiledRows) -> Batch:
        return Batch(
            dense=torch.from_numpy(out.dense),
            sparse=KeyedJaggedTensor.from_one_hot(list(self._names), torch.from_numpy(out.ids)),
            labels=torch.from_numpy(out.labels),
            sample_weights=None if out.weights is None else torch.from_numpy(out.weights),
        )

    def _plan(self, schema: pa.Schema) -> _Layout:
        check_types(self.spec, schema)
        spec = self.spec
        label = schema.get_field_index(spec.label)
        weight = None if spec.weight is None else schema.get_field_index(spec.weight)
        dense = tuple(schema.get_field_index(name) for name in spec.dense)
        sources = tuple(tuple(schema.get_field_index(c) for c in f.columns) for f in spec.sparse)
        sparse = tuple(s[0] for s in sources)
        one_hot = (
            not self._weighted
            and not self._raw
            and not any(
                is_list(schema.field(s[0]).type)
                for f, s in zip(spec.sparse, sources, strict=True)
                if f.cross is None and f.bucketize is None
            )
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


class WindowWriter:
    """``BatchTransform.window(tables, order)``, built one table at a time.

    ``add`` the tables in window order, then ``finish`` (the window as one ``Batch``) or
    ``batches`` (the window's batches, cut where the reader cuts them). On the compiled
    path each table's rows are written straight to their shuffled places as it arrives
    and the table is not kept: the reader transforms a row group right after decoding it,
    while its columns are still in cache, and frees it before decoding the next (a whole
    window decoded first no longer fits in cache when it is transformed). Other layouts
    (lists, per-ID weights, dictionaries, declared transforms ...) are transformed as they
    arrive too, and each block's rows placed at once in emission order (``PlacedWindow``).

    Used by one thread at a time; ``add`` raises for a table whose rows overflow
    ``order`` or whose layout differs from the compiled one of the tables before it.
    """

    def __init__(
        self, transform: BatchTransform, order: np.ndarray, dest: np.ndarray | None = None
    ) -> None:
        self._transform = transform
        if dest is None:
            self._order, self._dest = destinations(order, np.asarray(order).size)
        else:
            self._order, self._dest = order, np.asarray(dest, np.int64)
            if self._dest.shape != np.shape(order):
                raise ValueError(
                    f"window: dest has shape {self._dest.shape}, order {np.shape(order)}"
                )
        self._start = 0  # rows added so far
        # Decided by the first table with rows: the compiled path's arrays, or (when it
        # does not apply) the transformed tables, placed as they come.
        self._out: CompiledRows | None = None
        self._tables: list[pa.Table] = []  # tables without rows, before the path is decided
        self._blocks: list[Batch] = []  # the transformed tables, where not compiled
        # The blocks' rows in emission order while every block has one form; None before
        # the first block, and from a block of another form on (``shuffled`` then).
        self._placed: PlacedWindow | None = None
        self._mixed = False
        self._decided = False

    def add(self, table: pa.Table) -> None:
        """Place ``table``'s rows, the next ``table.num_rows`` of the window."""
        n, start = table.num_rows, self._start
        if start + n > len(self._dest):
            raise ValueError(f"window: {start + n} rows added, but order holds {len(self._dest)}")
        self._start += n
        t = self._transform
        if n == 0 or (self._decided and self._out is None):
            if self._decided:
                self._take(t._batch(table, contiguous=False), self._dest[start : start + n])
            elif self._out is None:
                self._tables.append(table)
            return
        layout, columns, lengths = t._read(table)
        if layout.compiled and lengths is None:
            # Columns chunked differently: one chunk each, and the compiled path applies.
            layout, columns, lengths = t._read(table.combine_chunks())
        if lengths is None:
            if self._out is not None:
                raise ValueError(
                    "window: a table the compiled path cannot take follows tables it took; "
                    "the tables of one window must share one schema"
                )
            self._decided = True
            # Transformed and placed now, while its columns are in cache.
            for empty in self._tables:
                self._take(t(empty), self._dest[start:start])
            self._tables = []
            # Its dense features stay feature-major: each row is placed, a copy anyway.
            self._take(t._batch(table, contiguous=False), self._dest[start : start + n])
            return
        if not self._decided:
            self._decided, self._tables = True, []
            self._out = t._allocate(len(self._dest), layout)
        assert self._out is not None
        t._write(columns, layout, lengths, self._dest[start : start + n], self._out)

    def _take(self, block: Batch, dest: np.ndarray) -> None:
        """Keep ``block`` (rows bound for ``dest``) and place its rows where its form
        allows."""
        self._blocks.append(block)
        if self._mixed:
            return
        if self._placed is None:
            self._placed = PlacedWindow.for_block(block, len(self._dest))
        if self._placed is None or not self._placed.add(block, dest):
            self._placed, self._mixed = None, True

    def finish(self) -> Batch:
        """The window's ``Batch``: row ``j`` is row ``order[j]`` of the tables added."""
        self._check_complete()
        if self._out is not None:
            return self._transform._finish(self._out)
        if self._blocks:
            if self._placed is not None:
                return self._placed.batch(0, len(self._dest))
            return shuffled(self._blocks, self._order)
        if not self._tables:
            return self._transform._empty()
        return self._transform.window(self._tables, self._order)

    def batches(self, pieces: list[tuple[int, int]]) -> list[Batch]:
        """``[finish().slice(a, b) for a, b in pieces]``, each built on its own where the
        window's rows were placed: no window-wide jagged batch is built to be cut up."""
        self._check_complete()
        if self._out is None and self._blocks and self._placed is not None:
            return [self._placed.batch(a, b) for a, b in pieces]
        window = self.finish()
        return [window.slice(a, b) for a, b in pieces]

    def _check_complete(self) -> None:
        if self._start != len(self._dest):
            raise ValueError(
                f"window: order holds {len(self._dest)} rows, but {self._start} were added"
            )

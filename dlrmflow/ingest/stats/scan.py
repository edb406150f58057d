"""The statistics pass: every day file of a dataset, one row group in memory at a time.

``dataset_stats`` gathers the statistics of every day in the manifest with whole-column
pyarrow and numpy work per row group, into running totals (``StatsAccumulator``: per
column, the counts and the ``sketches``) that merge exactly. So the ingest flow runs the
same pass one (cached, parallel) task per day (``file_stats``) and merges the days' totals
(``merge_stats``), with the same result bit for bit. Every file is checked against the
manifest's schema as it is read: a missing column, a drifted type or a bad label is a
``DataError`` naming the file, the row group and the column.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrmflow.ingest.dayfile import NotRegularFile, open_regular
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import Manifest, read_manifest
from dlrmflow.ingest.schema import DENSE, LABEL, SPARSE, criteo_schema
from dlrmflow.ingest.stats.cache_hits import lru_hit_rates
from dlrmflow.ingest.stats.results import DatasetStats, DenseStats, SparseStats
from dlrmflow.ingest.stats.sketches import (
    EXACT_SCALE,
    HyperLogLog,
    IdSample,
    SkewTotals,
    bucket_counts,
    exact_sum,
    hash_ids,
    integer_square_sum,
    sum_by_key,
)
from dlrmflow.ingest.strings import string_ids


def dataset_stats(url: str, manifest: Manifest | None = None) -> DatasetStats:
    """Scan every day file of the dataset at ``url`` and return its column statistics.

    Each file must have the columns of the manifest's schema with its types (Criteo's
    layout, one-hot or multi-hot, where it declares none); a missing column, a type that
    drifted, a label that is null or outside [0, 1], or a row group that cannot be decoded
    raises ``DataError`` naming the file, the row group and the column.

    This is ``file_stats`` of each day file, merged with ``merge_stats``: the ingest flow
    runs the same steps with one (cached, parallel) task per day. Every total merges
    exactly (integer sums, minima and maxima, the sketches' register-wise maximum), so the
    result is the same bit for bit however the files are grouped or ordered.
    """
    manifest = manifest if manifest is not None else read_manifest(url)
    columns, expected = declared_columns(manifest)
    parts = (
        file_stats(path, manifest.multi_hot, columns=columns, expected=expected)
        for path in manifest.day_paths(url)
    )
    return merge_stats(url, manifest.multi_hot, parts, columns=columns)


def declared_columns(manifest: Manifest) -> tuple[Columns | None, pa.Schema | None]:
    """The columns of a registered dataset's schema and their Arrow types (None, None:
    Criteo's layout)."""
    if manifest.features is None:
        return None, None
    declared = manifest.features
    columns = Columns(
        declared["label"],
        tuple(d["column"] for d in declared.get("dense", ())),
        tuple(f["column"] for f in declared["sparse"]),
    )
    types = {f["name"]: f["type"] for f in manifest.schema_}
    return columns, pa.schema([(name, _parse_type(types[name])) for name in columns.all])


def _parse_type(text: str) -> pa.DataType:
    """An Arrow type from the text ``str(type)`` gave (as manifests record it)."""
    return pa.type_for_alias(text) if "<" not in text else _nested_type(text)


def _nested_type(text: str) -> pa.DataType:
    inner = text[text.index("<") + 1 : text.rindex(">")]
    kind = text[: text.index("<")]
    if kind in ("list", "large_list"):
        value = _parse_type(inner.split(": ", 1)[-1])
        return pa.list_(value) if kind == "list" else pa.large_list(value)
    if kind == "dictionary":
        parts = dict(p.split("=", 1) for p in inner.split(", "))
        return pa.dictionary(_parse_type(parts["indices"]), _parse_type(parts["values"]))
    raise ValueError(f"unknown Arrow type {text!r}")


@dataclass(frozen=True)
class Columns:
    """The label, dense and sparse columns whose statistics are gathered."""

    label: str = LABEL
    dense: tuple[str, ...] = DENSE
    sparse: tuple[str, ...] = SPARSE

    @property
    def all(self) -> list[str]:
        return [self.label, *self.dense, *self.sparse]


def file_stats(
    path: str,
    multi_hot: bool = False,
    *,
    columns: Columns | None = None,
    expected: pa.Schema | None = None,
) -> StatsAccumulator:
    """The running totals of one day file (``merge_stats`` turns them into statistics).

    ``columns`` and their ``expected`` types are a registered dataset's (default: Criteo's
    layout, one-hot or ``multi_hot``). Memory is one row group plus 16 KiB of sketch per
    categorical feature, whatever the file's size. Raises ``DataError`` as
    ``dataset_stats`` does.
    """
    expected = criteo_schema(multi_hot) if expected is None else expected
    acc = StatsAccumulator(columns)
    try:
        f, _ = open_regular(path)  # a FIFO in a file's place is refused, never waited on
    except NotRegularFile as e:
        raise DataError(f"{path}: {e.strerror}") from e
    except OSError as e:
        raise DataError(f"{path}: cannot open: {e}") from e
    with f:
        try:
            parquet = pq.ParquetFile(f, pre_buffer=True)
        except Exception as e:
            raise DataError(f"{path}: cannot read Parquet footer: {e}") from e
        _check_schema(path, parquet.schema_arrow, expected)
        for group in range(parquet.metadata.num_row_groups):
            where = f"{path}, row group {group}"
            try:
                table = parquet.read_row_group(group, columns=acc.columns.all)
            except Exception as e:
                raise DataError(f"{where}: cannot decode: {e}") from e
            acc.add(table, where)
    return acc


def merge_stats(
    url: str, multi_hot: bool, parts: Iterable[StatsAccumulator], columns: Columns | None = None
) -> DatasetStats:
    """The statistics of the dataset at ``url`` whose files have the totals ``parts``."""
    acc = StatsAccumulator(columns)
    for part in parts:
        acc.merge(part)
    return acc.result(url, multi_hot)


def _check_schema(path: str, schema: pa.Schema, expected: pa.Schema) -> None:
    for field in expected:
        index = schema.get_field_index(field.name)
        if index < 0:
            raise DataError(f"{path}: column {field.name}: missing (schema drift)")
        actual = schema.field(index).type
        if not _same_type(actual, field.type):
            raise DataError(
                f"{path}: column {field.name}: type {actual}, the manifest says {field.type}"
            )


def _same_type(actual: pa.DataType, expected: pa.DataType) -> bool:
    """Type equality that ignores the name of a list's item field, which Parquet writers
    spell differently ("item", "element") for the same list of int64."""
    if pa.types.is_list(actual) and pa.types.is_list(expected):
        return actual.value_type == expected.value_type
    return actual == expected


class StatsAccumulator:
    """Running totals of every column: ``add`` takes one row group, ``merge`` another
    accumulator's totals (exactly: the result is as if its row groups had been added)."""

    def __init__(self, columns: Columns | None = None) -> None:
        self.columns = Columns() if columns is None else columns
        self.rows = self.positives = self.row_groups = 0
        self.dense = {name: _DenseTotals() for name in self.columns.dense}
        self.sparse = {name: _SparseTotals() for name in self.columns.sparse}

    def add(self, table: pa.Table, where: str) -> None:
        label = self.columns.label
        labels = table.column(label)
        if labels.null_count:
            raise DataError(f"{where}: column {label}: {labels.null_count} null labels")
        if pa.types.is_floating(labels.type):
            # Soft labels: any value in [0, 1]; the positives are their sum, rounded.
            bad = pc.sum(pc.invert(pc.and_(pc.greater_equal(labels, 0), pc.less_equal(labels, 1))))
            if bad.as_py():
                raise DataError(
                    f"{where}: column {label}: {bad.as_py()} values outside [0, 1] or NaN"
                )
            positives = round(pc.sum(labels.cast(pa.float64())).as_py() or 0)
        else:
            if pa.types.is_boolean(labels.type):
                labels = labels.cast(pa.int8())
            positives = pc.sum(labels).as_py() or 0
            bad = pc.sum(pc.invert(pc.is_in(labels, pa.array([0, 1], labels.type)))).as_py()
            if bad:
                raise DataError(f"{where}: column {label}: {bad} values that are not 0 or 1")
        self.rows += table.num_rows
        self.positives += positives
        self.row_groups += 1
        for name, totals in self.dense.items():
            totals.add(table.column(name))
        for name, totals in self.sparse.items():
            totals.add(table.column(name))

    def merge(self, other: StatsAccumulator) -> None:
        self.rows += other.rows
        self.positives += other.positives
        self.row_groups += other.row_groups
        for name, totals in self.dense.items():
            totals.merge(other.dense[name])
        for name, totals in self.sparse.items():
            totals.merge(other.sparse[name])

    def id_samples(self) -> dict[str, IdSample]:
        """Each categorical feature's sample of distinct IDs (see ``IdSample``)."""
        return {name: totals._skew().sample for name, totals in self.sparse.items()}

    def result(self, url: str, multi_hot: bool) -> DatasetStats:
        return DatasetStats(
            url=url,
            rows=self.rows,
            positives=self.positives,
            row_groups=self.row_groups,
            multi_hot=multi_hot,
            dense=tuple(t.result(name) for name, t in self.dense.items()),
            sparse=tuple(t.result(name, self.rows) for name, t in self.sparse.items()),
        )


class _DenseTotals:
    def __init__(self) -> None:
        self.present = self.missing = self.negatives = self.total = 0
        # Sum of the squares (each rounded to float64) in units of 2**-1074, exact; None
        # once a square overflowed float64 (no deviation then).
        self.squares: int | None = 0
        self.min: float | None = None
        self.max: float | None = None
        # The quantile sketch as plain lists (sorted keys), for the ingest flow's JSON.
        self.sketch_keys: list[int] = []
        self.sketch_counts: list[int] = []

    def add(self, column: pa.ChunkedArray) -> None:
        floating = pa.types.is_floating(column.type)
        if floating:  # NaN is missing, as the feature transform takes it
            column = pc.if_else(pc.is_nan(column), None, column)
        present = len(column) - column.null_count
        self.present += present
        self.missing += column.null_count
        if present == 0:
            return
        extremes = pc.min_max(column)
        low, high = extremes["min"].as_py(), extremes["max"].as_py()
        self.min = low if self.min is None else min(self.min, low)
        self.max = high if self.max is None else max(self.max, high)
        if floating:
            # Summed in float64, row group by row group in file order, correctly rounded.
            self.total = math.fsum([self.total, pc.sum(column.cast(pa.float64())).as_py()])
        else:
            # Exact integer sums: the mean does not depend on the order row groups come in.
            self.total += pc.sum(column.cast(pa.int64())).as_py()
        self.negatives += pc.sum(pc.less(column, 0)).as_py()
        values = pc.drop_null(column).to_numpy()  # the present values (NaN became null)
        if floating:
            values = values.astype(np.float64, copy=False)
            if self.squares is not None:
                square_sum = exact_sum(np.square(values))
                self.squares = None if square_sum is None else self.squares + square_sum
            values = values[np.isfinite(values)]
        elif self.squares is not None:
            self.squares += integer_square_sum(values.astype(np.int64)) * EXACT_SCALE
        self._add_sketch(*bucket_counts(values.astype(np.float64, copy=False)))

    def _add_sketch(self, keys: np.ndarray, counts: np.ndarray) -> None:
        merged_keys, merged_counts = sum_by_key(
            np.concatenate([np.array(self.sketch_keys, np.int64), keys.astype(np.int64)]),
            np.concatenate([np.array(self.sketch_counts, np.int64), counts]),
        )
        self.sketch_keys = merged_keys.tolist()
        self.sketch_counts = merged_counts.tolist()

    def merge(self, other: _DenseTotals) -> None:
        self.present += other.present
        self.missing += other.missing
        self.negatives += other.negatives
        both = (self.total, other.total)
        self.total = math.fsum(both) if any(isinstance(t, float) for t in both) else sum(both)
        self.squares = (
            None if self.squares is None or other.squares is None else self.squares + other.squares
        )
        self._add_sketch(
            np.array(other.sketch_keys, np.int64), np.array(other.sketch_counts, np.int64)
        )
        if other.min is not None:
            self.min = other.min if self.min is None else min(self.min, other.min)
        if other.max is not None:
            self.max = other.max if self.max is None else max(self.max, other.max)

    def result(self, name: str) -> DenseStats:
        mean = self.total / self.present if self.present else None
        std = None
        if mean is not None and math.isfinite(mean) and self.squares is not None:
            mean_square = float(Fraction(self.squares, EXACT_SCALE * self.present))
            std = math.sqrt(max(mean_square - mean * mean, 0.0))
        return DenseStats(
            name,
            self.present,
            self.missing,
            self.min,
            self.max,
            mean,
            self.negatives,
            std,
            tuple(self.sketch_keys),
            tuple(self.sketch_counts),
        )


class _SparseTotals:
    def __init__(self) -> None:
        self.missing = self.empty = self.ids = self.max_length = 0
        self.sketch = HyperLogLog()
        # ``SkewTotals`` as plain ints and lists, not arrays: the ingest flow's per-day
        # records carry every field but the sketch as JSON (hashes as signed int64).
        self.sample_level = 0
        self.sample_hashes: list[int] = []
        self.sample_counts: list[int] = []
        self.hot_hashes: list[int] = []
        self.hot_counts: list[int] = []

    def _skew(self) -> SkewTotals:
        def array(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64)

        return SkewTotals(
            IdSample(
                self.sample_level,
                array(self.sample_hashes).view(np.uint64),
                array(self.sample_counts),
            ),
            array(self.hot_hashes).view(np.uint64),
            array(self.hot_counts),
        )

    def _keep_skew(self, skew: SkewTotals) -> None:
        self.sample_level = skew.sample.level
        self.sample_hashes = skew.sample.hashes.view(np.int64).tolist()
        self.sample_counts = skew.sample.counts.tolist()
        self.hot_hashes = skew.hot_hashes.view(np.int64).tolist()
        self.hot_counts = skew.hot_counts.tolist()

    def add(self, column: pa.ChunkedArray) -> None:
        self.missing += column.null_count
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            lengths = pc.list_value_length(column)
            self.empty += pc.sum(pc.equal(lengths, 0)).as_py() or 0
            self.max_length = max(self.max_length, pc.max(lengths).as_py() or 0)
            values = pc.list_flatten(column).drop_null()
        else:
            values = column.drop_null()
            self.max_length = max(self.max_length, 1 if len(values) else 0)
        self.ids += len(values)
        if len(values) == 0:
            return
        hashed = hash_ids(_int64_ids(values))
        skew = self._skew()
        skew.add_hashes(hashed)
        self._keep_skew(skew)
        self.sketch.add_hashes(hashed)

    def merge(self, other: _SparseTotals) -> None:
        self.missing += other.missing
        self.empty += other.empty
        self.ids += other.ids
        self.max_length = max(self.max_length, other.max_length)
        self.sketch.merge(other.sketch)
        skew = self._skew()
        skew.merge(other._skew())
        self._keep_skew(skew)

    def result(self, name: str, rows: int) -> SparseStats:
        distinct = round(self.sketch.estimate())
        counts, weights = self._skew().representatives(self.ids, distinct)
        return SparseStats(
            name=name,
            rows=rows,
            missing=self.missing,
            empty=self.empty,
            ids=self.ids,
            distinct=distinct,
            max_length=self.max_length,
            skew_sample=len(counts),
            cache_hits=lru_hit_rates(counts, weights) if len(counts) else (),
        )


def _int64_ids(values: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A column's IDs as int64: string IDs by the stable hash the feature transform uses
    (``ingest.strings``), so that distinct counts are those of the IDs it maps."""
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
        return np.concatenate([string_ids(c) for c in chunks]) if chunks else np.zeros(0, np.int64)
    return np.asarray(values.to_numpy(), dtype=np.int64)

"""Feature statistics of a Parquet dataset, in one streaming pass over its row groups.

Sizing embedding tables (hash buckets, vocabulary caps), choosing dense transforms and
spotting a broken upstream export all start from the same facts: how often each column is
missing, the range of the counts, how many distinct IDs each categorical feature has and how
long multi-hot lists are. ``dataset_stats`` gathers them for every day in the manifest, one
row group in memory at a time, with whole-column pyarrow and numpy work per row group.

Distinct IDs are estimated with a HyperLogLog sketch rather than counted exactly: real
Criteo features reach hundreds of millions of distinct IDs over a month, which an exact set
would hold in gigabytes, while a sketch is 16 KiB per feature whatever the data size. Row
groups merge by an element-wise maximum, so the result does not depend on the reading order
and is bitwise reproducible; the relative standard error is 1.04 / sqrt(2**14), about 0.8%.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrmflow.ingest.manifest import Manifest, join_url, read_manifest, write_json
from dlrmflow.ingest.reader import DataError
from dlrmflow.ingest.schema import DENSE, LABEL, SPARSE, criteo_schema

STATS_NAME = "stats.json"

# 2**14 registers: 0.8% error for 16 KiB a feature; more buys little for table sizing.
HLL_PRECISION = 14
_HLL_SUFFIX_BITS = 64 - HLL_PRECISION  # hash bits left after the register index


@dataclass(frozen=True)
class DenseStats:
    """One integer count column. ``mean`` is over the present values (None if all missing)."""

    name: str
    present: int
    missing: int
    min: int | None
    max: int | None
    mean: float | None
    negatives: int  # Criteo's I2 has a few; transforms that take logs must clip them

    @property
    def missing_rate(self) -> float:
        return self.missing / max(self.present + self.missing, 1)


@dataclass(frozen=True)
class SparseStats:
    """One categorical column: a nullable ID, or (multi-hot) a list of IDs per row.

    ``ids`` counts every ID occurrence, ``distinct`` estimates the distinct IDs. ``missing``
    counts null rows; ``empty`` counts empty lists (always 0 for one-hot columns).
    """

    name: str
    rows: int
    missing: int
    empty: int
    ids: int
    distinct: int
    max_length: int

    @property
    def missing_rate(self) -> float:
        return self.missing / max(self.rows, 1)

    @property
    def mean_length(self) -> float:
        """IDs per row that has any (1.0 for one-hot columns)."""
        return self.ids / max(self.rows - self.missing - self.empty, 1)


@dataclass(frozen=True)
class DatasetStats:
    """Statistics of every column of a dataset's day files (all days, the test day too)."""

    url: str
    rows: int
    positives: int
    row_groups: int
    multi_hot: bool
    dense: tuple[DenseStats, ...]
    sparse: tuple[SparseStats, ...]

    @property
    def positive_rate(self) -> float:
        return self.positives / max(self.rows, 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DatasetStats:
        return cls(
            **{
                **data,
                "dense": tuple(DenseStats(**d) for d in data["dense"]),
                "sparse": tuple(SparseStats(**s) for s in data["sparse"]),
            }
        )


def dataset_stats(url: str, manifest: Manifest | None = None) -> DatasetStats:
    """Scan every day file of the dataset at ``url`` and return its column statistics.

    Each file must have the Criteo columns with the types of the manifest's layout (one-hot
    or multi-hot); a missing column, a type that drifted, a label that is null or not 0/1,
    or a row group that cannot be decoded raises ``DataError`` naming the file, the row
    group and the column.

    This is ``file_stats`` of each day file, merged with ``merge_stats``: the ingest flow
    runs the same steps with one (cached, parallel) task per day. Every total merges
    exactly (integer sums, minima and maxima, the sketches' register-wise maximum), so the
    result is the same bit for bit however the files are grouped or ordered.
    """
    manifest = manifest if manifest is not None else read_manifest(url)
    parts = (file_stats(path, manifest.multi_hot) for path in manifest.day_paths(url))
    return merge_stats(url, manifest.multi_hot, parts)


def file_stats(path: str, multi_hot: bool = False) -> StatsAccumulator:
    """The running totals of one day file (``merge_stats`` turns them into statistics).

    Memory is one row group plus 16 KiB of sketch per categorical feature, whatever the
    file's size. Raises ``DataError`` as ``dataset_stats`` does.
    """
    expected = criteo_schema(multi_hot)
    acc = StatsAccumulator()
    try:
        f = fsspec.open(path, "rb").open()
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
                table = parquet.read_row_group(group)
            except Exception as e:
                raise DataError(f"{where}: cannot decode: {e}") from e
            acc.add(table, where)
    return acc


def merge_stats(url: str, multi_hot: bool, parts: Iterable[StatsAccumulator]) -> DatasetStats:
    """The statistics of the dataset at ``url`` whose files have the totals ``parts``."""
    acc = StatsAccumulator()
    for part in parts:
        acc.merge(part)
    return acc.result(url, multi_hot)


def write_stats(root: str, stats: DatasetStats) -> str:
    """Write ``stats.json`` beside the dataset's manifest; returns its URL."""
    return write_json(root, STATS_NAME, stats.to_dict())


def read_stats(root: str) -> DatasetStats:
    """Read the ``stats.json`` that ``write_stats`` wrote under ``root``."""
    url = join_url(root, STATS_NAME)
    try:
        with fsspec.open(url, "r") as f:
            return DatasetStats.from_dict(json.load(f))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url}: no feature statistics; run the ingest flow") from e


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

    def __init__(self) -> None:
        self.rows = self.positives = self.row_groups = 0
        self.dense = {name: _DenseTotals() for name in DENSE}
        self.sparse = {name: _SparseTotals() for name in SPARSE}

    def add(self, table: pa.Table, where: str) -> None:
        labels = table.column(LABEL)
        if labels.null_count:
            raise DataError(f"{where}: column {LABEL}: {labels.null_count} null labels")
        positives = pc.sum(labels).as_py() or 0
        bad = pc.sum(pc.invert(pc.is_in(labels, pa.array([0, 1], labels.type)))).as_py()
        if bad:
            raise DataError(f"{where}: column {LABEL}: {bad} values that are not 0 or 1")
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
        self.min: int | None = None
        self.max: int | None = None

    def add(self, column: pa.ChunkedArray) -> None:
        present = len(column) - column.null_count
        self.present += present
        self.missing += column.null_count
        if present == 0:
            return
        extremes = pc.min_max(column)
        low, high = extremes["min"].as_py(), extremes["max"].as_py()
        self.min = low if self.min is None else min(self.min, low)
        self.max = high if self.max is None else max(self.max, high)
        # Exact integer sums: the mean does not depend on the order row groups come in.
        self.total += pc.sum(column.cast(pa.int64())).as_py()
        self.negatives += pc.sum(pc.less(column, 0)).as_py()

    def merge(self, other: _DenseTotals) -> None:
        self.present += other.present
        self.missing += other.missing
        self.negatives += other.negatives
        self.total += other.total
        if other.min is not None:
            self.min = other.min if self.min is None else min(self.min, other.min)
        if other.max is not None:
            self.max = other.max if self.max is None else max(self.max, other.max)

    def result(self, name: str) -> DenseStats:
        mean = self.total / self.present if self.present else None
        return DenseStats(
            name, self.present, self.missing, self.min, self.max, mean, self.negatives
        )


class _SparseTotals:
    def __init__(self) -> None:
        self.missing = self.empty = self.ids = self.max_length = 0
        self.sketch = HyperLogLog()

    def add(self, column: pa.ChunkedArray) -> None:
        self.missing += column.null_count
        if pa.types.is_list(column.type):
            lengths = pc.list_value_length(column)
            self.empty += pc.sum(pc.equal(lengths, 0)).as_py() or 0
            self.max_length = max(self.max_length, pc.max(lengths).as_py() or 0)
            values = pc.list_flatten(column)
        else:
            values = column.drop_null()
            self.max_length = max(self.max_length, 1 if len(values) else 0)
        self.ids += len(values)
        self.sketch.add(values.to_numpy())

    def merge(self, other: _SparseTotals) -> None:
        self.missing += other.missing
        self.empty += other.empty
        self.ids += other.ids
        self.max_length = max(self.max_length, other.max_length)
        self.sketch.merge(other.sketch)

    def result(self, name: str, rows: int) -> SparseStats:
        return SparseStats(
            name=name,
            rows=rows,
            missing=self.missing,
            empty=self.empty,
            ids=self.ids,
            distinct=round(self.sketch.estimate()),
            max_length=self.max_length,
        )


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
        if values.size == 0:
            return
        hashed = _splitmix64(values.astype(np.int64, copy=False).view(np.uint64))
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

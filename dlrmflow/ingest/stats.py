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
logs, a Zipf-like head): on Zipf-distributed IDs (exponents 0.7-1.1, 2M IDs, 10M accesses)
its hit rates were off by up to 0.55; with the hot IDs counted apart, by at most 0.035.
``cache_hits`` records the expected hit rate of an LRU cache holding a range of fractions of
the distinct IDs, by Che's approximation over one training pass (``lru_hit_rates``).

Dense columns get what the declared transforms need: the standard deviation beside the mean
(``standardize``) and a quantile sketch (``bucketize`` with ``buckets``). The sketch is a
log-linear histogram of the values' float64 bit patterns, the sign, the exponent and the
top ``SKETCH_MANTISSA_BITS`` bits of the mantissa as each bucket's key (HDR Histogram's
layout): integer arithmetic only, so every CPU puts a value in the same bucket; counts per
key merge by addition, exactly and in any order; and a quantile read from it is within
``2**-SKETCH_MANTISSA_BITS`` (0.8%) of the true one, relative (subnormal values share the
bucket of zero), while integers below 256 keep buckets of their own (exact quantiles for
counts and codes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrmflow.ingest.dayfile import NotRegularFile, open_regular
from dlrmflow.ingest.manifest import STATS_NAME, Manifest, join_url, read_manifest, write_json
from dlrmflow.ingest.reader import DataError
from dlrmflow.ingest.schema import DENSE, LABEL, SPARSE, criteo_schema
from dlrmflow.ingest.strings import string_ids

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
# Cache sizes, as fractions of a feature's distinct IDs, at which ``cache_hits`` is recorded
# (log-spaced: hit rates of skewed accesses grow about with the log of the cache size).
CACHE_FRACTIONS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
_CHE_BISECTIONS = 60  # halvings of the bracket on each LRU window: far below the noise
# Mantissa bits a dense quantile sketch's bucket keeps: 128 buckets an octave.
SKETCH_MANTISSA_BITS = 7
_SKETCH_SHIFT = 52 - SKETCH_MANTISSA_BITS
_ABS_BITS = np.int64(0x7FFF_FFFF_FFFF_FFFF)
# Every float64 is an integer multiple of 2**-1074 (the smallest subnormal): sums of squares
# are kept as such integers, exact, so they merge alike in any order.
_EXACT_SCALE = 1 << 1074


@dataclass(frozen=True)
class DenseStats:
    """One numeric column. ``mean`` and ``std`` (the population standard deviation) are
    over the present values (None if all missing); a floating column's NaN counts as
    missing, as the feature transform takes it. ``sketch_keys`` and ``sketch_counts`` are
    the finite present values' quantile sketch (see the module's docstring). Statistics
    written before deviations and sketches have None and empty ones.
    """

    name: str
    present: int
    missing: int
    min: float | None
    max: float | None
    mean: float | None
    negatives: int  # Criteo's I2 has a few; transforms that take logs must clip them
    std: float | None = None
    sketch_keys: tuple[int, ...] = ()
    sketch_counts: tuple[int, ...] = ()

    @property
    def missing_rate(self) -> float:
        return self.missing / max(self.present + self.missing, 1)

    def filled_moments(self, fill: float) -> tuple[float, float]:
        """(mean, population standard deviation) of the column once every missing value
        is ``fill``: the present values' moments and the fills' combined as two groups
        (Chan et al.'s update, without the cancellation of a sum of squares)."""
        if not self.present or self.mean is None:
            return float(fill), 0.0
        n = self.present + self.missing
        mean, std = self.mean, self.std or 0.0
        filled_mean = (self.present * mean + self.missing * fill) / n
        m2 = self.present * std * std + self.present * self.missing / n * (mean - fill) ** 2
        return float(filled_mean), float(math.sqrt(m2 / n))

    def boundaries(self, buckets: int, fill: float) -> tuple[float, ...]:
        """The ``i / buckets`` quantiles (``i`` in ``1..buckets-1``) of the column once
        every missing value is ``fill``, repeats merged: boundaries for ``buckets`` equally
        filled buckets, fewer where the values are few.

        A quantile is the value at rank ``floor(q * count)`` (counting from 0), read as the
        value of its sketch bucket nearest zero, so that ``x >= boundary`` puts that rank
        and all above it in the upper bucket."""
        keys = np.array(self.sketch_keys, np.int64)
        counts = np.array(self.sketch_counts, np.int64)
        if self.missing:
            fill_key = int(sketch_keys(np.array([fill], np.float64))[0])
            keys, counts = _sum_by_key(
                np.append(keys, fill_key), np.append(counts, np.int64(self.missing))
            )
        total = int(counts.sum())
        if total == 0:
            return (float(fill),)
        cumulative = np.cumsum(counts) * buckets  # exact: rank > i * total / buckets
        ranks = np.arange(1, buckets, dtype=np.int64) * total
        found = np.searchsorted(cumulative, ranks, side="right")
        return tuple(float(v) for v in np.unique(sketch_values(keys[found])))


@dataclass(frozen=True)
class SparseStats:
    """One categorical column: a nullable ID, or (multi-hot) a list of IDs per row.

    ``ids`` counts every ID occurrence, ``distinct`` estimates the distinct IDs. ``missing``
    counts null rows; ``empty`` counts empty lists (always 0 for one-hot columns).

    ``cache_hits`` holds ``(fraction, hit_rate)`` points: the expected share of lookups an
    LRU cache holding ``fraction`` of the distinct IDs serves over one pass of the data,
    estimated from ``skew_sample`` distinct IDs with their exact counts (empty when the
    column has no IDs, or the file was written before it was recorded).
    """

    name: str
    rows: int
    missing: int
    empty: int
    ids: int
    distinct: int
    max_length: int
    skew_sample: int = 0
    cache_hits: tuple[tuple[float, float], ...] = ()

    @property
    def missing_rate(self) -> float:
        return self.missing / max(self.rows, 1)

    @property
    def mean_length(self) -> float:
        """IDs per row that has any (1.0 for one-hot columns)."""
        return self.ids / max(self.rows - self.missing - self.empty, 1)

    @property
    def access_rate(self) -> float:
        """The share of rows with at least one ID: rows whose bag is looked up at all."""
        return (self.rows - self.missing - self.empty) / max(self.rows, 1)


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
                "dense": tuple(
                    DenseStats(
                        **{
                            **d,
                            "sketch_keys": tuple(d.get("sketch_keys", ())),
                            "sketch_counts": tuple(d.get("sketch_counts", ())),
                        }
                    )
                    for d in data["dense"]
                ),
                "sparse": tuple(
                    SparseStats(
                        **{
                            **s,
                            "cache_hits": tuple(
                                (float(f), float(h)) for f, h in s.get("cache_hits", ())
                            ),
                        }
                    )
                    for s in data["sparse"]
                ),
            }
        )


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


def write_stats(root: str, stats: DatasetStats) -> str:
    """Write ``stats.json`` beside the dataset's manifest; returns its URL."""
    return write_json(root, STATS_NAME, stats.to_dict())


def read_stats(root: str) -> DatasetStats:
    """Read the ``stats.json`` that ``write_stats`` wrote under ``root``. A missing file
    raises ``FileNotFoundError``; one that is not statistics raises ``DataError``, each
    naming the file."""
    url = join_url(root, STATS_NAME)
    try:
        with fsspec.open(url, "r") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url}: no feature statistics; run the ingest flow") from e
    except ValueError as e:
        raise DataError(f"{url}: not JSON: {e}") from e
    try:
        return DatasetStats.from_dict(data)
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{url}: not feature statistics ({type(e).__name__}: {e})") from e


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
            self.squares += _integer_square_sum(values.astype(np.int64)) * _EXACT_SCALE
        self._add_sketch(*_bucket_counts(values.astype(np.float64, copy=False)))

    def _add_sketch(self, keys: np.ndarray, counts: np.ndarray) -> None:
        merged_keys, merged_counts = _sum_by_key(
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
            mean_square = float(Fraction(self.squares, _EXACT_SCALE * self.present))
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
        hashed = _hash_ids(_int64_ids(values))
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


class SkewTotals:
    """How a feature's accesses spread over its IDs, in bounded memory: its hot IDs (the
    ``HOT_IDS_PER_ROW_GROUP`` most accessed of each row group, those accesses summed) and an
    ``IdSample`` of all its distinct IDs. Both merge exactly, in any order."""

    def __init__(self, sample: IdSample, hot_hashes: np.ndarray, hot_counts: np.ndarray) -> None:
        self.sample = sample
        self.hot_hashes = hot_hashes  # sorted, unique
        self.hot_counts = hot_counts

    def add_hashes(self, hashed: np.ndarray) -> None:
        """Count one row group's accesses, whose ID hashes (``_hash_ids``) are ``hashed``."""
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
        self.hot_hashes, self.hot_counts = _sum_by_key(
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


def _sum_by_key(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
        """Count ``counts`` accesses of the IDs whose hashes (``_hash_ids``) are ``keys``."""
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
        self.hashes, self.counts = _sum_by_key(
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


def lru_hit_rates(
    counts: np.ndarray,
    weights: np.ndarray | None = None,
    fractions: Sequence[float] = CACHE_FRACTIONS,
) -> tuple[tuple[float, float], ...]:
    """``(fraction, hit_rate)`` for an LRU cache holding each ``fraction`` of the distinct
    IDs, over one pass of accesses in which IDs were accessed ``counts`` times (each
    standing for ``weights`` IDs so accessed; default 1).

    Che's approximation: with IDs referenced independently with probabilities ``p``, an LRU
    cache of C entries holds an ID when it was referenced within the last T references,
    where T solves ``sum(1 - exp(-p T)) = C``; a reference to ID i hits with probability
    ``1 - exp(-p_i T)``. One pass: the first access to every ID misses whatever the cache,
    so only ``count - 1`` accesses of each can hit (a cache of every ID hits
    ``1 - distinct / accesses`` of them).
    """
    counts = np.asarray(counts, dtype=np.float64)
    weights = np.ones(len(counts)) if weights is None else np.asarray(weights, np.float64)
    total = float(np.sum(weights * counts))
    ids = float(weights.sum())
    p = counts / total
    wanted = np.array(fractions, dtype=np.float64)
    partial = wanted < 1.0  # a cache of every ID holds every ID: no T to solve for

    def held(t: np.ndarray) -> np.ndarray:
        """The share of IDs an LRU cache of window ``t`` (one per fraction) holds."""
        return (-np.expm1(-np.outer(t, p)) * weights).sum(axis=1) / ids

    # bisect every fraction's T at once, between 0 and a doubling that overshoots it
    low, high = np.zeros(len(wanted)), np.ones(len(wanted))
    while (short := partial & (held(high) < wanted)).any():
        high[short] *= 2.0
    for _ in range(_CHE_BISECTIONS):
        middle = 0.5 * (low + high)
        below = held(middle) < wanted
        low = np.where(below, middle, low)
        high = np.where(below, high, middle)
    resident = np.where(partial[:, None], -np.expm1(-np.outer(high, p)), 1.0)
    hits = (resident * (weights * np.maximum(counts - 1.0, 0.0))).sum(axis=1) / total
    return tuple((float(f), float(h)) for f, h in zip(wanted, hits, strict=True))


def interpolate_hit_rate(points: Sequence[Sequence[float]], fraction: float) -> float:
    """The hit rate of a cache holding ``fraction`` of the distinct IDs, from the
    ``(fraction, hit_rate)`` points of ``SparseStats.cache_hits``: linear in the log of the
    fraction between points (skewed accesses' hit rates grow about so), linear from no cache
    to the first point, and the last point's rate past it."""
    xs = np.array([x for x, _ in points], dtype=np.float64)
    hs = np.array([h for _, h in points], dtype=np.float64)
    if fraction <= 0:
        return 0.0
    if fraction < xs[0]:
        return float(hs[0] * fraction / xs[0])
    return float(np.interp(np.log(fraction), np.log(xs), hs))


def _bucket_counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def _integer_square_sum(values: np.ndarray) -> int:
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


def _int64_ids(values: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A column's IDs as int64: string IDs by the stable hash the feature transform uses
    (``ingest.strings``), so that distinct counts are those of the IDs it maps."""
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
        return np.concatenate([string_ids(c) for c in chunks]) if chunks else np.zeros(0, np.int64)
    return np.asarray(values.to_numpy(), dtype=np.int64)


def _hash_ids(values: np.ndarray) -> np.ndarray:
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
        self.add_hashes(_hash_ids(values))

    def add_hashes(self, hashed: np.ndarray) -> None:
        """Add values by their ``_hash_ids`` hashes (``hashed`` is overwritten)."""
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

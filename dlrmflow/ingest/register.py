"""Registering a dataset where it lies: day-partitioned Parquet that already exists becomes
a dataset every stage reads, without copying a byte of it.

A team's logs are already Parquet, partitioned by day in Hive's style (``day=N/`` or
``dt=YYYY-MM-DD/`` folders), or hold a column that says each row's day (the schema's
``day_column``: a date, a timestamp or an integer). ``register_dataset`` reads every
file's footer and checks its columns against the declared schema (``dlrmflow.schema``),
reads the label column for each file's rows and positive rate, gathers the features'
statistics (distinct IDs size the hash tables, as generated data's cardinalities do), and
writes ``manifest.json`` and ``stats.json`` beside the data: nothing else is written. Days
are numbered 0, 1, ... in partition order (``dt=`` dates sort as dates); the last is the
test day.

With a day column, every file below the dataset's folder is data (in any folder layout;
names starting with ``_`` or ``.`` aside) and must hold one day: the reader reads by file,
and nothing is copied to split one. Each file's day comes from its footer's statistics
(the column's least and greatest value in each row group), or where a writer left them
out, from the column itself. A timestamp's day is its date where its time zone says (as
written, without one); the days found are numbered 0, 1, ... in order, as folders are,
and the manifest names each one (``day_column=2026-11-01``, or ``day_column=N`` for
integers).

Each file's identity is its size and the digest of its Parquet footer (the metadata of
every row group), which a rewritten or replaced file changes without the data being read
again (``check_dataset`` holds the files to it before any run). Registering again keeps
the files whose size and footer are unchanged without reading their labels.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import date

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrmflow.ingest.dayfile import footer_digest, open_regular
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.lock import dataset_lock
from dlrmflow.ingest.manifest import (
    MANIFEST_NAME,
    STATS_NAME,
    DayFile,
    Manifest,
    join_url,
    read_manifest,
    write_manifest,
)
from dlrmflow.ingest.schema import schema_to_json
from dlrmflow.ingest.stats.results import write_stats
from dlrmflow.ingest.stats.scan import Columns, file_stats, merge_stats
from dlrmflow.schema import FeatureSchema

SOURCE = "registered"
_DAY = re.compile(r"day=(\d+)")
_DATE = re.compile(r"dt=(\d{4}-\d{2}-\d{2})")
# Footers read at once with a day column: on object stores each is a round trip or two.
_FOOTER_THREADS = 16


class NoDayPartitions(DataError):
    """A folder without day folders: its days may be in a column, and the message says
    which of its columns could say them (``date_columns``) and ``how`` to name one (the
    schema's ``day_column``, or a command's option)."""

    def __init__(
        self,
        url: str,
        candidates: list[tuple[str, pa.DataType]],
        how: str = "the schema's day_column",
    ) -> None:
        self.url = url
        self.candidates = candidates
        super().__init__(
            f"{url}: no day partitions; expected day=N/ or dt=YYYY-MM-DD/ folders of Parquet, "
            f"or {how} naming {_day_column_hint(candidates)}"
        )


def _day_column_hint(candidates: list[tuple[str, pa.DataType]]) -> str:
    """What a day column could be: the date or timestamp columns seen, or what one is."""
    if not candidates:
        return "a date, timestamp or integer column of each row's day"
    seen = ", ".join(f"{name} ({kind})" for name, kind in candidates)
    return f"a column of each row's day ({seen} in the data)"


def date_columns(url: str) -> list[tuple[str, pa.DataType]]:
    """The date and timestamp columns (name, type) of the first data file below ``url``
    (in path order, names starting with ``_`` or ``.`` aside): the columns likeliest to
    say each row's day where no folder does. None where no file is found or readable."""
    fs, root = fsspec.core.url_to_fs(url)
    try:
        paths = _data_files(fs, root)
    except OSError:
        return []
    if not paths:
        return []
    try:
        f, _ = open_regular(join_url(url, paths[0]))
        with f:
            arrow = pq.ParquetFile(f).schema_arrow
    except Exception:  # a hint only: the error it adds to names the folder already
        return []
    return [
        (field.name, field.type)
        for field in arrow
        if pa.types.is_date(field.type) or pa.types.is_timestamp(field.type)
    ]


def _data_files(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Every data file below ``root``, relative to it and sorted: names starting with
    ``_`` or ``.`` (``_SUCCESS``, checksums, hidden folders) and the dataset's own files
    aside."""
    found = fs.find(root, detail=False)
    prefix = root.rstrip("/") + "/"
    return sorted(
        relative
        for relative in (p[len(prefix) :] for p in found if p.startswith(prefix))
        if relative not in (MANIFEST_NAME, STATS_NAME)
        and not any(part.startswith(("_", ".")) for part in relative.split("/"))
    )


@dataclass(frozen=True)
class Partition:
    """One day's folder (or a day column's files of one day): its day number, what names
    it and the Parquet files in it."""

    day: int
    name: str  # the folder's, or with a day column ``COLUMN=VALUE``
    files: tuple[str, ...]  # paths relative to the dataset root, in name order


def find_partitions(url: str, day_column: str | None = None) -> list[Partition]:
    """The day partitions under ``url``: ``day=N`` folders by N, or ``dt=YYYY-MM-DD``
    folders by date, numbered 0, 1, ... Files whose names start with ``_`` or ``.``
    (``_SUCCESS``, checksums) are not data. A mix of both kinds, a folder holding no
    Parquet file, two folders of one day or a date that is not one fail naming it.

    With ``day_column``, the files below ``url`` grouped by the day that column holds
    (``column_partitions``), whatever their folders."""
    if day_column is not None:
        return column_partitions(url, day_column)
    fs, root = fsspec.core.url_to_fs(url)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        raise DataError(f"{url}: no such folder") from None
    found: list[tuple[object, str, str]] = []
    kinds = set()
    for entry in entries:
        if entry["type"] != "directory":
            continue
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        day, when = _DAY.fullmatch(name), _DATE.fullmatch(name)
        if day:
            kinds.add("day=")
            found.append((int(day.group(1)), name, entry["name"]))
        elif when:
            kinds.add("dt=")
            try:
                found.append((date.fromisoformat(when.group(1)), name, entry["name"]))
            except ValueError:
                raise DataError(f"{url}/{name}: not a date") from None
    if not found:
        raise NoDayPartitions(url, date_columns(url))
    if len(kinds) > 1:
        raise DataError(f"{url}: day=N/ and dt=YYYY-MM-DD/ folders together; use one kind")
    keys = [k for k, _, _ in found]
    repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
    if repeated:
        raise DataError(f"{url}: two folders of day {repeated[0]}")
    partitions = []
    for number, (_, name, path) in enumerate(sorted(found, key=lambda f: f[0])):
        files = sorted(
            p.rstrip("/").rsplit("/", 1)[-1]
            for p in fs.ls(path, detail=False)
            if not p.rstrip("/").rsplit("/", 1)[-1].startswith(("_", ".")) and fs.isfile(p)
        )
        if not files:
            raise DataError(f"{url}/{name}: no data file")
        partitions.append(Partition(number, name, tuple(f"{name}/{f}" for f in files)))
    return partitions


def column_partitions(url: str, column: str) -> list[Partition]:
    """The files below ``url`` grouped by the one day each holds in ``column`` (see the
    module's docstring), numbered 0, 1, ... in the days' order. A file of no rows holds
    no day and nothing to read, so it is left out. Fails in one line naming the file
    (and row group) and the column: a file of two days (naming both), a null day, a
    column missing, of a type that holds no day, or of another type than the first
    file's; and a folder without a data file."""
    fs, root = fsspec.core.url_to_fs(url)
    try:
        paths = _data_files(fs, root)
    except FileNotFoundError:
        raise DataError(f"{url}: no such folder") from None
    if not paths:
        raise DataError(f"{url}: no data file (day_column {column} names each file's day)")
    with ThreadPoolExecutor(min(_FOOTER_THREADS, len(paths))) as pool:
        days = list(pool.map(lambda p: _file_day(join_url(url, p), column), paths))
    first: tuple[pa.DataType, str] | None = None
    by_day: dict[date | int, list[str]] = {}
    for path, (kind, day) in zip(paths, days, strict=True):
        first = first or (kind, path)
        if kind != first[0]:
            raise DataError(
                f"{join_url(url, path)}: column {column}: type {kind}, but "
                f"{join_url(url, first[1])} has {first[0]}: every file must have the same types"
            )
        if day is not None:
            by_day.setdefault(day, []).append(path)
    if not by_day:
        raise DataError(f"{url}: no rows in any file, so no day in column {column}")
    return [
        Partition(number, f"{column}={_day_text(day)}", tuple(by_day[day]))
        for number, day in enumerate(sorted(by_day))
    ]


def _day_text(day: date | int) -> str:
    return day.isoformat() if isinstance(day, date) else str(day)


def _day_type(t: pa.DataType) -> bool:
    return pa.types.is_date(t) or pa.types.is_timestamp(t) or pa.types.is_integer(t)


def _days_of(values: pa.Array) -> pa.Array:
    """Each value's day: a date (Arrow's cast takes a timestamp's date where its time zone
    says) or an integer."""
    if pa.types.is_timestamp(values.type) or pa.types.is_date(values.type):
        return values.cast(pa.date32())
    return values.cast(pa.int64())


def _file_day(url: str, column: str) -> tuple[pa.DataType, date | int | None]:
    """The type of ``column`` in the file at ``url`` and the one day it holds (None: the
    file has no rows), from the footer's statistics where every row group has them."""
    try:
        f, _ = open_regular(url)
        with f:
            parquet = pq.ParquetFile(f)
            kind, days = _row_group_days(url, parquet, column)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{url}: not a readable Parquet file: {type(e).__name__}: {e}") from None
    if not days:
        return kind, None
    low, high = min(days), max(days)
    if low != high:
        raise DataError(
            f"{url}: column {column}: rows of {_day_text(low)} and of {_day_text(high)}, but a "
            "file must hold one day: partition the data by day (each file one day's rows)"
        )
    return kind, low


def _row_group_days(
    url: str, parquet: pq.ParquetFile, column: str
) -> tuple[pa.DataType, list[date | int]]:
    """The type of ``column`` and the least and greatest day of each of its row groups."""
    arrow = parquet.schema_arrow
    index = arrow.get_field_index(column)
    if index < 0:
        raise DataError(f"{url}: column {column}: missing (the schema's day_column)")
    kind = arrow.field(index).type
    if not _day_type(kind):
        raise DataError(
            f"{url}: column {column}: type {kind} cannot be a day column (a date, a "
            "timestamp or an integer)"
        )
    metadata = parquet.metadata
    leaf = [metadata.schema.column(i).path for i in range(metadata.num_columns)].index(column)
    days: list[date | int] = []
    for group in range(metadata.num_row_groups):
        chunk = metadata.row_group(group)
        if chunk.num_rows == 0:
            continue
        where = f"{url}, row group {group}, column {column}"
        stats = chunk.column(leaf).statistics
        if stats is not None and stats.has_min_max and stats.has_null_count:
            nulls = stats.null_count
            bounds = _days_of(pa.array([stats.min, stats.max], kind))
        else:  # no statistics: the column itself, this row group's
            values = parquet.read_row_group(group, columns=[column]).column(0)
            nulls = values.null_count
            bounds = _days_of(values.combine_chunks().drop_null())
        if nulls:
            raise DataError(f"{where}: {nulls} rows with no day (null)")
        days += [pc.min(bounds).as_py(), pc.max(bounds).as_py()]
    return kind, days


def register_dataset(
    url: str,
    schema: FeatureSchema,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Register the day-partitioned Parquet at ``url`` under ``schema`` (see the module's
    docstring) and return its manifest. ``progress(n)`` is called with the rows of each
    file read. Any file that does not fit the schema fails in one line naming the file,
    row group and column, with nothing written. The schema's ``day_column``, if it names
    one, says each file's day (``column_partitions``) instead of its folder."""
    with dataset_lock(url, "register"):
        return _register(url, schema, progress)


def _register(url: str, schema: FeatureSchema, progress: Callable[[int], None] | None) -> Manifest:
    partitions = find_partitions(url, schema.day_column)
    if len(partitions) < 2:
        raise DataError(
            f"{url}: one day partition; a dataset needs a day to train on and a test day"
        )
    before = _previous(url)
    types: dict[str, tuple[pa.DataType, str]] = {}  # column -> (type, the first file with it)
    files: list[DayFile] = []
    columns = Columns(schema.label, schema.dense_names, schema.sparse_names)
    for partition in partitions:
        for path in partition.files:
            full = join_url(url, path)
            size, digest, arrow = _footer(full)
            _check_columns(full, arrow, schema, types)
            kept = before.get(path)
            if kept is not None and (kept.bytes, kept.digest, kept.day) == (
                size,
                digest,
                partition.day,
            ):
                files.append(kept)
                continue
            rows, positives = _labels(full, schema.label)
            if progress is not None:
                progress(rows)
            files.append(
                DayFile(
                    day=partition.day,
                    path=path,
                    rows=rows,
                    positive_rate=positives / rows if rows else 0.0,
                    digest=digest,
                    bytes=size,
                )
            )
    expected = pa.schema([(name, types[name][0]) for name in schema.columns])
    stats = merge_stats(
        url,
        _multi_hot(expected, schema),
        (file_stats(join_url(url, f.path), columns=columns, expected=expected) for f in files),
        columns=columns,
    )
    rows = sum(f.rows for f in files)
    positives = sum(f.positive_rate * f.rows for f in files)
    manifest = Manifest(
        source=SOURCE,
        rows=rows,
        days=len(partitions),
        test_day=partitions[-1].day,
        positive_rate=positives / rows if rows else 0.0,
        multi_hot=_multi_hot(expected, schema),
        files=files,
        schema=schema_to_json(expected),
        cardinalities={s.name: max(s.distinct, 1) for s in stats.sparse},
        generator={"partitions": [p.name for p in partitions]},
        features=schema.to_dict(),
    )
    write_stats(url, stats)
    write_manifest(url, manifest)
    return manifest


def _previous(url: str) -> dict[str, DayFile]:
    """The files a registration before this one listed, by path (none if it was not one)."""
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(join_url(root, MANIFEST_NAME)):
        return {}
    try:
        manifest = read_manifest(url)
    except (OSError, ValueError):
        return {}
    if manifest.source != SOURCE:
        raise DataError(
            f"{url}: holds a {manifest.source} dataset (its manifest.json); register "
            "Parquet that no other command wrote"
        )
    return {f.path: f for f in manifest.files}


def _footer(url: str) -> tuple[int, str, pa.Schema]:
    try:
        f, stamp = open_regular(url)
        with f:
            digest = footer_digest(f, stamp.size)
            arrow = pq.ParquetFile(f).schema_arrow
    except (OSError, ValueError) as e:
        raise DataError(f"{url}: not a readable Parquet file: {e}") from None
    except Exception as e:
        raise DataError(f"{url}: not a readable Parquet file: {type(e).__name__}: {e}") from None
    return stamp.size, digest, arrow


def _check_columns(
    url: str,
    arrow: pa.Schema,
    schema: FeatureSchema,
    seen: dict[str, tuple[pa.DataType, str]],
) -> None:
    """Every declared column present in ``arrow`` with a type its role takes, and the
    type every file before had (``seen``, filled from the first file).

    Per-ID weights and crosses are held to what the feature transform takes: a weight
    column is a list (or large list) of integers or floats beside a list of IDs and one
    integer or float beside a one-hot ID (a list of one weight is not one); a crossed
    column holds one ID a row, never a list."""
    roles = [(schema.label, "label", _label_type)]
    if schema.weight is not None:
        roles.append((schema.weight, "weight", _dense_type))
    roles += [(name, "dense feature", _dense_type) for name in schema.dense_names]
    roles += [(name, "sparse feature", _id_type) for name in schema.sparse_names]
    roles += [(name, "key", _any_type) for name in schema.keys if name not in schema.columns]
    for name, role, fits in roles:
        kind = _column_type(url, arrow, name, role)
        if not fits(kind):
            raise DataError(f"{url}: column {name}: type {kind} cannot be a {role}")
        _same_as_before(url, name, kind, seen)
    for feature in schema.sparse:
        if feature.weights is None:
            continue
        name, ids = feature.weights, arrow.field(feature.column).type
        kind = _column_type(url, arrow, name, f"per-ID weights of {feature.column}")
        if _is_list(ids):
            fits = _is_list(kind) and _dense_type(kind.value_type)
            wanted = "a list of integers or floats a row, as its IDs are a list"
        else:
            fits = _dense_type(kind)
            wanted = "one integer or float a row, as it has one ID a row"
        if not fits:
            raise DataError(
                f"{url}: column {name}: type {kind} cannot be the per-ID weights of "
                f"{feature.column} ({ids}): they must be {wanted}"
            )
        _same_as_before(url, name, kind, seen)
    for cross in schema.crosses:
        for name in cross.columns:
            kind = arrow.field(name).type  # present and IDs: a declared sparse column
            if _is_list(kind):
                raise DataError(
                    f"{url}: cross {cross.name}: column {name}: type {kind} is a list; a "
                    "cross takes columns of one ID a row"
                )


def _column_type(url: str, arrow: pa.Schema, name: str, role: str) -> pa.DataType:
    index = arrow.get_field_index(name)
    if index < 0:
        raise DataError(f"{url}: column {name}: missing (the schema's {role})")
    return arrow.field(index).type


def _same_as_before(
    url: str, name: str, kind: pa.DataType, seen: dict[str, tuple[pa.DataType, str]]
) -> None:
    first = seen.setdefault(name, (kind, url))
    if not _same(first[0], kind):
        raise DataError(
            f"{url}: column {name}: type {kind}, but {first[1]} has {first[0]}: every "
            "day must have the same types"
        )


def _any_type(t: pa.DataType) -> bool:
    return True


def _label_type(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _dense_type(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _scalar_id(t: pa.DataType) -> bool:
    """int64 or string IDs, or such behind signed dictionary indices (the transform's)."""
    if pa.types.is_dictionary(t):
        return _scalar_id(t.value_type) and pa.types.is_signed_integer(t.index_type)
    return t == pa.int64() or pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _id_type(t: pa.DataType) -> bool:
    if _is_list(t):
        return _scalar_id(t.value_type)
    return _scalar_id(t)


def _same(a: pa.DataType, b: pa.DataType) -> bool:
    """Equal types, a list's item field name aside (writers name it "item" or "element")."""
    if (pa.types.is_list(a) and pa.types.is_list(b)) or (
        pa.types.is_large_list(a) and pa.types.is_large_list(b)
    ):
        return a.value_type == b.value_type
    return a == b


def _multi_hot(arrow: pa.Schema, schema: FeatureSchema) -> bool:
    return any(_is_list(arrow.field(n).type) for n in schema.sparse_names)


def _labels(url: str, label: str) -> tuple[int, float]:
    """Rows and positives (the labels' sum) of one file, every label checked: never null,
    0/1 (integers, booleans) or within [0, 1] (floats)."""
    f, _ = open_regular(url)
    rows, positives = 0, 0.0
    with f:
        parquet = pq.ParquetFile(f)
        for group in range(parquet.metadata.num_row_groups):
            where = f"{url}, row group {group}, column {label}"
            try:
                column = parquet.read_row_group(group, columns=[label]).column(0)
            except Exception as e:
                raise DataError(f"{where}: cannot decode: {e}") from None
            if column.null_count:
                raise DataError(f"{where}: {column.null_count} null labels")
            if pa.types.is_boolean(column.type):
                column = column.cast(pa.int8())
            values = column.cast(pa.float64())
            inside = pc.and_(pc.greater_equal(values, 0.0), pc.less_equal(values, 1.0))
            outside = len(values) - (pc.sum(inside.cast(pa.int64())).as_py() or 0)
            if not pa.types.is_floating(column.type):
                outside += (
                    pc.sum(
                        pc.and_(pc.greater(values, 0.0), pc.less(values, 1.0)).cast(pa.int64())
                    ).as_py()
                    or 0
                )
            if outside:
                allowed = "within [0, 1]" if pa.types.is_floating(column.type) else "0 or 1"
                raise DataError(f"{where}: {outside} labels not {allowed}")
            rows += len(values)
            positives += pc.sum(values).as_py() or 0.0
    return rows, positives

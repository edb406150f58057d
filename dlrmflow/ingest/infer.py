"""A first feature schema for day-partitioned Parquet, guessed from its footers and a sample.

Writing a schema by hand for a table of forty columns is where a new user gives up, and
most of it can be read off the data: the label is the 0/1 column named like one, floats
are dense values, strings and lists of IDs are sparse. ``infer_schema`` finds the day
partitions as ``register`` does (folders, or with ``day_column`` each file's day in that
column, which the guess then declares), reads every file's footer (rows, and whether a
column has one type in every file) and a bounded sample of rows (the first row groups of a
few files spread over the days, first and last day included), and ``schema_yaml`` writes
the guess as the YAML ``dlrmflow register --schema`` takes, every column annotated with
what the sample showed (Arrow type, null share, distinct values, list lengths) and every
column left out listed with the reason. It is a guess: the header says so, and a dataset
with no column that can be the label gets a placeholder that ``register`` refuses naming
it.

The rules, in order, for a column that is not the label:

- a type no feature takes (times, structs, maps, bytes, decimals, booleans, lists of
  numbers) is left out, with what to do instead;
- an integer named like a time is left out (derive hour or weekday columns from it);
- a column unique per row in every file sampled (request IDs, UUIDs, row numbers) is a
  key, not a feature, as a model can learn nothing from a value it never sees twice: the
  guess declares it in ``keys``, which ``score`` copies beside each prediction (one named
  as a column of ``score``'s output is left out instead, as ``score`` would refuse it);
- a column always null or of one value is left out;
- strings and lists of int64 or strings are sparse;
- an integer named like an ID (``item_id``, ``userId``, ``sku``), or with hash-like
  magnitudes, is sparse when it is int64 (other widths are left out: cast them);
- other integers are dense when they take many distinct values (more than 50 and 1% of
  the sampled rows), sparse (int64) when few: a code more than a quantity;
- floats are dense. A dense column is logged (``log``) when it is non-negative and skewed
  (counts, prices), passed on (``none``) otherwise.

Two more guesses for lists of IDs: a list whose longest are far longer than nearly all
(the sample's longest more than twice its 99th percentile of lengths) gets ``max_length``
at that percentile, so a few huge lists do not dominate a batch; and a list of numbers as
long as a list of IDs in every sampled row is taken as that list's per-ID ``weights``.

Distinct counts are exact over the sample, so a rough estimate of the whole column's.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import join_url
from dlrmflow.ingest.register import NoDayPartitions, find_partitions

SAMPLE_FILES = 3  # files sampled, spread over the days
SAMPLE_ROWS = 100_000  # rows read from each, from its first row groups
LABEL_PLACEHOLDER = "EDIT_ME_label_column"
DAY_COLUMN_OPTION = "--day-column"
# The columns of score's output (dlrmflow.score.output.SCHEMA, held equal by a test): a key
# column of one of these names is refused there, so it is never guessed as one. Ingest
# sits before score, so the names are written out rather than imported.
SCORE_COLUMNS = ("day", "row", "label", "prediction")

# Names a label goes by, in order of preference.
_LABEL_NAMES = ("click", "label", "clicked", "target", "y", "is_click")
_ID_NAME = re.compile(r"(?i:(^|[_\-.])(id|ids|uid|key|hash|code|sku)$)|[a-z0-9](Id|ID|Ids|IDs)$")
_TIME_NAME = re.compile(
    r"(?i:(^|[_\-.])(ts|time|timestamp|date|datetime|epoch)$|_at$)|[a-z0-9](At|Time|Ts)$"
)
_HASH_LIKE = 2**32  # integer IDs this large are hashes or random keys, not quantities
_MANY_DISTINCT = 50  # an integer with more distinct values (and 1% of its rows) is dense
_SKEWED = 1.0  # a non-negative column with a larger skewness is logged


@dataclass
class Profile:
    """What the sample showed of one column."""

    name: str
    type: pa.DataType
    rows: int = 0
    nulls: int = 0
    nans: int = 0
    distinct: int = 0
    unique_per_file: bool = False  # every sampled file: no null and no value twice
    low: float | None = None
    high: float | None = None
    mean: float | None = None
    skew: float = 0.0
    binary: bool = False  # every value 0 or 1 (or a boolean), at least one of each
    unit: bool = False  # every value within [0, 1], none null or NaN
    length_mean: float | None = None  # lists: IDs a row
    length_max: int | None = None
    length_p99: int | None = None  # lists: 99% of the rows hold at most this many

    def note(self) -> str:
        """The YAML comment of the column: type, null share, distinct values, lengths."""
        parts = [_type_name(self.type), f"null {_share(self.nulls, self.rows)}"]
        if self.nans:
            parts.append(f"NaN {_share(self.nans, self.rows)}")
        parts.append(f"{self.distinct:,} distinct")
        if self.length_mean is not None:
            parts.append(f"length mean {self.length_mean:.2g} max {self.length_max}")
        elif self.low is not None and self.high is not None:
            parts.append(f"{_number(self.low)}..{_number(self.high)}")
        return ", ".join(parts)


@dataclass
class Guess:
    """One column's role in the guessed schema, and why."""

    profile: Profile
    why: str = ""
    transform: str | None = None  # dense only
    max_length: int | None = None  # lists of IDs with a long tail of lengths
    weights: str | None = None  # the list of numbers beside a list of IDs, one a ID


@dataclass
class Inference:
    """The guessed schema of a dataset, with what it was guessed from."""

    url: str
    days: int
    files: int
    rows: int
    sampled_files: list[str]
    sampled_rows: int
    label: Guess | None
    dense: list[Guess] = field(default_factory=list)
    sparse: list[Guess] = field(default_factory=list)
    keys: list[Guess] = field(default_factory=list)  # unique per row: not features
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (column, why)
    day_column: tuple[str, pa.DataType] | None = None  # the column of each row's day, its type


def infer_schema(
    url: str,
    files: int = SAMPLE_FILES,
    rows_per_file: int = SAMPLE_ROWS,
    day_column: str | None = None,
) -> Inference:
    """Guess the feature schema of the day-partitioned Parquet at ``url`` (see the module's
    docstring); ``day_column``: the column of each row's day, for data not in day folders
    (as the schema's ``day_column``), never a feature. A folder without day partitions
    fails in one line naming it and the date or timestamp columns that could say its
    days; so does a file that is not Parquet, or one that gives no one day."""
    try:
        partitions = find_partitions(url, day_column)
    except NoDayPartitions as e:
        raise NoDayPartitions(e.url, e.candidates, DAY_COLUMN_OPTION) from None
    paths = [join_url(url, f) for p in partitions for f in p.files]
    with ThreadPoolExecutor(min(16, len(paths))) as pool:  # an object store answers slowly
        footers = list(pool.map(_footer, paths))
    first = footers[0][1]
    differs: dict[str, str] = {}
    for path, (_, arrow) in zip(paths, footers, strict=True):
        for name in first.names:
            index = arrow.get_field_index(name)
            if index < 0:
                differs.setdefault(name, f"missing in {path}")
            elif not _same(arrow.field(index).type, first.field(name).type):
                differs.setdefault(
                    name, f"{arrow.field(index).type} in {path}, {first.field(name).type} before"
                )
    chosen = _spread(len(paths), files)
    samples = [_sample(paths[i], rows_per_file) for i in chosen]
    profiles = [
        _profile(name, first.field(name).type, [t.column(name) for t in samples])
        for name in first.names
        if name not in differs and name != day_column
    ]
    label = _label(profiles)
    inference = Inference(
        url=url,
        days=len(partitions),
        files=len(paths),
        rows=sum(rows for rows, _ in footers),
        sampled_files=[paths[i] for i in chosen],
        sampled_rows=sum(t.num_rows for t in samples),
        label=label,
        day_column=None if day_column is None else (day_column, first.field(day_column).type),
    )
    inference.left_out += [
        (name, f"type differs between files: {why}") for name, why in differs.items()
    ]
    for profile in profiles:
        if label is not None and profile is label.profile:
            continue
        role, guess = _role(profile)
        if role == "dense":
            inference.dense.append(guess)
        elif role == "sparse":
            inference.sparse.append(guess)
        elif role == "key":
            inference.keys.append(guess)
        else:
            inference.left_out.append((profile.name, guess.why))
    _pair_weights(inference, samples, {f.name: f.type for f in first})
    return inference


def _pair_weights(
    inference: Inference, samples: list[pa.Table], types: dict[str, pa.DataType]
) -> None:
    """Take each list of numbers left out that is as long as a list of IDs in every
    sampled row (a null list as none, some list not empty) as that list's per-ID weights."""
    lists = [g for g in inference.sparse if _is_list(g.profile.type)]
    kept = []
    for name, why in inference.left_out:
        kind = types.get(name)
        match = None
        if kind is not None and _is_list(kind) and _numeric(_plain(kind.value_type)):
            lengths = _lengths(samples, name)
            if lengths.any():
                match = next(
                    (
                        g
                        for g in lists
                        if g.weights is None
                        and np.array_equal(_lengths(samples, g.profile.name), lengths)
                    ),
                    None,
                )
        if match is None:
            kept.append((name, why))
        else:
            match.weights = name
    inference.left_out = kept


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _lengths(samples: list[pa.Table], name: str) -> np.ndarray:
    """Every sampled row's list length (0 for a null list), file after file."""
    return np.concatenate(
        [pc.fill_null(pc.list_value_length(t.column(name)), 0).to_numpy() for t in samples]
    )


def schema_yaml(inference: Inference) -> str:
    """The guess as the YAML ``dlrmflow register --schema`` reads, each column annotated."""
    out = [
        f"# A feature schema GUESSED from {inference.url}: edit it before registering.",
        f"# {inference.days} days, {inference.files} files, {inference.rows:,} rows; figures "
        f"from a sample of {inference.sampled_rows:,} rows of {len(inference.sampled_files)} "
        "files.",
        "# Check the label, move columns between dense and sparse, delete what should not",
        "# be a feature, set a dense column's fill (for nulls) and transform (log, clip with",
        "# clip_min and clip_max, standardize, bucketize with boundaries or buckets, none)",
        "# and a sparse one's rows (its table's size), ids (hash or vocab with min_count),",
        "# max_length, weights and pooling; add crosses of sparse columns, then:",
        f"#   dlrmflow register --data {inference.url} --schema THIS_FILE",
    ]
    lines: list[tuple[str, str]] = []  # (YAML, comment)
    if inference.label is None:
        out.append(
            "# NO LABEL FOUND: no column holds only 0/1, booleans or floats in [0, 1] without "
            "nulls."
        )
        out.append("# Name the label column below; register refuses the placeholder.")
        lines.append((f"label: {LABEL_PLACEHOLDER}", "EDIT: the label column"))
    else:
        guess = inference.label
        lines.append(
            (f"label: {_yaml_name(guess.profile.name)}", f"{guess.profile.note()}; {guess.why}")
        )
    lines.append(("dense:" if inference.dense else "dense: []", ""))
    for guess in inference.dense:
        lines.append((f"  - column: {_yaml_name(guess.profile.name)}", guess.profile.note()))
        lines.append(("    fill: 0.0", "the value of a null or NaN"))
        lines.append((f"    transform: {guess.transform}", guess.why))
    if inference.sparse:
        lines.append(("sparse:", ""))
    else:
        lines.append(("sparse: []", "EDIT: no column looks like IDs; a model needs one"))
    for guess in inference.sparse:
        lines.append((f"  - column: {_yaml_name(guess.profile.name)}", guess.profile.note()))
        if guess.max_length is not None:
            lines.append(
                (
                    f"    max_length: {guess.max_length}",
                    f"99% of the sampled lists hold at most {guess.max_length} IDs, the "
                    f"longest {guess.profile.length_max}: longer ones keep their first "
                    f"{guess.max_length} (keep: last keeps the last)",
                )
            )
        if guess.weights is not None:
            lines.append(
                (
                    f"    weights: {_yaml_name(guess.weights)}",
                    "a list of numbers as long as this one in every sampled row: a weight per ID",
                )
            )
    if inference.keys:
        lines.append(("keys:", "not features: score copies them beside each prediction"))
    for guess in inference.keys:
        lines.append(
            (f"  - {_yaml_name(guess.profile.name)}", f"{guess.profile.note()}; {guess.why}")
        )
    if inference.day_column is not None:
        name, kind = inference.day_column
        lines.append(
            (
                f"day_column: {_yaml_name(name)}",
                f"{_type_name(kind)}: each row's day; register groups the files by it",
            )
        )
    width = max(len(text) for text, _ in lines) + 2
    out += [f"{text:<{width}}# {note}" if note else text for text, note in lines]
    if inference.left_out:
        out.append("# Left out (cannot be features as they are):")
        out += [f"#   {name}: {why}" for name, why in inference.left_out]
    return "\n".join(out) + "\n"


def _footer(url: str) -> tuple[int, pa.Schema]:
    try:
        with fsspec.open(url, "rb") as f:
            parquet = pq.ParquetFile(f)
            return parquet.metadata.num_rows, parquet.schema_arrow
    except FileNotFoundError:
        raise DataError(f"{url}: no such file") from None
    except Exception as e:
        raise DataError(f"{url}: not a readable Parquet file: {type(e).__name__}: {e}") from None


def _sample(url: str, rows: int) -> pa.Table:
    """The first ``rows`` rows of the file at ``url`` (its first row groups)."""
    batches: list[pa.RecordBatch] = []
    try:
        with fsspec.open(url, "rb") as f:
            parquet = pq.ParquetFile(f)
            read = 0
            for batch in parquet.iter_batches(batch_size=min(rows, 65_536)):
                batches.append(batch.slice(0, rows - read))
                read += batches[-1].num_rows
                if read >= rows:
                    break
            return pa.Table.from_batches(batches, schema=parquet.schema_arrow)
    except Exception as e:
        raise DataError(f"{url}: cannot decode: {type(e).__name__}: {e}") from None


def _spread(total: int, wanted: int) -> list[int]:
    """``wanted`` indices of ``total`` spread evenly, the first and the last included."""
    if wanted >= total:
        return list(range(total))
    if wanted <= 1:
        return [0]
    return sorted({round(i * (total - 1) / (wanted - 1)) for i in range(wanted)})


def _same(a: pa.DataType, b: pa.DataType) -> bool:
    """Equal types, a list's item field name aside (writers name it "item" or "element")."""
    if _is_list(a) and _is_list(b) and type(a) is type(b):
        return a.value_type == b.value_type
    return a == b


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _plain(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_string(t: pa.DataType) -> bool:
    t = _plain(t)
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _decoded(column: pa.ChunkedArray) -> pa.Array:
    array = column.combine_chunks()
    if isinstance(array, pa.DictionaryArray):
        array = array.dictionary_decode()
    return array


def _profile(name: str, kind: pa.DataType, columns: list[pa.ChunkedArray]) -> Profile:
    """What the sampled files' arrays of one column show (``columns``: one a file)."""
    arrays = [_decoded(c) for c in columns]
    profile = Profile(name, kind, rows=sum(len(a) for a in arrays))
    profile.nulls = sum(a.null_count for a in arrays)
    if not arrays or profile.rows == profile.nulls or _unusable(kind):
        return profile  # its type says why it is left out; its values would not
    if _is_list(kind):
        lengths = np.concatenate([pc.list_value_length(a).drop_null().to_numpy() for a in arrays])
        if lengths.size:
            profile.length_mean = float(lengths.mean())
            profile.length_max = int(lengths.max())
            profile.length_p99 = int(np.quantile(lengths, 0.99, method="higher"))
        values = [pc.list_flatten(a) for a in arrays]
        values = [v.dictionary_decode() if isinstance(v, pa.DictionaryArray) else v for v in values]
        profile.distinct = _distinct(values)
        return profile
    profile.distinct = _distinct(arrays)
    profile.unique_per_file = all(
        len(a) > 1 and a.null_count == 0 and pc.count_distinct(a).as_py() == len(a) for a in arrays
    )
    plain = _plain(kind)
    if pa.types.is_boolean(plain):
        ones = sum(pc.sum(a.cast(pa.int64())).as_py() or 0 for a in arrays)
        valid = profile.rows - profile.nulls
        profile.binary = 0 < ones < valid
        profile.unit = profile.nulls == 0
        profile.low, profile.high = float(ones == valid), float(ones > 0)
        profile.mean = ones / valid
        return profile
    if not (pa.types.is_integer(plain) or pa.types.is_floating(plain)):
        return profile
    values = np.concatenate([a.drop_null().to_numpy(zero_copy_only=False) for a in arrays])
    values = values.astype(np.float64)
    finite = np.isfinite(values)
    profile.nans = int(np.isnan(values).sum())
    values = values[finite]
    if not values.size:
        return profile
    profile.low, profile.high = float(values.min()), float(values.max())
    profile.mean = float(values.mean())
    spread = float(values.std())
    if spread > 0:
        profile.skew = float(np.mean(((values - profile.mean) / spread) ** 3))
    inside = profile.low >= 0 and profile.high <= 1
    whole = bool(np.all(values == np.round(values)))
    profile.binary = inside and whole and profile.low == 0 and profile.high == 1
    profile.unit = inside and profile.nulls == 0 and profile.nans == 0 and finite.all()
    return profile


def _distinct(arrays: list[pa.Array]) -> int:
    if not arrays:
        return 0
    return pc.count_distinct(pa.chunked_array(arrays, type=arrays[0].type)).as_py()


def _can_label(p: Profile) -> bool:
    """0/1 integers or booleans, or floats within [0, 1]: never null, never NaN."""
    plain = _plain(p.type)
    if not p.unit or p.rows == 0:
        return False
    if pa.types.is_floating(plain):
        return True
    return (pa.types.is_integer(plain) or pa.types.is_boolean(plain)) and p.binary


def _label(profiles: list[Profile]) -> Guess | None:
    """The column named like a label that can be one, else the first 0/1 column."""
    named = {p.name.lower(): p for p in profiles if _can_label(p)}
    for name in _LABEL_NAMES:
        if name in named:
            return Guess(named[name], f"the label: named like one, {_rate(named[name])}")
    for p in profiles:
        plain = _plain(p.type)
        if _can_label(p) and not pa.types.is_floating(plain):
            return Guess(p, f"the label: the first 0/1 column, {_rate(p)}")
    return None


def _rate(p: Profile) -> str:
    return f"positive rate {p.mean:.3g}" if p.mean is not None else "no values"


def _role(p: Profile) -> tuple[str, Guess]:
    """``dense``, ``sparse``, ``key`` or ``out``, with why (see the module's docstring)."""
    kind, plain = p.type, _plain(p.type)
    out = _unusable(kind)
    if out:
        return "out", Guess(p, out)
    if p.rows == p.nulls:
        return "out", Guess(p, f"{_type_name(kind)}: always null in the sample")
    if _is_list(kind):
        guess = Guess(p, "a list of IDs")
        if p.length_p99 and p.length_max is not None and p.length_max > 2 * p.length_p99:
            guess.max_length = p.length_p99
        return "sparse", guess
    if pa.types.is_integer(plain) and _TIME_NAME.search(p.name):
        return "out", Guess(
            p,
            f"{_type_name(kind)} named like a time: not a feature as it is (derive hour "
            "or weekday columns from it)",
        )
    if p.unique_per_file and (pa.types.is_integer(plain) or _is_string(plain)):
        unique = f"{_type_name(kind)}, unique per row in every file sampled: a key"
        if p.name in SCORE_COLUMNS:
            return "out", Guess(
                p,
                f"{unique}, but score's output has a column {p.name} (rename it to copy it "
                "beside each prediction)",
            )
        return "key", Guess(p, "unique per row in every file sampled: a key, not a feature")
    if p.distinct == 1 and p.nulls == 0 and p.nans == 0:
        return "out", Guess(p, f"{_type_name(kind)}: one value in the sample, nothing to learn")
    if _is_string(plain):
        return "sparse", Guess(p, "string IDs")
    if pa.types.is_integer(plain):
        hashed = max(abs(p.low or 0), abs(p.high or 0)) >= _HASH_LIKE
        many = p.distinct > max(_MANY_DISTINCT, 0.01 * (p.rows - p.nulls))
        if _ID_NAME.search(p.name) or hashed or not (many or p.binary):
            if plain == pa.int64():
                return "sparse", Guess(p, "integer IDs")
            if _ID_NAME.search(p.name) or hashed:
                return "out", Guess(
                    p,
                    f"{_type_name(kind)} IDs: sparse features take int64 or strings (cast it "
                    "to int64)",
                )
    return "dense", _dense(p)


def _dense(p: Profile) -> Guess:
    if p.binary:
        return Guess(p, "a 0/1 flag", transform="none")
    if p.low is not None and p.low >= 0 and p.skew > _SKEWED:
        return Guess(p, f"non-negative, skewed ({p.skew:.2g})", transform="log")
    if p.low is not None and p.low < 0:
        return Guess(p, "takes negative values", transform="none")
    return Guess(p, f"not skewed ({p.skew:.2g})", transform="none")


def _unusable(t: pa.DataType) -> str:
    """Why a column of type ``t`` cannot be a feature, or "" when it can."""
    name = _type_name(t)
    plain = _plain(t)
    if _is_list(t):
        item = _plain(t.value_type)
        if item == pa.int64() or _is_string(item):
            return ""
        if pa.types.is_integer(item):
            return f"{name}: lists of IDs take int64 or strings (cast its items to int64)"
        return f"{name}: only lists of IDs (int64 or strings) are features; no dense lists yet"
    if (
        pa.types.is_timestamp(plain)
        or pa.types.is_date(plain)
        or pa.types.is_time(plain)
        or pa.types.is_duration(plain)
        or pa.types.is_interval(plain)
    ):
        return f"{name}: a time is not a feature as it is (derive hour or weekday columns)"
    if pa.types.is_nested(plain):
        return f"{name}: nested; declare its fields as columns of their own"
    if (
        pa.types.is_binary(plain)
        or pa.types.is_large_binary(plain)
        or pa.types.is_fixed_size_binary(plain)
    ):
        return f"{name}: bytes; IDs are int64 or strings (decode or hash it into one)"
    if pa.types.is_decimal(plain):
        return f"{name}: a decimal; dense features are integers or floats (cast it)"
    if pa.types.is_boolean(plain):
        return f"{name}: a boolean feature is not one yet (cast it to int8: a dense 0/1)"
    if pa.types.is_null(plain):
        return f"{name}: always null"
    if pa.types.is_integer(plain) or pa.types.is_floating(plain) or _is_string(plain):
        return ""
    return f"{name}: no feature takes this type"


def _type_name(t: pa.DataType) -> str:
    if _is_list(t):
        return f"list<{_type_name(t.value_type)}>"
    if pa.types.is_dictionary(t):
        return f"dictionary<{_type_name(t.value_type)}>"
    return str(t)


def _share(part: int, whole: int) -> str:
    if not whole or not part:
        return "0%"
    share = 100 * part / whole
    return f"{share:.2g}%" if share < 10 else f"{share:.0f}%"


def _number(x: float) -> str:
    return f"{x:.0f}" if x == int(x) and abs(x) < 1e15 else f"{x:.4g}"


def _yaml_name(name: str) -> str:
    """``name`` as a YAML scalar: plain when it reads back as itself, else quoted."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name):
        try:
            if yaml.safe_load(name) == name:
                return name
        except yaml.YAMLError:
            pass
    return json.dumps(name)

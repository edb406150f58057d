r"""Raw Criteo TSV days -> Parquet day partitions with the shared Criteo schema.

A raw Criteo day is one tab-separated line per impression: label, 13 integer counts and 26
hexadecimal category IDs, no header, an empty field meaning "missing". Each input file
becomes one day (``OUT/day=K/part-<name>.parquet``, the generator's layout, the name a hash
of the input's fingerprint and the options: ``day_file_name``), so everything downstream
runs unchanged on real data.

Days are tens of GB, so a file is streamed in blocks of whole lines: numpy finds the line
breaks and the few lines pyarrow's CSV parser must not see, the parser splits the rest into
fields (every field read as raw bytes), and each block is validated and converted on whole
columns with numpy; no Python code runs per line except for the rare malformed ones.

Lines are what ``\n`` ends (a ``\r`` just before it is part of the break; the last line
may end the file without one), numbered from 1 as any text tool numbers them. Whatever a
line holds, it is converted or quarantined, never the end of the file: a wrong field count,
an empty line, bytes that are not UTF-8, NUL bytes, a ``\r`` inside the line (which the
CSV parser would take for a line break), a line too long to be Criteo's (longer than
``MAX_LINE_BYTES``: read past, never held whole), a bad label, integer or hex ID. Malformed
lines are never dropped silently: each is written with its line number and the reason to
``OUT/_quarantine/<input basename>.jsonl``, and a file with more of them than
``max_bad_fraction`` of its lines fails the run. Only input that cannot be read at all (a
corrupt or truncated archive) fails a file regardless of the fraction.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import os
import posixpath
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from dlrmflow.ingest.dayfile import (
    DayFileWriter,
    DayWriteError,
    day_file_writer,
    discard_unlisted,
    file_name,
    remove_temporaries,
)
from dlrmflow.ingest.lock import dataset_lock
from dlrmflow.ingest.manifest import (
    DayFile,
    Manifest,
    join_url,
    listed_paths,
    publish_manifest,
    read_manifest,
)
from dlrmflow.ingest.reader import DataError
from dlrmflow.ingest.schema import DENSE, LABEL, SPARSE, criteo_schema, schema_to_json
from dlrmflow.outputs import OutputError

FIELDS = (LABEL, *DENSE, *SPARSE)
QUARANTINE_DIR = "_quarantine"
# Part of every day file's name: change it whenever the same input and options start to
# give other rows, so that a new dataset never takes an old file's name.
CONVERTER_FORMAT = 1
# Metadata keys that identify a file's version on the file systems fsspec supports
# (local and memory: mtime/created; s3: ETag/LastModified; gcs: md5Hash/updated).
_VERSION_KEYS = ("mtime", "created", "LastModified", "last_modified", "updated", "ETag", "md5Hash")

# A valid line is at most 40 fields of _MAX_FIELD_CHARS, so a line this long is garbage (a
# binary file, a missing line break): it is quarantined, with its first _SHOWN_BYTES bytes,
# and read past without being held whole.
MAX_LINE_BYTES = 1 << 16
_SHOWN_BYTES = 1024
_LF, _CR = ord("\n"), ord("\r")

# Longer fields are rejected unparsed: no valid count or ID is this long, and the digit
# matrices below are (rows x longest field) wide, so one garbage field must not size them.
_MAX_FIELD_CHARS = 32
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

# Per-field error codes, turned into reasons only for the rows that have them.
_OK, _BAD, _RANGE = 0, 1, 2

# Byte -> digit value; 255 marks a byte that is not a digit of the base.
_DEC_VALUE = np.full(256, 255, np.uint8)
_DEC_VALUE[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX_VALUE = np.full(256, 255, np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16)
_HEX_VALUE[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
_POW10 = 10 ** np.arange(9, -1, -1, dtype=np.int64)  # place values of the last 10 digits
_HIGH_BITS = np.uint64(0x8080808080808080)  # set in a byte only if it is 255 (not a digit)


class MalformedDataError(DataError):
    """An input file has too many malformed lines, or cannot be read (a corrupt archive)."""


@dataclass
class ConvertResult:
    """What ``convert_criteo`` wrote.

    ``quarantine`` is the URL of the quarantine folder when any line was malformed (None
    otherwise); ``quarantine_files`` lists its files, one per input that had bad lines.
    """

    manifest: Manifest
    rows: int
    bad_lines: int
    quarantine: str | None
    quarantine_files: list[str] = field(default_factory=list)
    written_days: list[int] = field(default_factory=list)  # the rest were kept as they were


@dataclass
class ConvertedDay:
    """What ``convert_day`` wrote for one input: its line, row, positive and malformed-line
    counts, its quarantine file's URL (None when every line was good), and its day file:
    the path relative to the dataset root, the digest in its footer and its size."""

    day: int
    lines: int
    rows: int
    positives: int
    bad_lines: int
    quarantine: str | None
    path: str
    digest: str
    bytes: int
    kept: bool = False  # converted by an earlier run and left as it was


@dataclass
class _BadLine:
    line: int  # 1-based physical line number in the input file
    reason: str
    text: str


@dataclass
class _Lines:
    r"""Whole lines of an input: ``data`` holds lines ``first``, ``first + 1``, ... (each
    ending in ``\n``, except the file's last line if the file does not end in one);
    ``bad`` are lines already found malformed, numbered after ``data``'s."""

    first: int
    data: bytes
    bad: list[_BadLine] = field(default_factory=list)


def convert_criteo(
    inputs: Sequence[str],
    out: str,
    *,
    max_bad_fraction: float = 0.001,
    row_group_size: int = 65_536,
    block_size: int = 1 << 24,
    progress: Callable[[int], None] | None = None,
) -> ConvertResult:
    """Convert raw Criteo TSV files (plain or compressed) to a Parquet dataset at ``out``.

    Input K becomes day K; the last input is the test day. Valid lines are kept in input
    order in row groups of ``row_group_size`` rows; malformed ones go to the quarantine.
    ``block_size`` is the bytes read and converted at a time (memory is a small multiple of
    it plus one row group). ``progress(n)`` is called with the lines of each block read.

    Raises MalformedDataError when malformed lines exceed ``max_bad_fraction`` of a file's
    lines. A dataset already at ``out`` stays whole until the new one is: each day file is
    written under a temporary name beside the old files and renamed when complete,
    ``manifest.json`` is switched last, and only then are the files it no longer lists
    removed. A failed run removes the day files it wrote; a killed one leaves temporaries
    that the next run removes. A day file that cannot be written (a full disk) is an
    ``OutputError`` naming the day, the file and the input.

    This is ``start_conversion``, ``convert_day`` for each input, then ``finish_conversion``:
    the ingest flow runs the same three steps with the days as separate (parallel) tasks.
    The dataset folder is locked meanwhile (``dataset_lock``): a second writer fails at
    once naming this one.
    """
    with dataset_lock(out, "convert"):
        start_conversion(
            inputs,
            out,
            max_bad_fraction=max_bad_fraction,
            row_group_size=row_group_size,
            block_size=block_size,
        )
        days: list[ConvertedDay] = []
        try:
            for day, url in enumerate(inputs):
                days.append(
                    convert_day(
                        url,
                        day,
                        out,
                        max_bad_fraction=max_bad_fraction,
                        row_group_size=row_group_size,
                        block_size=block_size,
                        progress=progress,
                    )
                )
            return finish_conversion(inputs, out, days)
        except BaseException:
            # Against the manifest in place now: once the new one is, its files stay.
            discard_unlisted(out, [d.path for d in days], listed_paths(out))
            raise


def start_conversion(
    inputs: Sequence[str],
    out: str,
    *,
    max_bad_fraction: float = 0.001,
    row_group_size: int = 65_536,
    block_size: int = 1 << 24,
) -> None:
    """Check the arguments of a conversion, create ``out`` and remove what interrupted
    writes left there. A dataset already at ``out`` stays usable: its manifest is replaced
    only by ``finish_conversion``, once every new day file is complete."""
    if not inputs:
        raise ValueError("convert_criteo: no input files")
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"max_bad_fraction must be in [0, 1] (got {max_bad_fraction})")
    if row_group_size < 1:
        raise ValueError(f"row_group_size must be >= 1 (got {row_group_size})")
    if block_size < 1024:
        raise ValueError(f"block_size must be >= 1024 bytes (got {block_size})")
    names = [_input_name(url) for url in inputs]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        # Quarantine files are named after the input, so same-named inputs would share one.
        raise ValueError(f"inputs must have distinct file names; repeated: {clashes}")

    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    remove_temporaries(out)


def input_fingerprint(url: str) -> dict[str, Any]:
    """``url``, its size and whatever version metadata its file system reports (no byte of
    it is read). Raises FileNotFoundError naming the file if it does not exist."""
    fs, path = fsspec.core.url_to_fs(url)
    try:
        info = fs.info(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url}: input file not found") from e
    version = {key: str(info[key]) for key in _VERSION_KEYS if info.get(key) is not None}
    return {"url": url, "size": info.get("size"), **version}


def day_file_name(url: str, row_group_size: int) -> str:
    """The name of the day file converted from input ``url``: a hash of the input's
    fingerprint, the options its bytes follow from and the versions of this converter and
    of pyarrow. A changed input (or option) gets a new name, so it is written beside the
    file it replaces; converting the same input again lands on the same name."""
    fingerprint = sorted(input_fingerprint(url).items())
    return file_name("criteo", CONVERTER_FORMAT, pa.__version__, fingerprint, row_group_size)


def day_file(out: str, day: int, url: str, row_group_size: int) -> str:
    """URL of day ``day``'s Parquet file, converted from input ``url``, at ``out``."""
    return join_url(out, f"day={day}", day_file_name(url, row_group_size))


def convert_day(
    url: str,
    day: int,
    out: str,
    *,
    max_bad_fraction: float = 0.001,
    row_group_size: int = 65_536,
    block_size: int = 1 << 24,
    progress: Callable[[int], None] | None = None,
) -> ConvertedDay:
    """Convert one raw input to ``day_file(out, day, url, row_group_size)`` (see
    ``convert_criteo``; this day's output depends on nothing but ``url`` and the options).

    A day the dataset at ``out`` already lists as converted from this input (the same file
    name, hence the same input size and modification time and options, and the file there
    at its recorded size) is kept: its counts come from the manifest, and not a byte of the
    input or the day file is read. So a dataset grows by a day at the cost of that day."""
    kept = converted_before(url, day, out, row_group_size)
    if kept is not None:
        return kept
    return _convert_day(
        url,
        day,
        out,
        quarantine_url=join_url(out, QUARANTINE_DIR, f"{_input_name(url)}.jsonl"),
        max_bad_fraction=max_bad_fraction,
        row_group_size=row_group_size,
        block_size=block_size,
        progress=progress,
    )


def converted_before(url: str, day: int, out: str, row_group_size: int) -> ConvertedDay | None:
    """Day ``day`` as the manifest at ``out`` records it, if it was converted from ``url``
    with these options and its file is still there at its recorded size; else None."""
    try:
        manifest = read_manifest(out)
    except (OSError, ValueError):
        return None
    generator = manifest.generator or {}
    inputs = generator.get("inputs", [])
    path = f"day={day}/{day_file_name(url, row_group_size)}"
    listed = [f for f in manifest.files if f.day == day and f.path == path]
    if manifest.source != "criteo" or not listed or day >= len(inputs) or inputs[day] != url:
        return None
    record = listed[0]
    fs, root = fsspec.core.url_to_fs(join_url(out, path))
    try:
        size = fs.size(root)
    except FileNotFoundError:
        return None
    if record.digest is None or record.bytes is None or size != record.bytes:
        return None
    bad = int(generator["bad_lines"][day])
    quarantine = join_url(out, QUARANTINE_DIR, f"{_input_name(url)}.jsonl") if bad else None
    return ConvertedDay(
        day,
        int(generator["lines"][day]),
        record.rows,
        round(record.positive_rate * record.rows),
        bad,
        quarantine,
        path,
        record.digest,
        record.bytes,
        kept=True,
    )


def landed_days(directory: str) -> list[str]:
    """The raw day files in ``directory`` (a landing folder that gains a file a day), in
    day order: by name, with runs of digits compared as numbers (``day_2`` before
    ``day_10``). Hidden files and names ending in a temporary suffix (``.tmp``,
    ``.part``, ``.partial``) are not days yet: a file still being copied in is skipped.
    A folder without a day is a FileNotFoundError naming it, as a missing one is: no
    caller has anything to convert then."""
    fs, root = fsspec.core.url_to_fs(directory)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{directory}: landing directory not found") from e
    names = [posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file"]
    days = [n for n in names if not n.startswith(".") and not n.endswith(_NOT_LANDED)]
    if not days:
        raise FileNotFoundError(f"{directory}: no raw day file in the landing directory")
    return [join_url(directory, n) for n in sorted(days, key=_natural)]


_NOT_LANDED = (".tmp", ".part", ".partial")

# The manifest's record of the landed files converted into its days (``generator``'s
# ``landed``: one entry a day, in day order), by which a landing folder grows the dataset.
LANDED_KEY = "landed"
_HASH_BLOCK = 1 << 24


class LandingError(DataError):
    """A landing folder that cannot grow its dataset: a converted file changed, a late file
    that would renumber the days, an empty file."""


@dataclass(frozen=True)
class LandedFile:
    """A raw file of a landing folder and its day. Its identity is its content: ``bytes``
    and the SHA-256 of its bytes; ``seen`` (its size and version metadata when it was
    hashed) only saves hashing it again while the file system reports it unchanged, so a
    file touched or copied again with the same bytes is the same day."""

    day: int
    url: str
    bytes: int | None
    sha256: str | None  # None: converted before landed files were identified by content
    seen: dict[str, Any]
    converted: bool  # a day of the dataset already: kept, its raw file never read

    def record(self) -> dict[str, Any]:
        """Its entry in the manifest's ``landed`` record."""
        return {"url": self.url, "bytes": self.bytes, "sha256": self.sha256, "seen": self.seen}


def plan_landing(directory: str, out: str) -> list[LandedFile]:
    """The days of the dataset at ``out`` grown from the landing folder ``directory``:
    the days converted before, each kept whatever became of its raw file (moved away,
    renamed, touched), then one new day for each file whose content no day has, in name
    order (``landed_days``).

    A day, once converted, keeps its number for good. So a new file whose name sorts
    before a converted one's (it arrived late: taken as the next day it would sit among
    the days by name but not by number) is refused, naming it: move it out of the folder,
    or rename it to sort after the last converted file to take it as the next day. A
    converted file whose bytes changed under the same name, and an empty file, are refused
    the same way. Raises FileNotFoundError for a missing folder, or one without a day when
    nothing was converted."""
    recorded, urls = _landed_or_refused(directory, out)
    plan = [
        LandedFile(day, r["url"], r["bytes"], r["sha256"], r["seen"], True)
        for day, r in enumerate(recorded)
    ]
    by_content = {(f.bytes, f.sha256): f for f in plan if f.sha256 is not None}
    by_name = {_input_name(f.url): f for f in plan}
    last = max(by_name, key=_natural) if by_name else None
    for url in urls:
        name = _input_name(url)
        seen = {k: v for k, v in input_fingerprint(url).items() if k != "url"}
        known = by_name.get(name)
        if known is not None and known.sha256 is None:
            # Converted before content identities: the file of its name is its day.
            plan[known.day] = LandedFile(known.day, known.url, *_identity(url, seen), seen, True)
            continue
        if known is not None and known.seen == seen:
            continue  # unchanged since hashed: its day (no byte read)
        size, digest = _identity(url, seen)
        same = by_content.get((size, digest))
        if same is not None:
            if same is known:  # touched or copied again: the same bytes, seen anew
                plan[same.day] = LandedFile(same.day, same.url, size, digest, seen, True)
            continue
        day = len(plan)
        if known is not None:
            raise LandingError(
                f"{url}: its bytes changed since it was converted to day {known.day}, and a "
                "converted day never changes: put the file back as it was, or land the new "
                "rows under a name that sorts after it"
            )
        if last is not None and _natural(name) < _natural(last):
            raise LandingError(
                f"{url}: landed after {last} (day {by_name[last].day}) was converted but "
                "sorts before it, and converted days keep their numbers: move it out of "
                f"the landing folder, or rename it to sort after {last} to make it day {day}"
            )
        if size == 0:
            raise LandingError(
                f"{url}: an empty file is not a day: remove it from the landing folder, or "
                "land the day's rows in it"
            )
        plan.append(LandedFile(day, url, size, digest, seen, False))
    return plan


def convert_landed(
    directory: str,
    out: str,
    *,
    max_bad_fraction: float = 0.001,
    row_group_size: int = 65_536,
    block_size: int = 1 << 24,
    progress: Callable[[int], None] | None = None,
) -> ConvertResult:
    """Grow the dataset at ``out`` by the files that landed in ``directory`` since it was
    last grown from it (``plan_landing``): only the new days are converted; every day
    converted before keeps its number and its file, and its raw file is not read (it may
    have been archived). Each day's landed file is recorded by content in the manifest
    (``generator["landed"]``), switched with the days it lists in one rename. A new day
    without a row is refused naming its file: it could be neither validated nor trained
    on. The options are ``convert_criteo``'s."""
    _landed_or_refused(directory, out)  # before the lock, which would make the folder
    with dataset_lock(out, "convert"):
        plan = plan_landing(directory, out)
        records = [f.record() for f in plan]
        before = read_manifest(out) if any(f.converted for f in plan) else None
        new = [f for f in plan if not f.converted]
        if before is not None and not new and (before.generator or {}).get(LANDED_KEY) == records:
            return _as_result(before, [])  # nothing landed, nothing to write
        inputs = [f.url for f in plan]
        start_conversion(
            inputs,
            out,
            max_bad_fraction=max_bad_fraction,
            row_group_size=row_group_size,
            block_size=block_size,
        )
        days = [_kept_day(before, out, f) for f in plan if f.converted and before is not None]
        try:
            for f in new:
                day = convert_day(
                    f.url,
                    f.day,
                    out,
                    max_bad_fraction=max_bad_fraction,
                    row_group_size=row_group_size,
                    block_size=block_size,
                    progress=progress,
                )
                days.append(day)
                if day.rows == 0:
                    raise LandingError(
                        f"{f.url}: no row ({day.lines} lines, {day.bad_lines} malformed), and an "
                        "empty day can be neither validated nor trained on: remove it from the "
                        "landing folder"
                    )
            return finish_conversion(inputs, out, days, landed=records)
        except BaseException:
            discard_unlisted(out, [d.path for d in days if not d.kept], listed_paths(out))
            raise


def _landed_or_refused(directory: str, out: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The landed files the dataset at ``out`` records and those in ``directory`` now;
    FileNotFoundError when neither has one (nothing to convert, nor ever converted)."""
    recorded = _landed_record(out)
    urls = _landed_files(directory)
    if not urls and not recorded:
        raise FileNotFoundError(f"{directory}: no raw day file in the landing directory")
    return recorded, urls


def _landed_files(directory: str) -> list[str]:
    """``landed_days``, where a folder without a day is no error (its days may all have
    been converted and moved away)."""
    try:
        return landed_days(directory)
    except FileNotFoundError as e:
        if str(e).endswith("no raw day file in the landing directory"):
            return []
        raise


def _identity(url: str, seen: dict[str, Any]) -> tuple[int, str]:
    """A raw file's content identity: its size and the SHA-256 of its bytes."""
    digest = hashlib.sha256()
    with fsspec.open(url, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return int(seen["size"]), digest.hexdigest()


def _landed_record(out: str) -> list[dict[str, Any]]:
    """The landed files the dataset at ``out`` was converted from, one a day: the
    manifest's ``landed`` record, or, for a dataset converted before it was kept, its
    inputs with no content identity. None for no dataset, or one not converted."""
    try:
        manifest = read_manifest(out)
    except FileNotFoundError:
        return []
    generator = manifest.generator or {}
    if manifest.source != "criteo":
        return []
    if LANDED_KEY in generator:
        return list(generator[LANDED_KEY])
    inputs = generator.get("inputs", [])
    return [{"url": u, "bytes": None, "sha256": None, "seen": {}} for u in inputs]


def _kept_day(manifest: Manifest, out: str, landed: LandedFile) -> ConvertedDay:
    """A converted day as the manifest at ``out`` records it (no file read)."""
    generator = manifest.generator or {}
    [record] = [f for f in manifest.files if f.day == landed.day]
    bad = int(generator["bad_lines"][landed.day])
    name = _input_name(landed.url)
    return ConvertedDay(
        landed.day,
        int(generator["lines"][landed.day]),
        record.rows,
        round(record.positive_rate * record.rows),
        bad,
        join_url(out, QUARANTINE_DIR, f"{name}.jsonl") if bad else None,
        record.path,
        record.digest or "",
        record.bytes or 0,
        kept=True,
    )


def _as_result(manifest: Manifest, written: list[int]) -> ConvertResult:
    generator = manifest.generator or {}
    bad = sum(int(b) for b in generator.get("bad_lines", []))
    return ConvertResult(manifest, manifest.rows, bad, None, written_days=written)


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def finish_conversion(
    inputs: Sequence[str],
    out: str,
    days: Sequence[ConvertedDay],
    *,
    landed: list[dict[str, Any]] | None = None,
) -> ConvertResult:
    """Write ``OUT/manifest.json`` for ``inputs`` converted to ``days`` (day K from input K,
    in order) and return the conversion's result. ``landed``: the landed files' record
    (``convert_landed``), kept in the manifest."""
    if [d.day for d in days] != list(range(len(inputs))):
        raise ValueError(
            f"finish_conversion: need days 0..{len(inputs) - 1} in order, "
            f"got {[d.day for d in days]}"
        )
    rows = sum(s.rows for s in days)
    manifest = Manifest(
        source="criteo",
        rows=rows,
        days=len(inputs),
        test_day=len(inputs) - 1,
        positive_rate=sum(s.positives for s in days) / max(rows, 1),
        files=[
            DayFile(
                day=s.day,
                path=s.path,
                rows=s.rows,
                positive_rate=s.positives / max(s.rows, 1),
                digest=s.digest,
                bytes=s.bytes,
            )
            for s in days
        ],
        schema=schema_to_json(criteo_schema()),
        generator={
            "inputs": list(inputs),
            "lines": [s.lines for s in days],
            "bad_lines": [s.bad_lines for s in days],
            **({} if landed is None else {LANDED_KEY: landed}),
        },
    )
    publish_manifest(out, manifest)
    quarantine_files = [s.quarantine for s in days if s.quarantine is not None]
    return ConvertResult(
        manifest=manifest,
        rows=rows,
        bad_lines=sum(s.bad_lines for s in days),
        quarantine=join_url(out, QUARANTINE_DIR) if quarantine_files else None,
        quarantine_files=quarantine_files,
        written_days=[s.day for s in days if not s.kept],
    )


def _input_name(url: str) -> str:
    return posixpath.basename(url.rstrip("/"))


def _convert_day(
    url: str,
    day: int,
    out: str,
    *,
    quarantine_url: str,
    max_bad_fraction: float,
    row_group_size: int,
    block_size: int,
    progress: Callable[[int], None] | None,
) -> ConvertedDay:
    """Stream one input file into its day file; see ``convert_criteo``."""
    name = day_file_name(url, row_group_size)
    quarantine = _Quarantine(url, quarantine_url, day)
    lines = rows = positives = 0
    try:
        with (
            fsspec.open(url, "rb", compression="infer") as src,
            day_file_writer(out, day, name, criteo_schema()) as writer,
            quarantine,
        ):
            groups = _RowGroups(writer, row_group_size)
            try:
                for block in _read_lines(src, block_size):
                    batch, line_numbers, malformed = _split_fields(block)
                    table, value_bad = _convert_block(batch, line_numbers)
                    quarantine.write(sorted(malformed + value_bad, key=lambda b: b.line))
                    groups.add(table)
                    rows += table.num_rows
                    positives += int(pc.sum(table[LABEL]).as_py() or 0)
                    count = len(line_numbers) + len(malformed)
                    lines += count
                    if progress is not None:
                        progress(count)
            except (EOFError, gzip.BadGzipFile, zlib.error, lzma.LZMAError) as e:
                # A corrupt or truncated archive: no line after the damage can be read.
                raise MalformedDataError(f"{url}: unreadable input: {e}") from e
            groups.flush()

            bad = quarantine.count
            if bad > max_bad_fraction * lines:
                raise MalformedDataError(
                    f"{url}: {bad} malformed lines out of {lines} ({bad / lines:.4%}) exceed "
                    f"max_bad_fraction={max_bad_fraction:g}; they are listed in {quarantine_url}"
                )
            written = writer.finish()
    except DayWriteError as e:
        raise DayWriteError(f"{e} (converting {url})") from e
    return ConvertedDay(
        day,
        lines,
        rows,
        positives,
        bad,
        quarantine_url if bad else None,
        written.path,
        written.digest,
        written.bytes,
    )


def _read_lines(src: IO[bytes], block_size: int) -> Iterator[_Lines]:
    """The lines of ``src``, whole, about ``block_size`` bytes at a time.

    A line longer than ``MAX_LINE_BYTES`` is never held whole: once the unfinished line
    after a block grows past it, the rest of the line is read past and the line comes back
    as a bad one, with its first ``_SHOWN_BYTES`` bytes.
    """
    number = 1  # of the next line to come back
    carry = b""  # the start of a line whose end has not been read yet
    while chunk := src.read(block_size):
        data = carry + chunk
        end = data.rfind(b"\n") + 1
        carry = data[end:]
        if end:
            block = _Lines(number, data[:end])
            number += block.data.count(b"\n")
            yield block
        if len(carry) > MAX_LINE_BYTES:
            shown, size = carry[:_SHOWN_BYTES], len(carry)
            carry = b""
            while chunk := src.read(block_size):
                newline = chunk.find(b"\n")
                if newline >= 0:
                    size, carry = size + newline, chunk[newline + 1 :]
                    break
                size += len(chunk)
            yield _Lines(number, b"", [_BadLine(number, _too_long(size), _text(shown) + "...")])
            number += 1
    if carry:
        yield _Lines(number, carry)


def _too_long(size: int) -> str:
    return f"line of {size} bytes, longer than the {MAX_LINE_BYTES} a Criteo line can be"


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def _split_fields(block: _Lines) -> tuple[pa.RecordBatch, np.ndarray, list[_BadLine]]:
    r"""Split a block's lines into raw fields.

    Returns a batch of the lines that have 40 fields (every field as bytes, empty as b""),
    their line numbers, and the lines that do not (with ``block.bad``). numpy finds every
    line that pyarrow's CSV parser must not see, because it would misread or reject it:
    empty lines (read as 40 empty fields), over-long ones, and those holding a ``\r`` (a
    line break to the parser) or bytes that are not UTF-8 (which the parser decodes, and
    fails on, to report a wrong field count). Those few are judged here, line by line; the
    parser reports the rest with a wrong field count.
    """
    buf = np.frombuffer(block.data, np.uint8)
    ends = np.flatnonzero(buf == _LF)  # where each line's break is
    if len(buf) and buf[-1] != _LF:
        ends = np.append(ends, len(buf))  # the last line, ending the file without a break
    starts = np.empty_like(ends)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    # A "\r\n" break: the \r is not part of the line (and the parser takes it as a break).
    stops = ends - ((ends > starts) & (buf[ends - 1] == _CR))
    lengths = stops - starts
    numbers = block.first + np.arange(len(ends), dtype=np.int64)

    odd_bytes = np.flatnonzero((buf == _CR) | (buf >= 0x80))
    odd_lines = np.searchsorted(ends, odd_bytes)
    odd_lines = odd_lines[odd_bytes != stops[odd_lines]]  # not the \r of a "\r\n"
    suspects = np.union1d(odd_lines, np.flatnonzero((lengths == 0) | (lengths > MAX_LINE_BYTES)))
    bad = list(block.bad)
    dropped = []
    for i in suspects.tolist():
        raw = block.data[starts[i] : stops[i]]
        reason = _line_reason(raw)
        if reason is not None:
            text = _text(raw) if len(raw) <= MAX_LINE_BYTES else _text(raw[:_SHOWN_BYTES]) + "..."
            bad.append(_BadLine(int(numbers[i]), reason, text))
            dropped.append(i)
    data: bytes | memoryview = block.data
    if dropped:
        # Few lines go: copy the stretches between them.
        view, pieces, at = memoryview(block.data), [], 0
        for i in dropped:
            pieces.append(view[at : int(starts[i])])
            at = int(ends[i]) + 1
        pieces.append(view[at:])
        data = b"".join(pieces)
        numbers = np.delete(numbers, dropped)

    wrong_count: list[Any] = []  # the parser's rows with a field count other than 40

    def on_wrong_count(row: Any) -> str:
        wrong_count.append(row)
        return "skip"

    if len(data):
        table = pacsv.read_csv(
            pa.py_buffer(data),
            read_options=pacsv.ReadOptions(
                column_names=list(FIELDS),
                use_threads=False,  # only then does the parser know line numbers
                block_size=len(data) + 1,  # one block: no line straddles two
            ),
            parse_options=pacsv.ParseOptions(
                delimiter="\t",
                quote_char=False,  # Criteo has no quoting: a quote is just a bad value
                ignore_empty_lines=False,
                invalid_row_handler=on_wrong_count,
            ),
            convert_options=pacsv.ConvertOptions(
                column_types=dict.fromkeys(FIELDS, pa.binary()), strings_can_be_null=False
            ),
        ).combine_chunks()
        batch = table.to_batches()[0] if table.num_rows else _empty_fields()
    else:
        batch = _empty_fields()
    if wrong_count:
        index = np.array([row.number - 1 for row in wrong_count], dtype=np.int64)
        bad += [
            _BadLine(int(numbers[i]), _wrong_count(row.actual_columns), row.text)
            for i, row in zip(index.tolist(), wrong_count, strict=True)
        ]
        numbers = np.delete(numbers, index)
    if len(numbers) != batch.num_rows:  # the parser split lines differently: a bug here
        raise AssertionError(f"{batch.num_rows} rows parsed from {len(numbers)} lines")
    return batch, numbers, bad


def _line_reason(raw: bytes) -> str | None:
    r"""Why a line (without its break) the CSV parser must not see is malformed, or None
    for one it can take: 40 fields, no ``\r`` (bad bytes in a field are that field's
    error, found with the others)."""
    if not raw:
        return "empty line"
    if len(raw) > MAX_LINE_BYTES:
        return _too_long(len(raw))
    fields = raw.count(b"\t") + 1
    if fields != len(FIELDS):
        return _wrong_count(fields)
    if b"\r" in raw:
        return "a carriage return (\\r) inside the line"
    return None


def _wrong_count(fields: int) -> str:
    return f"expected {len(FIELDS)} fields, got {fields}"


def _empty_fields() -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=pa.schema([(f, pa.binary()) for f in FIELDS]))


class _Quarantine:
    """The JSONL file of one input's malformed lines, created at the first one.

    A quarantine file left by an earlier run of the same input is removed, so the file on
    disk always describes the latest conversion. A failed write (a full disk) is an
    ``OutputError`` naming the file, the day and the input.
    """

    def __init__(self, source: str, url: str, day: int) -> None:
        self.source, self.url, self.day, self.count = source, url, day, 0
        self._fs, self._path = fsspec.core.url_to_fs(url)
        self._file: IO[str] | None = None

    def __enter__(self) -> _Quarantine:
        if self._fs.exists(self._path):
            self._fs.rm(self._path)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                if exc[0] is None:  # a flush that failed; an earlier error says more
                    reason = os.strerror(e.errno) if e.errno is not None else str(e)
                    raise OutputError(
                        f"day {self.day}: {self.url}: could not be written: {reason} "
                        f"(converting {self.source})"
                    ) from e

    def write(self, bad: list[_BadLine]) -> None:
        if not bad:
            return
        try:
            if self._file is None:
                self._fs.makedirs(posixpath.dirname(self._path), exist_ok=True)
                self._file = self._fs.open(self._path, "w", encoding="utf-8")
            for b in bad:
                record = {"file": self.source, "line": b.line, "reason": b.reason, "text": b.text}
                self._file.write(json.dumps(record) + "\n")
        except OSError as e:
            reason = os.strerror(e.errno) if e.errno is not None else str(e)
            raise OutputError(
                f"day {self.day}: {self.url}: could not be written: {reason} "
                f"(converting {self.source})"
            ) from e
        self.count += len(bad)


class _RowGroups:
    """Buffers converted blocks and writes them in row groups of exactly ``size`` rows."""

    def __init__(self, writer: DayFileWriter, size: int) -> None:
        self.writer, self.size = writer, size
        self._buffer: list[pa.Table] = []
        self._rows = 0

    def add(self, table: pa.Table) -> None:
        self._buffer.append(table)
        self._rows += table.num_rows
        if self._rows >= self.size:
            full = self._rows - self._rows % self.size
            table = pa.concat_tables(self._buffer)
            self.writer.write_table(table.slice(0, full), row_group_size=self.size)
            self._buffer, self._rows = [table.slice(full)], self._rows - full

    def flush(self) -> None:
        if self._rows:
            self.writer.write_table(pa.concat_tables(self._buffer), row_group_size=self.size)
        self._buffer, self._rows = [], 0


def _convert_block(
    batch: pa.RecordBatch, line_numbers: np.ndarray
) -> tuple[pa.Table, list[_BadLine]]:
    """Parse one block of raw fields; returns the valid rows and the malformed ones."""
    columns = [batch.column(i) for i in range(len(FIELDS))]
    labels, label_error = _parse_label(columns[0])
    dense = [_parse_int32(c) for c in columns[1 : 1 + len(DENSE)]]
    sparse = [_parse_hex64(c) for c in columns[1 + len(DENSE) :]]
    errors = np.stack([label_error] + [p[2] for p in dense] + [p[2] for p in sparse], axis=1)
    ok = ~errors.any(axis=1)

    arrays = [pa.array(labels[ok], pa.int8())]
    for values, present, _ in dense:
        arrays.append(pa.array(values[ok].astype(np.int32), pa.int32(), mask=~present[ok]))
    for values, present, _ in sparse:
        arrays.append(pa.array(values[ok], pa.int64(), mask=~present[ok]))
    table = pa.Table.from_arrays(arrays, schema=criteo_schema())
    if ok.all():
        return table, []
    bad_rows = np.flatnonzero(~ok)
    return table, _describe(
        batch.take(pa.array(bad_rows)), errors[bad_rows], line_numbers[bad_rows]
    )


def _describe(raw: pa.RecordBatch, errors: np.ndarray, line_numbers: np.ndarray) -> list[_BadLine]:
    """Reasons and reconstructed text of malformed rows (few, so plain Python is fine)."""
    fields = [
        [v.decode("utf-8", "backslashreplace") for v in raw.column(i).to_pylist()]
        for i in range(len(FIELDS))
    ]
    bad = []
    for r, line in enumerate(line_numbers.tolist()):
        values = [column[r] for column in fields]
        reasons = [
            _reason(name, code, value)
            for name, code, value in zip(FIELDS, errors[r].tolist(), values, strict=True)
            if code != _OK
        ]
        bad.append(_BadLine(line, "; ".join(reasons), "\t".join(values)))
    return bad


def _reason(name: str, code: int, value: str) -> str:
    shown = f"'{value}'" if len(value) <= 40 else f"'{value[:40]}...'"
    if name == LABEL:
        return f"label: must be 0 or 1, got {shown}"
    if name in DENSE:
        return f"{name}: bad integer {shown}" if code == _BAD else f"{name}: {shown} not in int32"
    return f"{name}: bad hex {shown}" if code == _BAD else f"{name}: hex {shown} not in int64"


def _parse_label(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Labels as int8 and an error code per row: exactly "0" or "1" is valid."""
    offsets, data = _raw(column)
    one_byte = np.diff(offsets) == 1
    digit = np.full(len(one_byte), 255, np.uint8)
    digit[one_byte] = _DEC_VALUE[data[offsets[:-1][one_byte]]]
    valid = digit <= 1
    return np.where(valid, digit, 0).astype(np.int8), np.where(valid, _OK, _BAD).astype(np.uint8)


def _parse_int32(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Optionally negative decimal integers: values (int64), present mask, error codes."""
    offsets, data = _raw(column)
    lengths = np.diff(offsets)
    digits = _digits(offsets, data, _DEC_VALUE)
    rows, width = digits.shape
    # A leading '-' is a sign: note it, then read it as a leading zero.
    present = lengths > 0
    negative = np.zeros(rows, bool)
    negative[present] = data[offsets[:-1][present]] == ord("-")
    sign_rows = np.flatnonzero(negative & (lengths <= width))
    digits[sign_rows, width - lengths[sign_rows]] = 0
    bad = _has_invalid(digits) | (lengths > _MAX_FIELD_CHARS) | (negative & (lengths == 1))

    magnitude = digits[:, -10:].astype(np.int64) @ _POW10[-min(width, 10) :]
    values = np.where(negative, -magnitude, magnitude)
    out_of_range = (values < _INT32_MIN) | (values > _INT32_MAX)
    if width > 10:  # digits beyond the last 10 must be leading zeros
        out_of_range |= (digits[:, :-10] != 0).any(axis=1)
    return np.where(bad, 0, values), present, _codes(bad, out_of_range)


def _parse_hex64(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hexadecimal IDs as int64: values, present mask, error codes.

    Right-aligned nibbles are packed two per byte and read as one big-endian integer per
    row, so the whole column converts in a few array operations.
    """
    offsets, data = _raw(column)
    lengths = np.diff(offsets)
    nibbles = _digits(offsets, data, _HEX_VALUE)
    width = nibbles.shape[1]
    bad = _has_invalid(nibbles) | (lengths > _MAX_FIELD_CHARS)

    low = nibbles[:, -16:] & 0x0F  # masking keeps bad rows' 255s inside a byte
    packed = np.ascontiguousarray((low[:, 0::2] << 4) | low[:, 1::2])
    unsigned = packed.view(f">u{packed.shape[1]}")[:, 0].astype(np.uint64)
    out_of_range = unsigned > np.uint64(np.iinfo(np.int64).max)
    if width > 16:  # nibbles beyond the last 16 must be leading zeros
        out_of_range |= (nibbles[:, :-16] != 0).any(axis=1)
    values = np.where(bad | out_of_range, np.uint64(0), unsigned).view(np.int64)
    return values, lengths > 0, _codes(bad, out_of_range)


def _codes(bad: np.ndarray, out_of_range: np.ndarray) -> np.ndarray:
    return np.where(bad, _BAD, np.where(out_of_range, _RANGE, _OK)).astype(np.uint8)


def _raw(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The offsets (as int64) and bytes of a binary column; the bytes are not copied."""
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, np.int32)[column.offset : column.offset + len(column) + 1]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    return offsets.astype(np.int64), data


def _digits(offsets: np.ndarray, data: np.ndarray, table: np.ndarray) -> np.ndarray:
    """A (rows, width) matrix of each value's digit values, right-aligned, left-padded with 0.

    ``table`` maps each byte to its digit value (255: not a digit). Zero padding leaves a
    number's value unchanged, so every row is read positionally. The width is 8, 16 or 32,
    whichever first fits the longest value (a multiple of 8 for ``_has_invalid``). Values
    longer than ``_MAX_FIELD_CHARS`` are left as 0; callers reject them by length.
    """
    lengths = np.diff(offsets)
    longest = int(lengths.max(initial=0))
    width = next(w for w in (8, 16, _MAX_FIELD_CHARS) if w >= min(longest, _MAX_FIELD_CHARS))
    rows = len(lengths)
    values = table.take(data[offsets[0] : offsets[-1]])
    cells = np.zeros((rows, width), np.uint8)
    if 0 < longest <= _MAX_FIELD_CHARS and ((lengths == 0) | (lengths == longest)).all():
        # Fixed-width values (Criteo's 8-digit IDs) are already a matrix in the buffer.
        cells[lengths > 0, width - longest :] = values.reshape(-1, longest)
        return cells
    # Byte i of row r lands at cell r * width + width - (end_r - i) = i + shift_r; one
    # write per byte is faster than one read per cell (a row has no more bytes than cells).
    shift = np.arange(1, rows + 1) * width - offsets[1:]
    target = np.arange(offsets[0], offsets[-1]) + np.repeat(shift, lengths)
    if longest > _MAX_FIELD_CHARS:
        fits = np.repeat(lengths <= _MAX_FIELD_CHARS, lengths)
        target, values = target[fits], values[fits]
    cells.reshape(-1)[target] = values
    return cells


def _has_invalid(values: np.ndarray) -> np.ndarray:
    """Rows of a looked-up digit matrix holding a 255 (not a digit), 8 bytes at a time."""
    words = np.bitwise_or.reduce(values.view(np.uint64), axis=1)
    return (words & _HIGH_BITS) != 0

"""Raw Criteo TSV input files -> the dataset's day files and its manifest.

Input K becomes day K, streamed through ``tsv`` into a day file written beside the old ones
(``dayfile``) and switched in by the manifest last, so a dataset already there stays whole
until the new one is. ``convert_criteo`` is ``start_conversion``, ``convert_day`` for each
input and ``finish_conversion``: the ingest flow runs the same three steps with the days
as separate (parallel) tasks.

Malformed lines are never dropped silently: each is written with its line number and the
reason to ``OUT/_quarantine/<input basename>.jsonl``, and a file with more of them than
``max_bad_fraction`` of its lines fails the run. Only input that cannot be read at all (a
corrupt or truncated archive) fails a file regardless of the fraction.
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import posixpath
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc

from dlrmflow.atomic_writes import OutputError
from dlrmflow.ingest.criteo.tsv import BadLine, convert_block, read_lines, split_fields
from dlrmflow.ingest.dayfile import (
    DayFileWriter,
    DayWriteError,
    day_file_writer,
    discard_unlisted,
    file_name,
    remove_temporaries,
)
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.lock import dataset_lock
from dlrmflow.ingest.manifest import (
    DayFile,
    Manifest,
    join_url,
    listed_paths,
    publish_manifest,
    read_manifest,
)
from dlrmflow.ingest.schema import LABEL, criteo_schema, schema_to_json

QUARANTINE_DIR = "_quarantine"
# Part of every day file's name: change it whenever the same input and options start to
# give other rows, so that a new dataset never takes an old file's name.
CONVERTER_FORMAT = 1
# Metadata keys that identify a file's version on the file systems fsspec supports
# (local and memory: mtime/created; s3: ETag/LastModified; gcs: md5Hash/updated).
_VERSION_KEYS = ("mtime", "created", "LastModified", "last_modified", "updated", "ETag", "md5Hash")

# The manifest's record of the landed files converted into its days (``generator``'s
# ``landed``: one entry a day, in day order), by which a landing folder grows the dataset.
LANDED_KEY = "landed"


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
    names = [input_name(url) for url in inputs]
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
        quarantine_url=join_url(out, QUARANTINE_DIR, f"{input_name(url)}.jsonl"),
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
    quarantine = join_url(out, QUARANTINE_DIR, f"{input_name(url)}.jsonl") if bad else None
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


def input_name(url: str) -> str:
    """An input's file name, which names its quarantine file (and, landed, orders its day)."""
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
                for block in read_lines(src, block_size):
                    batch, line_numbers, malformed = split_fields(block)
                    table, value_bad = convert_block(batch, line_numbers)
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

    def write(self, bad: list[BadLine]) -> None:
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

"""A landing folder that gains a raw Criteo file a day -> its dataset, grown by the new days.

Each landed file is identified by its content (size and SHA-256), recorded in the
manifest (``generator["landed"]``), so a day once converted keeps its number and its file
whatever becomes of its raw file, and a later run converts only the files no day has
(``plan_landing``, ``convert_landed``). The conversion itself is ``convert``'s.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from dlrmflow.ingest.criteo.convert import (
    LANDED_KEY,
    QUARANTINE_DIR,
    ConvertedDay,
    ConvertResult,
    convert_day,
    finish_conversion,
    input_fingerprint,
    input_name,
    start_conversion,
)
from dlrmflow.ingest.dayfile import discard_unlisted
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.lock import dataset_lock
from dlrmflow.ingest.manifest import Manifest, join_url, listed_paths, read_manifest


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
    by_name = {input_name(f.url): f for f in plan}
    last = max(by_name, key=_natural) if by_name else None
    for url in urls:
        name = input_name(url)
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
    name = input_name(landed.url)
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

"""``manifest.json``: what a Parquet dataset holds, written by generate and convert.

The manifest is the contract between ingest and everything after it: which day files
exist, how many rows each has, each file's identity (the digest in its footer, see
``dlrmflow.ingest.dayfile``) and size, which day is held out for evaluation, and (for
synthetic data) the Bayes-optimal metrics a trained model is compared against.
``check_dataset`` holds a dataset to that contract, from the Parquet footers alone, before
any work starts. A new dataset replaces an old one at ``publish_manifest``: the manifest is
switched only once every new day file is complete, and the old files go after it.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from dlrmflow.atomic_writes import write_url
from dlrmflow.ingest.dayfile import (
    FOOTER_DIGEST,
    NotRegularFile,
    footer_digest,
    footer_identity,
    open_regular,
    remove_unlisted,
)
from dlrmflow.ingest.errors import DataError

MANIFEST_NAME = "manifest.json"
# The dataset's feature statistics (``dlrmflow.ingest.stats``), valid for the files the
# manifest listed when they were computed.
STATS_NAME = "stats.json"
FORMAT_VERSION = 1
# Footers read at once: on object stores each is a round trip or two of latency.
_FOOTER_THREADS = 16
# Problems named in one error message; the rest are counted.
_SHOWN_PROBLEMS = 5


class DayFile(BaseModel):
    """One day partition: its path relative to the dataset root, its row count, and its
    identity: the digest its footer records and its size in bytes.

    Manifests written before identities were recorded have neither; they are left out of
    the JSON when unknown, so such a manifest (and its digest, which checkpoints keep)
    reads and writes back unchanged.
    """

    model_config = ConfigDict(extra="forbid")
    day: int
    path: str
    rows: int
    positive_rate: float
    digest: str | None = None
    bytes: int | None = None
    # Synthetic data: the AUC and log loss of the true click probabilities on this day.
    bayes_auc: float | None = None
    bayes_logloss: float | None = None
    # Synthetic days that move: the click rate the generator aimed the day at, and the
    # calibration on this day of the day before's click model (today's click model with
    # yesterday's intercept): the part of a next-day miscalibration no model avoids.
    target_rate: float | None = None
    reference_calibration: float | None = None

    @model_serializer(mode="wrap")
    def _drop_unknown_identity(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in (
            "digest",
            "bytes",
            "bayes_auc",
            "bayes_logloss",
            "target_rate",
            "reference_calibration",
        ):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class Manifest(BaseModel):
    """Contents of ``manifest.json`` at the root of a dataset."""

    model_config = ConfigDict(extra="forbid")
    format_version: int = FORMAT_VERSION
    source: str  # "synthetic" or "criteo"
    rows: int
    days: int
    test_day: int
    positive_rate: float
    multi_hot: bool = False
    files: list[DayFile]
    schema_: list[dict[str, str]] = Field(alias="schema")
    # Distinct IDs each categorical column can take (known for synthetic data only).
    cardinalities: dict[str, int] | None = None
    bayes_auc: float | None = None
    bayes_logloss: float | None = None
    generator: dict[str, Any] | None = None
    # The declared feature schema (``dlrmflow.schema``) of a registered dataset; None:
    # Criteo's layout. Left out of the JSON when None, so a manifest written before
    # schemas (and its digest, which checkpoints keep) reads and writes back unchanged.
    features: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_schema(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("features") is None:
            data.pop("features", None)
        return data

    def day_paths(
        self, root: str, days: list[int] | None = None, held_out: list[int] | None = None
    ) -> list[str]:
        """Full URLs of the day files, optionally restricted to ``days``.

        Raises ``DataError`` when one of ``days`` has no file (an empty list would only fail
        later, far from its cause), and when a file they list is also listed under a
        held-out day (``held_out``, by default the test day when ``days`` leaves it out):
        held-out rows would be read with the others.
        """
        if days is None:
            return [join_url(root, f.path) for f in self.files]
        wanted = set(days)
        missing = sorted(wanted - {f.day for f in self.files})
        if missing:
            raise DataError(f"day {', '.join(map(str, missing))}: no file in the manifest")
        chosen = [f for f in self.files if f.day in wanted]
        if held_out is None:
            held_out = [] if self.test_day in wanted else [self.test_day]
        for day in held_out:
            kept = {_normal(f.path) for f in self.files if f.day == day}
            for f in chosen:
                if _normal(f.path) in kept:
                    raise DataError(
                        f"{f.path}: listed under day {f.day} and under the held-out day "
                        f"{day}; the held-out day's rows must not be read with others"
                    )
        return [join_url(root, f.path) for f in chosen]

    def path_days(self, root: str) -> dict[str, int]:
        """Each day file's full URL (as ``day_paths`` gives it) and its day: what the
        reader takes a file's day from where the file itself does not record it (a
        registered dataset's files, numbered in partition order)."""
        return {join_url(root, f.path): f.day for f in self.files}

    def train_days(self) -> list[int]:
        """Every day with a file except the held-out test day, ascending.

        Raises ``DataError`` when the test day has no file: then nothing would be held out,
        and the day meant for evaluation might be trained on under another number.
        """
        if not any(f.day == self.test_day for f in self.files):
            raise DataError(
                f"test day {self.test_day}: no file in the manifest, so no day is held out"
            )
        return sorted({f.day for f in self.files if f.day != self.test_day})


def check_dataset(
    url: str,
    manifest: Manifest,
    *,
    training: bool = True,
    train_days: list[int] | None = None,
    eval_days: list[int] | None = None,
) -> list[str]:
    """Check the dataset at ``url`` against its ``manifest`` before any work starts.

    Reads the Parquet footer of every listed file (never the data, so it is cheap at any
    size; footers are read a few at once for object stores). Raises ``DataError`` naming
    the day and file, and what is wrong (the first few problems when there are several):

    - the manifest: a file listed twice; a day outside ``0 .. days-1``, or one of those
      days without a file; a test day that is not one of the days or has no file; no
      training day; ``rows`` other than the files' sum;
    - the files: a file that is missing, not a regular file (a FIFO is refused from its
      type, never opened blocking) or not Parquet; or whose row count, size or footer
      digest differs from the manifest's (a file replaced, even by one of the same rows,
      or truncated). Manifests without sizes and digests have their row counts checked;
    - the rows: an empty test day (nothing to evaluate on), or every training day empty.

    Returns warnings, one string each: a training day with no rows (training goes on
    with the others). ``training=False`` checks what evaluation needs: the manifest, and
    of the files only the evaluated days', so a dataset of the test day alone passes, as
    does one whose training files are gone.

    A run that chose its windows (``data.train_days``, ``data.eval_days``) passes them:
    then its training days and its evaluated days (none, or others than the test day)
    are the ones checked, so a dataset of one day can be trained on.
    """
    where = join_url(url, MANIFEST_NAME)
    _raise_any(where, _manifest_problems(manifest, training and train_days is None))
    evaluated = [manifest.test_day] if eval_days is None else eval_days
    needed = [f for f in manifest.files if training or f.day in evaluated]
    _raise_any(where, _file_problems(url, needed))

    rows_by_day: dict[int, int] = defaultdict(int)
    for f in manifest.files:
        rows_by_day[f.day] += f.rows
    for day in evaluated:
        if rows_by_day[day] == 0:
            kind = "test day" if day == manifest.test_day else "evaluation day"
            raise DataError(
                f"{where}: {kind} {day} has no rows "
                f"({_files_of(url, manifest, day)}); there is nothing to evaluate on"
            )
    if not training:
        return []
    train = manifest.train_days() if train_days is None else train_days
    empty = [day for day in train if rows_by_day[day] == 0]
    if len(empty) == len(train):
        raise DataError(f"{where}: every training day ({_days(train)}) has no rows")
    return [
        f"day {day} has no rows ({_files_of(url, manifest, day)}); training on the other days"
        for day in empty
    ]


def _manifest_problems(manifest: Manifest, training: bool) -> list[str]:
    """What is inconsistent in the manifest itself (or, for ``training`` on the days
    outside the test day, unusable)."""
    problems = []
    paths = Counter(_normal(f.path) for f in manifest.files)
    for path, count in paths.items():
        if count > 1:
            problems.append(f"{path}: listed {count} times")
    days = range(manifest.days)
    with_file = {f.day for f in manifest.files}
    outside = sorted(with_file - set(days))
    if outside:
        problems.append(f"day {_days(outside)}: outside the manifest's {manifest.days} days")
    without = [day for day in days if day not in with_file and day != manifest.test_day]
    if without:
        problems.append(f"day {_days(without)}: no file")
    if manifest.test_day not in days:
        problems.append(
            f"test day {manifest.test_day}: not one of the manifest's days (0-{manifest.days - 1})"
        )
    elif manifest.test_day not in with_file:
        problems.append(f"test day {manifest.test_day}: no file")
    if training and not with_file - {manifest.test_day}:
        problems.append(f"no training day: no file outside test day {manifest.test_day}")
    listed = sum(f.rows for f in manifest.files)
    if manifest.rows != listed:
        problems.append(f"rows={manifest.rows}, but its files hold {listed} rows")
    return problems


def _file_problems(url: str, files: list[DayFile]) -> list[str]:
    """What differs between these listed files and the files present (footers only)."""

    def problem(listed: DayFile) -> str | None:
        """What is wrong with the listed file, or None."""
        path = join_url(url, listed.path)
        try:
            f, stamp = open_regular(path)
        except FileNotFoundError:
            return "missing"
        except NotRegularFile as e:
            return e.strerror
        except OSError as e:
            return f"cannot be opened: {e.strerror or e}"
        resized = listed.bytes is not None and stamp.size != listed.bytes
        size = (
            f"has {stamp.size} bytes, the manifest says {listed.bytes} "
            "(truncated, or replaced by another file)"
        )
        try:
            with f:
                registered = listed.digest is not None and listed.digest.startswith(FOOTER_DIGEST)
                footer = footer_digest(f, stamp.size) if registered else None
                metadata = pq.ParquetFile(f).metadata
        except Exception as e:  # whatever stops a footer being read is the file's fault
            unreadable = f"not a readable Parquet file ({type(e).__name__}: {e})"
            return f"{unreadable}; it {size}" if resized else unreadable
        if metadata.num_rows != listed.rows:
            return f"has {metadata.num_rows} rows, the manifest says {listed.rows}"
        if footer is not None:
            if footer != listed.digest:
                return "rewritten or replaced since it was registered: its footer differs"
        elif listed.digest is not None:
            _, digest = footer_identity(metadata)
            if digest is None:
                return (
                    "replaced by another file: its footer records no digest, the manifest "
                    f"says {_short(listed.digest)}"
                )
            if digest != listed.digest:
                return (
                    f"replaced by another file: its footer's digest {_short(digest)} differs "
                    f"from the manifest's {_short(listed.digest)}"
                )
        return size if resized else None

    threads = max(1, min(_FOOTER_THREADS, len(files)))
    with ThreadPoolExecutor(threads, thread_name_prefix="footer") as pool:
        found = list(pool.map(problem, files))
    return [
        f"day {f.day}: {join_url(url, f.path)}: {p}"
        for f, p in zip(files, found, strict=True)
        if p is not None
    ]


def _short(digest: str) -> str:
    return digest[:12]


def _raise_any(where: str, problems: list[str]) -> None:
    if not problems:
        return
    shown = "; ".join(problems[:_SHOWN_PROBLEMS])
    more = len(problems) - _SHOWN_PROBLEMS
    raise DataError(f"{where}: {shown}" + (f"; and {more} more" if more > 0 else ""))


def _files_of(url: str, manifest: Manifest, day: int) -> str:
    return ", ".join(join_url(url, f.path) for f in manifest.files if f.day == day)


def _days(days: list[int]) -> str:
    return ", ".join(map(str, days))


def _normal(path: str) -> str:
    return posixpath.normpath(path)


def join_url(root: str, *parts: str) -> str:
    """Join path parts onto an fsspec URL (``posixpath`` keeps ``memory://`` intact)."""
    return posixpath.join(root.rstrip("/"), *parts)


def write_json(root: str, name: str, data: object) -> str:
    """Write ``data`` as indented JSON to file ``name`` under ``root``; returns its URL."""
    url = join_url(root, name)
    write_url(url, json.dumps(data, indent=2) + "\n")
    return url


def write_manifest(root: str, manifest: Manifest) -> str:
    """Write ``manifest.json`` under ``root``; returns its URL."""
    return write_json(root, MANIFEST_NAME, manifest.model_dump(by_alias=True))


def publish_manifest(root: str, manifest: Manifest) -> str:
    """Make ``manifest`` the dataset at ``root``: write ``manifest.json`` (one atomic
    replace: readers see the old dataset or the new one), then remove the day files it no
    longer lists. Every file it lists must be complete before this is called."""
    before = listed_paths(root)
    if before != {posixpath.normpath(f.path) for f in manifest.files}:
        # Statistics of other files would plan the new dataset's tables (and say nothing
        # of it): gone before the switch, recomputed by `dlrmflow stats` or the flow.
        _remove_quietly(join_url(root, STATS_NAME))
    written = write_manifest(root, manifest)
    remove_unlisted(root, [f.path for f in manifest.files], [f.day for f in manifest.files])
    return written


def _remove_quietly(url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


def listed_paths(root: str) -> set[str] | None:
    """The files the manifest at ``root`` lists now: none if it has no manifest (or not a
    valid one), None if it could not be read (nothing can be said to be unlisted)."""
    try:
        return {posixpath.normpath(f.path) for f in read_manifest(root).files}
    except (FileNotFoundError, ValueError):
        return set()
    except OSError:
        return None


def read_manifest(root: str) -> Manifest:
    """Read and validate ``manifest.json`` under ``root``, with an error naming the file."""
    url = join_url(root, MANIFEST_NAME)
    try:
        with fsspec.open(url, "r") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{url}: no manifest; create the dataset with `dlrmflow generate` or `dlrmflow convert`"
        ) from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{url}: not valid JSON ({e})") from e
    try:
        return Manifest.model_validate(data)
    except Exception as e:
        raise ValueError(f"{url}: invalid manifest: {e}") from e

"""A registered dataset that grows a day at a time: the day partitions that landed under it
since it was registered become its next days, and the days registered before never change.

A team's pipeline writes a new ``day=N/`` or ``dt=YYYY-MM-DD/`` folder a day beside the
ones already registered (``dlrmflow.ingest.register``), or, where the schema names a day
column, new files of a new day anywhere below the dataset's folder. A model line over the dataset
registers it again before each run, so a new folder becomes the next day, but a line's
versions name the days they trained on by number and by the identity of their files: a
registered day must keep both for good. ``register_new_days`` therefore refuses, before
anything is written and in one line naming the folder or file, what would change one:

- a new partition (a folder, or the files of a day in the day column) that sorts before a
  registered one (it arrived late: registered again it would take that day's number and
  renumber every day after it);
- a registered partition that is gone, a file gone from it or a file added to it (with a
  day column: a new file of a registered day);
- a registered file rewritten or replaced (its size or its Parquet footer differs).

It mirrors what ``convert_landed`` does for raw Criteo files landing in a folder. Files
unchanged keep their records without their labels being read again (``register_dataset``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dlrmflow.ingest.dayfile import footer_digest, open_regular
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import MANIFEST_NAME, DayFile, Manifest, join_url, read_manifest
from dlrmflow.ingest.register import SOURCE, Partition, find_partitions, register_dataset
from dlrmflow.schema import parse_schema


class RegisteredDayChanged(DataError):
    """A registered day's partition or files changed, or a late partition would renumber
    the days: the message names the folder or file and what to do."""


@dataclass(frozen=True)
class GrownDataset:
    """What ``register_new_days`` did: the dataset's manifest now, and the days it gained."""

    manifest: Manifest
    new_days: list[int]


def is_registered(url: str) -> bool:
    """Whether ``url`` holds a registered dataset (False where it holds no manifest yet)."""
    try:
        return read_manifest(url).source == SOURCE
    except FileNotFoundError:
        return False


def register_new_days(url: str, progress: Callable[[int], None] | None = None) -> GrownDataset:
    """Register the day partitions that landed under the registered dataset at ``url``
    since it was last registered, under the schema its manifest records, as its next days
    (see the module's docstring for what is refused). Nothing is written when no partition
    is new. ``progress`` is ``register_dataset``'s."""
    before = read_manifest(url)
    where = join_url(url, MANIFEST_NAME)
    if before.source != SOURCE:
        raise DataError(f"{where}: a {before.source} dataset, not a registered one")
    if before.features is None:
        raise DataError(f"{where}: records no feature schema; register the dataset again")
    schema = parse_schema(before.features, where)
    partitions = find_partitions(url, schema.day_column)
    new = _check_unchanged(url, before, partitions, by_column=schema.day_column is not None)
    if not new:
        return GrownDataset(before, [])
    manifest = register_dataset(url, schema, progress)
    kept = {f.path: f for f in manifest.files}
    for old in before.files:
        now = kept.get(old.path)
        if now is None or (now.day, now.digest, now.bytes) != (old.day, old.digest, old.bytes):
            # Only a change between the check above and the registration's own reading.
            raise RegisteredDayChanged(
                f"{join_url(url, old.path)}: changed while the dataset was registered again "
                f"(day {old.day}); restore it as it was registered"
            )
    return GrownDataset(manifest, sorted({f.day for f in manifest.files} - set(_days(before))))


def _days(manifest: Manifest) -> list[int]:
    return sorted({f.day for f in manifest.files})


def _check_unchanged(
    url: str, before: Manifest, partitions: list[Partition], *, by_column: bool
) -> list[Partition]:
    """The partitions new since ``before``, after every registered day was found as it was
    registered: its partition, its files, each file's size and footer. ``by_column``: the
    partitions are a day column's, not folders."""
    by_day: dict[int, list[DayFile]] = {}
    for f in before.files:
        by_day.setdefault(f.day, []).append(f)
    names = (before.generator or {}).get("partitions")
    if not isinstance(names, list) or len(names) != before.days:
        raise DataError(
            f"{join_url(url, MANIFEST_NAME)}: names no partition for each of its days; "
            "register the dataset again"
        )
    registered = {day: names[day] for day in by_day}
    found = {p.name: p for p in partitions}
    if by_column:
        # A file keeps its day while it is unchanged: with every registered file as it was
        # registered, every registered day is found again, and can only have gained files.
        for f in before.files:
            _check_file(url, f)
    for day, name in sorted(registered.items()):
        if name not in found:  # a folder: a day column's days were found above
            raise RegisteredDayChanged(
                f"{join_url(url, name)}: gone, but it was registered as day {day}, and a "
                "registered day never changes: put the folder back"
            )
    last_day = max(registered)
    last = registered[last_day]
    after = f"land its rows in a partition that sorts after {last}"
    if by_column:
        after = f"give its rows a day after {last}"
    for p in partitions:
        if p.name not in registered.values() and p.day < found[last].day:
            # Numbered in partition order: it sorts before ``last``.
            place = (
                f"{join_url(url, p.files[0])} ({p.name})" if by_column else join_url(url, p.name)
            )
            raise RegisteredDayChanged(
                f"{place}: landed after {last} (day {last_day}) was registered but sorts "
                f"before it, and registered days keep their numbers: move it out of {url}, "
                f"or {after}"
            )
    for day, name in sorted(registered.items()):
        listed = {f.path for f in by_day[day]}
        present = set(found[name].files)
        added, gone = sorted(present - listed), sorted(listed - present)
        if added:
            raise RegisteredDayChanged(
                f"{join_url(url, added[0])}: a new file {'of' if by_column else 'in'} {name}, "
                f"registered as day {day}, and a registered day never changes: move it out, "
                f"or {after}"
            )
        if gone:  # a folder's: a day column's registered files were all found above
            raise RegisteredDayChanged(
                f"{join_url(url, gone[0])}: gone from {name}, but it was registered as day "
                f"{day}, and a registered day never changes: put the file back"
            )
        if not by_column:
            for f in by_day[day]:
                _check_file(url, f)
    return [p for p in partitions if p.name not in registered.values()]


def _check_file(url: str, listed: DayFile) -> None:
    """The registered file as it was registered: its size and footer digest (its data is
    not read: a rewrite changes the footer's row-group metadata)."""
    path = join_url(url, listed.path)
    try:
        f, stamp = open_regular(path)
        with f:
            digest = footer_digest(f, stamp.size)
    except FileNotFoundError:
        raise RegisteredDayChanged(
            f"{path}: gone, but it was registered as day {listed.day}, and a registered day "
            "never changes: put the file back"
        ) from None
    except (OSError, ValueError) as e:
        raise RegisteredDayChanged(
            f"{path}: not a readable Parquet file ({e}), but it was registered as day "
            f"{listed.day}: restore it as it was registered"
        ) from None
    if (stamp.size, digest) != (listed.bytes, listed.digest):
        raise RegisteredDayChanged(
            f"{path}: rewritten since it was registered as day {listed.day}, and a "
            "registered day never changes under a line: restore the file as it was "
            "registered, or land new rows in a partition of their own"
        )

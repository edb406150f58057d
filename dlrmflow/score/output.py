"""The output directory of ``dlrmflow score``: Parquet parts, their manifest, resumption.

Layout under ``OUT``::

    _scores.json                    the manifest: model, dataset, days, parts, rows
    day-D/part-S-of-N.parquet       share S of N of day D: day, row, label, prediction,
                                    then the key columns, if any (``dlrmflow.score.keys``)

A part is written under a hidden temporary name (``.part-S-of-N.parquet.PID.tmp``) as its
batches arrive, one row group per ``ROW_GROUP_ROWS`` rows, and renamed into place only
once complete: a part that exists is whole, and a killed run leaves none half-written
(its temporaries are removed by the next run, which holds the directory's lock). The
names keep readers of the directory simple: pyarrow, pandas and Spark skip files that
start with ``_`` or ``.``, and ``day-D`` is no ``key=value`` partition whose type would
clash with the ``day`` column.

What makes two runs' parts one output is ``OutputIdentity``: the model's digest, each
scored day's files (a digest per day, so a dataset grown by a day, or moved, still
matches), ``max_rows`` and the key columns. A rerun against the same identity skips the
parts that exist and scores the rest; a directory holding another model's or another
day-file's predictions is refused in one line, or with ``overwrite`` cleared of its parts
first.
Each part's footer carries the model digest, day digest and key columns too, so a part
is never counted for a model that did not write it, nor one of other columns.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrmflow.atomic_writes import OutputError, write_atomic
from dlrmflow.config import ConfigError
from dlrmflow.errors import DlrmflowError
from dlrmflow.ingest.manifest import Manifest

SCORES_FILE = "_scores.json"
KIND = "dlrmflow-scores"
FORMAT_VERSION = 1
# Rows per Parquet row group: ~1.3 MB of the four columns, the most a part writer holds.
ROW_GROUP_ROWS = 1 << 16
FOOTER_KEY = b"dlrmflow.scores"
SCHEMA = pa.schema(
    [
        pa.field("day", pa.int32(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),
        pa.field("label", pa.int8()),  # null where the scored data has no label
        pa.field("prediction", pa.float32(), nullable=False),
    ]
)
_PART = re.compile(r"part-(\d+)-of-(\d+)\.parquet")
_DAY = re.compile(r"day-(\d+)")


class ScoresDirError(DlrmflowError, ValueError):
    """``--out`` holds something scoring must not write into or over."""


def output_dir(url: str | Path) -> Path:
    """The local directory ``url`` names (a path, or a ``file://`` URL); anything else,
    or a file there, is refused in one line."""
    text = str(url)
    if "://" in text:
        scheme, _, rest = text.partition("://")
        if scheme != "file":
            raise ConfigError(
                f"--out {text}: predictions are written to a local directory (a path or "
                "file:// URL), not to a remote file system"
            )
        text = rest
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path} is not a directory; --out names the directory of the parts")
    return path


def day_digest(manifest: Manifest, day: int) -> str:
    """The identity of one day's files: their paths, rows and footer digests."""
    files = sorted((f.path, f.rows, f.digest or "") for f in manifest.files if f.day == day)
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()


def part_path(out: Path, day: int, share: int, count: int) -> Path:
    return out / f"day-{day}" / f"part-{share}-of-{count}.parquet"


@dataclass(frozen=True)
class Part:
    """A complete part file: where it is and what its footer says."""

    path: Path
    day: int
    share: int
    count: int
    rows: int
    model_digest: str
    day_digest: str
    keys: tuple[str, ...] = ()

    def record(self, out: Path) -> dict[str, Any]:
        return {
            "path": str(self.path.relative_to(out)),
            "day": self.day,
            "share": self.share,
            "shares": self.count,
            "rows": self.rows,
        }


def read_part(path: Path) -> Part:
    """The part at ``path`` from its footer; a ``ScoresDirError`` for a file that is not
    one of ``score``'s parts."""
    match, day = _PART.fullmatch(path.name), _DAY.fullmatch(path.parent.name)
    try:
        metadata = pq.read_metadata(path)
        footer = json.loads((metadata.metadata or {})[FOOTER_KEY])
    except (OSError, KeyError, ValueError, pa.ArrowException) as e:
        raise ScoresDirError(f"{path}: not a part written by `dlrmflow score` ({e})") from e
    if match is None or day is None:
        raise ScoresDirError(f"{path}: not a part's name (day-D/part-S-of-N.parquet)")
    return Part(
        path,
        int(day[1]),
        int(match[1]),
        int(match[2]),
        metadata.num_rows,
        footer["model_digest"],
        footer["day_digest"],
        tuple(footer.get("keys", ())),
    )


def list_parts(out: Path) -> list[Part]:
    """Every complete part under ``out``, by day then layout then share."""
    parts = [read_part(p) for p in sorted(out.glob("day-*/part-*-of-*.parquet"))]
    return sorted(parts, key=lambda p: (p.day, p.count, p.share))


def part_schema(keys: pa.Schema | None = None) -> pa.Schema:
    """A part's columns: ``SCHEMA``'s, then the key columns ``keys`` (none by default)."""
    return SCHEMA if keys is None or not len(keys) else pa.schema([*SCHEMA, *keys])


class PartWriter:
    """One part, written row group by row group to a temporary file, renamed in place by
    ``commit``; closed without ``commit`` (an error, a kill) it leaves no part.

    ``keys``: the key columns each ``write`` is given the values of (none by default);
    their names go in the footer (left out when there are none, as before keys)."""

    def __init__(self, path: Path, footer: dict[str, Any], keys: pa.Schema | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.schema = part_schema(keys)
        if len(self.schema) > len(SCHEMA):
            footer = {**footer, "keys": self.schema.names[len(SCHEMA) :]}
        metadata = {FOOTER_KEY: json.dumps(footer).encode()}
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            self.temporary, self.schema.with_metadata(metadata)
        )
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self.rows = 0

    def write(
        self,
        day: int,
        rows: np.ndarray,
        labels: np.ndarray | None,
        predictions: np.ndarray,
        keys: pa.Table | None = None,
    ) -> None:
        """Add the predictions of ``rows`` of ``day`` (``labels``: None for unlabeled data)
        and, with key columns, their values ``keys`` (a table of the same rows)."""
        n = len(rows)
        label = pa.nulls(n, pa.int8()) if labels is None else pa.array(labels.astype(np.int8))
        columns = [
            pa.array(np.full(n, day, np.int32)),
            pa.array(rows.astype(np.int64, copy=False)),
            label,
            pa.array(predictions.astype(np.float32, copy=False)),
        ]
        if len(self.schema) > len(SCHEMA):
            assert keys is not None and keys.num_rows == n
            columns = [pa.chunked_array([c]) for c in columns] + keys.columns
        self._pending.append(pa.Table.from_arrays(columns, schema=self.schema))
        self._pending_rows += n
        self.rows += n
        if self._pending_rows >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending and self._writer is not None:
            table = pa.concat_tables(self._pending)
            self._writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
        self._pending, self._pending_rows = [], 0

    def commit(self) -> None:
        """Finish the file and rename it into place (synced first: a crash right after
        leaves the whole part or none)."""
        assert self._writer is not None
        self._flush()
        self._writer.close()
        self._writer = None
        with open(self.temporary, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.temporary, self.path)

    def close(self) -> None:
        """Drop the part unless committed."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
        self.temporary.unlink(missing_ok=True)

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class OutputIdentity:
    """What every part of one output shares (see the module docstring)."""

    model: dict[str, Any]  # ModelIdentity.record()
    max_rows: int | None
    day_digests: dict[int, str] = field(default_factory=dict)
    keys: tuple[str, ...] = ()  # the key columns copied beside each prediction

    @property
    def model_digest(self) -> str:
        return self.model["digest"]


def _describe_model(model: dict[str, Any]) -> str:
    step = f", step {model['step']}" if model.get("step") is not None else ""
    return f"{model.get('path')}{step}"


def _conflict(previous: dict[str, Any], identity: OutputIdentity) -> str | None:
    """Why ``previous`` (an output's manifest) holds other predictions than ``identity``
    would write, or None."""
    model = previous.get("model", {})
    if model.get("digest") != identity.model_digest:
        return f"predictions of another model ({_describe_model(model)})"
    if previous.get("max_rows") != identity.max_rows:
        held = previous.get("max_rows")
        cap = "every row of each day" if held is None else f"at most {held} rows a day"
        asked = "every row" if identity.max_rows is None else f"--max-rows {identity.max_rows}"
        return f"predictions of {cap} (this run asks for {asked})"
    if tuple(previous.get("keys", ())) != identity.keys:
        return (
            f"predictions with key columns {_names(previous.get('keys', ()))} (this run asks "
            f"for {_names(identity.keys)})"
        )
    held = previous.get("dataset", {}).get("day_digests", {})
    for day, digest in sorted(identity.day_digests.items()):
        if str(day) in held and held[str(day)] != digest:
            url = previous.get("dataset", {}).get("url")
            return f"predictions of day {day} from other files ({url})"
    return None


def _names(keys: Any) -> str:
    return ", ".join(keys) if keys else "none"


def _remove_parts(out: Path) -> None:
    for path in out.glob("day-*/*.parquet"):
        path.unlink()
    for path in out.glob("day-*/.part-*.tmp"):
        path.unlink()
    for day in out.glob("day-*"):
        with contextlib.suppress(OSError):
            day.rmdir()
    (out / SCORES_FILE).unlink(missing_ok=True)


def read_scores_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of the output at ``out``, None where there is none."""
    path = out / SCORES_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ScoresDirError(f"{path}: unreadable ({e}); give another --out") from e
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ScoresDirError(f"{path}: not a `dlrmflow score` manifest; give another --out")
    return data


def claim(out: Path, identity: OutputIdentity, overwrite: bool) -> dict[str, Any] | None:
    """Make ``out`` (locked by the caller) ready for ``identity``'s parts: refuse a
    directory holding anything else, clear it of other predictions with ``overwrite``,
    remove the temporaries of a killed run. Returns the previous manifest, if kept."""
    previous = read_scores_manifest(out)
    if previous is None:
        visible = [p.name for p in out.iterdir() if not p.name.startswith(".")]
        if visible:
            raise ScoresDirError(
                f"{out}: not empty ({', '.join(sorted(visible)[:3])}) and not the output of "
                "`dlrmflow score`; give a new or empty --out"
            )
    else:
        conflict = _conflict(previous, identity)
        if conflict is not None:
            if not overwrite:
                raise ScoresDirError(
                    f"{out} holds {conflict}; give another --out, or --overwrite to replace them"
                )
            _remove_parts(out)
            previous = None
    for path in out.glob("day-*/.part-*.tmp"):
        path.unlink()  # a killed run's: never renamed, so never a part
    for part in list_parts(out):
        if part.model_digest != identity.model_digest:
            raise ScoresDirError(
                f"{part.path}: written by another model than {out / SCORES_FILE} names; "
                "give another --out, or --overwrite"
            )
        if part.keys != identity.keys:
            raise ScoresDirError(
                f"{part.path}: holds key columns {_names(part.keys)}, not "
                f"{_names(identity.keys)}; give another --out, or --overwrite"
            )
    return previous


def settle_days(out: Path, days: list[int], count: int) -> list[int]:
    """The days of ``days`` still to score in ``count`` shares. A day whose shares are all
    present in some layout (``part-*-of-N`` for every share of an N) is done, whatever
    ``count``; parts of any other layout of a day are removed, since the day's rows would
    otherwise be held twice."""
    todo = []
    by_day: dict[int, dict[int, set[int]]] = {}
    for part in list_parts(out):
        by_day.setdefault(part.day, {}).setdefault(part.count, set()).add(part.share)
    for day in days:
        layouts = by_day.get(day, {})
        complete = [n for n, shares in sorted(layouts.items()) if shares == set(range(n))]
        keep = complete[0] if complete else count
        for n in layouts:
            if n != keep:
                for share in layouts[n]:
                    part_path(out, day, share, n).unlink()
        if not complete:
            todo.append(day)
    return todo


def write_scores_manifest(
    out: Path,
    identity: OutputIdentity,
    dataset: dict[str, Any],
    *,
    complete: bool,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``out``'s manifest: the identity, the dataset last scored, and every complete
    part found now (``complete``: the run finished; else it is under way)."""
    parts = list_parts(out)
    held = dict((previous or {}).get("dataset", {}).get("day_digests", {}))
    held.update({str(day): digest for day, digest in identity.day_digests.items()})
    days = sorted({p.day for p in parts})
    manifest = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "model": identity.model,
        "dataset": {**dataset, "day_digests": dict(sorted(held.items(), key=lambda i: int(i[0])))},
        "max_rows": identity.max_rows,
        # Left out without keys: a manifest then reads as one written before them.
        **({"keys": list(identity.keys)} if identity.keys else {}),
        "columns": [*SCHEMA.names, *identity.keys],
        "days": days,
        "parts": [p.record(out) for p in parts],
        "rows": sum(p.rows for p in parts),
        "complete": complete,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_atomic(out / SCORES_FILE, json.dumps(manifest, indent=2) + "\n")
    return manifest

"""What the generated shapes share: a dataset grown a day at a time.

Both generators (``synthetic``: Criteo's layout; ``synthetic_logs``: a team's) keep every
day that the manifest lists under the file name the same parameters give, at its listed
size, without reading it; they write the other days beside what is there, switch the
manifest last (``publish_manifest``), and on a failure remove what they wrote that no
manifest lists. A killed run leaves temporaries, which the next one removes first.
"""

from __future__ import annotations

from collections.abc import Callable

import fsspec
import numpy as np

from dlrmflow.ingest.dayfile import WrittenDay, discard_unlisted, join, remove_temporaries
from dlrmflow.ingest.manifest import (
    DayFile,
    Manifest,
    listed_paths,
    publish_manifest,
    read_manifest,
)


def unchanged_days(
    root: str, days: int, day_file_name: Callable[[int], str]
) -> tuple[Manifest | None, dict[int, DayFile]]:
    """The manifest at ``root`` (None where there is no readable one) and, by day, the
    files it lists that generating ``days`` days would write again byte for byte: under
    ``day=D/day_file_name(D)`` and at the size listed (a stat, not a read)."""
    try:
        manifest = read_manifest(root)
    except (FileNotFoundError, ValueError, OSError):
        return None, {}
    fs, root_path = fsspec.core.url_to_fs(root)
    kept = {}
    for f in manifest.files:
        if f.day >= days or f.path != f"day={f.day}/{day_file_name(f.day)}":
            continue
        try:
            if fs.size(join(root_path, f.path)) != f.bytes:
                continue
        except OSError:
            continue
        kept[f.day] = f
    return manifest, kept


def day_record(
    day: int,
    written: WrittenDay,
    probs: np.ndarray,
    labels: np.ndarray,
    metrics: Callable[[np.ndarray, np.ndarray], tuple[float | None, float]],
) -> DayFile:
    """The manifest's record of day ``day``, just written: its rows, click rate, identity
    and the Bayes AUC and log loss (``metrics``) of its true probabilities."""
    auc, logloss = metrics(probs, labels)
    return DayFile(
        day=day,
        path=written.path,
        rows=len(labels),
        positive_rate=int(labels.sum()) / len(labels),
        digest=written.digest,
        bytes=written.bytes,
        bayes_auc=auc,
        bayes_logloss=logloss,
    )


def grow_days(
    root: str,
    days: int,
    kept: dict[int, DayFile],
    write_day: Callable[[int], DayFile],
    manifest_of: Callable[[list[DayFile], int], Manifest],
    progress: Callable[[int], None] | None,
) -> Manifest:
    """Days ``0 .. days-1`` at ``root``: each of ``kept`` as it is (its rows reported to
    ``progress``), each other written by ``write_day``; then the manifest that
    ``manifest_of(files, positives)`` makes of them all, published. Days are written in
    order, so a shape whose days follow from the day before can advance its state in
    ``write_day``."""
    remove_temporaries(root)
    files: list[DayFile] = []
    try:
        for day in range(days):
            if day in kept:
                files.append(kept[day])
                if progress is not None:
                    progress(kept[day].rows)
            else:
                files.append(write_day(day))
        positives = sum(round(f.positive_rate * f.rows) for f in files)
        manifest = manifest_of(files, positives)
        publish_manifest(root, manifest)
    except BaseException:
        # Against the manifest in place now: once the new one is, its files stay.
        discard_unlisted(root, [f.path for f in files], listed_paths(root))
        raise
    return manifest

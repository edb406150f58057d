"""How many of a day's IDs a line has never trained on: the share the next-day validation
records beside the metrics, so that a drop in next-day AUC can be told apart from a day
full of new items.

Counting it exactly would keep every distinct ID the line has seen (gigabytes at Criteo's
scale). Each day's ``IdSample`` instead (``dlrmflow.ingest.stats``: at most 2,048 distinct
IDs per feature, chosen by hash, the same IDs whatever the day) is kept under
``LINE/ids/day=N.npz``, a few hundred kilobytes a day; comparing a day's sample with the
samples of the days trained gives, for each feature, the share of a uniform sample of the
day's distinct IDs that no trained day had. ``unseen_ids`` is their mean over the
features that have IDs that day. With hashed IDs an unseen ID lands on a row trained by
other IDs that share its bucket; under ``features.ids: vocab`` on the OOV row (the line
keeps the vocabulary of its first day).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.stats.scan import declared_columns, file_stats
from dlrmflow.ingest.stats.sketches import IdSample
from dlrmflow.train.run.checkpoint import DataIdentity

IDS_DIR = "ids"
DIGEST_KEY = "day_digest"  # the identity of the day's files the sample was scanned from


def day_samples(line_dir: Path, url: str, day: int) -> dict[str, IdSample]:
    """Day ``day``'s sample of distinct IDs per feature: read from the line when kept for
    the day's files now (a sample is kept with the identity of the files it was scanned
    from, so a day whose files changed is scanned again), else scanned once and kept."""
    path = line_dir / IDS_DIR / f"day={day}.npz"
    manifest = read_manifest(url)
    digest = DataIdentity.of(manifest, [day]).day_digests[0]
    if path.is_file():
        with np.load(path) as kept:
            if DIGEST_KEY in kept.files and str(kept[DIGEST_KEY]) == digest:
                names = sorted({key.rsplit("/", 1)[0] for key in kept.files if "/" in key})
                return {n: IdSample(int(kept[f"{n}/level"]), kept[f"{n}/hashes"]) for n in names}
    files = manifest.day_paths(url, [day], held_out=[])
    # A registered dataset's own columns, as its manifest declares them.
    columns, expected = declared_columns(manifest)
    totals = file_stats(files[0], manifest.multi_hot, columns=columns, expected=expected)
    for other in files[1:]:
        totals.merge(file_stats(other, manifest.multi_hot, columns=columns, expected=expected))
    samples = totals.id_samples()
    arrays: dict[str, np.ndarray] = {DIGEST_KEY: np.array(digest)}
    for name, sample in samples.items():
        arrays[f"{name}/hashes"] = sample.hashes
        arrays[f"{name}/level"] = np.int64(sample.level)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda target: _save(target, arrays))
    return samples


def _save(target: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(target, "wb") as f:
        np.savez(f, **arrays)


def unseen_ids(line_dir: Path, url: str, day: int, trained: list[int]) -> float | None:
    """The mean over features of the share of ``day``'s distinct IDs that none of the
    ``trained`` days had (None when the day has no IDs)."""
    today = day_samples(line_dir, url, day)
    before = [day_samples(line_dir, url, d) for d in trained]
    shares = [
        share
        for name, sample in today.items()
        if (share := sample.unseen_share([b[name] for b in before])) is not None
    ]
    return statistics.fmean(shares) if shares else None

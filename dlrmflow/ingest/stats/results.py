"""What a statistics pass results in, and its file: ``DatasetStats`` and ``stats.json``.

One record per column (``DenseStats``, ``SparseStats``), with what sizing tables and
choosing transforms read from them (missing rates, mean lengths, the moments once missing
values are filled, quantile boundaries), written beside the dataset's manifest
(``write_stats``) and read back by training, the planner and the flows (``read_stats``).
Statistics written before a field was added read with that field empty.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import fsspec
import numpy as np

from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import STATS_NAME, join_url, write_json
from dlrmflow.ingest.stats.sketches import sketch_keys, sketch_values, sum_by_key


@dataclass(frozen=True)
class DenseStats:
    """One numeric column. ``mean`` and ``std`` (the population standard deviation) are
    over the present values (None if all missing); a floating column's NaN counts as
    missing, as the feature transform takes it. ``sketch_keys`` and ``sketch_counts`` are
    the finite present values' quantile sketch (see ``sketches``). Statistics
    written before deviations and sketches have None and empty ones.
    """

    name: str
    present: int
    missing: int
    min: float | None
    max: float | None
    mean: float | None
    negatives: int  # Criteo's I2 has a few; transforms that take logs must clip them
    std: float | None = None
    sketch_keys: tuple[int, ...] = ()
    sketch_counts: tuple[int, ...] = ()

    @property
    def missing_rate(self) -> float:
        return self.missing / max(self.present + self.missing, 1)

    def filled_moments(self, fill: float) -> tuple[float, float]:
        """(mean, population standard deviation) of the column once every missing value
        is ``fill``: the present values' moments and the fills' combined as two groups
        (Chan et al.'s update, without the cancellation of a sum of squares)."""
        if not self.present or self.mean is None:
            return float(fill), 0.0
        n = self.present + self.missing
        mean, std = self.mean, self.std or 0.0
        filled_mean = (self.present * mean + self.missing * fill) / n
        m2 = self.present * std * std + self.present * self.missing / n * (mean - fill) ** 2
        return float(filled_mean), float(math.sqrt(m2 / n))

    def boundaries(self, buckets: int, fill: float) -> tuple[float, ...]:
        """The ``i / buckets`` quantiles (``i`` in ``1..buckets-1``) of the column once
        every missing value is ``fill``, repeats merged: boundaries for ``buckets`` equally
        filled buckets, fewer where the values are few.

        A quantile is the value at rank ``floor(q * count)`` (counting from 0), read as the
        value of its sketch bucket nearest zero, so that ``x >= boundary`` puts that rank
        and all above it in the upper bucket."""
        keys = np.array(self.sketch_keys, np.int64)
        counts = np.array(self.sketch_counts, np.int64)
        if self.missing:
            fill_key = int(sketch_keys(np.array([fill], np.float64))[0])
            keys, counts = sum_by_key(
                np.append(keys, fill_key), np.append(counts, np.int64(self.missing))
            )
        total = int(counts.sum())
        if total == 0:
            return (float(fill),)
        cumulative = np.cumsum(counts) * buckets  # exact: rank > i * total / buckets
        ranks = np.arange(1, buckets, dtype=np.int64) * total
        found = np.searchsorted(cumulative, ranks, side="right")
        return tuple(float(v) for v in np.unique(sketch_values(keys[found])))


@dataclass(frozen=True)
class SparseStats:
    """One categorical column: a nullable ID, or (multi-hot) a list of IDs per row.

    ``ids`` counts every ID occurrence, ``distinct`` estimates the distinct IDs. ``missing``
    counts null rows; ``empty`` counts empty lists (always 0 for one-hot columns).

    ``cache_hits`` holds ``(fraction, hit_rate)`` points: the expected share of lookups an
    LRU cache holding ``fraction`` of the distinct IDs serves over one pass of the data,
    estimated from ``skew_sample`` distinct IDs with their exact counts (empty when the
    column has no IDs, or the file was written before it was recorded).
    """

    name: str
    rows: int
    missing: int
    empty: int
    ids: int
    distinct: int
    max_length: int
    skew_sample: int = 0
    cache_hits: tuple[tuple[float, float], ...] = ()

    @property
    def missing_rate(self) -> float:
        return self.missing / max(self.rows, 1)

    @property
    def mean_length(self) -> float:
        """IDs per row that has any (1.0 for one-hot columns)."""
        return self.ids / max(self.rows - self.missing - self.empty, 1)

    @property
    def access_rate(self) -> float:
        """The share of rows with at least one ID: rows whose bag is looked up at all."""
        return (self.rows - self.missing - self.empty) / max(self.rows, 1)


@dataclass(frozen=True)
class DatasetStats:
    """Statistics of every column of a dataset's day files (all days, the test day too)."""

    url: str
    rows: int
    positives: int
    row_groups: int
    multi_hot: bool
    dense: tuple[DenseStats, ...]
    sparse: tuple[SparseStats, ...]

    @property
    def positive_rate(self) -> float:
        return self.positives / max(self.rows, 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DatasetStats:
        return cls(
            **{
                **data,
                "dense": tuple(
                    DenseStats(
                        **{
                            **d,
                            "sketch_keys": tuple(d.get("sketch_keys", ())),
                            "sketch_counts": tuple(d.get("sketch_counts", ())),
                        }
                    )
                    for d in data["dense"]
                ),
                "sparse": tuple(
                    SparseStats(
                        **{
                            **s,
                            "cache_hits": tuple(
                                (float(f), float(h)) for f, h in s.get("cache_hits", ())
                            ),
                        }
                    )
                    for s in data["sparse"]
                ),
            }
        )


def write_stats(root: str, stats: DatasetStats) -> str:
    """Write ``stats.json`` beside the dataset's manifest; returns its URL."""
    return write_json(root, STATS_NAME, stats.to_dict())


def read_stats(root: str) -> DatasetStats:
    """Read the ``stats.json`` that ``write_stats`` wrote under ``root``. A missing file
    raises ``FileNotFoundError``; one that is not statistics raises ``DataError``, each
    naming the file."""
    url = join_url(root, STATS_NAME)
    try:
        with fsspec.open(url, "r") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url}: no feature statistics; run the ingest flow") from e
    except ValueError as e:
        raise DataError(f"{url}: not JSON: {e}") from e
    try:
        return DatasetStats.from_dict(data)
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{url}: not feature statistics ({type(e).__name__}: {e})") from e

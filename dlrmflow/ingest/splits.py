"""A dataset's units of work: each row group of each file (a *split*), listed from the
footers, and the splits each reader takes in an epoch.

Every epoch the global split list is shuffled by ``(seed, epoch)`` alone and dealt
round-robin to the ``world_size * num_workers`` readers, so every reader computes the same
permutation without communicating and each row is read exactly once per epoch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from dlrmflow.ingest.dayfile import NotRegularFile, day_path, footer_identity, open_regular
from dlrmflow.ingest.errors import DataError


@dataclass(frozen=True)
class Split:
    """One row group of one Parquet file: the unit of work handed to a reader.

    ``day`` and ``digest`` are the identity the file's footer recorded when the splits were
    listed (None for files without one); the reader holds the file to it at every open.
    """

    path: str
    row_group: int
    num_rows: int
    day: int | None = None
    digest: str | None = None


def list_splits(paths: Sequence[str], days: Mapping[str, int] | None = None) -> list[Split]:
    """Every non-empty row group of ``paths``, in file then row-group order.

    Only the footers are read. Empty row groups are left out since they hold no work.
    ``days``: each path's day as the dataset's manifest numbers it (``Manifest.path_days``),
    which wins over the footer's: a registered file's footer records no day, and its
    folder (``dt=2026-11-01``, ``day=20261101``) need not be its day's number.
    """
    splits = []
    for path in paths:
        try:
            f, _ = open_regular(path)
            with f:
                metadata = pq.ParquetFile(f).metadata
        except FileNotFoundError as e:
            raise DataError(f"{day_path(path)}: missing") from e
        except NotRegularFile as e:
            raise DataError(f"{day_path(path)}: {e.strerror}") from e
        except Exception as e:
            raise DataError(f"{day_path(path)}: cannot read Parquet footer: {e}") from e
        day, digest = footer_identity(metadata)
        if days is not None and path in days:
            day = days[path]
        for i in range(metadata.num_row_groups):
            rows = metadata.row_group(i).num_rows
            if rows > 0:
                splits.append(Split(path, i, rows, day, digest))
    return splits


def assign_splits(
    splits: Sequence[Split],
    *,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> list[Split]:
    """The splits that reader ``rank * num_workers + worker`` reads in ``epoch``, in order.

    The global list is permuted by ``(seed, epoch)`` alone, so every reader computes the same
    permutation without communicating; taking every ``world_size * num_workers``-th split
    then partitions it, which is what makes the epoch exactly-once.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is outside num_workers {num_workers}")
    order = list(splits)
    if shuffle:
        permutation = np.random.default_rng((seed, epoch)).permutation(len(order))
        order = [order[i] for i in permutation]
    return order[rank * num_workers + worker :: world_size * num_workers]

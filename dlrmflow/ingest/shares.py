"""Which rows of a day each scoring process reads, and the key of every row it reads.

A prediction is only useful joined back to its input row, so every output row carries
``(day, row)``: the row's index within its day, counting through the day's files in the
manifest's order and each file's row groups in order. The reader splits work by row
group (a ``Split``), so a day's splits are listed once here, each with the day-row its
first row has, and dealt to the ``count`` shares exactly as the reader deals them to
ranks (``assign_splits`` without shuffling). A share is then read by a reader of its own
splits only, in order, with no shuffle: its batches are consecutive runs of those rows,
and ``RowKeys`` hands out the day-rows of each batch as it comes, in bounded memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.splits import Split, assign_splits, list_splits


@dataclass(frozen=True)
class Share:
    """Share ``index`` of ``count`` of ``day``: its row groups in read order, and the
    day-row of the first row of each."""

    day: int
    index: int
    count: int
    splits: tuple[Split, ...]
    starts: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(s.num_rows for s in self.splits)


def day_shares(url: str, manifest: Manifest, day: int, count: int) -> list[Share]:
    """The ``count`` shares of ``day`` of the dataset at ``url`` (one per process; a
    share may be empty when the day has fewer row groups than processes)."""
    # held_out=[]: scoring reads whichever days it is asked for, the test day among them.
    splits = list_splits(manifest.day_paths(url, [day], held_out=[]), manifest.path_days(url))
    first = np.cumsum([0, *(s.num_rows for s in splits)])[:-1]
    start_of = {(s.path, s.row_group): int(row) for s, row in zip(splits, first, strict=True)}
    shares = []
    for index in range(count):
        mine = assign_splits(
            splits,
            rank=index,
            world_size=count,
            worker=0,
            num_workers=1,
            seed=0,
            epoch=0,
            shuffle=False,
        )
        starts = tuple(start_of[(s.path, s.row_group)] for s in mine)
        shares.append(Share(day, index, count, tuple(mine), starts))
    return shares


class RowKeys:
    """The day-rows of a share's rows in read order, handed out ``take(n)`` at a time."""

    def __init__(self, splits: Sequence[Split], starts: Sequence[int]) -> None:
        self._runs = [(start, s.num_rows) for s, start in zip(splits, starts, strict=True)]
        self._run = 0  # the split being handed out
        self._offset = 0  # rows of it handed out already

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` day-rows (int64); a ``ValueError`` past the share's end, which
        would mean the reader emitted rows the splits do not hold."""
        pieces = []
        left = n
        while left:
            if self._run == len(self._runs):
                raise ValueError(f"row keys: {left} more rows read than the share's splits hold")
            start, rows = self._runs[self._run]
            step = min(left, rows - self._offset)
            pieces.append(np.arange(start + self._offset, start + self._offset + step))
            self._offset += step
            left -= step
            if self._offset == rows:
                self._run, self._offset = self._run + 1, 0
        return np.concatenate(pieces) if pieces else np.empty(0, np.int64)

    @property
    def left(self) -> int:
        """Rows of the share not handed out yet."""
        done = sum(rows for _, rows in self._runs[: self._run]) + self._offset
        return sum(rows for _, rows in self._runs) - done

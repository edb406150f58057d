"""Parquet -> batches: one reader's pass over its splits, in shuffled windows, resumable
mid-epoch.

A reader works through its splits (``ingest.splits``) ``shuffle_window`` at a time. Each
split is decoded and validated whole (``ingest.decode``), and a window of them is
transformed and permuted together (a bounded shuffle: cheap, yet it mixes rows across
files), because vectorized or compiled work on row groups costs far less per row than the
same work on a batch; the window is then cut into batches. Rows left over carry into the
next window, so every batch except a reader's last is full. ``threads`` preparation
threads each prepare a whole window, ahead of the window whose batches are being handed
out: decode a row group, transform it at once while it is still in cache, then the next.
``validate`` and ``transform`` are called from several threads at once, so they must be
thread-safe. ``ingest.loader`` runs readers behind prefetch threads and interleaves them.

``transform(table)`` turns a row group into a *block*, anything that implements ``Block``
(``take``, ``concat``, ``len``) row-wise, so the batches hold the same rows in the same
order as without a transform: the window's blocks are concatenated and batches gathered
from them. A transform that also has ``window_writer(order, dest)`` (``BatchTransform``)
builds the whole window already permuted, as each row group is decoded: the compiled
transform writes each row straight to its shuffled place, other layouts place each row
group's rows as it arrives, so the shuffle costs no pass of its own; a writer with
``batches(pieces)`` then builds each batch on its own, else the batches are ``slice``s of
the window. Without a transform, batches are Arrow record batches, slices of a window that
each row group is scattered into, shuffled, as it is decoded (``ingest.window``), the same
way.

Resumption is a few integers per reader: ``(epoch, window, offset)``, the position of the
next row not yet emitted. Because a window's content and permutation depend only on the
configuration, restoring re-reads the current window, never the epoch so far.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, Self

import numpy as np
import pyarrow as pa
from torchdata.nodes import BaseNode

from dlrmflow.ingest.dayfile import day_of
from dlrmflow.ingest.decode import SplitDecoder, row_group_of, row_groups_of
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.shuffle import deal
from dlrmflow.ingest.splits import Split, assign_splits
from dlrmflow.ingest.window import ArrowWindow


class Block(Protocol):
    """What ``transform`` returns for one row group: rows that can be reordered and joined.

    Row ``i`` of the block must come from row ``i`` of the table (a row-wise transform), so
    that permuting the block permutes the table's rows.
    """

    def __len__(self) -> int:
        """The number of rows."""
        ...

    def take(self, indices: np.ndarray) -> Self:
        """The rows at ``indices`` (1-D int64), in that order."""
        ...

    @classmethod
    def concat(cls, blocks: Sequence[Self]) -> Self:
        """The rows of ``blocks``, one block after the other."""
        ...


class ParquetBatchDataset:
    """The configuration of one rank's batches: ``batch_size`` rows of ``columns`` of ``splits``.

    It reads nothing itself: ``make_loader`` builds the reader threads that iterate it.
    ``validate`` checks each decoded row group (an error it raises becomes a ``DataError``
    naming the row group) and ``transform`` turns it into a ``Block``.

    ``by_day``: each pass ("epoch") reads one day, the days in ascending order, its row
    groups shuffled by a seed derived from the day rather than from the pass, so that a day
    is read alike whichever pass reads it (see ``pass_of``).
    """

    def __init__(
        self,
        splits: Sequence[Split],
        columns: Sequence[str],
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_window: int = 4,
        drop_last: bool = False,
        validate: Callable[[pa.Table], None] | None = None,
        transform: Callable[[pa.Table], Block] | None = None,
        by_day: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if shuffle_window < 1:
            raise ValueError(f"shuffle_window must be positive, got {shuffle_window}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if not columns or len(set(columns)) != len(columns):
            raise ValueError(f"columns must be non-empty and distinct, got {list(columns)}")
        self.splits = list(splits)
        self.columns = list(columns)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_window = shuffle_window
        self.drop_last = drop_last
        self.validate = validate
        self.transform = transform
        self.by_day = by_day
        self._epoch = 0
        if by_day:
            self._day_splits: dict[int, list[Split]] = {}
            for split in self.splits:
                day = split.day if split.day is not None else day_of(split.path)
                if day is None:
                    raise ValueError(
                        f"{split.path}: no day in its footer, its path or the listing "
                        "(list_splits' days)"
                    )
                self._day_splits.setdefault(day, []).append(split)
            self.days = sorted(self._day_splits)

    def pass_of(self, epoch: int) -> tuple[list[Split], int]:
        """The splits pass ``epoch`` reads and the number its shuffles are seeded with: every
        split and the epoch, or by day the ``epoch``-th day's splits and that day (none
        past the last day)."""
        if not self.by_day:
            return self.splits, epoch
        if epoch >= len(self.days):
            return [], epoch
        day = self.days[epoch]
        return self._day_splits[day], day

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next fresh pass reads (a loaded state keeps its own)."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        self._epoch = epoch


def pass_steps(dataset: ParquetBatchDataset, epoch: int, num_workers: int) -> int:
    """The steps a job takes over pass ``epoch`` of ``dataset`` with ``num_workers`` readers
    a rank (0: one, in the consumer): the most batches any rank reads, since a rank whose
    readers end first steps on with empty batches until every rank's have. Each reader cuts
    its rows into full batches but the last (rows held over join the next row group's)."""
    splits, key = dataset.pass_of(epoch)
    readers = max(num_workers, 1)
    size = dataset.batch_size
    most = 0
    for rank in range(dataset.world_size):
        batches = 0
        for worker in range(readers):
            mine = assign_splits(
                splits,
                rank=rank,
                world_size=dataset.world_size,
                worker=worker,
                num_workers=readers,
                seed=dataset.seed,
                epoch=key,
                shuffle=dataset.shuffle,
            )
            rows = sum(s.num_rows for s in mine)
            batches += rows // size if dataset.drop_last else -(-rows // size)
        most = max(most, batches)
    return most


class SplitReader(BaseNode[Any]):
    """The batches of reader ``worker`` of ``num_workers`` on the dataset's rank.

    ``reset()`` starts a pass over the epoch set on the dataset; ``reset(state)`` resumes
    the pass ``state`` was taken in, after checking that it was taken under this reader's
    layout.
    """

    def __init__(
        self,
        dataset: ParquetBatchDataset,
        worker: int = 0,
        num_workers: int = 1,
        threads: int = 1,
    ):
        super().__init__()
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} is outside num_workers {num_workers}")
        if threads < 1:
            raise ValueError(f"threads must be positive, got {threads}")
        self.dataset = dataset
        self.worker = worker
        self.num_workers = num_workers
        self.threads = threads
        self._pass: _Pass | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            cursor = (self.dataset.epoch, 0, 0)
        else:
            if "layout" not in initial_state:
                raise ValueError(
                    "not a reader state (was it saved by a loader with num_workers > 0?)"
                )
            layout = self._layout(int(initial_state["epoch"]))
            if initial_state["layout"] != layout:
                raise ValueError(
                    f"reader state was saved with layout {initial_state['layout']}, "
                    f"which does not match this reader's {layout}"
                )
            cursor = (
                int(initial_state["epoch"]),
                int(initial_state["window"]),
                int(initial_state["offset"]),
            )
        # A new pass object rather than a rewound one: a prefetch thread of the previous
        # pass may still be finishing a batch (the Prefetcher waits for it 0.5 s at most),
        # and must not move this pass's cursor.
        self._pass = _Pass(self.dataset, self.worker, self.num_workers, self.threads, cursor)

    def next(self) -> Any:
        assert self._pass is not None  # BaseNode resets before the first next()
        return self._pass.next()

    def close(self) -> None:
        """End the current pass and wait for its preparation threads (see ``_Pass.close``)."""
        if self._pass is not None:
            self._pass.close()

    def get_state(self) -> dict[str, Any]:
        assert self._pass is not None
        epoch, window, offset = self._pass.cursor
        state = {"epoch": epoch, "window": window, "offset": offset}
        return {**state, "layout": self._layout(epoch)}

    def _layout(self, epoch: int) -> dict[str, Any]:
        # Everything that decides which rows a window holds and in what order; a state
        # taken under another layout would silently repeat or skip rows. By day, the
        # pass's day and its splits: days added after it change nothing of it.
        d = self.dataset
        splits, key = d.pass_of(epoch)
        by_day = {"by_day": True, "day": key} if d.by_day else {}
        return {
            **by_day,
            "splits": len(splits),
            "reader": d.rank * self.num_workers + self.worker,
            "num_readers": d.world_size * self.num_workers,
            "seed": d.seed,
            "shuffle": d.shuffle,
            "shuffle_window": d.shuffle_window,
            # How rows are dealt to batches (``shuffle.deal``): states taken under an
            # earlier deal would resume into other batches.
            "deal": 2,
        }


_Cursor = tuple[int, int, int]  # (epoch, window, offset) of the next row to emit


def _position(epoch: int, window: int, offset: int, window_rows: int) -> _Cursor:
    """The cursor after ``offset`` rows of ``window``.

    A finished window points at the next one so that resuming does not re-read it for nothing.
    """
    return (epoch, window + 1, 0) if offset == window_rows else (epoch, window, offset)


def _bounds(rows: int, first: int, size: int) -> list[int]:
    """Cut points of ``rows`` into pieces of ``first``, then ``size`` each (the last shorter)."""
    return [0, *range(first, rows, size), rows]


class _Pass:
    """One reader's pass through its splits from ``cursor`` on.

    It owns the pass's only mutable state, ``cursor``: the position of the next row not yet
    emitted, moved before each batch is returned so that a state taken right after it (the
    ``Prefetcher`` snapshots its source per item) points past it. Nothing refers back to
    the pass, so an abandoned one is freed, its threads told to stop, as soon as it is
    dropped rather than at the next garbage collection; ``close()`` also waits for them.
    """

    def __init__(
        self,
        dataset: ParquetBatchDataset,
        worker: int,
        num_workers: int,
        threads: int,
        cursor: _Cursor,
    ) -> None:
        epoch, window, offset = cursor
        plan = _Plan(dataset, worker, num_workers, epoch, threads)
        # Past the last window, only offset 0 (the end of the pass) exists.
        rows = [*plan.window_rows, 1]
        if not (0 <= window < len(rows) and 0 <= offset < rows[window]):
            raise ValueError(f"reader state {cursor} is outside this reader's windows")
        if window < len(plan.windows) and offset not in plan.bounds(window):
            raise ValueError(f"reader state {cursor} is not at a batch boundary of its window")
        self.cursor = cursor
        self._end = (epoch, len(plan.windows), 0)
        # Threads start with the first window submitted, not here.
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dlrmflow-prepare")
        self._batches = plan.batches(window, offset, self._pool)
        self._closed = False

    def next(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            batch, self.cursor = next(self._batches)
        except StopIteration:
            self.cursor = self._end  # also when drop_last dropped the rows left over
            raise
        return batch

    def close(self) -> None:
        """End the pass: windows not yet begun are dropped, those being prepared are waited
        for. Safe while another thread is in ``next``, which then returns or fails soon."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)


class _Plan:
    """What one reader reads in one epoch, and how: its windows of splits, cut into batches."""

    def __init__(
        self,
        dataset: ParquetBatchDataset,
        worker: int,
        num_workers: int,
        epoch: int,
        threads: int = 1,
    ) -> None:
        self._dataset = dataset
        self._threads = threads
        self._worker = worker
        self._epoch = epoch
        pass_splits, self._key = dataset.pass_of(epoch)
        splits = assign_splits(
            pass_splits,
            rank=dataset.rank,
            world_size=dataset.world_size,
            worker=worker,
            num_workers=num_workers,
            seed=dataset.seed,
            epoch=self._key,
            shuffle=dataset.shuffle,
        )
        size = dataset.shuffle_window
        self.windows = [splits[i : i + size] for i in range(0, len(splits), size)]
        self.window_rows = [sum(s.num_rows for s in window) for window in self.windows]
        # Rows of earlier windows not yet in a full batch when each window starts: its
        # first batch completes them.
        before = itertools.accumulate(self.window_rows[:-1], initial=0)
        self._held = [rows % dataset.batch_size for rows in before]
        transform = dataset.transform
        self._blocks: _ArrowBlocks | _TransformedBlocks = (
            _ArrowBlocks() if transform is None else _TransformedBlocks(transform)
        )
        self._decoder = SplitDecoder(dataset.columns, dataset.validate, dataset.transform)

    def batches(
        self, start_window: int, start_offset: int, pool: ThreadPoolExecutor
    ) -> Iterator[tuple[Any, _Cursor]]:
        """The batches from row ``start_offset`` of ``start_window`` on, with their cursors,
        prepared by ``pool``'s threads (shut down when the batches end or are abandoned).

        A batch's cursor is the position after it, where a pass resumed from it begins.
        """
        epoch, size = self._epoch, self._dataset.batch_size
        # Each window is prepared (decoded, transformed, cut) whole by one of ``threads``
        # threads, up to ``threads`` windows ahead of the one whose batches are handed out:
        # a steady stream of batches rather than a burst of work per window (which would
        # hold up the round robin over readers). Where a window's batches start and end
        # follows from the split row counts alone (``bounds``), so windows are prepared
        # independently.
        starts = {start_window: start_offset}  # later windows are read from row 0
        ready: dict[int, Future[list[Any]]] = {}
        submitted = start_window  # the next window to hand to the pool

        def prepare_until(last: int) -> None:
            nonlocal submitted
            for w in range(submitted, min(last + 1, len(self.windows))):
                ready[w] = pool.submit(self._prepare, w, starts.get(w, 0))
                submitted = w + 1

        carry = None  # fewer than batch_size rows from earlier windows
        try:
            for w in range(start_window, len(self.windows)):
                prepare_until(w + self._threads)
                rows, pos = self.window_rows[w], starts.get(w, 0)
                pieces = ready.pop(w).result()
                for piece in pieces:
                    pos += len(piece)
                    if carry is not None:
                        piece, carry = self._blocks.join_batches([carry, piece]), None
                    if len(piece) < size:
                        carry = piece
                        continue
                    yield piece, _position(epoch, w, pos, rows)
        finally:
            # Whether finished or abandoned: windows still being prepared are not waited for.
            pool.shutdown(wait=False, cancel_futures=True)
        if carry is not None and not self._dataset.drop_last:
            yield carry, (epoch, len(self.windows), 0)

    def bounds(self, w: int) -> list[int]:
        """Where window ``w``'s batches start and end, as row offsets into it.

        The first completes the rows held over from earlier windows; every one after it
        has ``batch_size`` rows but the last. A pass resumed at any of these offsets cuts
        the same batches from there on.
        """
        size, rows = self._dataset.batch_size, self.window_rows[w]
        return _bounds(rows, min(size - self._held[w], rows), size)

    def _prepare(self, w: int, start: int) -> list[Any]:
        """Window ``w``'s batches from row ``start`` (one of its ``bounds``) on."""
        bounds = self.bounds(w)
        order, dest = self._order(w, bounds)
        pieces = [(a, b) for a, b in itertools.pairwise(bounds) if a >= start]
        return self._blocks.cut(self.windows[w], self._decoder.read, order, dest, pieces, bounds)

    def _order(self, window: int, bounds: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The emission order of the window's rows, dealt to its batches at random, and its
        inverse: where each row goes."""
        d = self._dataset
        if not d.shuffle:
            identity = np.arange(bounds[-1], dtype=np.int64)
            return identity, identity
        rng = np.random.default_rng((d.seed, self._key, d.rank, self._worker, window))
        return deal(np.asarray(bounds), rng)


class _TransformedBlocks:
    """How splits become batches when ``transform`` makes blocks: the ``Block`` protocol.

    A transform with a ``window_writer(order, dest)`` method (``BatchTransform``'s
    ``WindowWriter``) builds the window's rows already in emission ``order``, one row group
    at a time as each is decoded, as a block with ``slice(start, stop)``: the batches are
    then slices of it, and the shuffle costs no gather of its own.
    """

    def __init__(self, transform: Callable[[pa.Table], Block]) -> None:
        self.transform = transform
        self.window_writer = getattr(transform, "window_writer", None)

    def make(self, split: Split, table: pa.Table) -> Block:
        try:
            block = self.transform(table)
        except Exception as e:
            raise DataError(
                f"{row_group_of(split)}: transform failed: {type(e).__name__}: {e}"
            ) from e
        if len(block) != table.num_rows:
            raise ValueError(
                f"{row_group_of(split)}: transform returned {len(block)} rows for "
                f"{table.num_rows}; it must map each row to one row"
            )
        return block

    @staticmethod
    def join_batches(blocks: list[Block]) -> Block:
        return type(blocks[0]).concat(blocks)

    def cut(
        self,
        splits: list[Split],
        read: Callable[[Split], pa.Table],
        order: np.ndarray,
        dest: np.ndarray,
        pieces: list[tuple[int, int]],
        bounds: list[int],  # noqa: ARG002 - the block is cut by ``pieces`` alone
    ) -> list[Block]:
        """The ``pieces`` of the window of ``splits`` (each decoded by ``read``), shuffled
        by ``order`` (``dest`` is its inverse). Each row group is transformed right after
        it is decoded, while its columns are still in cache."""
        if self.window_writer is None:
            blocks = [self.make(s, read(s)) for s in splits]
            block = blocks[0] if len(blocks) == 1 else self.join_batches(blocks)
            return [block.take(order[a:b]) for a, b in pieces]
        writer = self.window_writer(order, dest)
        for split in splits:
            table = read(split)
            try:
                writer.add(table)
            except Exception as e:
                raise DataError(
                    f"{row_group_of(split)}: transform failed: {type(e).__name__}: {e}"
                ) from e
        # A writer with ``batches`` builds each batch on its own; else the window is cut.
        cut = getattr(writer, "batches", None)
        try:
            if cut is not None:
                return cut(pieces)
            block = writer.finish()
        except Exception as e:
            raise DataError(
                f"{row_groups_of(splits)}: transform failed: {type(e).__name__}: {e}"
            ) from e
        if len(block) != len(order):
            raise ValueError(
                f"transform returned {len(block)} rows for the {len(order)} of "
                f"{row_groups_of(splits)}; it must map each row to one row"
            )
        return [block.slice(a, b) for a, b in pieces]


class _ArrowBlocks:
    """How splits become batches without a transform: Arrow tables in, record batches out."""

    @staticmethod
    def join_batches(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
        # A batch that owns exactly its rows, so that it keeps no window alive.
        table = pa.Table.from_batches(batches)
        arrays = [pa.concat_arrays(column.chunks) for column in table.columns]
        return pa.RecordBatch.from_arrays(arrays, schema=table.schema)

    @staticmethod
    def cut(
        splits: list[Split],
        read: Callable[[Split], pa.Table],
        order: np.ndarray,
        dest: np.ndarray,  # noqa: ARG004 - the window places rows by batch (``bounds``)
        pieces: list[tuple[int, int]],
        bounds: list[int],
    ) -> list[pa.RecordBatch]:
        # Each row group scattered into the shuffled window as soon as it is decoded, the
        # batches slices of it: Arrow's take of the whole window cost more than the decode
        # (see ``ingest.window``).
        window = ArrowWindow(order, bounds)
        for split in splits:
            window.add(read(split))
        return window.batches(pieces)

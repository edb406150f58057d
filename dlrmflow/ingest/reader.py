"""Parquet -> batches, split across ranks and reader threads, resumable mid-epoch.

The unit of work is a *split*: one row group of one file. Every epoch the global split list
is shuffled by ``(seed, epoch)`` and dealt round-robin to the ``world_size * num_workers``
readers, so each row is read exactly once per epoch. A reader works through its splits
``shuffle_window`` at a time. Each split is decoded and validated whole, and a window of
them is transformed and permuted together (a bounded shuffle: cheap, yet it mixes rows
across files), because vectorized or compiled work on row groups costs far less per row
than the same work on a batch; the window is then cut into batches. Rows left over carry
into the next window, so every batch except a reader's last is full.

Readers are threads, not processes: pyarrow, numpy and torch release the GIL, so readers
run in parallel with training and a batch reaches the consumer without an inter-process
copy. Each reader is a ``torchdata.nodes`` node (``SplitReader``) behind a prefetch thread
(``ReaderPrefetcher``, which passes a reader's errors on unchanged); ``RoundRobin``
interleaves them in a fixed order, and ``make_loader`` wraps the graph in a ``Loader`` that
can be closed (``ReaderLoader``: it stops and waits for every thread). Inside a reader,
``threads`` preparation threads (two where the cores allow, see ``reader_threads``) each
prepare a whole window, ahead of the window whose batches are being handed out: decode a
row group, transform it at once while it is still in cache, then the next. ``validate``
and ``transform`` are called from several threads at once, so they must be thread-safe.

``transform(table)`` turns a row group into a *block*, anything that implements ``Block``
(``take``, ``concat``, ``len``) row-wise, so the batches hold the same rows in the same
order as without a transform: the window's blocks are concatenated and batches gathered
from them. A transform that also has ``window_writer(order, dest)`` (``BatchTransform``)
builds the whole window already permuted, as each row group is decoded, and the batches
are ``slice``s of it: the compiled transform writes each row straight to its shuffled
place, so the shuffle costs no pass of its own. Without a transform, batches are Arrow
record batches, slices of a window that each row group is scattered into, shuffled, as
it is decoded (``ingest.window``), the same way.

Resumption is a few integers per reader: ``(epoch, window, offset)``, the position of the
next row not yet emitted. Because a window's content and permutation depend only on the
configuration, restoring re-reads the current window, never the epoch so far.

Files are held to the identity their footers recorded when the splits were listed (the
digest ``dlrmflow.ingest.dayfile`` writes): a file that is gone, replaced or not a regular
file when a reader opens it is a ``DataError`` naming its day, so a dataset rewritten under
a running job stops the job at its next file rather than mixing two datasets' rows.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, Self

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torchdata.nodes import BaseNode, Loader, Prefetcher

from dlrmflow.errors import DlrmflowError
from dlrmflow.ingest.dayfile import (
    NotRegularFile,
    Stamp,
    day_of,
    day_path,
    footer_identity,
    open_regular,
    open_regular_for_arrow,
)
from dlrmflow.ingest.shuffle import deal
from dlrmflow.ingest.strings import is_string
from dlrmflow.ingest.window import ArrowWindow
from dlrmflow.runtime.torchdata_threads import stop_prefetch_thread


class DataError(DlrmflowError, ValueError):
    """Input data that cannot be used; the message names the file, row group and column."""


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
        self._decoder = _SplitDecoder(dataset)

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
            raise DataError(f"{_where(split)}: transform failed: {type(e).__name__}: {e}") from e
        if len(block) != table.num_rows:
            raise ValueError(
                f"{_where(split)}: transform returned {len(block)} rows for {table.num_rows}; "
                "it must map each row to one row"
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
                    f"{_where(split)}: transform failed: {type(e).__name__}: {e}"
                ) from e
        # A writer with ``batches`` builds each batch on its own; else the window is cut.
        cut = getattr(writer, "batches", None)
        try:
            if cut is not None:
                return cut(pieces)
            block = writer.finish()
        except Exception as e:
            raise DataError(
                f"{_where_all(splits)}: transform failed: {type(e).__name__}: {e}"
            ) from e
        if len(block) != len(order):
            raise ValueError(
                f"transform returned {len(block)} rows for the {len(order)} of "
                f"{_where_all(splits)}; it must map each row to one row"
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


def _where(split: Split) -> str:
    return f"{split.path}, row group {split.row_group}"


def _where_all(splits: Sequence[Split]) -> str:
    return "; ".join(_where(s) for s in splits)


def _open_for_arrow(split: Split) -> tuple[Any, Stamp]:
    """The split's file opened for Arrow to read (a native file where it is local, else
    fsspec's), with its ``Stamp``; a file that is gone or not a regular file (a FIFO is
    never opened blocking) is a ``DataError`` naming the day.

    Arrow reads pre-buffered ranges in its own IO threads. A range read from a Python file
    object is held in a Python ``bytes``, which only the GIL can free, and the IO thread that
    drops it last can be a step behind the reader: if the interpreter is finalizing by then
    (the process exiting right after its last read, as after an error), that thread aborts
    the process ("terminate called without an active exception", exit 134). A native file's
    buffers need no GIL.
    """
    try:
        return open_regular_for_arrow(split.path)
    except FileNotFoundError as e:
        raise DataError(
            f"{day_path(split.path, split.day)}: missing; the dataset was rewritten or removed "
            "while this job read it"
        ) from e
    except NotRegularFile as e:
        raise DataError(f"{day_path(split.path, split.day)}: {e.strerror}") from e


@dataclass(frozen=True)
class _Footer:
    metadata: pq.FileMetaData
    stamp: Stamp
    # The file's string ID columns the transform takes as dictionaries (see _SplitDecoder).
    dictionaries: tuple[str, ...] = ()


class _SplitDecoder:
    """Decodes splits into tables under one schema, validated.

    One per pass, shared by the pass's preparation threads. A file's footer is read at its
    first open and again whenever its ``Stamp`` (size, inode, modification time) changed
    since; each time, the digest it records must be the one the splits were listed with,
    so a file replaced under a running job fails the job at that file, naming its day,
    instead of feeding it rows of another dataset.

    A transform with ``dictionary_columns(schema)`` (``BatchTransform``) names the string
    ID columns of a file it takes as dictionaries: those are decoded as Parquet stores them
    when a writer dictionary-encodes strings (each distinct string once, and an index a
    row), so that neither the decode nor the transform goes over every row's string. A
    column whose dictionary turns out as large as half its rows (a writer that gave up
    dictionary-encoding it, where Arrow builds one at a cost) is decoded plain from then
    on. Either way the transform gives the same rows; the schema a file declares is what
    drift is checked against.
    """

    def __init__(self, dataset: ParquetBatchDataset) -> None:
        self.columns = dataset.columns
        self.validate = dataset.validate
        self._dictionary_columns: Callable[[pa.Schema], list[str]] | None = getattr(
            dataset.transform, "dictionary_columns", None
        )
        self._plain: set[str] = set()  # read plain from now on (see above)
        self._footers: dict[str, _Footer] = {}
        self._schema: pa.Schema | None = None  # declared by the first row group, all nullable
        self._schema_source = ""
        self._first = threading.Lock()  # the first row group read sets the schema
        # The last decoded schema found to conform (with the columns read as dictionaries),
        # and the schema its tables take: a file's row groups share one, and comparing 40
        # fields' types each time adds up.
        self._conforming: tuple[pa.Schema, tuple[str, ...], pa.Schema] | None = None

    def read(self, split: Split) -> pa.Table:
        table, dictionaries = self._decode(split)
        table = self._conform(table, split, dictionaries)
        if self.validate is not None:
            try:
                self.validate(table)
            except Exception as e:
                raise DataError(f"{_where(split)}: {e}") from e
        return table

    def _decode(self, split: Split) -> tuple[pa.Table, list[str]]:
        """The split's table and the columns read as dictionaries that the file declares
        as strings."""
        where = _where(split)
        f, stamp = _open_for_arrow(split)
        try:
            with f:
                footer = self._footers.get(split.path)
                if footer is not None and footer.stamp != stamp:
                    footer = None
                dictionaries = [] if footer is None else self._dictionaries(footer)
                # pre_buffer coalesces the column-chunk reads: one request per row group on
                # object stores instead of one per column.
                parquet = pq.ParquetFile(
                    f,
                    metadata=None if footer is None else footer.metadata,
                    pre_buffer=True,
                    read_dictionary=dictionaries or None,
                )
                if footer is None:
                    self._check_identity(split, parquet.metadata)
                    footer = _Footer(parquet.metadata, stamp, self._dictionaries_of(parquet))
                    self._footers[split.path] = footer
                    dictionaries = self._dictionaries(footer)
                    if dictionaries:
                        parquet = pq.ParquetFile(
                            f,
                            metadata=footer.metadata,
                            pre_buffer=True,
                            read_dictionary=dictionaries,
                        )
                names = parquet.schema_arrow.names
                missing = [c for c in self.columns if c not in names]
                if missing:
                    raise DataError(f"{where}: missing column {', '.join(missing)} (schema drift)")
                # Without Arrow's thread pool: every reader would spread over all cores, and
                # the loader's CPU use would no longer follow from num_workers.
                table = parquet.read_row_group(
                    split.row_group, columns=self.columns, use_threads=False
                )
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{where}: cannot decode: {e}") from e
        if table.num_rows != split.num_rows:
            raise DataError(
                f"{where}: has {table.num_rows} rows, the split listing said {split.num_rows} "
                "(file changed since list_splits)"
            )
        for name in dictionaries:
            for chunk in table.column(name).chunks:
                if 2 * len(chunk.dictionary) > len(chunk):
                    self._plain.add(name)
        return table, dictionaries

    def _dictionaries_of(self, parquet: pq.ParquetFile) -> tuple[str, ...]:
        """The string ID columns of ``parquet`` that the transform takes as dictionaries."""
        if self._dictionary_columns is None:
            return ()
        schema = parquet.schema_arrow
        wanted = self._dictionary_columns(schema)
        # Only top-level plain strings: read_dictionary names leaf columns, and a column
        # the file declares a dictionary already is read as one.
        return tuple(
            name
            for name in wanted
            if name in self.columns
            and schema.get_field_index(name) >= 0
            and is_string(schema.field(name).type)
        )

    def _dictionaries(self, footer: _Footer) -> list[str]:
        return [name for name in footer.dictionaries if name not in self._plain]

    @staticmethod
    def _check_identity(split: Split, metadata: pq.FileMetaData) -> None:
        day, digest = footer_identity(metadata)
        if digest != split.digest:
            found = digest[:12] if digest is not None else "none"
            listed = split.digest[:12] if split.digest is not None else "none"
            raise DataError(
                f"{day_path(split.path, split.day if split.day is not None else day)}: replaced "
                f"while this job read the dataset (its footer's digest is {found}, it was "
                f"{listed}); the dataset changed under the job"
            )

    def _conform(self, table: pa.Table, split: Split, dictionaries: list[str]) -> pa.Table:
        """``table`` under the reader's one schema, or a DataError if a column's type drifted.

        Row groups of one window are concatenated, which needs identical schemas; files that
        differ only in nullability or metadata are fine, so the reference is all-nullable.
        Types are compared as the files declare them: a column decoded as a dictionary
        here (``dictionaries``) is the string column its file holds, and keeps its
        decoded type.
        """
        schema = table.schema
        if dictionaries:
            declared = pa.schema(
                [f.with_type(f.type.value_type) if f.name in dictionaries else f for f in schema]
            )
        else:
            declared = schema
        if self._schema is None:
            with self._first:
                if self._schema is None:
                    self._schema_source = _where(split)
                    self._schema = pa.schema([f.with_nullable(True) for f in declared])
        conforming = self._conforming
        if (
            conforming is None
            or conforming[1] != tuple(dictionaries)
            or not schema.equals(conforming[0])
        ):
            for field, expected in zip(declared, self._schema, strict=True):
                if field.type != expected.type:
                    raise DataError(
                        f"{_where(split)}: column {field.name} is {field.type}, but "
                        f"{self._schema_source} has {expected.type} (schema drift)"
                    )
            target = pa.schema(
                [e.with_type(f.type) for f, e in zip(schema, self._schema, strict=True)],
                metadata=self._schema.metadata,
            )
            conforming = self._conforming = (schema, tuple(dictionaries), target)
        if schema.equals(conforming[2]):
            return table
        return pa.Table.from_arrays(table.columns, schema=conforming[2])


class RoundRobin(BaseNode[Any]):
    """One item from each source in turn; a source that runs out leaves the rotation.

    The order depends only on the sources, never on which one is ready first, so a run's
    batch order is reproducible. The state holds whose turn it is, the sources still in the
    rotation and every source's state.
    """

    def __init__(self, sources: Sequence[BaseNode[Any]]) -> None:
        super().__init__()
        if not sources:
            raise ValueError("RoundRobin needs at least one source")
        self.sources = list(sources)
        self._active: list[int] = []  # indices into sources, in rotation order
        self._turn = 0  # index into _active

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            for source in self.sources:
                source.reset()
            self._active, self._turn = list(range(len(self.sources))), 0
            return
        if "sources" not in initial_state:
            raise ValueError(
                "not a round-robin state (was it saved by a loader with num_workers=0?)"
            )
        states = initial_state["sources"]
        if len(states) != len(self.sources):
            raise ValueError(
                f"state holds {len(states)} sources, this round robin has {len(self.sources)} "
                "(was it saved with another num_workers?)"
            )
        for source, state in zip(self.sources, states, strict=True):
            source.reset(state)
        self._active = [int(i) for i in initial_state["active"]]
        self._turn = int(initial_state["turn"])

    def next(self) -> Any:
        while self._active:
            source = self.sources[self._active[self._turn]]
            try:
                item = next(source)
            except StopIteration:
                del self._active[self._turn]
                if self._turn == len(self._active):
                    self._turn = 0
                continue
            self._turn = (self._turn + 1) % len(self._active)
            return item
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {
            "turn": self._turn,
            "active": list(self._active),
            "sources": [source.state_dict() for source in self.sources],
        }

    def close(self) -> None:
        """Close every source that can be closed (ends their threads)."""
        for source in self.sources:
            close_node(source)


def close_node(node: BaseNode[Any]) -> None:
    """``node.close()``, for the nodes that hold threads or connections; others have none."""
    close = getattr(node, "close", None)
    if close is not None:
        close()


class _KeepError(BaseNode[Any]):
    """``source`` unchanged, keeping the error that its ``next`` or state last raised.

    torchdata's prefetch thread passes an error on as its type and formatted traceback
    only; the consumer raises the kept original instead (see ``ReaderPrefetcher``). The
    state is the source's own, so states are those of a plain ``Prefetcher``. With
    ``pin_memory`` each item is copied to page-locked memory here, in the prefetch thread
    (items with a ``pin_memory()`` method, such as the features' ``Batch``).
    """

    def __init__(self, source: BaseNode[Any], pin_memory: bool = False) -> None:
        super().__init__()
        self.source = source
        self.pin_memory = pin_memory
        self.error: Exception | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.error = None
        self.source.reset(initial_state)

    def next(self) -> Any:
        try:
            item = next(self.source)
            return item.pin_memory() if self.pin_memory else item
        except StopIteration:
            raise
        except Exception as e:
            self.error = e
            raise

    def get_state(self) -> dict[str, Any]:
        try:
            return self.source.state_dict()
        except Exception as e:
            self.error = e
            raise

    def close(self) -> None:
        close_node(self.source)

    def take_error(self) -> Exception | None:
        error, self.error = self.error, None
        return error


class ReaderPrefetcher(Prefetcher):
    """torchdata's ``Prefetcher`` (a thread keeping ``prefetch_factor`` items of ``source``
    ready), for reader nodes: their errors arrive whole, and their threads can be stopped.

    An error raised in the thread reaches the consumer as itself: its type, one-line
    message and cause, not torchdata's copy whose message is "Caught DataError in
    _populate_queue" and the thread's traceback. ``close()`` stops the thread and closes
    ``source``, waiting for both; the next ``reset`` starts afresh. Prefetchers still open
    when the interpreter exits are closed then (``_close_open_prefetchers``): the thread is
    a daemon, and one caught inside a torch call as the interpreter finalizes aborts the
    process ("terminate called without an active exception", exit 134).
    """

    JOIN_TIMEOUT_S = 10.0  # a thread ends once its source's current item is done

    def __init__(
        self, source: BaseNode[Any], prefetch_factor: int, pin_memory: bool = False
    ) -> None:
        self._kept = _KeepError(source, pin_memory)
        super().__init__(self._kept, prefetch_factor)
        _open_prefetchers.add(self)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        try:
            # Starting the thread may fail in it (the source's first state, e.g. a reader
            # server asked for it that cannot be reached).
            super().reset(initial_state)
        except Exception as wrapped:
            error = self._kept.take_error() or wrapped
        else:
            return
        raise error

    def next(self) -> Any:
        try:
            return super().next()
        except StopIteration:
            raise
        except Exception as wrapped:
            error = self._kept.take_error() or wrapped
        # Raised outside the handler: the original's context stays its own.
        raise error

    def close(self) -> None:
        stop_prefetch_thread(self, lambda: close_node(self._kept), self.JOIN_TIMEOUT_S)


_open_prefetchers: weakref.WeakSet[ReaderPrefetcher] = weakref.WeakSet()


@atexit.register
def _close_open_prefetchers() -> None:
    """Stop every prefetch thread before the interpreter finalizes (see ``ReaderPrefetcher``).

    Runs after the preparation pools were waited for; a failed close must not hide others.
    """
    for prefetcher in list(_open_prefetchers):
        with contextlib.suppress(Exception):
            prefetcher.close()


class ReaderLoader(Loader[Any]):
    """torchdata's ``Loader`` over a reader graph, plus ``close()``: it stops every reader
    and preparation thread and waits for them (a later ``for`` starts them again). Also a
    context manager that closes on exit."""

    def close(self) -> None:
        close_node(self.root)

    def __enter__(self) -> ReaderLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def reader_threads(num_workers: int) -> int:
    """Preparation threads per reader when not given: two where the cores allow, else one.

    With two, a reader prepares its next two windows at once (the consumer waits less on
    one core's decode). More threads than cores only add contention: two readers of two
    threads each on two cores used more CPU per row than two of one thread.
    """
    return max(1, min(2, _cores() // max(1, num_workers)))


def make_loader(
    dataset: ParquetBatchDataset,
    num_workers: int = 1,
    prefetch_factor: int = 4,
    threads: int | None = None,
    pin_memory: bool = False,
) -> ReaderLoader:
    """A resumable loader whose ``num_workers`` readers run ahead of the consumer.

    Each reader prepares windows in ``threads`` threads (default ``reader_threads``) and
    keeps up to ``prefetch_factor`` batches ready; with ``num_workers=0`` the one reader
    hands its batches out in the consumer's thread (its preparation threads still work
    ahead). ``threads`` changes nothing but speed: the batches are the same. ``for batch
    in loader`` starts a fresh pass over the epoch set with ``dataset.set_epoch``, unless a
    state was loaded with ``load_state_dict``: then the pass resumes in that state's epoch,
    right after its last batch. A state taken after an epoch's last batch restores to a
    fresh pass, so call ``set_epoch`` with the next epoch first. With ``pin_memory`` (for a
    GPU trainer) each reader's prefetch thread pins the batches it hands out; states are
    the same either way. A reader's error
    (a ``DataError`` naming the file, row group and column) is raised as it was raised in
    the reader's thread; ``close()`` stops the threads.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be non-negative, got {num_workers}")
    if prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be positive, got {prefetch_factor}")
    if threads is None:
        threads = reader_threads(num_workers)
    if num_workers == 0:
        return ReaderLoader(SplitReader(dataset, threads=threads))
    readers = [
        ReaderPrefetcher(
            SplitReader(dataset, worker, num_workers, threads), prefetch_factor, pin_memory
        )
        for worker in range(num_workers)
    ]
    return ReaderLoader(RoundRobin(readers))

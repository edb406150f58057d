"""Embedding tables larger than memory: rows on disk, a cache of hot rows in memory.

``TieredEmbeddingBag`` keeps every row of its tables, with the row's optimizer state, in
one memory-mapped file per bag (the "ssd" tier of ``dlrmflow.train.model.plan.Shard``), and
``cache_rows`` of them in memory. A batch's rows are made resident (least recently used
rows are evicted, dirty ones written back first), copied into a small dense *working set*
that is itself a ``TableBatchedEmbeddingBag`` over just those rows, and looked up and
updated there by the unchanged TBE code; backward then copies the updated rows and state
back into the cache. ``flush`` writes every dirty row to the file.

Why a working set rather than a second implementation of the lookup: the pooled outputs
and the fused optimizer update are then those of ``TableBatchedEmbeddingBag`` by
construction, bit for bit. The working set numbers a batch's rows in the order of their
global rows (table, then row), so the TBE's stable sort by ID, its CSR gradient reduction
and its update see the same structure and values as the in-memory bag does: a model whose
tables exceed the cache trains to weights identical to all-in-memory training.

``prefetch(kjt)`` makes a later batch's rows resident ahead of its forward: the cache's
bookkeeping (which row goes in which slot, what is evicted) is decided at once in the
calling thread, in call order, so counters and weights never depend on timing; only the
disk reads and write-backs run in one background thread, in submission order. The rows a
prefetch loads stay pinned until that batch's forward, and a batch's rows stay pinned from
its forward to its backward, so neither is evicted while it is needed. The intended order
per step is the train pipeline's: ``prefetch(next)``, ``forward(this)``, ``backward``.

Memory: the cached records plus a row-to-slot map of 4 bytes per stored row (a direct map:
one vectorized gather per batch instead of a hash table). One LRU serves every table; a
slot is as wide as the widest record, so tables of smaller dims waste the difference.

The file holds a 4 KiB JSON header (layout, optimizer, step count) and then, per run of
same-dim tables, the weights of every row (``[rows, dim]``) followed by each optimizer
state in the same row order (row-wise Adagrad: ``[rows, 1]``; Adam: the two moments, each
``[rows, dim]``). Each table's weights and states are thus contiguous in the file, so a
checkpoint saves and loads them as views of the mapping, never as a copy of a table that
may not fit in memory; in the cache a row and its state sit side by side as one record.

The file's blocks are reserved when it is created (``posix_fallocate``), so a disk too
small for it fails there, as a ``DiskSpaceError`` naming the file and the bytes, with the
file removed. Without the reservation the file would be sparse, and the first write into
a hole of a full disk's mapping kills the process with SIGBUS, mid-run and without a word.

Resident memory stays bounded however much of the file a run touches: pages of a shared
file mapping count in a process's resident set once touched, and the kernel leaves them
mapped while memory is free. A batch's reads and write-backs go in chunks of
``PAGE_CHUNK_ROWS`` rows; once the pages they may have mapped add up to
``MAPPED_ALLOWANCE_BYTES``, the process's shared resident set is read and, past that
allowance, every page of the file is unmapped (``MADV_DONTNEED``) at once. Sequential bulk
accesses (a table's initialisation, a checkpoint item) unmap the range they touched as
they go. The data stays in the page cache (dirty pages are written back by the kernel);
only this process's mapping of it is dropped. Why an allowance rather than unmapping
after every chunk: each unmapping makes the next accesses to those pages fault again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dlrmflow.errors import DlrmflowError
from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.kernels.tbe import INIT_BLOCK_ROWS, TableBatchedEmbeddingBag, init_table_rows
from dlrmflow.memory import format_bytes
from dlrmflow.sparse import EmbeddingTable, KeyedJaggedTensor

__all__ = ["CacheStats", "CacheTooSmall", "DiskSpaceError", "TieredEmbeddingBag"]

HEADER_BYTES = 4096
MAGIC = "dlrmflow-tiered-embeddings"
FORMAT_VERSION = 2  # 1 stored a row's weights and state side by side
FILE_SUFFIX = ".tiered"
# Rows initialised per write: whole init blocks, so that no block is drawn twice.
INIT_CHUNK_ROWS = 8 * INIT_BLOCK_ROWS
NEVER_USED = -1
# Random rows gathered from or scattered to the file at once: each row touches a page per
# part, and a fault maps up to 16 cached neighbours with it (FAULT_AROUND_BYTES), so one
# chunk maps at most 2 x 64 KiB x PAGE_CHUNK_ROWS (32 MiB at 256) of the file.
PAGE_CHUNK_ROWS = 256
FAULT_AROUND_BYTES = 64 << 10
# The file's pages a process keeps mapped before it unmaps them all: its resident set
# holds at most this plus one chunk's worth of them. They are page cache (reclaimable);
# a small allowance unmaps often, and every unmapped page faults again when next used.
MAPPED_ALLOWANCE_BYTES = 256 << 20
# Memory a cache needs besides its records: per slot its row, last use, pending job (8
# bytes each), pin count (4) and dirty flag (1). Outside the cache's memory: per row in the
# file, its slot (4 bytes, the row map).
SLOT_BOOKKEEPING_BYTES = 29
ROW_MAP_BYTES = 4
# A square-sum hook (see ``TableBatchedEmbeddingBag``) told which bag it runs in: the
# working set, whose group-local rows the hook receives.
WorkingSetHook = Callable[[TableBatchedEmbeddingBag, int, torch.Tensor, torch.Tensor], torch.Tensor]
UNUSABLE = torch.iinfo(torch.int64).max


class CacheTooSmall(DlrmflowError, RuntimeError):
    """A batch needs more distinct rows in memory at once than the cache can hold.

    ``rows`` is what the batch needs, ``free`` what the cache could give it (its slots not
    pinned by another batch) and ``slot_bytes`` the memory of one slot, bookkeeping
    included: whoever sized the cache can say how much more memory it takes.
    """

    def __init__(self, message: str, *, rows: int, free: int, slot_bytes: int) -> None:
        super().__init__(message)
        self.rows, self.free, self.slot_bytes = rows, free, slot_bytes

    @property
    def missing_bytes(self) -> int:
        """The memory the cache lacks for this batch."""
        return (self.rows - self.free) * self.slot_bytes


class DiskSpaceError(DlrmflowError, OSError):
    """The file system cannot hold a new tiered embedding file (none is left behind)."""


@dataclass
class CacheStats:
    """Counters of one bag since its creation or ``reset_stats``.

    ``lookups`` counts the distinct rows each forward needed and ``hits`` those already in
    memory (kept from earlier batches or loaded by ``prefetch``); the others were read from
    disk while the forward waited. ``prefetched`` rows were read ahead of their batch;
    ``prefetch_skipped`` ones were not, every slot being pinned.
    """

    lookups: int = 0
    hits: int = 0
    prefetched: int = 0
    prefetch_skipped: int = 0
    evictions: int = 0
    writebacks: int = 0  # dirty rows written to the file, on eviction or flush

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class _Pages:
    """The file's mapping, and dropping this process's mapped pages of a range of it."""

    def __init__(self, memmap: np.memmap) -> None:
        mapping = memmap.base  # the mapping numpy made (from HEADER_BYTES)
        if not isinstance(mapping, mmap.mmap):
            raise ValueError("the tier's memmap must be numpy's own mapping of the file")
        self._mmap: mmap.mmap = mapping
        if memmap.offset % mmap.ALLOCATIONGRANULARITY:
            raise ValueError(f"the header ({memmap.offset} bytes) must be whole pages")
        self._base = memmap.ctypes.data
        self._size = len(self._mmap)
        if hasattr(mmap, "MADV_RANDOM"):
            self._mmap.madvise(mmap.MADV_RANDOM)  # no readahead: rows are read at random
        # Bytes the random accesses since the last look may have mapped (an upper bound),
        # and the shared resident set when the file's pages were last unmapped.
        self._unchecked = 0
        self._shared_at_drop = _shared_resident()
        self._lock = threading.Lock()  # the prefetch thread accesses rows too

    def touched(self, rows: int, parts: int) -> None:
        """After ``rows`` random rows of ``parts`` parts were read or written: unmap every
        page of the file once this process's shared resident set has grown by more than
        ``MAPPED_ALLOWANCE_BYTES`` since they were last unmapped (looked at only when the
        accesses since the last look could have taken it there)."""
        with self._lock:
            self._unchecked += rows * parts * FAULT_AROUND_BYTES
            if self._unchecked < MAPPED_ALLOWANCE_BYTES:
                return
            grown = _shared_resident() - self._shared_at_drop
            if grown <= MAPPED_ALLOWANCE_BYTES:
                self._unchecked = max(grown, 0)
                return
            self.drop_all()
            self._shared_at_drop = _shared_resident()
            self._unchecked = 0

    def drop(self, array: np.ndarray, first: int, last: int) -> None:
        """Unmap the pages of rows ``first..last`` (inclusive) of ``array``, a 2-D view of
        the mapping; their data stays in the page cache and the file."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        row_bytes = array.strides[0]
        start = array.ctypes.data - self._base + first * row_bytes
        end = array.ctypes.data - self._base + (last + 1) * row_bytes
        start -= start % mmap.PAGESIZE
        end = min(end + (-end % mmap.PAGESIZE), self._size)
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def drop_all(self) -> None:
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)


def _shared_resident() -> int:
    """This process's resident pages backed by files or shared memory, in bytes (the third
    field of ``/proc/self/statm``); 0 where there is no such file, which never unmaps."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[2]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return 0


@dataclass(frozen=True)
class _Region:
    """The rows ``[start, end)`` of one run of same-dim tables in the file: one 2-D array
    per record part (the weights, then each optimizer state), ``[end - start, width]``."""

    start: int
    end: int
    parts: list[np.ndarray]

    def gather(self, local: np.ndarray, pages: _Pages) -> np.ndarray:
        """Records ``[len(local), width]`` of rows ``local`` (sorted or not)."""
        out = np.empty((len(local), sum(p.shape[1] for p in self.parts)), np.float32)
        for lo in range(0, len(local), PAGE_CHUNK_ROWS):
            chunk = local[lo : lo + PAGE_CHUNK_ROWS]
            column = 0
            for part in self.parts:
                width = part.shape[1]
                out[lo : lo + len(chunk), column : column + width] = part[chunk]
                column += width
            pages.touched(len(chunk), len(self.parts))
        return out

    def scatter(self, local: np.ndarray, records: np.ndarray, pages: _Pages) -> None:
        """Write ``records`` (their first columns) as rows ``local``."""
        for lo in range(0, len(local), PAGE_CHUNK_ROWS):
            chunk = local[lo : lo + PAGE_CHUNK_ROWS]
            column = 0
            for part in self.parts:
                width = part.shape[1]
                part[chunk] = records[lo : lo + len(chunk), column : column + width]
                column += width
            pages.touched(len(chunk), len(self.parts))

    def read_rows(self, first: int, end: int, pages: _Pages) -> np.ndarray:
        """A copy of the records of local rows ``[first, end)``."""
        out = np.empty((end - first, sum(p.shape[1] for p in self.parts)), np.float32)
        step = PAGE_CHUNK_ROWS * 64  # sequential: faults map neighbours, not strangers
        for lo in range(first, end, step):
            hi = min(lo + step, end)
            column = 0
            for part in self.parts:
                width = part.shape[1]
                out[lo - first : hi - first, column : column + width] = part[lo:hi]
                pages.drop(part, lo, hi - 1)
                column += width
        return out

    def write_rows(self, first: int, records: np.ndarray, pages: _Pages) -> None:
        """Write ``records`` as local rows ``first, first + 1, ...``."""
        step = PAGE_CHUNK_ROWS * 64
        for lo in range(0, len(records), step):
            hi = min(lo + step, len(records))
            column = 0
            for part in self.parts:
                width = part.shape[1]
                part[first + lo : first + hi] = records[lo:hi, column : column + width]
                pages.drop(part, first + lo, first + hi - 1)
                column += width


@dataclass
class _Transfer:
    """The disk I/O of one placement: write the evicted dirty rows, then read the new ones."""

    write_rows: torch.Tensor
    write_slots: torch.Tensor
    read_rows: torch.Tensor
    read_slots: torch.Tensor

    @property
    def empty(self) -> bool:
        return not (self.write_rows.numel() or self.read_rows.numel())


class _RowCache:
    """``capacity`` slots in memory over the rows of ``regions``, LRU, with pins.

    A slot holds one row's record (weights then optimizer state). Every placement advances
    a tick; a slot used at the current tick or pinned (by a prefetched batch not yet looked
    up, or by a batch between forward and backward) is never evicted. Only the calling
    thread changes the bookkeeping; ``run`` (the data) may run in another.
    """

    def __init__(self, regions: list[_Region], capacity: int, pages: _Pages) -> None:
        self.regions = regions
        self.pages = pages
        width = max(sum(p.shape[1] for p in r.parts) for r in regions)
        # Uninitialised: a slot is written (read from the file) before it is ever used, so
        # the cache's pages become resident only as it fills.
        self.records = torch.empty(capacity, width)
        self.slot_row = torch.full((capacity,), -1, dtype=torch.int64)
        self.row_slot = torch.full((regions[-1].end,), -1, dtype=torch.int32)
        self.last_used = torch.full((capacity,), NEVER_USED, dtype=torch.int64)
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.pins = torch.zeros(capacity, dtype=torch.int32)
        # The background job that fills each slot (0: none pending).
        self.ready = torch.zeros(capacity, dtype=torch.int64)
        # Slots are first used in order, so the never-used ones are ``[filled, capacity)``:
        # while the cache fills, a placement takes them without scanning every slot.
        self.filled = 0

    @property
    def capacity(self) -> int:
        return self.records.shape[0]

    def clear(self) -> None:
        """Forget every cached row (none may be dirty or pending), keeping the memory: a
        second cache beside this one, even briefly, would double the peak."""
        self.slot_row.fill_(-1)
        self.row_slot.fill_(-1)
        self.last_used.fill_(NEVER_USED)
        self.dirty.zero_()
        self.pins.zero_()
        self.ready.zero_()
        self.filled = 0

    def lookup(self, rows: torch.Tensor, tick: int) -> torch.Tensor:
        """Slots of ``rows`` (-1: not cached); the cached ones count as used at ``tick``, so
        that this placement does not evict them."""
        slots = self.row_slot.index_select(0, rows).long()
        self.last_used.index_fill_(0, slots[slots >= 0], tick)
        return slots

    @property
    def never_used(self) -> int:
        return self.capacity - self.filled

    def available(self, tick: int) -> int:
        """Slots a placement at ``tick`` may take: never used, or unpinned and not used at
        ``tick``."""
        used = slice(0, self.filled)
        return self.never_used + int(((self.pins[used] == 0) & (self.last_used[used] < tick)).sum())

    def place(self, rows: torch.Tensor, slots: torch.Tensor, tick: int) -> tuple[_Transfer, int]:
        """Give the uncached ``rows`` (``slots`` -1) slots, in order, as many as are
        available; fills ``slots`` in place. Returns the I/O that makes them resident and
        how many cached rows were evicted for them."""
        missing = (slots < 0).nonzero().squeeze(1)
        victims = self._victims(missing.numel(), tick)
        missing = missing[: victims.numel()]
        new_rows = rows.index_select(0, missing)
        old_rows = self.slot_row.index_select(0, victims)
        dirty = self.dirty.index_select(0, victims)  # only occupied slots are ever dirty
        evicted = old_rows[old_rows >= 0]
        self.row_slot.index_fill_(0, evicted, -1)
        self.row_slot.index_copy_(0, new_rows, victims.int())
        self.slot_row.index_copy_(0, victims, new_rows)
        self.last_used.index_fill_(0, victims, tick)
        self.dirty.index_fill_(0, victims, False)
        slots.index_copy_(0, missing, victims)
        return _Transfer(old_rows[dirty], victims[dirty], new_rows, victims), evicted.numel()

    def _victims(self, count: int, tick: int) -> torch.Tensor:
        """``count`` slots (fewer if fewer are available): never-used ones first, then the
        least recently used, ties by slot number, so every run chooses the same."""
        used = self.filled
        fresh = torch.arange(used, used + min(count, self.never_used))
        self.filled += fresh.numel()
        count -= fresh.numel()
        usable = (self.pins[:used] == 0) & (self.last_used[:used] < tick)
        take = min(count, int(usable.sum())) if count else 0
        if take == 0:
            return fresh
        key = self.last_used[:used].masked_fill(~usable, UNUSABLE)
        threshold = torch.kthvalue(key, take).values
        below = (key < threshold).nonzero().squeeze(1)
        equal = (key == threshold).nonzero().squeeze(1)[: take - below.numel()]
        return torch.cat([fresh, below, equal])

    def pin(self, slots: torch.Tensor, by: int) -> None:
        self.pins.index_add_(0, slots, torch.full_like(slots, by, dtype=torch.int32))

    def run(self, transfer: _Transfer) -> None:
        # Writes first: a victim slot's old row must reach the file before the new row
        # overwrites the slot.
        if transfer.write_rows.numel():
            self._write(transfer.write_rows, self.records.index_select(0, transfer.write_slots))
        if transfer.read_rows.numel():
            self.records.index_copy_(0, transfer.read_slots, self._read(transfer.read_rows))

    def write_dirty(self) -> int:
        """Write every dirty slot's record to the file; returns how many."""
        slots = self.dirty.nonzero().squeeze(1)
        if slots.numel():
            self._write(self.slot_row.index_select(0, slots), self.records.index_select(0, slots))
            self.dirty.index_fill_(0, slots, False)
        return slots.numel()

    def _write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        for r in self.regions:
            inside = (rows >= r.start) & (rows < r.end)
            if bool(inside.any()):
                r.scatter((rows[inside] - r.start).numpy(), records[inside].numpy(), self.pages)

    def _read(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows.numel(), self.records.shape[1])
        for r in self.regions:
            inside = (rows >= r.start) & (rows < r.end)
            if bool(inside.any()):
                values = r.gather((rows[inside] - r.start).numpy(), self.pages)
                out[inside, : values.shape[1]] = torch.from_numpy(values)
        return out

    def read_range(self, start: int, end: int, columns: slice) -> torch.Tensor:
        """Record ``columns`` of rows ``[start, end)`` of one region, a copy, taken from the
        cache where the row is cached."""
        region = next(r for r in self.regions if r.start <= start < r.end)
        records = region.read_rows(start - region.start, end - region.start, self.pages)
        out = torch.from_numpy(np.ascontiguousarray(records[:, columns]))
        cached = ((self.slot_row >= start) & (self.slot_row < end)).nonzero().squeeze(1)
        rows = self.slot_row.index_select(0, cached) - start
        out.index_copy_(0, rows, self.records.index_select(0, cached)[:, columns])
        return out


@dataclass
class _Prefetched:
    """A batch whose rows ``prefetch`` pinned (slot -1: left on disk), and its distinct
    rows, which its forward reuses."""

    kjt: KeyedJaggedTensor
    slots: torch.Tensor
    unique: torch.Tensor
    inverse: torch.Tensor


@dataclass
class _InFlight:
    """A training forward whose backward has not run yet."""

    slots: torch.Tensor  # the cache slot of each of the batch's distinct rows
    ws_rows: list[torch.Tensor]  # per group, the working-set rows of those rows, in order
    superseded: bool = False


@dataclass
class _Jobs:
    """Background transfers, run one at a time in submission order."""

    executor: ThreadPoolExecutor | None = None
    pending: list[tuple[int, Future]] = field(default_factory=list)
    last: int = 0

    def submit(self, cache: _RowCache, transfer: _Transfer) -> int:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="tiered-prefetch")
        self.last += 1
        self.pending.append((self.last, self.executor.submit(cache.run, transfer)))
        return self.last

    def wait(self, job: int | None = None) -> None:
        """Wait for the jobs up to ``job`` (all when None), re-raising their errors."""
        while self.pending and (job is None or self.pending[0][0] <= job):
            _, future = self.pending.pop(0)
            future.result()

    def shutdown(self) -> None:
        self.wait()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None


class _WorkingSet(TableBatchedEmbeddingBag):
    """One batch's rows as a table-batched bag of their own; after the inherited fused
    update, ``on_update`` hands them back to the cache."""

    # Its update hands the rows back to the cache: FBGEMM's fused backward would skip that.
    fbgemm_capable = False

    def __init__(
        self, tables: Sequence[EmbeddingTable], optimizer: EmbeddingOptimizer, kernels: str = "auto"
    ) -> None:
        super().__init__(tables, optimizer, init=lambda _k, rows: rows.zero_(), kernels=kernels)
        self.on_update: Callable[[_WorkingSet], None] | None = None

    def _apply_gradient(self, grad_out: torch.Tensor, lookups: list) -> None:
        super()._apply_gradient(grad_out, lookups)
        if self.on_update is not None:
            self.on_update(self)

    def record_views(self, g: int) -> list[torch.Tensor]:
        """2-D views of group ``g``'s weights and optimizer state, in record column order."""
        group = self.groups[g]
        views = [self._view(self.weight, group)]
        for part in self.optimizer.state_parts:
            view = self._state_view(part, group)
            views.append(view[:, None] if part.per_row else view)
        return views


def record_width(optimizer: EmbeddingOptimizer, dim: int) -> int:
    """Floats per row in the file: the weights, then the optimizer state."""
    return sum(optimizer.record_widths(dim))


def _make_directories(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; return those created, deepest first,
    for a failed creation to remove."""
    missing = []
    for path in [directory, *directory.parents]:
        if path.exists():
            break
        missing.append(path)
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    try:
        stat = os.statvfs(path.parent)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return None
    return stat.f_bavail * stat.f_frsize


def _no_space(path: Path, size: int, free: int | None) -> DiskSpaceError:
    have = "" if free is None else f", but its file system has {format_bytes(free)} free"
    return DiskSpaceError(
        f"{path}: the embedding rows and optimizer state kept on disk need "
        f"{format_bytes(size)}{have}; free space there or keep the file elsewhere"
    )


def _check_free(path: Path, size: int) -> None:
    """Refuse at once a file larger than the free space (reserving would fail anyway,
    after briefly filling the disk for every other writer)."""
    free = _free_bytes(path)
    if free is not None and size > free:
        raise _no_space(path, size, free)


def _reserve(fd: int, path: Path, size: int, *, new: bool) -> None:
    """Allocate every block of the open file ``fd`` (``size`` bytes), keeping its contents:
    writes through the mapping then never meet a full disk. Where the file system cannot
    reserve (no ``posix_fallocate``, or it says not supported), the file stays sparse: a
    ``new`` one was checked against the free space first. A ``new`` file that does not fit
    is emptied before the free space is reported."""
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            if new:
                os.ftruncate(fd, 0)  # give back what it got, then say what is free
            raise _no_space(path, size, _free_bytes(path)) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def cache_rows_for(
    memory_bytes: int, tables: Sequence[EmbeddingTable], optimizer: EmbeddingOptimizer
) -> int:
    """The cache slots that ``memory_bytes`` holds for a bag of ``tables``: the records
    (each slot as wide as the widest) and the slots' bookkeeping. The row map
    (``ROW_MAP_BYTES`` per row in the file) is not counted: it follows the tables, not
    the cache. Below 1: the memory cannot hold a cache at all."""
    slot = 4 * max(record_width(optimizer, t.embedding_dim) for t in tables)
    return memory_bytes // (slot + SLOT_BOOKKEEPING_BYTES)


class TieredEmbeddingBag(nn.Module):
    """A ``TableBatchedEmbeddingBag`` whose rows live in a file, ``cache_rows`` in memory.

    ``forward(kjt)`` and its backward compute exactly what the in-memory bag computes for
    the same tables, optimizer and seed. The file is ``directory/name.tiered``: a new bag
    creates it (rows drawn by ``init_table_rows``) and refuses to overwrite one;
    ``resume=True`` opens the file an earlier bag flushed. The cache must hold at least
    the distinct rows of one batch. Unlike the TBE, it has no gradient hook (it holds no
    replicated tables); its ``square_sum_hook`` (column shards under row-wise Adagrad) is
    the TBE's with the working set first, whose rows it is called with. ``state_dict``
    does not hold the rows: the flushed file does. Rows updated since the last ``flush`` (or
    ``close``) exist only in memory, so a checkpoint must flush first (``file_views``
    does).

    ``init(k, rows, first)`` fills rows ``[first, first + len(rows))`` of table ``k`` when
    the file is created (default: ``init_table_rows`` from ``seed`` and the table's name;
    a shard of a larger table passes its own offsets); ``fill=False`` leaves them zeros
    (a sparse file), for a bag that a checkpoint load fills next. ``kernels`` picks the working
    set's TBE implementation, as for the in-memory bag, so both run the same code.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingTable],
        optimizer: EmbeddingOptimizer,
        directory: str | Path,
        *,
        cache_rows: int,
        name: str = "embeddings",
        seed: int = 0,
        resume: bool = False,
        init: Callable[[int, torch.Tensor, int], None] | None = None,
        kernels: str = "auto",
        fill: bool = True,
    ) -> None:
        super().__init__()
        if "://" in str(directory):
            raise ValueError(f"{directory}: tiered embeddings need a local directory to mmap")
        if cache_rows < 1:
            raise ValueError(f"cache_rows must be >= 1, got {cache_rows}")
        # A one-row TBE of the same tables checks them and the optimizer, and its groups
        # (runs of same-dim tables) are the file's regions.
        layout = _WorkingSet(
            [EmbeddingTable(t.name, 1, t.embedding_dim, t.pooling) for t in tables],
            optimizer,
            kernels,
        )
        self.kernels = kernels
        self.tables = list(tables)
        self.optimizer = optimizer
        self.lr = optimizer.lr
        self.path = Path(directory) / f"{name}{FILE_SUFFIX}"
        self._sizes = torch.tensor([t.num_embeddings for t in self.tables])
        self._starts = torch.zeros(len(self.tables) + 1, dtype=torch.int64)
        torch.cumsum(self._sizes, 0, out=self._starts[1:])
        self._group_keys = [(g.first_key, g.end_key) for g in layout.groups]
        self.step = 0  # the optimizer's global step count (``step_key``), as the TBE keeps it
        self._memmap = self._open() if resume else self._create(seed, init, fill)
        self._pages = _Pages(self._memmap)
        total_rows = int(self._starts[-1])
        self._cache = self._new_cache(min(cache_rows, total_rows))
        self._stats = CacheStats()
        self._tick = 0
        self._jobs = _Jobs()
        self._prefetched: list[_Prefetched] = []
        self._in_flight: _InFlight | None = None
        self.square_sum_hook: WorkingSetHook | None = None

    # -- the file -------------------------------------------------------------------------

    def fbgemm_refusal(self) -> str:
        """Why FBGEMM's kernels cannot run this bag's steps (``model.kernels=fbgemm``
        says so in ``kernels_reason`` rather than leaving the choice unexplained)."""
        return (
            "its rows live on disk behind a DRAM cache, and each batch's updated rows go "
            "back to that cache between the backward and the next lookup, which FBGEMM's "
            "fused backward would skip"
        )

    def _region_shapes(self) -> list[tuple[int, int, int]]:
        """(first global row, rows, record width) of each group's region."""
        return [
            (
                int(self._starts[first]),
                int(self._starts[end] - self._starts[first]),
                record_width(self.optimizer, self.tables[first].embedding_dim),
            )
            for first, end in self._group_keys
        ]

    def _regions(self, memmap: np.memmap | None = None) -> list[_Region]:
        memmap = self._memmap if memmap is None else memmap
        regions, offset = [], 0
        for (start, rows, _), (first, _end) in zip(
            self._region_shapes(), self._group_keys, strict=True
        ):
            parts = []
            for width in self.optimizer.record_widths(self.tables[first].embedding_dim):
                parts.append(memmap[offset : offset + rows * width].reshape(rows, width))
                offset += rows * width
            regions.append(_Region(start, start + rows, parts))
        return regions

    def _new_cache(self, capacity: int) -> _RowCache:
        return _RowCache(self._regions(), capacity, self._pages)

    def _header(self) -> dict:
        return {
            "magic": MAGIC,
            "format": FORMAT_VERSION,
            "tables": [[t.name, t.num_embeddings, t.embedding_dim] for t in self.tables],
            "optimizer": type(self.optimizer).__name__,
            "step": self.step,
        }

    def _file_bytes(self) -> int:
        return HEADER_BYTES + 4 * sum(rows * width for _, rows, width in self._region_shapes())

    def _write_header(self) -> None:
        raw = json.dumps(self._header()).encode()
        if len(raw) > HEADER_BYTES:
            raise ValueError(f"{self.path}: {len(self.tables)} tables overflow the file header")
        with self.path.open("r+b") as f:
            f.write(raw.ljust(HEADER_BYTES, b" "))

    def _create(
        self, seed: int, init: Callable[[int, torch.Tensor, int], None] | None, fill: bool
    ) -> np.memmap:
        if self.path.exists():
            raise FileExistsError(
                f"{self.path}: already exists; pass resume=True to train on from it, or "
                "delete it to start over"
            )
        size = self._file_bytes()
        created = _make_directories(self.path.parent)
        try:
            _check_free(self.path, size)
            with self.path.open("wb") as f:
                # Zeros (the initial optimizer state) without writing them, then every
                # block reserved: a full disk is an error now, not a SIGBUS mid-run.
                f.truncate(size)
                _reserve(f.fileno(), self.path, size, new=True)
            self._write_header()
            memmap = np.memmap(self.path, np.float32, "r+", offset=HEADER_BYTES)
            if fill:
                self._fill(memmap, seed, init)
        except BaseException:
            self.path.unlink(missing_ok=True)
            for directory in created:
                with contextlib.suppress(OSError):  # not empty: another file is there
                    directory.rmdir()
            raise
        return memmap

    def _fill(
        self, memmap: np.memmap, seed: int, init: Callable[[int, torch.Tensor, int], None] | None
    ) -> None:
        """Write every table's initial rows into a new file (its state stays zeros)."""
        pages = _Pages(memmap)
        for region, (first, end) in zip(self._regions(memmap), self._group_keys, strict=True):
            weights = region.parts[0]
            for k in range(first, end):
                t = self.tables[k]
                row = int(self._starts[k]) - region.start
                for start in range(0, t.num_embeddings, INIT_CHUNK_ROWS):
                    rows = min(INIT_CHUNK_ROWS, t.num_embeddings - start)
                    chunk = torch.empty(rows, t.embedding_dim)
                    if init is None:
                        init_table_rows(
                            chunk, t.name, seed, table_rows=t.num_embeddings, row_start=start
                        )
                    else:
                        init(k, chunk, start)
                    weights[row + start : row + start + rows] = chunk.numpy()
                    pages.drop(weights, row + start, row + start + rows - 1)
        memmap.flush()

    def _open(self) -> np.memmap:
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no tiered embedding file to resume from")
        with self.path.open("rb") as f:
            raw = f.read(HEADER_BYTES)
        try:
            header = json.loads(raw.decode().rstrip())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path}: not a tiered embedding file ({e})") from None
        if not isinstance(header, dict) or header.get("magic") != MAGIC:
            raise ValueError(f"{self.path}: not a tiered embedding file (no {MAGIC} header)")
        wanted = self._header()
        for key in ("format", "tables", "optimizer"):
            if header.get(key) != wanted[key]:
                raise ValueError(
                    f"{self.path}: header field {key!r} is {header.get(key)!r}, but this bag "
                    f"needs {wanted[key]!r}"
                )
        size, expected = self.path.stat().st_size, self._file_bytes()
        if size != expected:
            raise ValueError(
                f"{self.path}: {size} bytes, but the layout in its header needs {expected} "
                "(truncated or damaged)"
            )
        self.step = int(header["step"])
        # A file written sparse (before files were reserved, or copied) gets its holes'
        # blocks now: writing into a hole of a full disk would be a SIGBUS.
        with self.path.open("r+b") as f:
            _reserve(f.fileno(), self.path, size, new=False)
        return np.memmap(self.path, np.float32, "r+", offset=HEADER_BYTES)

    def flush(self) -> None:
        """Write every updated row and its state, and the step count, to the file."""
        self._jobs.wait()
        self._stats.writebacks += self._cache.write_dirty()
        self._memmap.flush()
        self._write_header()

    def close(self) -> None:
        """Flush, stop the prefetch thread and unmap the file; the bag is unusable after."""
        self.flush()
        self._jobs.shutdown()
        del self._memmap, self._cache

    def discard(self) -> None:
        """Stop the prefetch thread and delete the file, unflushed: for a bag whose job
        cannot start (another rank's file found no room). The bag is unusable after."""
        self._jobs.shutdown()
        del self._memmap, self._cache, self._pages
        self.path.unlink(missing_ok=True)

    # -- what the in-memory bag offers ----------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tables]

    @property
    def output_dim(self) -> int:
        return sum(t.embedding_dim for t in self.tables)

    @property
    def cache_rows(self) -> int:
        return self._cache.capacity

    @property
    def stats(self) -> CacheStats:
        """A copy of the counters."""
        return CacheStats(**asdict(self._stats))

    def reset_stats(self) -> None:
        self._stats = CacheStats()

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next updates (a scheduler calls this each step)."""
        if not lr >= 0:
            raise ValueError(f"TieredEmbeddingBag: learning rate must be >= 0, got {lr}")
        self.lr = float(lr)

    def table(self, name: str) -> torch.Tensor:
        """A copy of one table's ``[num_embeddings, dim]`` rows as they are now."""
        return self._read_table(name, lambda dim: slice(0, dim))

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """Copies of one table's optimizer state, keyed and shaped as the TBE's ``state``."""
        dim = self.tables[self.names.index(name)].embedding_dim
        widths = self.optimizer.record_widths(dim)
        copies = {}
        for k, part in enumerate(self.optimizer.state_parts, start=1):
            start = sum(widths[:k])
            columns = slice(start, start + widths[k])
            values = self._read_table(name, lambda _dim, c=columns: c)
            copies[part.name] = values[:, 0] if part.per_row else values
        return copies

    def file_views(
        self, name: str, rows: tuple[int, int] | None = None, *, flush: bool = True
    ) -> dict[str, torch.Tensor]:
        """One table's rows (``"weight"``) and optimizer state (keyed as ``state(name)``) as
        views of the file (``rows``: only the table's rows ``[first, end)``), after a
        ``flush``: a checkpoint saves from them and loads into them without a copy of a
        table that may not fit in memory. Each view is contiguous and is the whole of its
        storage, so ``torch.distributed.checkpoint`` writes it as it is. Reading or writing
        them maps pages of the file: ``drop_pages`` unmaps them again. After writing into
        them, call ``reload``; training on before that would use stale cached rows."""
        if flush:
            self.flush()
        k = self.names.index(name)
        first, end = rows if rows is not None else (0, self.tables[k].num_embeddings)
        start = int(self._starts[k])
        region = next(r for r in self._cache.regions if r.start <= start < r.end)
        lo, hi = start - region.start + first, start - region.start + end
        parts = [torch.from_numpy(part[lo:hi]) for part in region.parts]
        views = {"weight": parts[0]}
        for part, view in zip(self.optimizer.state_parts, parts[1:], strict=True):
            views[part.name] = view.view(-1) if part.per_row else view
        return views

    def drop_pages(self) -> None:
        """Unmap every page of the file this process has mapped (the data stays in the page
        cache and the file): after a checkpoint item read or wrote ``file_views``."""
        self._pages.drop_all()

    def reload(self) -> None:
        """Forget every cached row and pending prefetch, so that the next batches read the
        file (written through ``file_views``, e.g. by a checkpoint load). The cache must
        hold no update the file lacks: ``file_views`` flushed it."""
        self._jobs.wait()
        if bool(self._cache.dirty.any()):
            raise RuntimeError(f"{self.path}: reload would drop rows updated since the last flush")
        self._memmap.flush()
        self._pages.drop_all()
        self._cache.clear()
        self._prefetched.clear()
        self._in_flight = None

    def _read_table(self, name: str, columns: Callable[[int], slice]) -> torch.Tensor:
        """Record columns ``columns(dim)`` of every row of one table, as they are now."""
        k = self.names.index(name)
        self._jobs.wait()
        start, end = int(self._starts[k]), int(self._starts[k + 1])
        return self._cache.read_range(start, end, columns(self.tables[k].embedding_dim))

    # -- batches --------------------------------------------------------------------------

    def _distinct_rows(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's distinct global rows (each ID plus its table's first row), sorted,
        and each ID's index among them, shaped as the IDs (one-hot: ``[B, n_keys]``, with
        -1 for an empty bag). Out-of-range IDs fail, naming the feature."""
        if kjt.keys != self.names:
            raise ValueError(f"batch keys {kjt.keys} differ from the tables {self.names}")
        rows = kjt.one_hot_rows
        if rows is not None:
            rows = rows.long()
            bad = (rows < -1) | (rows >= self._sizes)
            if bool(bad.any()):
                sample, key = (int(i) for i in bad.nonzero()[0])
                raise IndexError(
                    f"feature {self.names[key]!r}: ID {int(rows[sample, key])} of sample "
                    f"{sample} is outside its table's [0, {int(self._sizes[key])}) rows"
                )
            absent = rows < 0
            ids = (rows + self._starts[:-1]).masked_fill_(absent, -1)
            unique, inverse = torch.unique(ids, return_inverse=True)
            if bool(absent.any()):  # -1 sorted first: drop it, and empty bags index -1
                unique, inverse = unique[1:], inverse.sub_(1)
            return unique, inverse
        per_key = torch.tensor(kjt.length_per_key(), dtype=torch.int64)
        n = kjt.values.numel()
        bad = (kjt.values < 0) | (
            kjt.values >= self._sizes.repeat_interleave(per_key, output_size=n)
        )
        if bool(bad.any()):
            position = int(bad.nonzero()[0, 0])
            key = int(torch.searchsorted(per_key.cumsum(0), position, right=True))
            raise IndexError(
                f"feature {self.names[key]!r}: ID {int(kjt.values[position])} is outside its "
                f"table's [0, {int(self._sizes[key])}) rows"
            )
        ids = kjt.values + self._starts[:-1].repeat_interleave(per_key, output_size=n)
        return torch.unique(ids, return_inverse=True)

    def _place(self, rows: torch.Tensor, *, partial: bool) -> tuple[torch.Tensor, _Transfer, int]:
        """Make ``rows`` resident (``partial``: as many as fit). Returns their slots (-1:
        left on disk), the I/O to run, and how many were already cached."""
        self._tick += 1
        slots = self._cache.lookup(rows, self._tick)
        hits = int((slots >= 0).sum())
        need = rows.numel() - hits
        if (
            not partial
            and need > self._cache.never_used
            and need > self._cache.available(self._tick)
        ):
            # A forward takes precedence over batches prefetched after it: drop their pins.
            self._release_prefetched(len(self._prefetched))
            free = self._cache.available(self._tick)
            if need > free:
                pinned = int((self._cache.pins > 0).sum())
                raise CacheTooSmall(
                    f"{self.path}: a batch needs {rows.numel()} distinct rows in memory at "
                    f"once but the cache holds {self._cache.capacity}"
                    + (f" ({pinned} of them pinned by another batch)" if pinned else ""),
                    rows=rows.numel(),
                    free=free + hits,
                    slot_bytes=4 * self._cache.records.shape[1] + SLOT_BOOKKEEPING_BYTES,
                )
        transfer, evicted = self._cache.place(rows, slots, self._tick)
        self._stats.evictions += evicted
        self._stats.writebacks += transfer.write_rows.numel()
        return slots, transfer, hits

    def _release_prefetched(self, count: int) -> None:
        """Unpin the first ``count`` prefetched batches."""
        for record in self._prefetched[:count]:
            self._cache.pin(record.slots[record.slots >= 0], -1)
        del self._prefetched[:count]

    @torch.no_grad()
    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        """Start reading the rows of a batch whose forward comes later (the next one).

        They stay pinned in the cache until that batch's forward; rows that find no
        unpinned slot are left for the forward to read (``stats.prefetch_skipped``).
        """
        unique, inverse = self._distinct_rows(kjt)
        slots, transfer, _ = self._place(unique, partial=True)
        if not transfer.empty:
            self._cache.ready.index_fill_(
                0, transfer.read_slots, self._jobs.submit(self._cache, transfer)
            )
        self._cache.pin(slots[slots >= 0], 1)
        self._stats.prefetched += transfer.read_rows.numel()
        self._stats.prefetch_skipped += int((slots < 0).sum())
        self._prefetched.append(_Prefetched(kjt, slots, unique, inverse))

    def _consume_prefetched(self, kjt: KeyedJaggedTensor) -> _Prefetched | None:
        """The prefetch of ``kjt``, unpinned with those of the batches prefetched before it
        (never looked up); None, unpinning nothing, when ``kjt`` was not prefetched."""
        for i, record in enumerate(self._prefetched):
            if record.kjt is kjt:
                self._release_prefetched(i + 1)
                return record
        return None

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """Pooled embeddings ``[B, sum of dims]``, each table's columns in config order."""
        prefetched = self._consume_prefetched(kjt)
        if prefetched is None:
            unique, inverse = self._distinct_rows(kjt)
        else:
            unique, inverse = prefetched.unique, prefetched.inverse
        training = self.training and torch.is_grad_enabled()
        if training and self._in_flight is not None:
            # Its backward never ran (and will be refused): its rows need no pin.
            self._in_flight.superseded = True
            self._cache.pin(self._in_flight.slots, -1)
            self._in_flight = None
        with torch.no_grad():
            slots, transfer, hits = self._place(unique, partial=False)
            self._stats.lookups += unique.numel()
            self._stats.hits += hits
            if transfer.empty:
                # Only the jobs filling this batch's slots (its prefetch) must be done.
                ready = self._cache.ready.index_select(0, slots)
                self._jobs.wait(int(ready.max()) if ready.numel() else 0)
            else:
                # Queued write-backs may hold rows this reads: all jobs first.
                self._jobs.wait()
                self._cache.run(transfer)
            ws, ws_kjt, ws_rows = self._working_set(kjt, unique, inverse, slots)
        ws.train(self.training)
        hook = self.square_sum_hook
        if hook is not None:
            ws.square_sum_hook = lambda g, rows, sums: hook(ws, g, rows, sums)
        if training:
            in_flight = _InFlight(slots, ws_rows)
            self._cache.pin(slots, 1)
            ws.on_update = lambda updated: self._write_back(in_flight, updated)
            self._in_flight = in_flight
        return ws(ws_kjt)

    def _working_set(
        self,
        kjt: KeyedJaggedTensor,
        unique: torch.Tensor,
        inverse: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[_WorkingSet, KeyedJaggedTensor, list[torch.Tensor]]:
        """A TBE whose table ``k`` holds the batch's distinct rows of table ``k`` in order
        (at least one row: an unused one is never read), filled from the cache; the batch
        renumbered into it; and per group, the working-set row of each distinct row."""
        bounds = torch.searchsorted(unique, self._starts)  # each table's first distinct row
        counts = bounds.diff()
        ws_sizes = counts.clamp(min=1)
        ws = _WorkingSet(
            [
                EmbeddingTable(t.name, n, t.embedding_dim, t.pooling)
                for t, n in zip(self.tables, ws_sizes.tolist(), strict=True)
            ],
            self.optimizer,
            self.kernels,
        )
        ws.lr = self.lr
        if self.optimizer.step_key is not None:
            ws.step.fill_(self.step)
        ws_starts = torch.zeros_like(self._starts)
        torch.cumsum(ws_sizes, 0, out=ws_starts[1:])
        table_of = torch.repeat_interleave(torch.arange(len(self.tables)), counts)
        ws_row = torch.arange(unique.numel()) + (ws_starts - bounds)[:-1].index_select(0, table_of)
        records = self._cache.records.index_select(0, slots)
        ws_rows = []
        for g, (first, end) in enumerate(self._group_keys):
            part = slice(int(bounds[first]), int(bounds[end]))
            local = ws_row[part] - ws.groups[g].first_row
            column = 0
            for view in ws.record_views(g):
                view.index_copy_(0, local, records[part, column : column + view.shape[1]])
                column += view.shape[1]
            ws_rows.append(local)
        rows = kjt.one_hot_rows
        if rows is not None:
            ws_ids = (inverse - bounds[:-1]).masked_fill_(rows < 0, -1)
            return ws, KeyedJaggedTensor.from_one_hot(kjt.keys, ws_ids), ws_rows
        per_key = torch.tensor(kjt.length_per_key(), dtype=torch.int64)
        ws_ids = inverse - bounds[:-1].repeat_interleave(per_key, output_size=inverse.numel())
        return ws, KeyedJaggedTensor(kjt.keys, ws_ids, kjt.lengths, kjt.weights), ws_rows

    @torch.no_grad()
    def _write_back(self, in_flight: _InFlight, ws: _WorkingSet) -> None:
        """After the working set's fused update: its rows and state back into the cache."""
        if in_flight.superseded:
            raise RuntimeError(
                f"{self.path}: backward of a forward that a later forward superseded; a "
                "tiered bag applies each batch's update before the next batch's forward"
            )
        records = torch.zeros(in_flight.slots.numel(), self._cache.records.shape[1])
        row = 0
        for g, local in enumerate(in_flight.ws_rows):
            column = 0
            for view in ws.record_views(g):
                width = view.shape[1]
                records[row : row + local.numel(), column : column + width] = view.index_select(
                    0, local
                )
                column += width
            row += local.numel()
        self._cache.records.index_copy_(0, in_flight.slots, records)
        self._cache.dirty.index_fill_(0, in_flight.slots, True)
        self._cache.pin(in_flight.slots, -1)
        if self.optimizer.step_key is not None:
            self.step = int(ws.step)
        self._in_flight = None

    def extra_repr(self) -> str:
        return f"path={str(self.path)!r}, tables={len(self.tables)}, cache_rows={self.cache_rows}"

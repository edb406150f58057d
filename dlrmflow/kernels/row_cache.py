"""The cache of a tiered embedding bag: ``capacity`` rows of its file in memory, each with
its optimizer state as one record, least recently used first out, with pins; and the
background thread that runs its reads and write-backs in submission order.

Memory: the cached records plus a row-to-slot map of 4 bytes per stored row (a direct map:
one vectorized gather per batch instead of a hash table). One LRU serves every table; a
slot is as wide as the widest record, so tables of smaller dims waste the difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from dlrmflow.errors import DlrmflowError
from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.kernels.row_file import Pages, Region, record_width
from dlrmflow.sparse import EmbeddingTable

__all__ = [
    "ROW_MAP_BYTES",
    "SLOT_BOOKKEEPING_BYTES",
    "CacheStats",
    "CacheTooSmall",
    "RowCache",
    "Transfer",
    "TransferJobs",
    "cache_rows_for",
]

NEVER_USED = -1
UNUSABLE = torch.iinfo(torch.int64).max
# Memory a cache needs besides its records: per slot its row, last use, pending job (8
# bytes each), pin count (4) and dirty flag (1). Outside the cache's memory: per row in the
# file, its slot (4 bytes, the row map).
SLOT_BOOKKEEPING_BYTES = 29
ROW_MAP_BYTES = 4


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


@dataclass
class Transfer:
    """The disk I/O of one placement: write the evicted dirty rows, then read the new ones."""

    write_rows: torch.Tensor
    write_slots: torch.Tensor
    read_rows: torch.Tensor
    read_slots: torch.Tensor

    @property
    def empty(self) -> bool:
        return not (self.write_rows.numel() or self.read_rows.numel())


class RowCache:
    """``capacity`` slots in memory over the rows of ``regions``, LRU, with pins.

    A slot holds one row's record (weights then optimizer state). Every placement advances
    a tick; a slot used at the current tick or pinned (by a prefetched batch not yet looked
    up, or by a batch between forward and backward) is never evicted. Only the calling
    thread changes the bookkeeping; ``run`` (the data) may run in another.
    """

    def __init__(self, regions: list[Region], capacity: int, pages: Pages) -> None:
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

    def place(self, rows: torch.Tensor, slots: torch.Tensor, tick: int) -> tuple[Transfer, int]:
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
        return Transfer(old_rows[dirty], victims[dirty], new_rows, victims), evicted.numel()

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

    def run(self, transfer: Transfer) -> None:
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
class TransferJobs:
    """Background transfers, run one at a time in submission order."""

    executor: ThreadPoolExecutor | None = None
    pending: list[tuple[int, Future]] = field(default_factory=list)
    last: int = 0

    def submit(self, cache: RowCache, transfer: Transfer) -> int:
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


def cache_rows_for(
    memory_bytes: int, tables: Sequence[EmbeddingTable], optimizer: EmbeddingOptimizer
) -> int:
    """The cache slots that ``memory_bytes`` holds for a bag of ``tables``: the records
    (each slot as wide as the widest) and the slots' bookkeeping. The row map
    (``ROW_MAP_BYTES`` per row in the file) is not counted: it follows the tables, not
    the cache. Below 1: the memory cannot hold a cache at all."""
    slot = 4 * max(record_width(optimizer, t.embedding_dim) for t in tables)
    return memory_bytes // (slot + SLOT_BOOKKEEPING_BYTES)

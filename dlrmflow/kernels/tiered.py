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

The file (``row_file``: its layout, its reserved blocks, bounded resident pages) and the
cache (``row_cache``: records, LRU, pins, background transfers) are the bag's storage;
this module is the bag over them: batches made resident and looked up, updated rows handed
back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dlrmflow.kernels.bag import EmbeddingBagBase
from dlrmflow.kernels.optimizers import EmbeddingOptimizer, StatePart
from dlrmflow.kernels.row_cache import (
    SLOT_BOOKKEEPING_BYTES,
    CacheStats,
    CacheTooSmall,
    RowCache,
    Transfer,
    TransferJobs,
)
from dlrmflow.kernels.row_file import FILE_SUFFIX, RowFile
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.sparse import EmbeddingTable, KeyedJaggedTensor

__all__ = ["TieredEmbeddingBag"]

# A square-sum hook (see ``TableBatchedEmbeddingBag``) told which bag it runs in: the
# working set, whose group-local rows the hook receives.
WorkingSetHook = Callable[[TableBatchedEmbeddingBag, int, torch.Tensor, torch.Tensor], torch.Tensor]


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


class TieredEmbeddingBag(EmbeddingBagBase):
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
        super().__init__(tables, optimizer, kernels)
        if "://" in str(directory):
            raise ValueError(f"{directory}: tiered embeddings need a local directory to mmap")
        if cache_rows < 1:
            raise ValueError(f"cache_rows must be >= 1, got {cache_rows}")
        # The groups (runs of same-dim tables) of a one-row TBE of the same tables are the
        # file's regions.
        layout = _WorkingSet(
            [EmbeddingTable(t.name, 1, t.embedding_dim, t.pooling) for t in tables],
            optimizer,
            kernels,
        )
        self.path = Path(directory) / f"{name}{FILE_SUFFIX}"
        self._sizes = torch.tensor([t.num_embeddings for t in self.tables])
        self._group_keys = [(g.first_key, g.end_key) for g in layout.groups]
        self.file = RowFile(
            self.path,
            self.tables,
            optimizer,
            self._group_keys,
            resume=resume,
            seed=seed,
            init=init,
            fill=fill,
        )
        self._starts = self.file.starts
        total_rows = int(self._starts[-1])
        self._cache = RowCache(self.file.regions, min(cache_rows, total_rows), self.file.pages)
        self._stats = CacheStats()
        self._tick = 0
        self._jobs = TransferJobs()
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

    def flush(self) -> None:
        """Write every updated row and its state, and the step count, to the file."""
        self._jobs.wait()
        self._stats.writebacks += self._cache.write_dirty()
        self.file.flush()

    def close(self) -> None:
        """Flush, stop the prefetch thread and unmap the file; the bag is unusable after."""
        self.flush()
        self._jobs.shutdown()
        del self.file, self._cache

    def discard(self) -> None:
        """Stop the prefetch thread and delete the file, unflushed: for a bag whose job
        cannot start (another rank's file found no room). The bag is unusable after."""
        self._jobs.shutdown()
        del self._cache
        self.file.discard()

    @property
    def step(self) -> int:
        """The optimizer's global step count (``step_key``), as the TBE keeps it; kept in
        the file's header."""
        return self.file.step

    @step.setter
    def step(self, value: int) -> None:
        self.file.step = int(value)

    # -- what the in-memory bag offers ----------------------------------------------------

    @property
    def cache_rows(self) -> int:
        return self._cache.capacity

    @property
    def stats(self) -> CacheStats:
        """A copy of the counters."""
        return CacheStats(**asdict(self._stats))

    def reset_stats(self) -> None:
        self._stats = CacheStats()

    def _table_part(self, k: int, part: StatePart | None) -> torch.Tensor:
        """A copy of one record part of every row of table ``k``, as it is now: from the
        cache where a row is cached, else from the file."""
        widths = self.optimizer.record_widths(self.tables[k].embedding_dim)
        index = 0 if part is None else 1 + self.optimizer.state_parts.index(part)
        start = sum(widths[:index])
        self._jobs.wait()
        first, end = int(self._starts[k]), int(self._starts[k + 1])
        values = self._cache.read_range(first, end, slice(start, start + widths[index]))
        return values[:, 0] if part is not None and part.per_row else values

    def checkpoint_views(
        self, name: str, rows: tuple[int, int] | None = None
    ) -> dict[str, torch.Tensor]:
        """Views of the file, not copies (see ``EmbeddingBagBase.checkpoint_views``): a
        checkpoint saves a table that may not fit in memory without holding it there.
        Reading or writing them maps pages of the file: ``drop_pages`` unmaps them again.
        After writing into them, call ``reload``; training on before that would use stale
        cached rows."""
        k = self.names.index(name)
        first, end = rows if rows is not None else (0, self.tables[k].num_embeddings)
        return self.file.views(k, first, end)

    def _after_rows_written(self) -> None:
        # Written into the file (flushed first): the cached copies are stale now.
        self.reload()
        self.drop_pages()

    def drop_pages(self) -> None:
        """Unmap every page of the file this process has mapped (the data stays in the page
        cache and the file): after a checkpoint item read or wrote ``checkpoint_views``."""
        self.file.pages.drop_all()

    def reload(self) -> None:
        """Forget every cached row and pending prefetch, so that the next batches read the
        file (written through ``checkpoint_views``, e.g. by a checkpoint load). The cache must
        hold no update the file lacks: a checkpoint flushed it first."""
        self._jobs.wait()
        if bool(self._cache.dirty.any()):
            raise RuntimeError(f"{self.path}: reload would drop rows updated since the last flush")
        self.file.memmap.flush()
        self.file.pages.drop_all()
        self._cache.clear()
        self._prefetched.clear()
        self._in_flight = None

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

    def _place(self, rows: torch.Tensor, *, partial: bool) -> tuple[torch.Tensor, Transfer, int]:
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

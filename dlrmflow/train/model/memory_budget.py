"""Where a run keeps embedding rows on disk under ``train.embedding_memory_bytes``.

Training keeps them in ``RUN_DIR/embeddings/``: one file per rank of a job
(``rank{r}/``, the shards its plan puts on disk) or one for a single process (every table,
once they exceed the budget). Evaluation and other readers of a checkpoint keep to the
same budget in a scratch directory of their own (``eval-rank{r}/``), never the training's
files, with rows left unwritten until the checkpoint's load fills them.

Before any of it is allocated, ``check_memory`` compares what the embeddings will take
in memory on this host (every rank of the job on it together) with what the host has
(``dlrmflow.memory.available_memory``): a model too large fails at once, in one line
naming ``train.embedding_memory_bytes``, instead of in the allocator (a traceback) or the
OOM killer (a dead process). In memory, a table takes its rows and optimizer state; on
disk, a cache within the budget and ``ROW_MAP_BYTES`` per row (the cache's row map).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from dlrmflow.config import RunConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.kernels.row_cache import ROW_MAP_BYTES, SLOT_BOOKKEEPING_BYTES, cache_rows_for
from dlrmflow.kernels.row_file import FILE_SUFFIX, record_width
from dlrmflow.memory import Available, available_memory, format_bytes
from dlrmflow.train.model.dlrm import embedding_optimizer
from dlrmflow.train.model.dynamic_ids import rows_budget
from dlrmflow.train.model.embeddings import TieredEmbeddings
from dlrmflow.train.model.plan import ShardingPlan
from dlrmflow.train.model.sharded.tiers import TierBudgetError, TierStorage
from dlrmflow.train.model.shared_tables import share_tables

TIERED_DIR = "embeddings"


def tier_storage(
    config: RunConfig, spec: FeatureSpec, rank: int, world_size: int, run_dir: Path
) -> TierStorage | None:
    """Where this rank of a job keeps its shards on disk (``RUN_DIR/embeddings/rank{r}/``)
    and its memory budget, ``train.embedding_memory_bytes`` less ``spec``'s dynamic
    tables' maps (``rows_budget``); None without a budget.

    Each rank's file starts afresh from the seed's rows, as in one process; rank 0 also
    removes the files of ranks this job does not have (an earlier run at another world
    size) and the one-process file.
    """
    budget = rows_budget(config.train.embedding_memory_bytes, spec)
    if budget is None:
        return None
    root = run_dir / TIERED_DIR
    directory = root / f"rank{rank}"
    (directory / f"embeddings{FILE_SUFFIX}").unlink(missing_ok=True)
    if rank == 0:
        (root / f"embeddings{FILE_SUFFIX}").unlink(missing_ok=True)
        for other in root.glob("rank*"):
            number = other.name.removeprefix("rank")
            if number.isdigit() and int(number) >= world_size:
                shutil.rmtree(other, ignore_errors=True)
    return TierStorage(directory, budget)


def scratch_directory(run_dir: Path, rank: int) -> Path:
    """Where a reader of the run's checkpoints (evaluation) keeps rows on disk."""
    return Path(run_dir) / TIERED_DIR / f"eval-rank{rank}"


def scratch_tier_storage(
    config: RunConfig, spec: FeatureSpec, rank: int, run_dir: Path
) -> TierStorage | None:
    """A job's ``tier_storage`` for reading a checkpoint: in ``scratch_directory``,
    unfilled (the load writes every row); None without a budget."""
    budget = rows_budget(config.train.embedding_memory_bytes, spec)
    if budget is None:
        return None
    directory = scratch_directory(run_dir, rank)
    shutil.rmtree(directory, ignore_errors=True)
    return TierStorage(directory, budget, fill=False)


def tiered_embeddings(
    config: RunConfig,
    spec: FeatureSpec,
    optimizer: EmbeddingOptimizer,
    directory: Path,
    *,
    fill: bool = True,
) -> TieredEmbeddings | None:
    """One process's embeddings on disk in ``directory`` behind a cache of hot rows, when
    their rows and optimizer state exceed ``train.embedding_memory_bytes`` (the cache gets
    that memory); else None.

    The file starts afresh from the seed's rows (``fill=False``: zeros, for a checkpoint's
    load to fill); a resumed run then writes the checkpoint's rows into it, so only the
    checkpoint, never a half-written file, decides the weights.

    Either way the memory it takes (the tables, or the cache and the row map) is checked
    first against what the host has (``check_memory``), before anything is allocated; a
    budget too small for one row of cache is a ``TierBudgetError`` naming it.
    """
    check_memory(config, spec, alone=True)
    budget = rows_budget(config.train.embedding_memory_bytes, spec)
    if budget is None or _table_bytes(spec.tables, optimizer) <= budget:
        return None
    rows = cache_rows_for(budget, spec.tables, optimizer)
    if rows < 1:
        raise TierBudgetError(
            f"train.embedding_memory_bytes: {budget} bytes hold no row of the cache of the "
            f"tables on disk ({_slot_bytes(spec.tables, optimizer)} bytes a row, its "
            "tracking included); raise it"
        )
    (Path(directory) / f"embeddings{FILE_SUFFIX}").unlink(missing_ok=True)
    tiered = TieredEmbeddings(
        spec.tables,
        optimizer,
        directory,
        cache_rows=rows,
        seed=config.train.seed,
        fill=fill,
    )
    return share_tables(tiered, spec)


class MemoryShortage(DlrmflowError):
    """The embeddings a job would allocate exceed the memory its host has left."""


def check_memory(
    config: RunConfig,
    spec: FeatureSpec,
    plan: ShardingPlan | None = None,
    *,
    ranks_per_host: int | None = None,
    available: Available | None = None,
    alone: bool = False,
) -> None:
    """Raise ``MemoryShortage`` when the embeddings of this host's ranks would take more
    memory than the host has (``available``, default: ``available_memory()`` now).

    Without ``plan``: one process holding every table (in memory, or on disk past
    ``train.embedding_memory_bytes``), or, in a job, the lower bound of an even share of
    the tables, checked before planning, on hosts of ``ranks_per_host`` ranks (default:
    ``distributed.ranks_per_host``, else all). With it: the plan's shards of each rank of
    this host. In a ``torch.distributed`` job it is a collective (every rank calls it), and
    every rank raises the first rank's shortage; measure ``available`` before any rank
    allocates, since the ranks of a host share its memory. ``alone``: the model of this
    process only, never a collective.
    """
    distributed = not alone and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    if plan is not None:
        world_size, per_host = plan.world_size, plan.ranks_per_host
    else:
        per_host = ranks_per_host or config.distributed.ranks_per_host or world_size
    available = available_memory() if available is None else available
    problem = ""
    if available is not None:
        problem = _shortage(config, spec, plan, available, rank, world_size, per_host)
    if distributed and dist.get_world_size() > 1:
        problems: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), "")
    if problem:
        raise MemoryShortage(problem)


def _table_bytes(tables: Sequence[SparseFeature], optimizer: EmbeddingOptimizer) -> int:
    """Rows and optimizer state of ``tables`` in memory."""
    return 4 * sum(t.num_embeddings * record_width(optimizer, t.embedding_dim) for t in tables)


def _slot_bytes(tables: Sequence[SparseFeature], optimizer: EmbeddingOptimizer) -> int:
    return 4 * max(record_width(optimizer, t.embedding_dim) for t in tables) + (
        SLOT_BOOKKEEPING_BYTES
    )


def _on_disk_bytes(
    budget: int, kept: int, tables: Sequence[SparseFeature], opt: EmbeddingOptimizer
) -> int:
    """Memory of a tiered bag of ``tables``: its cache (what ``budget`` leaves after
    ``kept`` bytes in memory, at most a slot per row) and its row map."""
    rows = sum(t.num_embeddings for t in tables)
    cache = min(max(1, cache_rows_for(budget - kept, tables, opt)), rows)
    return cache * _slot_bytes(tables, opt) + ROW_MAP_BYTES * rows


def _rank_needs(
    config: RunConfig, spec: FeatureSpec, plan: ShardingPlan | None, rank: int, world_size: int
) -> tuple[int, int]:
    """Bytes of memory ``rank``'s embeddings take, and the rows it could put on disk."""
    opt = embedding_optimizer(config.train)
    budget = config.train.embedding_memory_bytes
    if plan is None:
        tables = list(spec.tables)
        total, rows = _table_bytes(tables, opt), sum(t.num_embeddings for t in tables)
        if world_size > 1:  # before planning: an even share, a lower bound of the largest
            return (0 if budget is not None else -(-total // world_size)), rows // world_size
        if budget is None or total <= budget:
            return total, rows
        return _on_disk_bytes(budget, 0, tables, opt), rows
    in_memory, on_disk, movable = [], [], 0
    for table, shard in plan.shards_on(rank):
        local = SparseFeature(table.name, shard.rows, shard.cols)
        if table.sharding != "data_parallel":
            movable += shard.rows
        # As the sharded collection decides: a column-wise table split over ranks goes to
        # disk only when all of its shards do.
        split = table.sharding == "column_wise" and len(table.shards) > 1
        tiers = [s.tier for s in table.shards] if split else [shard.tier]
        disk = budget is not None and table.sharding != "data_parallel"
        (on_disk if disk and all(t != "device" for t in tiers) else in_memory).append(local)
    kept = _table_bytes(in_memory, opt)
    if on_disk and budget is not None:
        return kept + _on_disk_bytes(budget, kept, on_disk, opt), movable
    return kept, movable


def _shortage(
    config: RunConfig,
    spec: FeatureSpec,
    plan: ShardingPlan | None,
    available: Available,
    rank: int,
    world_size: int,
    per_host: int,
) -> str:
    """Why the ranks of ``rank``'s host do not fit in ``available`` (empty: they do)."""
    per_host = max(1, min(per_host, world_size))
    first = rank // per_host * per_host
    ranks = range(first, first + per_host)
    needs = [_rank_needs(config, spec, plan, r, world_size) for r in ranks]
    needed = sum(n for n, _ in needs)
    if needed <= available.bytes:
        return ""
    who = (
        "this process"
        if world_size == 1
        else f"rank {first}"
        if per_host == 1
        else f"ranks {first}-{first + per_host - 1} on this host"
    )
    text = (
        f"the embedding tables need {format_bytes(needed)} of memory in {who}, but this host "
        f"has {format_bytes(available.bytes)} available ({available.source})"
    )
    # Each rank then needs its budget and the row map of the rows it could put on disk.
    row_map = ROW_MAP_BYTES * max(rows for _, rows in needs)
    most = available.bytes // per_host - row_map
    budget = config.train.embedding_memory_bytes
    if most < _slot_bytes(spec.tables, embedding_optimizer(config.train)):
        more = " or spread them over more hosts (distributed.nnodes)" if world_size > 1 else ""
        whose = "the tables'" if world_size == 1 else "a rank's"
        return (
            f"{text}; even on disk, {whose} {row_map // ROW_MAP_BYTES} rows need "
            f"{format_bytes(row_map)} of memory, {ROW_MAP_BYTES} bytes a row: lower "
            f"features.max_rows_per_table{more}"
        )
    if budget is None:
        return (
            f"{text}; set train.embedding_memory_bytes below {most} to keep the rows beyond "
            "it on disk"
        )
    return f"{text}; lower train.embedding_memory_bytes (now {budget}) below {most}"

"""Where a run keeps embedding rows on disk under ``train.embedding_memory_bytes``.

Training keeps them in ``RUN_DIR/embeddings/``: one file per rank of a job
(``rank{r}/``, the shards its plan puts on disk) or one for a single process (every table,
once they exceed the budget). Evaluation and other readers of a checkpoint keep to the
same budget in a scratch directory of their own (``eval-rank{r}/``), never the training's
files, with rows left unwritten until the checkpoint's load fills them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dlrmflow.config import RunConfig
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.kernels.tbe_layout import Optimizer
from dlrmflow.kernels.tiered import FILE_SUFFIX, TieredEmbeddingBag, cache_rows_for, record_width
from dlrmflow.train.sharded import TierStorage

TIERED_DIR = "embeddings"


def tier_storage(
    config: RunConfig, rank: int, world_size: int, run_dir: Path
) -> TierStorage | None:
    """Where this rank of a job keeps its shards on disk (``RUN_DIR/embeddings/rank{r}/``)
    and its memory budget, ``train.embedding_memory_bytes``; None without a budget.

    Each rank's file starts afresh from the seed's rows, as in one process; rank 0 also
    removes the files of ranks this job does not have (an earlier run at another world
    size) and the one-process file.
    """
    budget = config.train.embedding_memory_bytes
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


def scratch_tier_storage(config: RunConfig, rank: int, run_dir: Path) -> TierStorage | None:
    """A job's ``tier_storage`` for reading a checkpoint: in ``scratch_directory``,
    unfilled (the load writes every row); None without a budget."""
    budget = config.train.embedding_memory_bytes
    if budget is None:
        return None
    directory = scratch_directory(run_dir, rank)
    shutil.rmtree(directory, ignore_errors=True)
    return TierStorage(directory, budget, fill=False)


def tiered_embeddings(
    config: RunConfig,
    spec: FeatureSpec,
    optimizer: Optimizer,
    directory: Path,
    *,
    fill: bool = True,
) -> TieredEmbeddingBag | None:
    """One process's embeddings on disk in ``directory`` behind a cache of hot rows, when
    their rows and optimizer state exceed ``train.embedding_memory_bytes`` (the cache gets
    that memory); else None.

    The file starts afresh from the seed's rows (``fill=False``: zeros, for a checkpoint's
    load to fill); a resumed run then writes the checkpoint's rows into it, so only the
    checkpoint, never a half-written file, decides the weights.
    """
    budget = config.train.embedding_memory_bytes
    if budget is None:
        return None
    widths = [record_width(optimizer, f.embedding_dim) for f in spec.sparse]
    needed = 4 * sum(f.num_embeddings * w for f, w in zip(spec.sparse, widths, strict=True))
    if needed <= budget:
        return None
    (Path(directory) / f"embeddings{FILE_SUFFIX}").unlink(missing_ok=True)
    return TieredEmbeddingBag(
        spec.sparse,
        optimizer,
        directory,
        cache_rows=max(1, cache_rows_for(budget, spec.sparse, optimizer)),
        seed=config.train.seed,
        fill=fill,
    )

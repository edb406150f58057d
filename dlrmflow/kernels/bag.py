"""What every table-batched embedding bag offers, whatever holds its rows.

The bag in memory (``tbe.TableBatchedEmbeddingBag``) and the bag over a file on disk
(``tiered.TieredEmbeddingBag``) differ only in where the rows and their optimizer state
live; their lookup and fused update are the TBE's in both (the disk bag runs each batch
in a working set that is itself a TBE). This base is the surface they share, written
once: the tables and their checks, the names and width of the output, the learning rate,
a table's rows and optimizer state by name, each storage saying only how it reads one
part of a table (``_table_part``), and the views a checkpoint saves from and loads into
(``checkpoint_views``, after ``flush``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dlrmflow.kernels import backends, optimizers
from dlrmflow.kernels.optimizers import EmbeddingOptimizer, StatePart
from dlrmflow.sparse import EmbeddingTable

__all__ = ["EmbeddingBagBase", "check_tables", "exact_storage"]


class EmbeddingBagBase(nn.Module):
    """Tables, optimizer and learning rate of a bag; ``table(name)`` and ``state(name)``
    from the storage's ``_table_part``."""

    def __init__(
        self, tables: Sequence[EmbeddingTable], optimizer: EmbeddingOptimizer, kernels: str
    ) -> None:
        super().__init__()
        check_tables(tables, optimizer)
        if kernels not in backends.KERNELS:
            raise ValueError(f"kernels must be one of {backends.KERNELS}, got {kernels!r}")
        self.kernels = kernels
        self.tables = list(tables)
        self.optimizer = optimizer
        self.lr = optimizer.lr

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tables]

    @property
    def output_dim(self) -> int:
        return sum(t.embedding_dim for t in self.tables)

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next updates (a scheduler calls this each step)."""
        if not lr >= 0:
            raise ValueError(f"{type(self).__name__}: learning rate must be >= 0, got {lr}")
        self.lr = float(lr)

    def table(self, name: str) -> torch.Tensor:
        """One table's ``[num_embeddings, dim]`` rows as they are now (a view where the
        rows are in memory, else a copy)."""
        return self._table_part(self.names.index(name), None)

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """One table's optimizer state by part name: ``[num_embeddings]`` per row,
        ``[num_embeddings, dim]`` per element (views or copies, as ``table``)."""
        k = self.names.index(name)
        return {part.name: self._table_part(k, part) for part in self.optimizer.state_parts}

    def flush(self) -> None:
        """Write what only memory holds to where the rows are kept (nothing to do when
        they are kept in memory)."""

    def checkpoint_views(
        self, name: str, rows: tuple[int, int] | None = None
    ) -> dict[str, torch.Tensor]:
        """One table's rows ``[first, end)`` (all by default): its weights (``"weight"``)
        and each optimizer state part (keyed as ``state``), as tensors a checkpoint saves
        from and loads into in place, each the whole of its storage (so that
        ``torch.distributed.checkpoint`` writes it as it is, with no copy). ``flush``
        first; after loading into them, the storage may need to forget cached rows."""
        k = self.names.index(name)
        first, end = rows if rows is not None else (0, self.tables[k].num_embeddings)
        parts = {"weight": self._table_part(k, None)}
        parts.update({p.name: self._table_part(k, p) for p in self.optimizer.state_parts})
        return {key: exact_storage(value[first:end]) for key, value in parts.items()}

    def reset_rows(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Set rows ``rows`` of table ``name`` to ``values`` (``[len(rows), dim]``) and zero
        their optimizer state: a row handed to a new ID (a dynamic table's eviction) must
        carry nothing of the ID it held. Written where the rows are kept, through the
        checkpoint's views; a storage that caches rows forgets them after
        (``_after_rows_written``)."""
        k = self.names.index(name)
        rows = torch.as_tensor(rows, dtype=torch.int64, device="cpu")
        if rows.numel() == 0:
            return
        n, dim = self.tables[k].num_embeddings, self.tables[k].embedding_dim
        if int(rows.min()) < 0 or int(rows.max()) >= n:
            raise IndexError(f"table {name!r}: rows to reset must lie in [0, {n})")
        if tuple(values.shape) != (rows.numel(), dim):
            raise ValueError(f"table {name!r}: {rows.numel()} rows need values [n, {dim}]")
        self.flush()
        views = self.checkpoint_views(name)
        with torch.no_grad():
            views["weight"][rows.to(views["weight"].device)] = values.to(views["weight"])
            for part in self.optimizer.state_parts:
                view = views[part.name]
                view[rows.to(view.device)] = 0
        self._after_rows_written()

    def _after_rows_written(self) -> None:
        """After ``reset_rows`` wrote through ``checkpoint_views``: nothing where the
        views are the rows themselves."""

    def _table_part(self, k: int, part: StatePart | None) -> torch.Tensor:
        """Table ``k``'s weights (``part`` None) or one optimizer state part."""
        raise NotImplementedError


def exact_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (contiguous, on the CPU) as a tensor whose storage is exactly its memory,
    sharing it: DCP copies a tensor whose storage is larger (a slice of a bag's weights)
    before writing it, which would hold a second copy of every in-memory table."""
    if view.device.type != "cpu" or not view.is_contiguous():
        return view
    return torch.from_numpy(view.detach().numpy())


def check_tables(tables: Sequence[EmbeddingTable], optimizer: EmbeddingOptimizer) -> None:
    """Refuse tables and optimizers no bag can hold, naming the table."""
    if not tables:
        raise ValueError("an embedding bag needs at least one table")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    for t in tables:
        if t.num_embeddings <= 0 or t.embedding_dim <= 0:
            raise ValueError(f"table {t.name!r}: num_embeddings and dim must be positive")
        if t.pooling not in ("sum", "mean"):
            raise ValueError(
                f"table {t.name!r}: pooling must be 'sum' or 'mean', not {t.pooling!r}"
            )
    optimizers.checked(optimizer)

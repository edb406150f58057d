"""What every embedding collection of the DLRM offers, and the two that live in one process.

The model's embeddings are one of three collections: every table in memory
(``InMemoryEmbeddings``), every table on disk behind a cache of hot rows
(``TieredEmbeddings``), or the shards a plan gives this rank of a job
(``sharded.ShardedEmbeddingCollection``). They differ in what a lookup
needs first (nothing, the rows read from disk, the input all-to-all), in what lives only
in memory until written (cached rows) and in how their state reaches a checkpoint; the
``EmbeddingCollection`` protocol names those differences once, so the step runner, the
checkpoint and the evaluation call it and never ask which collection they hold.
``parallelize`` (``dlrmflow.train.model.parallelize``) chooses the collection for a run.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from dlrmflow.features.spec import FeatureSpec
from dlrmflow.kernels.bag import EmbeddingBagBase
from dlrmflow.kernels.row_cache import CacheStats
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.kernels.tiered import TieredEmbeddingBag
from dlrmflow.sparse import KeyedJaggedTensor


class StartedInput(Protocol):
    """A batch's input on its way to the lookup (the all-to-all, maybe in flight)."""

    def wait(self) -> Any:
        """What ``EmbeddingCollection.look_up`` takes, once it has arrived."""
        ...


class EmbeddingCollection(Protocol):
    """The embeddings of a DLRM: pooled ``[B, sum of dims]`` per batch, in feature order.

    A training step uses it in this order: ``start_input`` of the batch (and, while the
    step runs, of the next one with ``ahead``), ``look_up`` of what arrived,
    ``prefetch_next`` after the forward; ``flush`` before anything reads the tables' files.
    Calling the module itself (``forward(kjt)``) starts, waits and looks up at once.
    """

    rows_on_disk: bool  # whether rows live on disk (the same answer on every rank of a job)
    begins_ahead: bool  # whether ``start_input(ahead=True)`` begins anything

    def __call__(self, kjt: KeyedJaggedTensor) -> torch.Tensor: ...

    def start_input(self, kjt: KeyedJaggedTensor, *, ahead: bool = False) -> StartedInput | None:
        """Begin what the lookup of ``kjt`` needs. ``ahead``: ``kjt`` is the next step's
        batch, begun while the current step computes; None when nothing of it may begin
        that early (start it again when it is current)."""
        ...

    def look_up(self, received: Any) -> torch.Tensor:
        """The pooled embeddings of a started input's result."""
        ...

    def input_rows(self, received: Any) -> int:
        """The rows this rank computes the step's logits for."""
        ...

    def prefetch_next(self, started: StartedInput | None) -> None:
        """After the current step's forward: begin what of the next batch (its started
        input, None when not started) may overlap the backward."""
        ...

    def flush(self) -> None:
        """Write what is held only in memory (updated rows cached from disk)."""
        ...

    def cache_stats(self) -> CacheStats | None:
        """The cache of the rows on disk (a collective for a job's), None without one."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """The DCP state of the tables and their optimizer, keyed ``<table>.weight``,
        ``<table>.<state>`` (and the optimizer's step count): views that DCP loads in place."""
        ...

    def after_checkpoint_load(self, loaded: dict[str, Any]) -> None:
        """Take up what ``checkpoint_state`` received from a checkpoint's load."""
        ...

    def drop_file_pages(self) -> None:
        """Unmap the pages of the tables' files a checkpoint item touched (so a checkpoint
        keeps one item resident at a time); nothing without files."""
        ...

    def lookup_modules(self) -> list[nn.Module]:
        """The bags that look up this process's rows (for the kernels a run reports)."""
        ...


class ReadyInput:
    """The input of a collection in this process: the batch's IDs, there already."""

    def __init__(self, kjt: KeyedJaggedTensor) -> None:
        self._kjt = kjt

    def wait(self) -> KeyedJaggedTensor:
        return self._kjt


class InMemoryEmbeddings(TableBatchedEmbeddingBag):
    """Every table in this process's memory, in one table-batched bag whose backward
    updates the touched rows itself (no embedding gradient ever exists)."""

    rows_on_disk = False
    begins_ahead = False

    def start_input(self, kjt: KeyedJaggedTensor, *, ahead: bool = False) -> ReadyInput | None:
        return None if ahead else ReadyInput(kjt)

    def look_up(self, received: KeyedJaggedTensor) -> torch.Tensor:
        return self(received)

    def input_rows(self, received: KeyedJaggedTensor) -> int:
        return received.stride

    def prefetch_next(self, started: StartedInput | None) -> None:
        pass

    def cache_stats(self) -> CacheStats | None:
        return None

    def checkpoint_state(self) -> dict[str, Any]:
        state = _tables_state(self)
        if self.optimizer.step_key is not None:
            state[self.optimizer.step_key] = self.step
        return state

    def after_checkpoint_load(self, loaded: dict[str, Any]) -> None:
        pass  # loaded in place, nothing cached

    def drop_file_pages(self) -> None:
        pass

    def lookup_modules(self) -> list[nn.Module]:
        return [self]


class TieredEmbeddings(TieredEmbeddingBag):
    """Every table in a file on disk behind a cache of hot rows
    (``train.embedding_memory_bytes``): the next batch's rows load from disk while the
    current step computes."""

    rows_on_disk = True
    begins_ahead = True

    def start_input(self, kjt: KeyedJaggedTensor, *, ahead: bool = False) -> ReadyInput | None:
        if ahead:
            self.prefetch(kjt)  # its rows load from disk meanwhile
            return None
        return ReadyInput(kjt)

    def look_up(self, received: KeyedJaggedTensor) -> torch.Tensor:
        return self(received)

    def input_rows(self, received: KeyedJaggedTensor) -> int:
        return received.stride

    def prefetch_next(self, started: StartedInput | None) -> None:
        pass  # begun by ``start_input(ahead=True)``, before this step's forward

    def cache_stats(self) -> CacheStats | None:
        return self.stats

    def checkpoint_state(self) -> dict[str, Any]:
        # Views of the file (loaded in place, then ``reload``): never a copy of the tables.
        state = _tables_state(self)
        if self.optimizer.step_key is not None:
            state[self.optimizer.step_key] = torch.tensor(
                self.step, dtype=torch.int64, device="cpu"
            )
        return state

    def after_checkpoint_load(self, loaded: dict[str, Any]) -> None:
        self.reload()  # loaded in place, into the file: the cached rows are stale now
        key = self.optimizer.step_key
        if key is not None and key in loaded:
            self.step = int(loaded[key])

    def drop_file_pages(self) -> None:
        self.drop_pages()

    def lookup_modules(self) -> list[nn.Module]:
        return [self]


class InFrontOf(nn.Module):
    """A collection in front of another (``inner``) that changes what goes in or comes out
    of a lookup (shared tables' batches, dynamic IDs' rows) and hands everything else on:
    whatever it does not override, attributes included, is ``inner``'s."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.rows_on_disk = inner.rows_on_disk
        self.begins_ahead = inner.begins_ahead

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.inner(kjt)

    def start_input(self, kjt: KeyedJaggedTensor, *, ahead: bool = False) -> StartedInput | None:
        return self.inner.start_input(kjt, ahead=ahead)

    def look_up(self, received: Any) -> torch.Tensor:
        return self.inner.look_up(received)

    def input_rows(self, received: Any) -> int:
        return self.inner.input_rows(received)

    def prefetch_next(self, started: StartedInput | None) -> None:
        self.inner.prefetch_next(started)

    def flush(self) -> None:
        self.inner.flush()

    def cache_stats(self) -> CacheStats | None:
        return self.inner.cache_stats()

    def checkpoint_state(self) -> dict[str, Any]:
        return self.inner.checkpoint_state()

    def after_checkpoint_load(self, loaded: dict[str, Any]) -> None:
        self.inner.after_checkpoint_load(loaded)

    def drop_file_pages(self) -> None:
        self.inner.drop_file_pages()

    def lookup_modules(self) -> list[nn.Module]:
        return self.inner.lookup_modules()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


def behind(embeddings: nn.Module) -> nn.Module:
    """The collection behind every ``InFrontOf`` in front of it: the one that looks up."""
    while isinstance(embeddings, InFrontOf):
        embeddings = embeddings.inner
    return embeddings


class UnplacedEmbeddings(nn.Module):
    """The tables of a DLRM not yet placed anywhere: the plain model's embeddings before
    ``parallelize`` chooses where they live, so that building the model allocates none of
    them (a job's shards or a table on disk never exist whole in memory)."""

    def __init__(self, spec: FeatureSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        raise RuntimeError("the model's embeddings are not placed yet: parallelize it first")


def _tables_state(bag: EmbeddingBagBase) -> dict[str, Any]:
    """Every table's checkpoint views, keyed ``<table>.weight`` and ``<table>.<state>``."""
    bag.flush()
    return {
        f"{name}.{key}": view
        for name in bag.names
        for key, view in bag.checkpoint_views(name).items()
    }

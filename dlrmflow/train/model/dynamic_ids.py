"""Dynamic ID tables on the trainer's side: raw IDs remapped to rows in batch order.

A dynamic table's rows follow its IDs (``kernels.id_map.DynamicIdMap``: admission,
eviction, a default row). The map must see the batches in the order they train, once
each, so it is kept here, in front of the embedding collection, and never in the readers,
whose windows run ahead in several threads (TorchRec's managed-collision modules sit at
the same place). ``DynamicIdEmbeddings`` takes batches whose dynamic features carry raw
IDs (int64; strings hashed to int64 by the reader), maps them (admitting while training,
looking up only while evaluating or scoring), evicts every ``evict_every`` training
batches, resetting the freed rows in the bag (``EmbeddingBagBase.reset_rows``: their birth
values, no optimizer state) before any ID reads them, and hands the rows to the
collection it wraps. Its maps are part of the checkpoint, beside the rows they index.

In a job every rank keeps the whole of each map, and the maps stay identical: a training
batch's raw IDs of the dynamic features are gathered from every rank (two all-gathers on
the maps' own group), and each rank maps every rank's IDs, feature by feature in rank
order, keeping the rows of its own. That order is the one a single process maps the
global batch in (a feature's bags key-major, rank 0's samples first), so the maps, and
the rows freed by each eviction, are those of one process on the same global batches.
The rows themselves are sharded as any table's: each rank resets the part of a freed row
its shard holds (``ShardedEmbeddingCollection.reset_rows``), and the rows follow the
input all-to-all to their shards. A replicated map costs every rank the map's memory and
the global batch's lookups, and needs no routing of raw IDs, no second all-to-all, and
no resharding: a checkpoint's maps are plain tensors that load at any rank count.
Evaluation and scoring look up without admitting, so each rank maps its own batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dlrmflow.features.spec import FeatureSpec
from dlrmflow.kernels.id_map import DynamicIdMap, IdMapStats
from dlrmflow.kernels.tbe import initial_rows
from dlrmflow.schema import SchemaError
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.comms import all_gather_ints
from dlrmflow.train.model.embeddings import InFrontOf, StartedInput, behind

__all__ = ["DynamicIdEmbeddings", "DynamicTable"]

STEP_KEY = "id_maps.step"  # the checkpoint key of the training batches mapped so far


@dataclass(frozen=True)
class DynamicTable:
    """One dynamic table: its name in the bag, the batch keys (features) whose IDs it
    maps, and its map's settings (``DynamicIdMap``)."""

    name: str
    features: tuple[str, ...]
    capacity: int
    dim: int
    admit_after: int = 1
    ttl: int | None = None
    evict_every: int | None = None  # training batches between evictions (None: never)

    def new_map(self) -> DynamicIdMap:
        return DynamicIdMap(self.capacity, admit_after=self.admit_after, ttl=self.ttl)


class DynamicIdEmbeddings(InFrontOf):
    """An ``EmbeddingCollection`` (``inner``) whose dynamic features' raw IDs are mapped
    to rows first; ``bag`` is the one holding the dynamic tables' rows (a bag of this
    process, or a job's sharded collection: anything with ``names`` and ``reset_rows``),
    ``seed`` the one its rows were drawn from (a reset row gets its birth values back).
    ``group``: a job's ranks, whose training batches every map sees (None: one process)."""

    def __init__(
        self,
        inner: nn.Module,
        bag: nn.Module,
        tables: list[DynamicTable],
        *,
        seed: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(inner)
        for t in tables:
            if t.name not in bag.names:
                raise ValueError(f"dynamic table {t.name!r} is not among the bag's {bag.names}")
            if t.evict_every is not None and t.evict_every < 1:
                raise ValueError(f"table {t.name!r}: evict_every must be at least 1 (or None)")
        # The bag holding the dynamic tables' rows, inside ``inner``: kept beside it, not
        # registered again (its parameters and buffers are ``inner``'s).
        object.__setattr__(self, "bag", bag)
        self.dynamic = tables
        self.maps = {t.name: t.new_map() for t in tables}
        self.seed = seed
        self.group = group
        self.begins_ahead = False  # a batch is mapped when it is current, never ahead
        # Training batches mapped so far: the maps' clock (``now``), saved with them.
        self.step = torch.zeros((), dtype=torch.int64, device="cpu")

    # -- the collection's interface -------------------------------------------------------

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.inner(self.remap(kjt))

    def start_input(self, kjt: KeyedJaggedTensor, *, ahead: bool = False) -> StartedInput | None:
        if ahead:
            return None  # mapped when current: the maps see batches in training order
        return self.inner.start_input(self.remap(kjt))

    def checkpoint_state(self) -> dict[str, Any]:
        state = self.inner.checkpoint_state()
        for name, m in self.maps.items():
            for key, array in m.arrays().items():
                state[f"{name}.id_map.{key}"] = torch.from_numpy(array)  # loaded in place
        state[STEP_KEY] = self.step
        return state

    # -- the maps ------------------------------------------------------------------------

    def take_stats(self) -> dict[str, IdMapStats]:
        """Each dynamic table's map counters since the last call, and its size."""
        return {name: m.take_stats() for name, m in self.maps.items()}

    def remap(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with its dynamic features' raw IDs replaced by rows. A training batch
        (module in training mode, autograd on) advances the clock, may first evict, and
        admits; any other only looks up."""
        admit = self.training and torch.is_grad_enabled()
        if admit:
            self.step += 1
            self.evict(due_only=True)
        now = int(self.step)
        if kjt.one_hot_rows is not None:
            # -1 marks an empty bag there, and is a raw ID like any other.
            raise ValueError("dynamic features take jagged batches: raw IDs have no sentinel")
        keys = kjt.keys
        values = kjt.values.clone()
        starts = np.concatenate([[0], np.cumsum(kjt.length_per_key())])
        segments = [
            values[starts[keys.index(f)] : starts[keys.index(f) + 1]]
            for table in self.dynamic
            for f in table.features
        ]
        # Training in a job: every rank's IDs, each feature's by rank, go through the maps.
        everyone = self._gathered(segments) if admit and self.group is not None else None
        at = 0
        for table in self.dynamic:
            m = self.maps[table.name]
            for _ in table.features:
                segment = segments[at]
                if everyone is None:
                    out = m.map(segment.numpy(), now, admit=admit)
                else:
                    rows = [m.map(ids[at], now, admit=True) for ids in everyone]
                    out = rows[dist.get_rank(self.group)]
                segment.copy_(torch.from_numpy(out))
                at += 1
        return KeyedJaggedTensor(keys, values, kjt.lengths, kjt.weights)

    def _gathered(self, segments: list[torch.Tensor]) -> list[list[np.ndarray]]:
        """Every rank's ``segments`` (raw IDs, one per dynamic feature), by rank: the
        lengths first, then the IDs padded to the longest rank's."""
        every_size = all_gather_ints([len(s) for s in segments], self.group)  # [world, n]
        totals = every_size.sum(dim=1)
        mine = torch.zeros(int(totals.max()), dtype=torch.int64, device="cpu")
        rank = dist.get_rank(self.group)
        mine[: int(totals[rank])] = torch.cat(segments) if segments else mine[:0]
        every = [torch.empty_like(mine) for _ in range(len(every_size))]
        dist.all_gather(every, mine, group=self.group)
        return [
            np.split(ids.numpy()[: int(total)], np.cumsum(sizes.numpy())[:-1])
            for ids, sizes, total in zip(every, every_size, totals, strict=True)
        ]

    def evict(self, *, due_only: bool = False) -> None:
        """Evict from every map (``due_only``: those whose ``evict_every`` divides the
        clock), resetting the freed rows before any ID reads them."""
        now = int(self.step)
        for table in self.dynamic:
            if due_only and (table.evict_every is None or now % table.evict_every):
                continue
            freed = self.maps[table.name].evict(now)
            if len(freed):
                rows = torch.from_numpy(freed)
                fresh = initial_rows(
                    table.name, self.seed, rows, table_rows=table.capacity, dim=table.dim
                )
                self.bag.reset_rows(table.name, rows, fresh)


# Steps between a dynamic table's evictions when its schema names none.
EVICT_EVERY = 1000


def map_bytes(spec: FeatureSpec) -> dict[str, int]:
    """The memory each dynamic table's map will hold, by table (``DynamicIdMap.bytes_for``
    of its capacity and admission)."""
    sizes = {}
    for table in spec.tables:
        first = next(f for f in spec.sparse if f.table_name == table.name)
        if first.ids == "dynamic":
            sizes[table.name] = DynamicIdMap.bytes_for(
                table.num_embeddings, admit_after=first.admit_after or 1
            )
    return sizes


def rows_budget(memory_bytes: int | None, spec: FeatureSpec) -> int | None:
    """What ``train.embedding_memory_bytes`` leaves the rows and their cache once the
    dynamic tables' maps (kept in memory, whole on every rank of a job) take theirs; None
    without a budget."""
    return None if memory_bytes is None else memory_bytes - sum(map_bytes(spec).values())


def check_capacity(
    spec: FeatureSpec,
    batch_size: int,
    cardinalities: dict[str, int] | None,
    memory_bytes: int | None = None,
) -> None:
    """Refuse, naming the feature, a dynamic table whose rows cannot hold one batch's IDs:
    ``batch_size`` samples with one ID of each of its features each, or, where the dataset
    knows its columns' distinct IDs (``cardinalities``), those IDs if fewer, and the
    default row. Such a table would send IDs of every batch to the default row. Maps that
    do not fit ``memory_bytes`` (``train.embedding_memory_bytes``: the maps stay in memory,
    the rows' cache gets what they leave) are refused naming the largest."""
    sizes = map_bytes(spec)
    if memory_bytes is not None and sizes and sum(sizes.values()) >= memory_bytes:
        largest = max(sizes, key=lambda name: sizes[name])
        first = next(f for f in spec.sparse if f.table_name == largest)
        raise SchemaError(
            f"sparse feature {first.name}: ids dynamic: its map takes {sizes[largest]} bytes "
            f"({sum(sizes.values())} for every dynamic table), which leaves nothing of "
            f"train.embedding_memory_bytes {memory_bytes} for the rows; raise it or give "
            "the table fewer rows"
        )
    for table in spec.tables:
        features = [f for f in spec.sparse if f.table_name == table.name]
        first = features[0]
        if first.ids != "dynamic":
            continue
        ids = batch_size * len(features)
        why = f"train.batch_size {batch_size} x {len(features)} feature(s)"
        known = [(cardinalities or {}).get(f.name) for f in features]
        if None not in known and sum(known) < ids:  # type: ignore[arg-type]
            ids = sum(known)  # type: ignore[arg-type]
            why = f"the dataset's {ids} distinct IDs"
        needed = ids + 1
        if table.num_embeddings < needed:
            raise SchemaError(
                f"sparse feature {first.name}: ids dynamic with rows {table.num_embeddings} "
                f"cannot hold one batch's IDs ({why}, and the default row); give it rows "
                f">= {needed}"
            )


def with_dynamic_ids(
    embeddings: nn.Module,
    spec: FeatureSpec,
    *,
    seed: int,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """``embeddings`` (one process's, or with ``group`` a job's sharded collection) behind
    the maps of ``spec``'s dynamic tables; itself when it has none. The tables' settings
    are their features' (``ids: dynamic``, or the run's ``features`` defaults)."""
    tables = []
    for table in spec.tables:
        features = [f for f in spec.sparse if f.table_name == table.name]
        first = features[0]
        if first.ids != "dynamic":
            continue
        tables.append(
            DynamicTable(
                table.name,
                tuple(f.name for f in features),
                table.num_embeddings,
                table.embedding_dim,
                admit_after=first.admit_after or 1,
                ttl=first.ttl,
                evict_every=first.evict_every or EVICT_EVERY,
            )
        )
    if not tables:
        return embeddings
    return DynamicIdEmbeddings(embeddings, behind(embeddings), tables, seed=seed, group=group)


def id_map_counts(embeddings: nn.Module, keys: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """``keys`` of each dynamic table's ``IdMapStats`` since they were last taken (then
    reset), by table: what a run or an evaluation reports; {} without dynamic tables."""
    if not isinstance(embeddings, DynamicIdEmbeddings):
        return {}
    return {
        name: {key: getattr(stats, key) for key in keys}
        for name, stats in embeddings.take_stats().items()
    }


def id_map_arrays(embeddings: nn.Module) -> dict[str, dict[str, np.ndarray]]:
    """Each dynamic table's map state by table (``DynamicIdMap.arrays``); {} without."""
    if not isinstance(embeddings, DynamicIdEmbeddings):
        return {}
    return {name: m.arrays() for name, m in embeddings.maps.items()}

"""Dynamic ID tables on the trainer's side: raw IDs remapped to rows in batch order.

A dynamic table's rows follow its IDs (``kernels.id_map.DynamicIdMap``: admission,
eviction, a default row), through a map split into shards by ID
(``kernels.id_map_shards.ShardedIdMap``). The map must see the batches in the order they
train, once each, so it is kept here, in front of the embedding collection, and never in
the readers, whose windows run ahead in several threads (TorchRec's managed-collision
modules sit at the same place). ``DynamicIdEmbeddings`` takes batches whose dynamic
features carry raw IDs (int64; strings hashed to int64 by the reader), maps them
(admitting while training, looking up only while evaluating or scoring), evicts every
``evict_every`` training batches, resetting the freed rows in the bag
(``EmbeddingBagBase.reset_rows``: their birth values, no optimizer state) before any ID
reads them, and hands the rows to the collection it wraps. Its maps are part of the
checkpoint, beside the rows they index.

In a job each rank holds some of the shards of each map (``shard_holders``: the dynamic
tables' shards, counted in table order, are dealt to the ranks in turn), and every raw
ID is routed to the rank holding its shard: an all-to-all of the batch's raw IDs, each
holder mapping what it received feature by feature and, within a feature, in rank order,
then an all-to-all of the rows back. That order is the one a single process maps the
global batch in (a feature's bags key-major, rank 0's samples first), and a shard's
state depends only on the IDs it is given, in order, so the maps, and the rows freed by
each eviction, are those of one process on the same global batches. The rows freed by
the holders are gathered to every rank, and each resets the part of them its shard of
the rows holds (``ShardedEmbeddingCollection.reset_rows``); the rows then follow the
input all-to-all to their shards as any table's. A checkpoint holds each shard of a map
once, under names of its own, so it loads at any rank count: a rank loads the shards it
holds there. Evaluation and scoring route the same way, only looking up.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dlrmflow.features.spec import FeatureSpec
from dlrmflow.kernels.id_map import IdMapStats
from dlrmflow.kernels.id_map_shards import ShardedIdMap
from dlrmflow.kernels.tbe import initial_rows
from dlrmflow.schema import SchemaError
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.comms import all_gather_ints, all_to_all
from dlrmflow.train.model.embeddings import InFrontOf, StartedInput, behind

__all__ = ["DynamicIdEmbeddings", "DynamicTable"]

STEP_KEY = "id_maps.step"  # the checkpoint key of the training batches mapped so far


@dataclass(frozen=True)
class DynamicTable:
    """One dynamic table: its name in the bag, the batch keys (features) whose IDs it
    maps, and its map's settings (``ShardedIdMap``)."""

    name: str
    features: tuple[str, ...]
    capacity: int
    dim: int
    admit_after: int = 1
    ttl: int | None = None
    evict_every: int | None = None  # training batches between evictions (None: never)
    shards: int = 1  # the map's shards (``ShardedIdMap``)

    def new_map(self, owned: list[int] | None = None) -> ShardedIdMap:
        return ShardedIdMap(
            self.capacity, self.shards, owned=owned, admit_after=self.admit_after, ttl=self.ttl
        )


def shard_holders(tables: list[DynamicTable], world: int) -> dict[str, np.ndarray]:
    """The rank of ``world`` holding each shard of each table's map: every table's shards,
    counted in table order, dealt to the ranks in turn (so that tables of one shard each
    still spread over the ranks)."""
    holders, at = {}, 0
    for t in tables:
        holders[t.name] = (at + np.arange(t.shards, dtype=np.int64)) % world
        at += t.shards
    return holders


def held_shards(tables: list[DynamicTable], rank: int, world: int) -> dict[str, list[int]]:
    """The shards of each table's map that ``rank`` of ``world`` holds (``shard_holders``)."""
    return {
        name: np.flatnonzero(holders == rank).tolist()
        for name, holders in shard_holders(tables, world).items()
    }


class DynamicIdEmbeddings(InFrontOf):
    """An ``EmbeddingCollection`` (``inner``) whose dynamic features' raw IDs are mapped
    to rows first; ``bag`` is the one holding the dynamic tables' rows (a bag of this
    process, or a job's sharded collection: anything with ``names`` and ``reset_rows``),
    ``seed`` the one its rows were drawn from (a reset row gets its birth values back).
    ``group``: a job's ranks, each holding its ``held_shards`` of every map (None: one
    process, holding them all)."""

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
        self.group = group
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        held = held_shards(tables, self.rank, self.world)
        self.maps = {t.name: t.new_map(held[t.name]) for t in tables}
        self._holders = shard_holders(tables, self.world)
        self.seed = seed
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
            # The shards this rank holds, each under names of its own (``arrays``).
            for key, array in m.arrays().items():
                state[f"{name}.id_map.{key}"] = torch.from_numpy(array)  # loaded in place
        state[STEP_KEY] = self.step
        return state

    # -- the maps ------------------------------------------------------------------------

    def take_stats(self) -> dict[str, IdMapStats]:
        """Each dynamic table's map counters since the last call, and its size: in a job,
        every rank's shards summed (a collective)."""
        stats = {name: m.take_stats() for name, m in self.maps.items()}
        if self.group is None:
            return stats
        names = sorted(stats)
        keys = [f.name for f in fields(IdMapStats)]
        summed = torch.tensor(
            [[getattr(stats[n], k) for k in keys] for n in names], dtype=torch.int64, device="cpu"
        )
        dist.all_reduce(summed, group=self.group)
        return {
            n: IdMapStats(**dict(zip(keys, row, strict=True)))
            for n, row in zip(names, summed.tolist(), strict=True)
        }

    def remap(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with its dynamic features' raw IDs replaced by rows. A training batch
        (module in training mode, autograd on) advances the clock, may first evict, and
        admits; any other only looks up. In a job every rank calls it for each batch."""
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
        owners = [table for table in self.dynamic for _ in table.features]
        ids = [segment.numpy() for segment in segments]
        if self.group is None:
            rows = [
                self.maps[t.name].map(i, now, admit=admit) for t, i in zip(owners, ids, strict=True)
            ]
        else:
            rows = self._routed(ids, owners, now, admit)
        for segment, out in zip(segments, rows, strict=True):
            segment.copy_(torch.from_numpy(out))
        return KeyedJaggedTensor(keys, values, kjt.lengths, kjt.weights)

    def _routed(
        self, ids: list[np.ndarray], tables: list[DynamicTable], now: int, admit: bool
    ) -> list[np.ndarray]:
        """The rows of ``ids`` (one array a dynamic feature, ``tables`` their tables), each
        ID mapped by the rank holding its shard: the IDs go there (an all-to-all), each
        holder maps a feature's IDs of every rank in rank order, and the rows come back."""
        world, rank = self.world, self.rank
        holder = [
            self._holders[t.name][self.maps[t.name].shard_of(i)]
            for t, i in zip(tables, ids, strict=True)
        ]
        orders = [np.argsort(h, kind="stable") for h in holder]
        # counts[k, d]: the IDs of feature k this rank sends to rank d.
        counts = np.stack([np.bincount(h, minlength=world) for h in holder])
        bounds = np.concatenate([np.zeros((len(ids), 1), np.int64), counts.cumsum(1)], axis=1)
        by_holder = [i[o] for i, o in zip(ids, orders, strict=True)]
        send = [
            torch.from_numpy(np.concatenate([b[bounds[k, d] : bounds[k, d + 1]]
                                             for k, b in enumerate(by_holder)]))
            for d in range(world)
        ]  # fmt: skip
        every = all_gather_ints(counts.reshape(-1).tolist(), self.group).numpy()
        every = every.reshape(world, len(ids), world)  # [source, feature, destination]
        mine = every[:, :, rank]  # what each source sends here, by feature
        received = all_to_all(send, mine.sum(1).tolist(), self.group, kind="input", stats=None)
        pieces = [
            np.split(chunk.numpy(), np.cumsum(mine[src])[:-1])
            for src, chunk in enumerate(received.wait())
        ]
        # Map feature by feature, each feature's IDs in rank order: one process's order.
        back: list[list[np.ndarray]] = [[] for _ in range(world)]
        for k, table in enumerate(tables):
            mapped = self.maps[table.name].map(
                np.concatenate([pieces[src][k] for src in range(world)]), now, admit=admit
            )
            for src, part in enumerate(np.split(mapped, np.cumsum(mine[:, k])[:-1])):
                back[src].append(part)
        returned = all_to_all(
            [torch.from_numpy(np.concatenate(b)) for b in back],
            counts.sum(0).tolist(),
            self.group,
            kind="input",
            stats=None,
        ).wait()
        # From holder d come feature k's rows in the order they were sent.
        answers = [
            np.split(r.numpy(), np.cumsum(counts[:, d])[:-1]) for d, r in enumerate(returned)
        ]
        rows = []
        for k, order in enumerate(orders):
            out = np.empty(len(order), np.int64)
            out[order] = np.concatenate([answers[d][k] for d in range(world)])
            rows.append(out)
        return rows

    def evict(self, *, due_only: bool = False) -> None:
        """Evict from every map (``due_only``: those whose ``evict_every`` divides the
        clock), resetting the freed rows before any ID reads them; in a job, each rank
        evicts from its shards and resets its part of every rank's freed rows."""
        now = int(self.step)
        for table in self.dynamic:
            if due_only and (table.evict_every is None or now % table.evict_every):
                continue
            freed = self.maps[table.name].evict(now)
            if self.group is not None:
                freed = self._gathered(freed)
            if len(freed):
                rows = torch.from_numpy(freed)
                fresh = initial_rows(
                    table.name, self.seed, rows, table_rows=table.capacity, dim=table.dim
                )
                self.bag.reset_rows(table.name, rows, fresh)

    def _gathered(self, rows: np.ndarray) -> np.ndarray:
        """Every rank's ``rows``, ascending: the lengths first, then the rows padded to the
        longest rank's."""
        sizes = all_gather_ints([len(rows)], self.group)[:, 0].tolist()
        mine = torch.zeros(max(sizes), dtype=torch.int64, device="cpu")
        mine[: len(rows)] = torch.from_numpy(rows)
        every = [torch.empty_like(mine) for _ in sizes]
        dist.all_gather(every, mine, group=self.group)
        return np.sort(np.concatenate([e.numpy()[:n] for e, n in zip(every, sizes, strict=True)]))


# Steps between a dynamic table's evictions when its schema names none.
EVICT_EVERY = 1000


def dynamic_tables(spec: FeatureSpec) -> list[DynamicTable]:
    """``spec``'s dynamic tables, in table order, with their features' settings (``ids:
    dynamic``, or the run's ``features`` defaults, resolved into the spec)."""
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
                shards=first.map_shards or 1,
            )
        )
    return tables


def map_bytes(spec: FeatureSpec, world: int = 1) -> dict[str, int]:
    """The memory each dynamic table's map will hold, by table (``ShardedIdMap.bytes_for``
    of its capacity and admission): on the rank of ``world`` holding the most of it."""
    tables = dynamic_tables(spec)
    every = [held_shards(tables, rank, world) for rank in range(world)]
    return {
        t.name: max(
            ShardedIdMap.bytes_for(
                t.capacity, t.shards, admit_after=t.admit_after, owned=held[t.name]
            )
            for held in every
        )
        for t in tables
    }


def rows_budget(memory_bytes: int | None, spec: FeatureSpec, world: int = 1) -> int | None:
    """What ``train.embedding_memory_bytes`` leaves the rows and their cache once the
    dynamic tables' maps (kept in memory; in a job, the shards a rank holds) take theirs;
    None without a budget."""
    return None if memory_bytes is None else memory_bytes - sum(map_bytes(spec, world).values())


def check_capacity(
    spec: FeatureSpec,
    batch_size: int,
    cardinalities: dict[str, int] | None,
    memory_bytes: int | None = None,
    world: int = 1,
) -> None:
    """Refuse, naming the feature, a dynamic table whose rows cannot hold one batch's IDs:
    ``batch_size`` samples with one ID of each of its features each, or, where the dataset
    knows its columns' distinct IDs (``cardinalities``), those IDs if fewer, and the
    default row. Such a table would send IDs of every batch to the default row. Maps that
    do not fit ``memory_bytes`` (``train.embedding_memory_bytes``: the maps stay in memory,
    the rows' cache gets what they leave; in a job of ``world`` ranks, the shards of the
    rank holding most) are refused naming the largest."""
    sizes = map_bytes(spec, world)
    if memory_bytes is not None and sizes and sum(sizes.values()) >= memory_bytes:
        largest = max(sizes, key=lambda name: sizes[name])
        first = next(f for f in spec.sparse if f.table_name == largest)
        where = "" if world == 1 else f" on a rank of {world}"
        raise SchemaError(
            f"sparse feature {first.name}: ids dynamic: its map takes {sizes[largest]} bytes"
            f"{where} ({sum(sizes.values())} for every dynamic table), which leaves nothing of "
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
    the maps of ``spec``'s dynamic tables (``dynamic_tables``); itself when it has none."""
    tables = dynamic_tables(spec)
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
    """Each dynamic table's map state by table (``ShardedIdMap.arrays``); {} without."""
    if not isinstance(embeddings, DynamicIdEmbeddings):
        return {}
    return {name: m.arrays() for name, m in embeddings.maps.items()}

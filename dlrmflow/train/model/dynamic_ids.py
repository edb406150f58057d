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

In this step the collection must keep its rows in this process (in memory or on disk):
a job's input all-to-all would have to route each raw ID to the rank owning it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from dlrmflow.errors import DlrmflowError
from dlrmflow.features.spec import FeatureSpec, dataset_schema
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.kernels.bag import EmbeddingBagBase
from dlrmflow.kernels.id_map import DynamicIdMap, IdMapStats
from dlrmflow.kernels.tbe import initial_rows
from dlrmflow.schema import SchemaError
from dlrmflow.sparse import KeyedJaggedTensor
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
    to rows first; ``bag`` is the one holding the dynamic tables' rows, ``seed`` the one
    its rows were drawn from (a reset row gets its birth values back)."""

    def __init__(
        self,
        inner: nn.Module,
        bag: EmbeddingBagBase,
        tables: list[DynamicTable],
        *,
        seed: int,
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
        for table in self.dynamic:
            for feature in table.features:
                k = keys.index(feature)
                segment = values[starts[k] : starts[k + 1]]
                out = self.maps[table.name].map(segment.numpy(), now, admit=admit)
                segment.copy_(torch.from_numpy(out))
        return KeyedJaggedTensor(keys, values, kjt.lengths, kjt.weights)

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


def with_dynamic_ids(embeddings: nn.Module, spec: FeatureSpec, *, seed: int) -> nn.Module:
    """``embeddings`` (one process's) behind the maps of ``spec``'s dynamic tables; itself
    when it has none. The tables' settings are their features' (``ids: dynamic``, or the
    run's ``features`` defaults)."""
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
    bag = behind(embeddings)
    assert isinstance(bag, EmbeddingBagBase)  # one process's: in memory or on disk
    return DynamicIdEmbeddings(embeddings, bag, tables, seed=seed)


def refuse_dynamic_ids(spec: FeatureSpec, what: str) -> None:
    """Refuse ``what`` (a job, an export: not built for dynamic tables yet) in one line
    naming the first dynamic feature."""
    for f in spec.sparse:
        if f.ids == "dynamic":
            raise _not_built(f.name, what)


def refuse_dynamic_dataset(url: str, default_ids: str, what: str) -> None:
    """``refuse_dynamic_ids`` for the dataset at ``url``'s declared schema (its features
    without ``ids`` take ``default_ids``, the run's ``features.ids``), before any model
    exists; a dataset that cannot be read is left to the run to report."""
    try:
        schema = dataset_schema(read_manifest(url))
    except (DlrmflowError, OSError, ValueError):
        return
    for f in schema.sparse:
        if (schema.table_settings(f.table_name).get("ids") or default_ids) == "dynamic":
            raise _not_built(f.column, what)


def _not_built(feature: str, what: str) -> SchemaError:
    return SchemaError(f"sparse feature {feature}: ids dynamic: {what} is not built yet")


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

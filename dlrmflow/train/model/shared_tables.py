"""Tables shared between features: each feature pooled on its own, from one table's rows.

A schema may let several features look up one table (``table:``; TorchRec's
``feature_names`` of one ``EmbeddingBagConfig``): ``item_id`` and a ``clicked_items`` list
then give an item one vector wherever it appears. Every embedding collection (in memory,
on disk, sharded over a job) pools one bag per key and sample, a key being a table, so a
batch keyed by features is handed to it keyed by tables instead, over a taller batch:
table ``t``'s bags are its first feature's ``B`` bags, then its second's, and so on, ``M``
blocks of ``B`` bags for every table, ``M`` being the most features any table has (a
table with fewer has empty bags in the blocks it lacks). The collection's backward then
sums the gradients of every bag that looked up a row, whichever feature it came from,
before the optimizer updates it once, as one table's update must.

Why a taller batch rather than a feature-to-table map inside every bag: the kernels, the
disk tier, the sharded routing and checkpoints all stay per key, unchanged; the cost is
that every table pools ``M * B`` bags (the empty ones cost a length and a pooled row of
zeros each) and a job sends those rows through its all-to-alls. A model without shared
tables never passes through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dlrmflow.features.spec import FeatureSpec
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.embeddings import InFrontOf, StartedInput

__all__ = ["SharedTableEmbeddings", "TableSharing"]


@dataclass(frozen=True)
class TableSharing:
    """Where each feature's bags go in the table-keyed batch, and its pooled columns back.

    ``table_of[f]`` is feature ``f``'s table (an index into ``tables``), ``slot_of[f]`` its
    block among the table's ``slots`` blocks of bags.
    """

    features: tuple[str, ...]
    tables: tuple[str, ...]
    table_of: tuple[int, ...]
    slot_of: tuple[int, ...]
    table_dims: tuple[int, ...]
    slots: int

    @classmethod
    def of(cls, spec: FeatureSpec) -> TableSharing | None:
        """The sharing of ``spec``'s tables, None when each feature has its own."""
        if not spec.shares_tables:
            return None
        tables = spec.tables
        index = {t.name: k for k, t in enumerate(tables)}
        table_of, slot_of, used = [], [], [0] * len(tables)
        for f in spec.sparse:
            k = index[f.table_name]
            table_of.append(k)
            slot_of.append(used[k])
            used[k] += 1
        return cls(
            features=tuple(spec.sparse_names),
            tables=tuple(t.name for t in tables),
            table_of=tuple(table_of),
            slot_of=tuple(slot_of),
            table_dims=tuple(t.embedding_dim for t in tables),
            slots=max(used),
        )

    def stack(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` (keyed by feature, ``B`` samples) keyed by table over ``slots * B`` bags."""
        if kjt.keys != list(self.features):
            raise ValueError(f"batch keys {kjt.keys} differ from the features {self.features}")
        batch, n_tables = kjt.stride, len(self.tables)
        rows = kjt.one_hot_rows
        device = (rows if rows is not None else kjt.lengths).device
        tables = torch.tensor(self.table_of, device=device)
        slots = torch.tensor(self.slot_of, device=device)
        if rows is not None:
            stacked = rows.new_full((self.slots, batch, n_tables), -1)
            stacked[slots, :, tables] = rows.t()
            return KeyedJaggedTensor.from_one_hot(
                list(self.tables), stacked.view(self.slots * batch, n_tables)
            )
        lengths = kjt.lengths.view(len(self.features), batch)
        stacked_lengths = lengths.new_zeros((n_tables, self.slots, batch))
        stacked_lengths[tables, slots] = lengths
        # Feature segments in (table, slot) order: the key-major values of the stacked keys.
        order = sorted(range(len(self.features)), key=lambda f: (self.table_of[f], self.slot_of[f]))
        per_key = kjt.length_per_key()
        starts = [0]
        for n in per_key:
            starts.append(starts[-1] + n)
        values = torch.cat([kjt.values[starts[f] : starts[f + 1]] for f in order])
        weights = None
        if kjt.weights is not None:
            weights = torch.cat([kjt.weights[starts[f] : starts[f + 1]] for f in order])
        return KeyedJaggedTensor(list(self.tables), values, stacked_lengths.view(-1), weights)

    def unstack(self, pooled: torch.Tensor) -> torch.Tensor:
        """The table-keyed lookup's ``[slots * B, sum of table dims]`` as ``[B, sum of
        feature dims]``, each feature's columns in feature order."""
        width = sum(self.table_dims)
        batch = pooled.shape[0] // self.slots
        by_sample = pooled.view(self.slots, batch, width).transpose(0, 1).reshape(batch, -1)
        return by_sample.index_select(1, self._columns(pooled.device))

    def _columns(self, device: torch.device) -> torch.Tensor:
        starts = [0]
        for d in self.table_dims:
            starts.append(starts[-1] + d)
        width = starts[-1]
        columns = [
            self.slot_of[f] * width + starts[t] + c
            for f, t in enumerate(self.table_of)
            for c in range(self.table_dims[t])
        ]
        return torch.tensor(columns, dtype=torch.int64, device=device)


class SharedTableEmbeddings(InFrontOf):
    """An embedding collection keyed by table, taking batches keyed by feature
    (``TableSharing``): the ``EmbeddingCollection`` of a model with shared tables. Whatever
    else is asked of it (tables, state, statistics) is its collection's."""

    def __init__(self, inner: nn.Module, sharing: TableSharing) -> None:
        super().__init__(inner)
        self.sharing = sharing

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.sharing.unstack(self.inner(self.sharing.stack(kjt)))

    def start_input(self, kjt: KeyedJaggedTensor, *, ahead: bool = False) -> StartedInput | None:
        return self.inner.start_input(self.sharing.stack(kjt), ahead=ahead)

    def look_up(self, received: Any) -> torch.Tensor:
        return self.sharing.unstack(self.inner.look_up(received))

    def input_rows(self, received: Any) -> int:
        return self.inner.input_rows(received) // self.sharing.slots


def share_tables(embeddings: nn.Module, spec: FeatureSpec) -> nn.Module:
    """``embeddings`` (keyed by ``spec.tables``) taking batches keyed by feature: itself
    when no table is shared."""
    sharing = TableSharing.of(spec)
    return embeddings if sharing is None else SharedTableEmbeddings(embeddings, sharing)

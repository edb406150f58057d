"""Who holds what: each rank's shards as destinations of input IDs, and the index tensors
that route IDs out and pooled columns back, built once from the plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dlrmflow.features.spec import SparseFeature
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.plan import Shard, ShardingPlan, TablePlan

# Shardings whose shards each pool part of a bag: the owner sums their partial sums.
PARTIAL_SUM_TYPES = ("row_wise", "table_row_wise")


@dataclass(frozen=True)
class Route:
    """One shard of a model-parallel table, as a destination of input IDs."""

    feature: int  # index of the feature in the collection (global order)
    table: TablePlan
    shard: Shard

    @property
    def partial(self) -> bool:
        return self.table.sharding in PARTIAL_SUM_TYPES


class Routing:
    """The plan seen from one rank: ``routes[r]`` are rank r's model-parallel shards, in
    the plan's order; the rest are index tensors on ``device``, built once.

    - ``send_keys[r]``, ``send_lo[r]``, ``send_hi[r]``: which input features go to rank r,
      and the row range of each (IDs outside it stay home);
    - ``out_columns[r]``: where rank r's returned columns land in the output;
    - ``replicated_features`` and ``replicated_columns``: the data-parallel tables;
    - ``mean_partial``: features whose partial sums of a mean-pooled bag the owner divides;
    - ``permutation`` / ``concatenated_in_order``: without partial sums, the output is the
      returned blocks concatenated (and permuted into feature order), not summed;
    - ``codec_width``: the quantization row of the output codecs.
    """

    def __init__(
        self,
        features: Sequence[SparseFeature],
        plan: ShardingPlan,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        if plan.world_size != world_size:
            raise ValueError(
                f"the sharding plan is for {plan.world_size} ranks, the job has {world_size}"
            )
        plan.validate()
        self.features = list(features)
        self.names = [f.name for f in self.features]
        _check_plan(plan, self.features)
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.device = device
        starts = [0]
        for f in self.features:
            starts.append(starts[-1] + f.embedding_dim)
        self.feature_start = starts
        self.output_dim = starts[-1]
        index = {name: k for k, name in enumerate(self.names)}
        self.routes = [
            [
                Route(index[t.name], t, s)
                for t, s in plan.shards_on(r)
                if t.sharding != "data_parallel"
            ]
            for r in range(world_size)
        ]
        self.local = self.routes[rank]
        self.local_names = [self.features[r.feature].name for r in self.local]
        self.replicated_features = [
            index[t.name] for t in plan.tables if t.sharding == "data_parallel"
        ]
        self._build_maps()

    def _build_maps(self) -> None:
        device = self.device

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.send_keys, self.send_lo, self.send_hi, self.out_columns = [], [], [], []
        for routes in self.routes:
            self.send_keys.append(ints([r.feature for r in routes]))
            self.send_lo.append(ints([r.shard.row_start for r in routes]))
            self.send_hi.append(ints([r.shard.row_end for r in routes]))
            columns = [
                self.feature_start[r.feature] + c
                for r in routes
                for c in range(r.shard.col_start, r.shard.col_end)
            ]
            self.out_columns.append(ints(columns))
        self.replicated_columns = ints(
            [
                c
                for k in self.replicated_features
                for c in range(self.feature_start[k], self.feature_start[k + 1])
            ]
        )
        self.mean_partial = sorted(
            {
                route.feature
                for routes in self.routes
                for route in routes
                if route.partial and self.features[route.feature].pooling == "mean"
            }
        )
        self.widths = [int(c.numel()) for c in self.out_columns]
        self.permutation: torch.Tensor | None = None
        self.concatenated_in_order = False
        if not any(r.partial for routes in self.routes for r in routes):
            order = torch.cat([*self.out_columns, self.replicated_columns])
            if torch.equal(order.cpu(), torch.arange(self.output_dim, device="cpu")):
                self.concatenated_in_order = True
            else:
                self.permutation = torch.empty_like(order)
                self.permutation[order] = torch.arange(order.numel(), device=device)
        # One table's vector when every shard has the same width (row-wise codecs then
        # scale each embedding on its own), else one sample's block.
        widths = {r.shard.cols for routes in self.routes for r in routes}
        self.codec_width = widths.pop() if len(widths) == 1 else None

    def mean_scale(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """1 / bag length on the columns of mean-pooled row-wise features, 1 elsewhere."""
        scale = torch.ones(kjt.stride, self.output_dim, device=self.device)
        lengths = kjt.lengths.view(len(self.names), kjt.stride)
        for k in self.mean_partial:
            cols = slice(self.feature_start[k], self.feature_start[k + 1])
            scale[:, cols] = lengths[k].clamp(min=1).reciprocal()[:, None]
        return scale


def _check_plan(plan: ShardingPlan, features: Sequence[SparseFeature]) -> None:
    planned = {t.name: t for t in plan.tables}
    names = [f.name for f in features]
    if sorted(planned) != sorted(names):
        raise ValueError(
            f"the sharding plan covers tables {sorted(planned)}, the model has {sorted(names)}"
        )
    for f in features:
        t = planned[f.name]
        if (t.rows, t.dim) != (f.num_embeddings, f.embedding_dim):
            raise ValueError(
                f"table {f.name}: the plan says {t.rows}x{t.dim}, the model "
                f"{f.num_embeddings}x{f.embedding_dim}"
            )


def key_starts(kjt: KeyedJaggedTensor) -> list[int]:
    """Where each key's values start in ``kjt.values`` (and where the last ends)."""
    if kjt.stride == 0:
        return [0] * (len(kjt.keys) + 1)
    return kjt.offsets()[:: kjt.stride].tolist()


def select_keys(kjt: KeyedJaggedTensor, keys: list[str]) -> KeyedJaggedTensor:
    """The bags of ``keys`` only (in that order), keeping the one-hot form."""
    index = [kjt.keys.index(k) for k in keys]
    rows = kjt.one_hot_rows
    if rows is not None:
        return KeyedJaggedTensor.from_one_hot(keys, rows[:, index])
    batch = kjt.stride
    starts = key_starts(kjt)
    lengths = kjt.lengths.view(len(kjt.keys), batch)
    values = torch.cat([kjt.values[starts[k] : starts[k + 1]] for k in index])
    weights = (
        None
        if kjt.weights is None
        else torch.cat([kjt.weights[starts[k] : starts[k + 1]] for k in index])
    )
    return KeyedJaggedTensor(keys, values, lengths[index].reshape(-1), weights)

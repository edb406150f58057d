"""The DLRM (Naumov et al., 2019) and its DCNv2 variant, in one short file.

Dense features go through a bottom MLP; each sparse feature is pooled by an embedding bag;
the dense vector and the pooled embeddings meet in an interaction layer (pairwise dot
products, or a low-rank cross network for DCNv2 as in MLPerf's DLRM-DCNv2); a top MLP
turns the result into one click logit per sample.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dlrmflow.config import ModelConfig
from dlrmflow.features.batch import KeyedJaggedTensor
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.kernels.interaction import dot_interaction


def mlp(sizes: list[int], *, last_relu: bool) -> nn.Sequential:
    """Linear layers with ReLU in between (and after the last one when ``last_relu``)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class EmbeddingBagCollection(nn.Module):
    """Every sparse feature's table stacked into one ``nn.EmbeddingBag``.

    The jagged batch is key-major, so shifting each key's IDs by its table's first row
    turns all features into bags of one big table: one lookup and one sparse gradient per
    step instead of one per feature, which is where a 26-table model spends its time.
    ``sparse=True`` makes each step's gradient touch only the rows it used.
    """

    def __init__(self, spec: FeatureSpec) -> None:
        super().__init__()
        self.names = spec.sparse_names
        modes = {f.pooling for f in spec.sparse}
        dims = {f.embedding_dim for f in spec.sparse}
        if len(modes) != 1 or len(dims) != 1:
            raise ValueError("all sparse features must share one pooling mode and dim")
        sizes = [f.num_embeddings for f in spec.sparse]
        # One extra all-zero row that pools to nothing: empty bags of one-hot batches point
        # at it, so they need no compaction into the jagged layout.
        self.padding_row = sum(sizes)
        self.bag = nn.EmbeddingBag(
            self.padding_row + 1,
            dims.pop(),
            mode=modes.pop(),
            sparse=True,
            padding_idx=self.padding_row,
        )
        starts = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)
        self.register_buffer("table_starts", starts, persistent=False)
        with torch.no_grad():
            for table, size in zip(self.bag.weight[:-1].split(sizes), sizes, strict=True):
                bound = math.sqrt(1.0 / size)
                nn.init.uniform_(table, -bound, bound)
        self.sizes = sizes

    def table(self, name: str) -> torch.Tensor:
        """The rows of one feature's table (a view into the stacked weight)."""
        return self.bag.weight[:-1].split(self.sizes)[self.names.index(name)]

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Pooled embeddings [B, n_features, dim] in spec order."""
        if sparse.keys != self.names:
            raise ValueError(f"batch keys {sparse.keys} differ from the model's {self.names}")
        rows = sparse.one_hot_rows
        if rows is not None:
            # Sample-major bags of one: a [B * K, 1] input pools straight into [B, K, dim].
            stacked = torch.where(rows >= 0, rows + self.table_starts, self.padding_row)
            return self.bag(stacked.view(-1, 1)).view(rows.shape[0], len(self.names), -1)
        per_key = torch.tensor(sparse.length_per_key(), dtype=torch.int64)
        rows = sparse.values + self.table_starts.repeat_interleave(per_key)
        pooled = self.bag(rows, sparse.offsets()[:-1])
        return pooled.view(len(self.names), sparse.stride, -1).transpose(0, 1)


class DotInteraction(nn.Module):
    """Pairwise dot products of all feature vectors (lower triangle, no diagonal), plus dense.

    Runs the fused op of ``dlrmflow.kernels`` (one bmm forward, a hand-written backward
    without the scatter-add an indexed gram would need).
    """

    @staticmethod
    def output_dim(n_vectors: int, dim: int) -> int:
        return dim + n_vectors * (n_vectors - 1) // 2

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return dot_interaction(dense, pooled)


class CrossNetwork(nn.Module):
    """DCNv2's low-rank cross layers: x_{l+1} = x_0 * (U_l V_l x_l + b_l) + x_l."""

    def __init__(self, dim: int, layers: int, rank: int) -> None:
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(dim, rank, bias=False) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(rank, dim) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for down, up in zip(self.down, self.up, strict=True):
            x = x0 * up(down(x)) + x
        return x


class DLRM(nn.Module):
    """Bottom MLP + embedding bags + interaction + top MLP, producing click logits."""

    def __init__(self, spec: FeatureSpec, config: ModelConfig) -> None:
        super().__init__()
        n_sparse = len(spec.sparse)
        dim = config.embedding_dim
        if any(f.embedding_dim != dim for f in spec.sparse):
            raise ValueError("every sparse feature must use model.embedding_dim")
        self.arch = config.arch
        self.bottom = mlp([len(spec.dense), *config.bottom_mlp], last_relu=True)
        self.embeddings = EmbeddingBagCollection(spec)
        if config.arch == "dlrm":
            self.interaction: nn.Module = DotInteraction()
            top_in = DotInteraction.output_dim(n_sparse + 1, dim)
        else:
            top_in = config.bottom_mlp[-1] + n_sparse * dim
            self.interaction = CrossNetwork(top_in, config.dcn_layers, config.dcn_low_rank)
        self.top = mlp([top_in, *config.top_mlp, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        dense_out = self.bottom(dense)
        pooled = self.embeddings(sparse)
        if self.arch == "dlrm":
            features = self.interaction(dense_out, pooled)
        else:
            features = self.interaction(torch.cat([dense_out, pooled.flatten(1)], dim=1))
        return self.top(features).squeeze(1)

    def sparse_parameters(self) -> list[nn.Parameter]:
        """Embedding weights: their gradients are sparse and need a sparse-capable optimizer."""
        return list(self.embeddings.parameters())

    def dense_parameters(self) -> list[nn.Parameter]:
        sparse_ids = {id(p) for p in self.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse_ids]

"""The DLRM (Naumov et al., 2019) and its DCNv2 variant, in one short file.

Dense features go through a bottom MLP; each sparse feature is pooled by an embedding bag;
the dense vector and the pooled embeddings meet in an interaction layer (pairwise dot
products, or a low-rank cross network for DCNv2 as in MLPerf's DLRM-DCNv2); a top MLP
turns the result into one click logit per sample.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dlrmflow.config import ModelConfig, TrainConfig
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.kernels.interaction import dot_interaction
from dlrmflow.kernels.optimizers import SGD, EmbeddingOptimizer, RowWiseAdagrad
from dlrmflow.kernels.row_cache import CacheTooSmall
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.embeddings import InMemoryEmbeddings, behind
from dlrmflow.train.model.sharded.tiers import cache_budget_error
from dlrmflow.train.model.shared_tables import share_tables


def embedding_optimizer(train: TrainConfig) -> EmbeddingOptimizer:
    """The optimizer fused into the embeddings' backward: row-wise Adagrad (as in the DLRM
    papers and FBGEMM: one accumulator per row) or SGD."""
    lr = train.embedding_lr or train.lr
    return RowWiseAdagrad(lr=lr) if train.optimizer == "adagrad" else SGD(lr=lr)


def mlp(sizes: list[int], *, last_relu: bool) -> nn.Sequential:
    """Linear layers with ReLU in between (and after the last one when ``last_relu``)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DotInteraction(nn.Module):
    """Pairwise dot products of all feature vectors (lower triangle, no diagonal), plus dense.

    Runs the fused op of ``dlrmflow.kernels`` (one bmm forward, a hand-written backward
    without the scatter-add an indexed gram would need), or its Triton twin (``kernels``).
    """

    def __init__(self, kernels: str = "auto") -> None:
        super().__init__()
        self.kernels = kernels

    @staticmethod
    def output_dim(n_vectors: int, dim: int) -> int:
        return dim + n_vectors * (n_vectors - 1) // 2

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return dot_interaction(dense, pooled, self.kernels)


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


class DenseArch(nn.Module):
    """Everything but the embeddings: bottom MLP, interaction and top MLP.

    Its parameters are the data-parallel half of the model (replicated, gradients
    allreduced); the embeddings feeding it are the model-parallel half. With ``precision``
    "bf16" it computes under bfloat16 autocast (parameters, gradients and the optimizer
    stay float32), on whichever device its inputs are; the logits come back float32.
    """

    def __init__(self, spec: FeatureSpec, config: ModelConfig, precision: str = "fp32") -> None:
        super().__init__()
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
        self.precision = precision
        n_sparse = len(spec.sparse)
        dim = config.embedding_dim
        self.arch = config.arch
        self.n_sparse = n_sparse
        self.dim = dim
        width = sum(f.embedding_dim for f in spec.sparse)
        self.bottom = mlp([len(spec.dense), *config.bottom_mlp], last_relu=True)
        if config.arch == "dlrm":
            self.interaction: nn.Module = DotInteraction(config.kernels)
            top_in = DotInteraction.output_dim(n_sparse + 1, dim)
        else:
            top_in = config.bottom_mlp[-1] + width
            self.interaction = CrossNetwork(top_in, config.dcn_layers, config.dcn_low_rank)
        self.top = mlp([top_in, *config.top_mlp, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Click logits ``[B]`` from dense features and the pooled embeddings ``[B, n * dim]``."""
        if self.precision == "fp32":
            return self._logits(dense, pooled)
        with torch.autocast(dense.device.type, dtype=torch.bfloat16):
            return self._logits(dense, pooled).float()

    def _logits(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        dense_out = self.bottom(dense)
        # Autocast leaves a custom op's inputs alone: the interaction gets one dtype (the
        # cast's backward hands the embeddings a float32 gradient).
        pooled = pooled.to(dense_out.dtype)
        if self.arch == "dlrm":
            features = self.interaction(
                dense_out, pooled.view(dense.shape[0], self.n_sparse, self.dim)
            )
        else:
            features = self.interaction(torch.cat([dense_out, pooled], dim=1))
        return self.top(features).squeeze(1)


def hand_pooled_in(model: DLRM, precision: str) -> None:
    """Embeddings in one bag hand the dense arch its pooled rows in the dtype it computes
    in (bf16: bfloat16, gathered straight into it; see ``TableBatchedEmbeddingBag``).
    Other collections hand on float32, which the dense arch casts."""
    bag = behind(model.embeddings)
    if isinstance(bag, TableBatchedEmbeddingBag):
        bag.pooled_dtype = torch.bfloat16 if precision == "bf16" else torch.float32


class DLRM(nn.Module):
    """Embeddings feeding the dense arch, producing click logits: the one model class.

    ``embeddings`` is an ``EmbeddingCollection`` mapping a ``KeyedJaggedTensor`` to pooled
    ``[B, n * dim]`` in feature order: every table in this process's memory by default.
    What a run needs beyond that (tables on disk, a job's shards, DDP for the dense arch,
    the device and precision) ``dlrmflow.train.model.parallelize`` applies to the plain model.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        config: ModelConfig,
        embedding_optimizer: EmbeddingOptimizer | None = None,
        seed: int = 0,
        embeddings: nn.Module | None = None,
        precision: str = "fp32",
    ) -> None:
        """``embedding_optimizer`` is fused into the embeddings' backward (SGD by default, for
        a model that is only evaluated); ``seed`` draws the embedding weights; ``precision``
        is the dense arch's (``DenseArch``)."""
        super().__init__()
        if config.arch == "dlrm":
            for f in spec.sparse:
                if f.embedding_dim != config.embedding_dim:
                    raise ValueError(
                        f"feature {f.name}: dim {f.embedding_dim}, but the dot interaction "
                        f"needs every table at model.embedding_dim ({config.embedding_dim})"
                    )
        # All tables in one table-batched bag whose backward updates the touched rows itself:
        # no embedding gradient ever exists, so no torch optimizer sees these weights.
        self.embeddings = embeddings or share_tables(
            InMemoryEmbeddings(
                spec.tables, embedding_optimizer or SGD(lr=0.0), seed=seed, kernels=config.kernels
            ),
            spec,
        )
        self.dense_arch = DenseArch(spec, config, precision)
        hand_pooled_in(self, precision)
        # The dense arch's data-parallel wrapper in a job (``parallelize``: DDP), which
        # runs it; beside it, not in its place, so its parameters keep their names.
        self.ddp: nn.Module | None = None

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        try:
            pooled = self.embeddings(sparse)
        except CacheTooSmall as e:  # tables on disk (train.embedding_memory_bytes)
            raise cache_budget_error(e) from e
        return self._dense(dense, pooled)

    def forward_received(self, dense: torch.Tensor, received: Any) -> torch.Tensor:
        """The logits of a batch whose input the embeddings started
        (``EmbeddingCollection.start_input``) and that has arrived (``received``)."""
        try:
            pooled = self.embeddings.look_up(received)
        except CacheTooSmall as e:
            raise cache_budget_error(e) from e
        return self._dense(dense, pooled)

    def _dense(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        arch = self.ddp if self.ddp is not None else self.dense_arch
        return arch(dense, pooled)

    def dense_parameters(self) -> list[nn.Parameter]:
        """What the dense optimizer updates (the embeddings update themselves)."""
        return list(self.dense_arch.parameters())

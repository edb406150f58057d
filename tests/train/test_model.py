import pytest
import torch

from dlrmflow.config import ModelConfig
from dlrmflow.features.batch import KeyedJaggedTensor
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.train.model import DLRM, DotInteraction


def _spec(dim: int) -> FeatureSpec:
    return FeatureSpec(
        dense=("a", "b", "c"),
        sparse=(SparseFeature("x", 10, dim), SparseFeature("y", 7, dim)),
    )


def _kjt() -> KeyedJaggedTensor:
    # batch of 3: x = [1], [2, 3], []; y = [0], [6], [5, 5]
    return KeyedJaggedTensor(
        keys=["x", "y"],
        values=torch.tensor([1, 2, 3, 0, 6, 5, 5]),
        lengths=torch.tensor([1, 2, 0, 1, 1, 2], dtype=torch.int32),
    )


def test_dot_interaction_is_lower_triangle_of_gram_plus_dense():
    dense = torch.randn(2, 4)
    pooled = torch.randn(2, 3, 4)
    out = DotInteraction()(dense, pooled)
    vectors = torch.cat([dense[:, None], pooled], 1)
    expected = [dense]
    pairs = [vectors[:, i] @ vectors[:, j].T for i in range(4) for j in range(i)]
    expected.append(torch.stack([p.diagonal() for p in pairs], 1))
    torch.testing.assert_close(out, torch.cat(expected, 1))
    assert out.shape[1] == DotInteraction.output_dim(4, 4)


def test_embedding_bags_pool_per_spec_and_give_sparse_gradients():
    torch.manual_seed(0)
    spec = FeatureSpec(
        dense=("a", "b", "c"), sparse=(SparseFeature("x", 10, 4), SparseFeature("y", 7, 4))
    )
    model = DLRM(spec, ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6]))
    pooled = model.embeddings(_kjt())
    wx = model.embeddings.table("x")
    wy = model.embeddings.table("y")
    torch.testing.assert_close(pooled[1, 0], wx[2] + wx[3])
    torch.testing.assert_close(pooled[2, 0], torch.zeros(4))
    torch.testing.assert_close(pooled[2, 1], 2 * wy[5])  # sum of [5, 5]
    logits = model(torch.randn(3, 3), _kjt())
    assert logits.shape == (3,)
    logits.sum().backward()
    grad = model.embeddings.bag.weight.grad
    assert grad.is_sparse
    # only the rows the batch used: x rows 1, 2, 3 and y rows 0, 5, 6 (offset by x's 10)
    assert sorted(grad.coalesce().indices()[0].tolist()) == [1, 2, 3, 10, 15, 16]
    assert all(p.grad is not None and not p.grad.is_sparse for p in model.dense_parameters())


def test_dcnv2_variant_runs_and_differs_in_structure():
    torch.manual_seed(0)
    cfg = ModelConfig(arch="dcnv2", embedding_dim=4, bottom_mlp=[8, 5], top_mlp=[6], dcn_layers=2)
    model = DLRM(_spec(4), cfg)
    out = model(torch.randn(3, 3), _kjt())
    assert out.shape == (3,)
    assert len(model.interaction.down) == 2
    # the cross network sees the bottom output (5) plus two 4-dim embeddings
    assert model.interaction.up[0].out_features == 5 + 2 * 4


def test_mean_pooling_and_mismatched_keys():
    spec = FeatureSpec(
        dense=("a",),
        sparse=(SparseFeature("x", 10, 4, "mean"), SparseFeature("y", 7, 4, "mean")),
    )
    model = DLRM(spec, ModelConfig(embedding_dim=4, bottom_mlp=[4], top_mlp=[]))
    pooled = model.embeddings(_kjt())
    wx = model.embeddings.table("x")
    torch.testing.assert_close(pooled[1, 0], (wx[2] + wx[3]) / 2)
    bad = _kjt()
    bad.keys = ["y", "x"]
    with pytest.raises(ValueError, match="differ from the model"):
        model.embeddings(bad)


def test_one_hot_form_pools_like_the_jagged_form():
    torch.manual_seed(0)
    spec = FeatureSpec(dense=("a",), sparse=(SparseFeature("x", 10, 4), SparseFeature("y", 7, 4)))
    model = DLRM(spec, ModelConfig(embedding_dim=4, bottom_mlp=[4], top_mlp=[]))
    rows = torch.tensor([[1, 0], [3, -1], [-1, 6]], dtype=torch.int32)
    one_hot = KeyedJaggedTensor.from_one_hot(["x", "y"], rows)
    jagged = KeyedJaggedTensor(
        ["x", "y"], torch.tensor([1, 3, 0, 6]), torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.int32)
    )
    pooled = model.embeddings(one_hot)
    torch.testing.assert_close(pooled, model.embeddings(jagged), rtol=0, atol=0)
    torch.testing.assert_close(pooled[1, 1], torch.zeros(4))  # empty bag pools to zero
    pooled.sum().backward()
    grad = model.embeddings.bag.weight.grad.coalesce()
    # the padding row never receives a gradient, so it stays zero for ever
    assert model.embeddings.padding_row not in grad.indices()[0][grad.values().abs().sum(1) > 0]

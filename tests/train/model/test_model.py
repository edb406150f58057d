import json

import pytest
import torch

from dlrmflow.config import ModelConfig
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.kernels.optimizers import SGD
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.dlrm import DLRM, DotInteraction


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


def test_embeddings_pool_per_spec_and_update_only_touched_rows_in_backward():
    torch.manual_seed(0)
    spec = FeatureSpec(
        dense=("a", "b", "c"), sparse=(SparseFeature("x", 10, 4), SparseFeature("y", 7, 4))
    )
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6])
    model = DLRM(spec, cfg, SGD(lr=0.5))
    pooled = model.embeddings(_kjt()).view(3, 2, 4)
    wx, wy = model.embeddings.table("x").clone(), model.embeddings.table("y").clone()
    torch.testing.assert_close(pooled[1, 0], wx[2] + wx[3])
    torch.testing.assert_close(pooled[2, 0], torch.zeros(4))
    torch.testing.assert_close(pooled[2, 1], 2 * wy[5])  # sum of [5, 5]
    logits = model(torch.randn(3, 3), _kjt())
    assert logits.shape == (3,)
    logits.sum().backward()
    # the fused optimizer moved exactly the rows the batch used: x 1, 2, 3 and y 0, 5, 6
    changed_x = (model.embeddings.table("x") != wx).any(1).nonzero().flatten().tolist()
    changed_y = (model.embeddings.table("y") != wy).any(1).nonzero().flatten().tolist()
    assert changed_x == [1, 2, 3] and changed_y == [0, 5, 6]
    assert all(p.grad is not None for p in model.parameters())
    assert not any(b.requires_grad for b in model.embeddings.buffers())


def test_dcnv2_variant_runs_and_differs_in_structure():
    torch.manual_seed(0)
    cfg = ModelConfig(arch="dcnv2", embedding_dim=4, bottom_mlp=[8, 5], top_mlp=[6], dcn_layers=2)
    model = DLRM(_spec(4), cfg)
    out = model(torch.randn(3, 3), _kjt())
    assert out.shape == (3,)
    assert len(model.dense_arch.interaction.down) == 2
    # the cross network sees the bottom output (5) plus two 4-dim embeddings
    assert model.dense_arch.interaction.up[0].out_features == 5 + 2 * 4


def test_mean_pooling_and_mismatched_keys():
    spec = FeatureSpec(
        dense=("a",),
        sparse=(SparseFeature("x", 10, 4, "mean"), SparseFeature("y", 7, 4, "mean")),
    )
    model = DLRM(spec, ModelConfig(embedding_dim=4, bottom_mlp=[4], top_mlp=[4]))
    pooled = model.embeddings(_kjt()).view(3, 2, 4)
    wx = model.embeddings.table("x")
    torch.testing.assert_close(pooled[1, 0], (wx[2] + wx[3]) / 2)
    bad = _kjt()
    bad.keys = ["y", "x"]
    with pytest.raises(ValueError, match="differ from the tables"):
        model.embeddings(bad)


def test_one_hot_and_jagged_batches_train_to_identical_weights():
    spec = FeatureSpec(dense=("a",), sparse=(SparseFeature("x", 10, 4), SparseFeature("y", 7, 4)))
    rows = torch.tensor([[1, 0], [3, -1], [-1, 6]], dtype=torch.int32)
    one_hot = KeyedJaggedTensor.from_one_hot(["x", "y"], rows)
    jagged = KeyedJaggedTensor(
        ["x", "y"], torch.tensor([1, 3, 0, 6]), torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.int32)
    )
    dense = torch.randn(3, 1)
    weights = []
    for sparse in (one_hot, jagged):
        torch.manual_seed(0)
        model = DLRM(spec, ModelConfig(embedding_dim=4, bottom_mlp=[4], top_mlp=[4]), SGD(lr=0.3))
        model(dense, sparse).sum().backward()
        weights.append(model.embeddings.weight.clone())
    assert torch.equal(weights[0], weights[1])


def test_cross_network_matches_the_dcnv2_formula():
    """x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l, written out with plain matrices."""
    from dlrmflow.train.model.dlrm import CrossNetwork

    torch.manual_seed(1)
    net = CrossNetwork(dim=6, layers=3, rank=2)
    x0 = torch.randn(5, 6, dtype=torch.float64)
    net = net.double()
    want = x0.clone()
    for down, up in zip(net.down, net.up, strict=True):
        v, u, b = down.weight.detach(), up.weight.detach(), up.bias.detach()
        want = x0 * ((want @ v.T) @ u.T + b) + want
    assert torch.allclose(net(x0), want, rtol=0, atol=1e-12)
    # A cross layer is not just a residual: with the layers zeroed it is the identity.
    for up in net.up:
        torch.nn.init.zeros_(up.weight)
        torch.nn.init.zeros_(up.bias)
    assert torch.equal(net(x0), x0)


def test_dcnv2_learns_the_synthetic_click_model(tiny_dataset, tmp_path):
    from dlrmflow.train.run.evaluate import evaluate
    from dlrmflow.train.run.trainer import train
    from tests.conftest import tiny_run_config

    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", epochs=2)
    cfg.model.arch = "dcnv2"
    cfg.model.dcn_layers = 2
    cfg.model.dcn_low_rank = 8
    result = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["loss"] < records[0]["loss"]
    assert result.steps == 48
    # The dot-interaction DLRM reaches AUC > 0.6 on this data in the same steps.
    assert evaluate(tmp_path / "run")["auc"] > 0.6


def test_parallelize_places_the_plain_models_tables_as_the_model_itself_would(tmp_path):
    """``build_model`` allocates no table; ``parallelize`` in one process places them in
    memory (the same weights as ``DLRM`` built whole from the same seed), or on disk once
    they exceed train.embedding_memory_bytes; either offers the embeddings' interface."""
    from dlrmflow.config import RunConfig
    from dlrmflow.train.model.dlrm import embedding_optimizer
    from dlrmflow.train.model.embeddings import EmbeddingCollection, UnplacedEmbeddings
    from dlrmflow.train.model.parallelize import build_model, parallelize

    config = RunConfig.model_validate(
        {"model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [6]}, "train": {"seed": 3}}
    )
    spec = _spec(4)
    torch.manual_seed(0)
    whole = DLRM(spec, config.model, embedding_optimizer(config.train), seed=3)
    torch.manual_seed(0)
    model = build_model(config, spec)
    assert isinstance(model.embeddings, UnplacedEmbeddings)
    with pytest.raises(RuntimeError, match="parallelize it first"):
        model(torch.randn(3, 3), _kjt())
    parallelize(model, config, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="unplaced"):
        parallelize(model, config, device=torch.device("cpu"))
    assert all(torch.equal(whole.embeddings.table(n), model.embeddings.table(n)) for n in "xy")
    dense_params = zip(whole.dense_arch.parameters(), model.dense_arch.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in dense_params)
    embeddings: EmbeddingCollection = model.embeddings
    started = embeddings.start_input(_kjt())
    assert embeddings.start_input(_kjt(), ahead=True) is None  # nothing to begin early
    dense = torch.randn(3, 3)
    assert torch.equal(model.forward_received(dense, started.wait()), model(dense, _kjt()))
    assert embeddings.input_rows(started.wait()) == 3
    assert not embeddings.rows_on_disk and embeddings.cache_stats() is None
    assert sorted(embeddings.checkpoint_state()) == [
        "x.sum_squares",
        "x.weight",
        "y.sum_squares",
        "y.weight",
    ]

    config.train.embedding_memory_bytes = 200  # below the tables' 17 rows x (4 + 1) floats
    on_disk = parallelize(
        build_model(config, spec), config, device=torch.device("cpu"), embeddings_dir=tmp_path
    )
    assert on_disk.embeddings.rows_on_disk and on_disk.embeddings.cache_stats() is not None
    assert torch.equal(on_disk.embeddings.table("y"), whole.embeddings.table("y"))
    assert on_disk.embeddings.start_input(_kjt(), ahead=True) is None  # its rows load meanwhile
    assert on_disk.embeddings.cache_stats().prefetched > 0

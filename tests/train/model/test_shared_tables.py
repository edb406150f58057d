"""Tables shared between features: each feature pooled on its own from one table's rows, a
row's gradients from every feature summed before one optimizer update, and the same
answer whatever form (one-hot or jagged) the batch comes in."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from dlrmflow.bench.spawn import run_spawned_job
from dlrmflow.config import ModelConfig, RunConfig
from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.kernels.optimizers import SGD, RowWiseAdagrad
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.dlrm import DLRM
from dlrmflow.train.model.plan import SHARDING_TYPES
from dlrmflow.train.model.shared_tables import SharedTableEmbeddings, TableSharing
from dlrmflow.train.planner import cpu_topology, plan_sharding
from dlrmflow.train.planner.jobs import tables_from_spec
from dlrmflow.train.run.checkpoint import model_state
from tests.train.model.global_batches import train_share, train_whole
from tests.train.model.test_sharded import random_batch

DIM = 4
# ``a`` and ``b`` share table ``t``; ``u`` has its own, between them in feature order.
SPEC = FeatureSpec(
    dense=("d",),
    sparse=(
        SparseFeature("a", 50, DIM, table="t"),
        SparseFeature("u", 30, DIM),
        SparseFeature("b", 50, DIM, table="t"),
    ),
)
CONFIG = ModelConfig(embedding_dim=DIM, bottom_mlp=[8, DIM], top_mlp=[8])
# Three samples: ``a`` one-hot, ``u`` one-hot with a gap, ``b`` a list; row 1 of ``t`` is
# looked up by both features, twice by ``b`` in sample 0.
A, U, B_LISTS = [1, 2, 3], [5, None, 6], [[1, 1], [], [7, 9, 1]]


def jagged() -> KeyedJaggedTensor:
    values = A + [u for u in U if u is not None] + [i for bag in B_LISTS for i in bag]
    lengths = [1] * 3 + [0 if u is None else 1 for u in U] + [len(bag) for bag in B_LISTS]
    return KeyedJaggedTensor(
        ["a", "u", "b"], torch.tensor(values), torch.tensor(lengths, dtype=torch.int32)
    )


def test_the_spec_has_one_table_per_name_in_order_of_first_use():
    assert [t.name for t in SPEC.tables] == ["t", "u"]
    assert SPEC.table_features("t") == ["a", "b"]
    sharing = TableSharing.of(SPEC)
    assert (sharing.table_of, sharing.slot_of, sharing.slots) == ((0, 1, 0), (0, 0, 1), 2)
    alone = FeatureSpec(dense=("d",), sparse=(SparseFeature("a", 5, DIM),))
    assert TableSharing.of(alone) is None and alone.tables == alone.sparse


def test_each_feature_pools_its_own_bags_from_the_shared_rows():
    model = DLRM(SPEC, CONFIG, SGD(lr=0.1), seed=3)
    assert isinstance(model.embeddings, SharedTableEmbeddings)
    assert model.embeddings.names == ["t", "u"]
    t, u = model.embeddings.table("t"), model.embeddings.table("u")
    pooled = model.embeddings(jagged())
    assert pooled.shape == (3, 3 * DIM)
    expected = torch.cat(
        [
            t[A],
            torch.stack([u[5], torch.zeros(DIM), u[6]]),
            torch.stack([t[bag].sum(0) if bag else torch.zeros(DIM) for bag in B_LISTS]),
        ],
        dim=1,
    )
    torch.testing.assert_close(pooled, expected, rtol=0, atol=1e-7)


def test_one_hot_and_jagged_batches_look_up_alike():
    model = DLRM(SPEC, CONFIG, SGD(lr=0.1), seed=3)
    rows = torch.tensor([[1, 5, 1], [2, -1, -1], [3, 6, 7]])
    one_hot = KeyedJaggedTensor.from_one_hot(["a", "u", "b"], rows)
    as_jagged = KeyedJaggedTensor(["a", "u", "b"], one_hot.values, one_hot.lengths)
    assert torch.equal(model.embeddings(one_hot), model.embeddings(as_jagged))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_a_shared_row_takes_one_update_of_every_features_gradient(optimizer):
    """Against plain autograd on one weight that both features index: the row-wise Adagrad
    update of a row looked up by both must see the sum of their gradients (two updates,
    one a feature, would square-accumulate each part apart)."""
    lr = 0.05
    opt = SGD(lr=lr) if optimizer == "sgd" else RowWiseAdagrad(lr=lr)
    torch.manual_seed(0)  # the dense arch's draws: every looked-up row gets a gradient
    model = DLRM(SPEC, CONFIG, opt, seed=5)
    model.train()
    weight = model.embeddings.table("t").detach().clone().requires_grad_(True)
    u = model.embeddings.table("u").detach().clone()  # before the step updates it
    dense = torch.randn(3, 1, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([1.0, 0.0, 1.0])

    logits = model(dense, jagged())
    F.binary_cross_entropy_with_logits(logits, target).backward()

    # The reference: the same pooled vectors from ``weight`` by autograd, fed to the same
    # dense arch (its copy, so its gradients do not mix with the model's).
    pooled = torch.cat(
        [
            weight[A],
            torch.stack([u[5], torch.zeros(DIM), u[6]]),
            torch.stack([weight[bag].sum(0) if bag else torch.zeros(DIM) for bag in B_LISTS]),
        ],
        dim=1,
    )
    arch = DLRM(SPEC, CONFIG, SGD(lr=0.0), seed=5).dense_arch
    arch.load_state_dict(model.dense_arch.state_dict())
    # The model's dense arch took no step (no dense optimizer here): same parameters.
    F.binary_cross_entropy_with_logits(arch(dense, pooled), target).backward()
    grad = weight.grad
    touched = grad.abs().sum(1) > 0
    assert touched.nonzero().squeeze(1).tolist() == [1, 2, 3, 7, 9]
    expected = weight.detach().clone()
    if optimizer == "sgd":
        expected[touched] -= lr * grad[touched]
    else:
        state = grad[touched].square().mean(1)
        expected[touched] -= lr * grad[touched] / (state.sqrt()[:, None] + opt.eps)
    torch.testing.assert_close(model.embeddings.table("t"), expected, rtol=0, atol=1e-6)


def test_the_planner_sees_a_shared_table_once_with_its_features_lookups():
    tables = tables_from_spec(SPEC)
    assert [t.name for t in tables] == ["t", "u"]
    assert tables[0].ids_per_sample == pytest.approx(2.0)  # a's one and b's one
    assert tables[1].ids_per_sample == pytest.approx(1.0)


# A job: every sharding type at 2 ranks against one process on the global batches.
JOB_SPEC = FeatureSpec(
    dense=("d1", "d2"),
    sparse=(
        SparseFeature("a", 40, DIM, table="t"),
        SparseFeature("u", 23, DIM),
        SparseFeature("b", 40, DIM, table="t"),
        SparseFeature("c", 40, DIM, table="t"),
    ),
)
JOB_CONFIG = RunConfig.model_validate(
    {"model": {"embedding_dim": DIM, "bottom_mlp": [8, DIM], "top_mlp": [8]}, "train": {"seed": 3}}
)
STEPS, BATCH, LR = 8, 6, 0.1


def _job_batches(world: int) -> list[Batch]:
    return [
        random_batch(JOB_SPEC, BATCH * world, 500 + step, multi_hot=True) for step in range(STEPS)
    ]


def _train_job(rank: int, world: int, out_dir: str, shardings: list[str]) -> dict:
    from dlrmflow.train.model.parallelize import sharded_dlrm

    torch.use_deterministic_algorithms(True)
    paths = {}
    for sharding in shardings:
        plan = plan_sharding(
            tables_from_spec(JOB_SPEC), cpu_topology(world, world), BATCH, force=sharding
        )
        torch.manual_seed(JOB_CONFIG.train.seed)  # the dense arch's draws, as the reference's
        model = sharded_dlrm(JOB_SPEC, JOB_CONFIG, plan, RowWiseAdagrad(lr=LR))
        optimizer = torch.optim.Adagrad(model.dense_parameters(), lr=LR)
        train_share(model, optimizer, _job_batches(world), rank, world, BATCH)
        path = Path(out_dir) / sharding
        dcp.save(model_state(model, optimizer), checkpoint_id=str(path))
        paths[sharding] = str(path)
    return paths


def test_every_sharding_of_a_shared_table_trains_as_one_process(tmp_path):
    world = 2
    seed = JOB_CONFIG.train.seed
    torch.manual_seed(seed)
    reference = DLRM(JOB_SPEC, JOB_CONFIG.model, RowWiseAdagrad(lr=LR), seed=seed)
    start = reference.state_dict()["embeddings.inner.weight"].clone()
    optimizer = torch.optim.Adagrad(reference.parameters(), lr=LR)
    train_whole(reference, optimizer, _job_batches(world))
    want = reference.state_dict()
    ranks = run_spawned_job(
        _train_job, world, str(tmp_path), list(SHARDING_TYPES), threads=1,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    for sharding, path in ranks[0].result.items():
        model = DLRM(JOB_SPEC, JOB_CONFIG.model, RowWiseAdagrad(lr=LR))
        dcp.load(
            model_state(model, torch.optim.Adagrad(model.parameters(), lr=LR)), checkpoint_id=path
        )
        got = model.state_dict()
        assert got.keys() == want.keys()
        for key in want:
            worst = float((got[key] - want[key]).abs().max()) if want[key].numel() else 0.0
            assert worst <= 2e-5, f"{sharding} {key}: differs by {worst:.2e}"
    moved = float((want["embeddings.inner.weight"] - start).abs().max())
    assert moved > 1e-3  # the comparison is of tables that trained

"""Dynamic ID tables in front of an embedding collection: raw IDs get rows in batch
order (admitted while training, only looked up while evaluating), evicted rows start
afresh before any ID reads them, and the maps travel in the checkpoint so that a resumed
run continues exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels.optimizers import RowWiseAdagrad
from dlrmflow.kernels.tbe import initial_rows
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.dynamic_ids import DynamicIdEmbeddings, DynamicTable
from dlrmflow.train.model.embeddings import InMemoryEmbeddings

DIM, CAPACITY, SEED = 4, 6, 2
TABLES = [SparseFeature("d", CAPACITY, DIM), SparseFeature("p", 10, DIM)]
BIG = 2**62 + 12345  # raw IDs take any bit pattern


def collection(evict_every: int | None = None, ttl: int | None = None) -> DynamicIdEmbeddings:
    bag = InMemoryEmbeddings(TABLES, RowWiseAdagrad(lr=0.1), seed=SEED)
    dynamic = [DynamicTable("d", ("d",), CAPACITY, DIM, ttl=ttl, evict_every=evict_every)]
    return DynamicIdEmbeddings(bag, bag, dynamic, seed=SEED)


def batch(d: list[list[int]], p: list[int]) -> KeyedJaggedTensor:
    values = [i for bag in d for i in bag] + p
    lengths = [len(bag) for bag in d] + [1] * len(p)
    return KeyedJaggedTensor(
        ["d", "p"],
        torch.tensor(values, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int32),
    )


def step(model: DynamicIdEmbeddings, kjt: KeyedJaggedTensor, seed: int) -> torch.Tensor:
    out = model(kjt)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(grad)
    return out.detach()


def test_raw_ids_get_rows_in_order_and_evaluation_admits_none():
    model = collection()
    model.train()
    out = step(model, batch([[BIG], [-7, BIG], [3]], [1, 2, 3]), 0)
    assert model.maps["d"].rows_of(np.array([BIG, -7, 3])).tolist() == [1, 2, 3]
    table = model.bag.table("d")
    model.eval()
    with torch.no_grad():
        looked_up = model(batch([[-7], [99], []], [0, 0, 0]))
    assert torch.equal(looked_up[0, :DIM], table[2])
    assert torch.equal(looked_up[1, :DIM], table[0])  # unknown: the default row
    assert model.maps["d"].rows_in_use == 3  # evaluation admitted nothing
    assert out.shape == (3, 2 * DIM)


def test_a_full_table_sends_new_ids_to_the_trained_default_row():
    model = collection()
    model.train()
    ids = [[10 + i] for i in range(CAPACITY + 2)]
    step(model, batch(ids, [0] * len(ids)), 0)
    stats = model.take_stats()["d"]
    assert (stats.rows_in_use, stats.refused_full) == (CAPACITY - 1, 3)
    assert model.maps["d"].rows_of(np.array([10 + CAPACITY - 1])).tolist() == [0]


def test_evicted_rows_start_afresh_before_a_new_id_reads_them():
    model = collection(evict_every=3, ttl=2)
    model.train()
    step(model, batch([[100], [200]], [0, 1]), 0)  # step 1: rows 1, 2
    step(model, batch([[200], [200]], [0, 1]), 1)  # step 2
    trained = model.bag.table("d").clone()
    step(model, batch([[300], [200]], [0, 1]), 2)  # step 3 evicts 100 (unseen for 2)
    stats = model.take_stats()["d"]
    assert stats.evicted == 1
    # 300 took row 1, reset to its birth values before this batch read it.
    assert model.maps["d"].rows_of(np.array([100, 300, 200])).tolist() == [0, 1, 2]
    birth = initial_rows("d", SEED, torch.tensor([1]), table_rows=CAPACITY, dim=DIM)
    assert not torch.equal(trained[1], birth[0])  # it had trained
    fresh = collection()
    fresh.train()
    # The same single update from the birth values and no state: what row 1 holds now.
    fresh.maps["d"].map(np.array([100, 200]), 0)  # 100 -> row 1 in the fresh map too
    step(fresh, batch([[100], [200]], [0, 1]), 2)
    assert torch.equal(model.bag.table("d")[1], fresh.bag.table("d")[1])
    assert torch.equal(
        model.bag.state("d")["sum_squares"][1], fresh.bag.state("d")["sum_squares"][1]
    )


def test_one_hot_batches_are_refused_for_raw_ids():
    model = collection()
    with pytest.raises(ValueError, match="dynamic features take jagged batches"):
        model(KeyedJaggedTensor.from_one_hot(["d", "p"], torch.tensor([[5, 1]])))


def test_the_maps_travel_in_the_checkpoint_and_a_resume_continues_exactly(tmp_path):
    rng = np.random.default_rng(0)
    batches = [
        batch([[int(i)] for i in rng.integers(0, 9, 4)], [int(i) for i in rng.integers(0, 10, 4)])
        for _ in range(12)
    ]
    whole, first = collection(evict_every=4, ttl=3), collection(evict_every=4, ttl=3)
    for model in (whole, first):
        model.train()
    for s, kjt in enumerate(batches[:6]):
        step(whole, kjt, s), step(first, kjt, s)
    dcp.save(first.checkpoint_state(), checkpoint_id=str(tmp_path / "ckpt"))
    resumed = collection(evict_every=4, ttl=3)
    resumed.train()
    state = resumed.checkpoint_state()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    resumed.after_checkpoint_load(state)
    assert int(resumed.step) == 6
    for s, kjt in enumerate(batches[6:], start=6):
        assert torch.equal(step(whole, kjt, s), step(resumed, kjt, s)), s
    assert torch.equal(whole.bag.table("d"), resumed.bag.table("d"))
    assert whole.take_stats()["d"].rows_in_use == resumed.take_stats()["d"].rows_in_use

"""Dynamic ID tables in front of an embedding collection: raw IDs get rows in batch
order (admitted while training, only looked up while evaluating), evicted rows start
afresh before any ID reads them, the maps travel in the checkpoint so that a resumed
run continues exactly, and a job's ranks keep identical maps, those of one process on the
same global batches, under every sharding of the rows."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dlrmflow.bench.spawn import run_spawned_job
from dlrmflow.config import RunConfig
from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.kernels.id_map_shards import ShardedIdMap
from dlrmflow.kernels.optimizers import RowWiseAdagrad
from dlrmflow.kernels.row_cache import SLOT_BOOKKEEPING_BYTES
from dlrmflow.kernels.tbe import initial_rows
from dlrmflow.schema import SchemaError, parse_schema
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.dlrm import DLRM
from dlrmflow.train.model.dynamic_ids import (
    DynamicIdEmbeddings,
    DynamicTable,
    held_shards,
    map_bytes,
)
from dlrmflow.train.model.embeddings import InMemoryEmbeddings
from dlrmflow.train.model.parallelize import build_model, parallelize
from dlrmflow.train.model.plan import SHARDING_TYPES, ShardingPlan
from dlrmflow.train.model.sharded import TierStorage
from dlrmflow.train.planner import cpu_topology, plan_sharding
from dlrmflow.train.planner.jobs import tables_from_spec
from dlrmflow.train.run.checkpoint import model_state
from tests.train.model.global_batches import train_share, train_whole

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


# A job: the maps at 2 ranks, under every sharding of the dynamic table, against one process
# on the same global batches (rank r holding rows r*BATCH:(r+1)*BATCH of each). The map has
# 3 shards: rank 0 holds two of them, rank 1 one, and IDs cross to their holders.
JOB_MAP = {"admit_after": 2, "ttl": 3, "evict_every": 2, "map_shards": 3}
JOB_SPEC = FeatureSpec(
    dense=("x",),
    sparse=(
        SparseFeature("a", 40, DIM, table="t", ids="dynamic", **JOB_MAP),
        SparseFeature("u", 23, DIM),
        SparseFeature("b", 40, DIM, table="t", ids="dynamic", **JOB_MAP),
    ),
)
JOB_CONFIG = RunConfig.model_validate(
    {"model": {"embedding_dim": DIM, "bottom_mlp": [8, DIM], "top_mlp": [8]}, "train": {"seed": 3}}
)
JOB_STEPS, BATCH, LR = 10, 6, 0.1


def _job_batches(world: int) -> list[Batch]:
    """Raw IDs from 60 (more than the table's 39 rows besides the default), far from 0."""
    batches = []
    for s in range(JOB_STEPS):
        gen = torch.Generator().manual_seed(700 + s)
        n = BATCH * world
        lengths = torch.randint(0, 3, (3, n), generator=gen)
        lengths[1] = 1
        a, b = (torch.randint(0, 60, (int(lengths[k].sum()),), generator=gen) for k in (0, 2))
        u = torch.randint(0, 23, (n,), generator=gen)
        values = torch.cat([a + 2**40, u, b + 2**40])
        sparse = KeyedJaggedTensor(["a", "u", "b"], values, lengths.reshape(-1).int())
        dense = torch.rand(n, 1, generator=gen)
        batches.append(Batch(dense, sparse, (torch.rand(n, generator=gen) < 0.3).float()))
    return batches


def _on_disk(plan: ShardingPlan, rank: int, directory: Path) -> tuple[ShardingPlan, TierStorage]:
    """``plan`` with the dynamic table's shards on SSD, and ``rank``'s storage for them: a
    cache as large as the table, so that freed rows are cached when they are reset."""
    tables = tuple(
        dataclasses.replace(
            t, shards=tuple(dataclasses.replace(s, tier="ssd" if t.name == "t" else "device")
                            for s in t.shards)
        )
        for t in plan.tables
    )  # fmt: skip
    plan = dataclasses.replace(plan, tables=tables)
    mine = plan.shards_on(rank)
    kept = sum(4 * s.rows * (s.cols + 1) for _, s in mine if s.tier == "device")
    slot = 4 * (DIM + 1) + SLOT_BOOKKEEPING_BYTES
    return plan, TierStorage(directory / f"rank{rank}", kept + 40 * slot)


def _dynamic_job(rank: int, world: int, out_dir: str, cases: list[tuple[str, bool]]) -> dict:
    from dlrmflow.train.model.parallelize import sharded_dlrm

    torch.use_deterministic_algorithms(True)
    out = {}
    for sharding, disk in cases:
        plan = plan_sharding(
            tables_from_spec(JOB_SPEC), cpu_topology(world, world), BATCH, force=sharding
        )
        name = f"{sharding}-disk" if disk else sharding
        tiers = None
        if disk:
            plan, tiers = _on_disk(plan, rank, Path(out_dir) / f"{name}-rows")
        torch.manual_seed(JOB_CONFIG.train.seed)
        model = sharded_dlrm(JOB_SPEC, JOB_CONFIG, plan, RowWiseAdagrad(lr=LR), tiers=tiers)
        holds_t = any(t.name == "t" for t, _ in plan.shards_on(rank))
        assert (model.embeddings.inner.inner.tiered is not None) == (disk and holds_t)
        optimizer = torch.optim.Adagrad(model.dense_parameters(), lr=LR)
        train_share(model, optimizer, _job_batches(world), rank, world, BATCH)
        path = Path(out_dir) / name
        dcp.save(model_state(model, optimizer), checkpoint_id=str(path))
        out[name] = (str(path), model.embeddings.maps["t"].arrays())
    return out


def _one_process() -> DLRM:
    torch.manual_seed(JOB_CONFIG.train.seed)
    model = parallelize(
        build_model(JOB_CONFIG, JOB_SPEC),
        JOB_CONFIG,
        device=torch.device("cpu"),
        optimizer=RowWiseAdagrad(lr=LR),
    )
    assert isinstance(model.embeddings, DynamicIdEmbeddings)
    return model


def test_a_job_maps_every_ranks_ids_as_one_process_maps_the_global_batch(tmp_path):
    world = 2
    reference = _one_process()
    optimizer = torch.optim.Adagrad(reference.dense_parameters(), lr=LR)
    train_whole(reference, optimizer, _job_batches(world))
    want_maps = reference.embeddings.maps["t"].arrays()
    assert reference.embeddings.take_stats()["t"].evicted > 0  # rows were freed and reset
    want = model_state(reference, optimizer)
    # Every sharding in memory; on disk, shards holding whole rows of the table or part.
    cases = [(s, False) for s in SHARDING_TYPES] + [("table_wise", True), ("row_wise", True)]
    ranks = run_spawned_job(
        _dynamic_job, world, str(tmp_path), cases, threads=1, timeout=timedelta(seconds=120)
    )
    for sharding in ranks[0].result:
        path = ranks[0].result[sharding][0]
        held = [r.result[sharding][1] for r in ranks]
        assert held[0].keys() & held[1].keys() == set()  # each shard on one rank
        assert {k.split(".")[0] for k in held[0]} == {"0", "2"}
        together = {**held[0], **held[1]}
        assert together.keys() == want_maps.keys()
        for key, array in want_maps.items():  # the shards are exactly one process's
            assert np.array_equal(together[key], array), (sharding, key)
        loaded = _one_process()
        state = model_state(loaded, torch.optim.Adagrad(loaded.dense_parameters(), lr=LR))
        dcp.load(state, checkpoint_id=path)
        for key in want:
            got, expected = state[key], want[key]
            if not isinstance(expected, torch.Tensor) or not expected.is_floating_point():
                assert torch.equal(torch.as_tensor(got), torch.as_tensor(expected)), key
                continue
            worst = float((got - expected).abs().max()) if expected.numel() else 0.0
            assert worst <= 2e-5, f"{sharding} {key}: differs by {worst:.2e}"


def test_a_jobs_ranks_hold_the_shards_in_turn_and_count_only_theirs():
    tables = [
        DynamicTable("x", ("x",), 100, DIM, shards=3),
        DynamicTable("y", ("y",), 50, DIM),
        DynamicTable("z", ("z",), 50, DIM),
    ]
    assert held_shards(tables, 0, 2) == {"x": [0, 2], "y": [], "z": [0]}
    assert held_shards(tables, 1, 2) == {"x": [1], "y": [0], "z": []}
    assert held_shards(tables, 0, 1) == {"x": [0, 1, 2], "y": [0], "z": [0]}
    # Memory: a rank of a job counts the shards it holds (the most any rank holds).
    spec = FeatureSpec(dense=("x",), sparse=JOB_SPEC.sparse)
    one, two = map_bytes(spec)["t"], map_bytes(spec, world=2)["t"]
    assert one == ShardedIdMap.bytes_for(40, 3, admit_after=2)
    assert two == ShardedIdMap.bytes_for(40, 3, admit_after=2, owned=[0, 2]) < one
    with pytest.raises(SchemaError, match="item: map_shards is for ids: dynamic"):
        parse_schema(
            {"label": "y", "sparse": [{"column": "item", "ids": "vocab", "map_shards": 2}]}, "s"
        )

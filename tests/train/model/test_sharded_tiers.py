"""Shards on disk in the sharded trainer: bitwise the weights of all-in-memory training.

Each world size (1, 2, 3) runs one spawn of gloo processes. For each sharding type it
trains one plan twice: with the shards of the two large tables on disk (a tiered bag per
rank, its cache a few dozen rows of the hundreds the steps touch, the next batch's rows
prefetched as the trainer does) and with every shard in memory. Both save a checkpoint
(every rank its shards); the test loads each into the one-process model and compares
weights and optimizer state bitwise. World size 2 also resumes a tiered run from a
checkpoint halfway; world size 3 loads world size 2's checkpoints under other plans, into
shards on disk and in memory (resharding both ways), and predicts with them. Last, a
two-rank ``train`` job with train.embedding_memory_bytes, where the planner decides the
tiers, against the same job without it.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from dlrmflow.bench.spawn import run_spawned_job
from dlrmflow.config import RunConfig
from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.kernels.optimizers import RowWiseAdagrad
from dlrmflow.kernels.row_cache import SLOT_BOOKKEEPING_BYTES
from dlrmflow.train.model.dlrm import DLRM
from dlrmflow.train.model.plan import ShardingPlan
from dlrmflow.train.model.sharded.tiers import TierBudgetError, TierStorage
from dlrmflow.train.planner import cpu_topology, plan_sharding, tables_from_spec
from dlrmflow.train.run.checkpoint import model_state
from tests.train.model.test_sharded import random_batch

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
STEPS = 12
BATCH = 6  # per rank
SPEC = FeatureSpec(
    dense=("I1", "I2", "I3"),
    sparse=(
        SparseFeature("C1", 10, 4),
        SparseFeature("C2", 200, 4),
        SparseFeature("C3", 5, 4, "mean"),
        SparseFeature("C4", 300, 4),
    ),
)
ON_DISK = ("C2", "C4")
CONFIG = RunConfig.model_validate(
    {
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8]},
        "train": {"seed": 3, "lr": 0.1},
    }
)
LR = 0.1
# Cache rows per rank: a step's distinct rows of the shards on disk fit (one-hot: at most
# 2 tables x 18 samples; multi-hot: bags of up to 3 IDs), the rows 12 steps touch do not.
CACHE_ROWS = {False: 40, True: 112}
CASES = [
    ("table_wise", False),
    ("row_wise", False),
    ("table_row_wise", False),
    ("column_wise", False),
    ("table_wise", True),
    ("row_wise", True),
]


def tiered_plan(world: int, sharding: str) -> ShardingPlan:
    """The planner's plan with ``sharding`` forced, the shards of ``ON_DISK`` on SSD."""
    plan = plan_sharding(tables_from_spec(SPEC), cpu_topology(world, world), BATCH, force=sharding)
    tables = tuple(
        dataclasses.replace(
            t,
            shards=tuple(
                dataclasses.replace(s, tier="ssd" if t.name in ON_DISK else "device")
                for s in t.shards
            ),
        )
        for t in plan.tables
    )
    return dataclasses.replace(plan, tables=tables)


def in_memory_bytes(plan: ShardingPlan, rank: int) -> int:
    """What ``rank`` keeps in memory: its device shards' rows and row-wise Adagrad state."""
    return sum(4 * s.rows * (s.cols + 1) for _, s in plan.shards_on(rank) if s.tier == "device")


def budget_for(plan: ShardingPlan, rank: int, cache_rows: int) -> int:
    """The memory budget that leaves ``rank`` a cache of ``cache_rows`` rows, each slot as
    wide as its widest record on disk (a row and its row-wise Adagrad state) plus its
    bookkeeping."""
    widths = [s.cols + 1 for _, s in plan.shards_on(rank) if s.tier != "device"]
    return in_memory_bytes(plan, rank) + cache_rows * (
        4 * max(widths, default=1) + SLOT_BOOKKEEPING_BYTES
    )


def global_batch(step: int, world: int, multi_hot: bool) -> Batch:
    """Deterministic random data: one-hot with empty bags, or multi-hot bags of 0-3 IDs."""
    return random_batch(SPEC, BATCH * world, 500 + step, multi_hot)


def _model(plan: ShardingPlan, rank: int, tiers_dir: Path | None, cache_rows: int):
    from dlrmflow.train.model.parallelize import sharded_dlrm

    torch.manual_seed(CONFIG.train.seed)
    tiers = None
    if tiers_dir is not None:
        tiers = TierStorage(tiers_dir / f"rank{rank}", budget_for(plan, rank, cache_rows))
    model = sharded_dlrm(SPEC, CONFIG, plan, RowWiseAdagrad(lr=LR), tiers=tiers)
    return model, torch.optim.Adagrad(model.dense_parameters(), lr=LR)


def _train(model, optimizer, batches: list[Batch], world: int, prefetch: bool) -> None:
    """The trainer's order: the next batch's input exchange in the background; with
    ``prefetch``, its rows on disk requested after this forward, before this backward."""
    loss_fn = nn.BCEWithLogitsLoss(reduction="sum")
    pending = model.embeddings.start_input_dist(batches[0].sparse, async_op=prefetch)
    for step, batch in enumerate(batches):
        received = pending.wait()
        following = None
        if step + 1 < len(batches) and prefetch:
            following = model.embeddings.start_input_dist(batches[step + 1].sparse, async_op=True)
        logits = model.forward_received(batch.dense, received)
        if following is not None:
            model.embeddings.prefetch(following.wait())
        loss = loss_fn(logits, batch.labels) * world / sum(received.batch_sizes)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step + 1 < len(batches):
            pending = following or model.embeddings.start_input_dist(batches[step + 1].sparse)


def _rank_batches(rank: int, world: int, multi_hot: bool, steps: range) -> list[Batch]:
    rows = torch.arange(rank * BATCH, (rank + 1) * BATCH)
    return [global_batch(step, world, multi_hot).take(rows) for step in steps]


def restore_state(model, optimizer, path: str) -> None:
    """What ``dlrmflow.train.run.checkpoint.restore`` does with the model's part of a
    checkpoint: load in place, then let the embeddings write what the load filled."""
    state = model_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    embeddings = {k.removeprefix("emb."): v for k, v in state.items() if k.startswith("emb.")}
    model.embeddings.after_checkpoint_load(embeddings)


def _save(model, optimizer, path: Path) -> str:
    model.embeddings.flush()
    dcp.save(model_state(model, optimizer), checkpoint_id=str(path))
    return str(path)


def _run_case(rank: int, world: int, out: Path, sharding: str, multi_hot: bool, tag: str):
    """One training of ``STEPS`` steps; ``tag`` says how: "memory", "tiered" (prefetched),
    "no_prefetch" (tiered, the exchange not pipelined), "resume" (tiered, restarted from a
    checkpoint after half the steps in a new model and directory)."""
    name = f"{sharding}-{multi_hot}-{tag}"
    plan = tiered_plan(world, sharding)
    tiered = tag != "memory"
    cache = CACHE_ROWS[multi_hot]
    model, optimizer = _model(plan, rank, out / name if tiered else None, cache)
    half = STEPS // 2 if tag == "resume" else STEPS
    _train(
        model,
        optimizer,
        _rank_batches(rank, world, multi_hot, range(half)),
        world,
        tag != "no_prefetch",
    )
    stats = model.embeddings.cache_stats()
    if tag == "resume":
        first = _save(model, optimizer, out / f"{name}-half")
        model, optimizer = _model(plan, rank, out / f"{name}-again", cache)
        restore_state(model, optimizer, first)
        batches = _rank_batches(rank, world, multi_hot, range(half, STEPS))
        _train(model, optimizer, batches, world, True)
    bag = model.embeddings.tiered
    return {
        "checkpoint": _save(model, optimizer, out / name),
        "cache": None if stats is None else stats.to_dict(),
        "cache_rows": None if bag is None else bag.cache_rows,
        "tiered_shards": 0 if bag is None else len(bag.names),
    }


# Rows per checkpoint item in these jobs: every shard of the 200- and 300-row tables is
# saved and loaded in several chunks (the default is 2**18 rows).
CHUNK_ROWS = 64


def _small_chunks() -> None:
    from dlrmflow.train.model.sharded import checkpoint as sharded

    sharded.CHECKPOINT_CHUNK_ROWS = CHUNK_ROWS


def _job(rank: int, world: int, out: str, cases: list) -> dict:
    torch.use_deterministic_algorithms(True)
    _small_chunks()
    return {case: _run_case(rank, world, Path(out), *case) for case in cases}


def run_job(out: Path, world: int, cases: list) -> list[dict]:
    ranks = run_spawned_job(_job, world, str(out), cases, threads=1, timeout=COLLECTIVE_TIMEOUT)
    return [r.result for r in ranks]


def load_single_process(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint loaded into the one-process DLRM: its weights and optimizer state."""
    model = DLRM(SPEC, CONFIG.model, RowWiseAdagrad(lr=LR))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR)
    dcp.load(model_state(model, optimizer), checkpoint_id=path)
    return model.state_dict()


def assert_bitwise_equal(got: str, want: str, case) -> None:
    a, b = load_single_process(got), load_single_process(want)
    assert a.keys() == b.keys()
    for key in b:
        assert torch.equal(a[key], b[key]), (case, key)


def check_world(results: list[dict], world: int, cases: list) -> None:
    """Tiered == in memory, bitwise; the caches were as small as asked and evicted."""
    for sharding, multi_hot in cases:
        memory = results[0][(sharding, multi_hot, "memory")]
        tiered = results[0][(sharding, multi_hot, "tiered")]
        assert_bitwise_equal(tiered["checkpoint"], memory["checkpoint"], (world, sharding))
        shards = sum(r[(sharding, multi_hot, "tiered")]["tiered_shards"] for r in results)
        assert shards == len(ON_DISK) * (world if sharding != "table_wise" else 1)
        for r in results:
            rows = r[(sharding, multi_hot, "tiered")]["cache_rows"]
            assert rows in (None, CACHE_ROWS[multi_hot])  # the budget's rest, exactly
        cache = tiered["cache"]
        assert cache["evictions"] > 0 and cache["writebacks"] > 0, (world, sharding, cache)
        assert 0 < cache["hit_rate"] < 1 and cache["prefetched"] > 0


def world_cases(extra: list) -> list:
    return [(s, mh, tag) for s, mh in CASES for tag in ("memory", "tiered")] + extra


@pytest.mark.parametrize("world", [1, 3])
def test_shards_on_disk_train_to_the_in_memory_weights(tmp_path: Path, world: int) -> None:
    results = run_job(tmp_path, world, world_cases([]))
    check_world(results, world, CASES)


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    extra = [("row_wise", True, "no_prefetch"), ("table_wise", False, "resume")]
    return run_job(tmp_path_factory.mktemp("tiers2"), 2, world_cases(extra))


def test_world_size_two_trains_to_the_in_memory_weights(world2: list[dict]) -> None:
    check_world(world2, 2, CASES)


def test_checkpoints_hold_each_shard_in_chunks(world2: list[dict]) -> None:
    """A 300-row table split row-wise over 2 ranks is saved as 64-row items, however its
    shards live: a shard on disk passes through a rank's memory one item at a time."""
    for tag in ("tiered", "memory"):
        path = world2[0][("row_wise", False, tag)]["checkpoint"]
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        rows = [c.sizes[0] for c in metadata["emb.C4.weight"].chunks]
        assert sorted(rows) == [22, 22, 64, 64, 64, 64], (tag, rows)
        assert sum(c.sizes[0] for c in metadata["emb.C4.sum_squares"].chunks) == 300


def test_without_prefetch_and_after_a_resume_the_weights_are_the_same(
    world2: list[dict],
) -> None:
    for case, tag in ((("row_wise", True), "no_prefetch"), (("table_wise", False), "resume")):
        got = world2[0][(*case, tag)]
        assert_bitwise_equal(got["checkpoint"], world2[0][(*case, "memory")]["checkpoint"], tag)
        if tag == "no_prefetch":
            assert got["cache"]["prefetched"] == 0 and got["cache"]["evictions"] > 0


def _reshard(rank: int, world: int, out: str, sources: dict[str, str]) -> dict:
    """Load world size 2's checkpoints under other plans at world size 3, tiered and in
    memory; predict on a probe batch (after a forward that cached the initial rows, so
    stale cached rows would show) and save again."""
    torch.use_deterministic_algorithms(True)
    probe = global_batch(99, world, False).take(torch.arange(rank * BATCH, (rank + 1) * BATCH))
    saved = {}
    for source, (sharding, tiered) in (
        ("tiered", ("row_wise", False)),
        ("memory", ("table_wise", True)),
    ):
        plan = tiered_plan(world, sharding)
        model, optimizer = _model(plan, rank, Path(out) / source if tiered else None, 40)
        model.eval()
        with torch.no_grad():
            model(probe.dense, probe.sparse)
        restore_state(model, optimizer, sources[source])
        with torch.no_grad():
            logits = model(probe.dense, probe.sparse)
        every = [torch.empty(0)] * world
        dist.all_gather_object(every, logits)
        saved[source] = {
            "checkpoint": _save(model, optimizer, Path(out) / f"from-{source}"),
            "logits": torch.cat(every),
            "tiered": model.embeddings.tiered is not None,
        }
    return saved


def test_checkpoints_reshard_between_disk_and_memory(tmp_path: Path, world2: list[dict]) -> None:
    """World size 2 with shards on disk -> 3 ranks all in memory (another plan), and world
    size 2 all in memory -> 3 ranks with shards on disk: the same tensors, and the
    predictions of the one-process model loaded from the source."""
    sources = {
        "tiered": world2[0][("table_wise", False, "tiered")]["checkpoint"],
        "memory": world2[0][("row_wise", False, "memory")]["checkpoint"],
    }
    ranks = run_spawned_job(
        _reshard, 3, str(tmp_path), sources, threads=1, timeout=COLLECTIVE_TIMEOUT
    )
    result = ranks[0].result
    assert not result["tiered"]["tiered"]  # row_wise, in memory...
    assert any(r.result["memory"]["tiered"] for r in ranks)  # ...table_wise, partly on disk
    probe = global_batch(99, 3, False)
    for source, path in sources.items():
        assert_bitwise_equal(result[source]["checkpoint"], path, source)
        model = DLRM(SPEC, CONFIG.model, RowWiseAdagrad(lr=LR))
        dcp.load(model_state(model, torch.optim.Adagrad(model.parameters())), checkpoint_id=path)
        model.eval()
        with torch.no_grad():
            want = model(probe.dense, probe.sparse)
        torch.testing.assert_close(result[source]["logits"], want, atol=1e-6, rtol=1e-6)


def _too_small(rank: int, world: int) -> str:
    plan = tiered_plan(world, "table_wise")
    budget = in_memory_bytes(plan, rank)  # nothing left for the cache
    from dlrmflow.train.model.parallelize import sharded_dlrm

    try:
        sharded_dlrm(
            SPEC,
            CONFIG,
            plan,
            RowWiseAdagrad(lr=LR),
            tiers=TierStorage(Path("/nonexistent"), budget),
        )
    except TierBudgetError as e:
        return str(e)
    return ""


def test_a_budget_without_room_for_the_cache_fails_naming_the_key() -> None:
    (result,) = run_spawned_job(_too_small, 1, threads=1, timeout=COLLECTIVE_TIMEOUT)
    assert result.result.startswith("train.embedding_memory_bytes: rank 0 keeps ")
    assert "no room for a cache of its 500 rows on disk" in result.result


def test_a_job_with_an_embedding_budget_trains_as_in_memory(tiny_dataset: str, tmp_path: Path):
    """``train --nproc 2`` with train.embedding_memory_bytes per rank: the plan puts shards
    on disk on both ranks, the job stops at a checkpoint and resumes, and the weights are
    bitwise those of the job without a budget (row-wise forced on both: the same shards,
    other tiers); the result sums both ranks' cache counters."""
    from safetensors.torch import load_file

    from dlrmflow.train.launch.job import launch_evaluation, launch_training
    from dlrmflow.train.run.checkpoint import load_checkpoint
    from dlrmflow.train.run.evaluate import evaluate
    from dlrmflow.train.run.export import export_model
    from tests.conftest import tiny_run_config

    def config(name: str, budget: int | None, steps: int) -> RunConfig:
        cfg = tiny_run_config(
            tiny_dataset,
            tmp_path / name,
            batch_size=16,
            max_steps=steps,
            checkpoint_every=6,
            embedding_memory_bytes=budget,
        )
        cfg.distributed.nproc = 2
        cfg.distributed.sharding = "row_wise"
        return cfg

    # Bytes per rank, of the ~1 MB of rows and state each holds: one table's shard (18 KB)
    # stays in memory, the cache holds 193 rows (65 bytes each with their bookkeeping), a
    # step needs about 100.
    budget = 31_000
    launch_training(config("memory", None, 12))
    launch_training(config("disk", budget, 6))
    result = launch_training(config("disk", budget, 12))
    assert result is not None and result.resumed_from_step == 6 and result.steps == 12
    plan = ShardingPlan.from_dict(json.loads((tmp_path / "disk" / "plan.json").read_text()))
    for rank in range(2):
        tiers = {s.tier for _, s in plan.shards_on(rank)}
        assert tiers == {"device", "ssd"}, rank
        assert (tmp_path / "disk" / "embeddings" / f"rank{rank}" / "embeddings.tiered").is_file()
    cache = result.embedding_cache
    assert cache["evictions"] > 0 and cache["prefetched"] > 0 and 0 < cache["hit_rate"] < 1
    got = load_checkpoint(tmp_path / "disk").model.state_dict()
    want = load_checkpoint(tmp_path / "memory").model.state_dict()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    # Exported whole, the tables of the shards on disk are those of the in-memory job.
    exported = {}
    for name in ("disk", "memory"):
        export_model(tmp_path / name, tmp_path / f"{name}.safetensors")
        exported[name] = load_file(tmp_path / f"{name}.safetensors")
    assert exported["disk"].keys() == exported["memory"].keys()
    assert all(torch.equal(exported["disk"][k], v) for k, v in exported["memory"].items())
    # Evaluated by 2 ranks under the same budget: the in-memory job's metrics, shards on
    # disk in a scratch directory that is gone afterwards, each rank's peak reported.
    scored = launch_evaluation(tmp_path / "disk", 2)
    want_metrics = evaluate(tmp_path / "memory")
    assert scored["auc"] == pytest.approx(want_metrics["auc"], abs=1e-6)
    assert scored["logloss"] == pytest.approx(want_metrics["logloss"], abs=1e-6)
    assert len(scored["peak_rss_bytes"]) == 2 and min(scored["peak_rss_bytes"]) > 0
    assert not list((tmp_path / "disk" / "embeddings").glob("eval-rank*"))

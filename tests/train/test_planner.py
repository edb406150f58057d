"""The sharding planner: valid plans for every sharding type, constraints, tiers, balance,
errors that say by how much, the paper-scale model, and the printed and JSON forms."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dlrmflow.config import build_config
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.train.planner import (
    PlanningError,
    TableSpec,
    Topology,
    evaluate_plan,
    format_plan,
    paper_12t,
    plan_for_config,
    plan_sharding,
    tables_from_spec,
)
from dlrmflow.train.sharding import SHARDING_TYPES, Shard, ShardingPlan, TablePlan

# uneven rows and dims, one table with fewer rows than some world sizes
TINY = [
    TableSpec("a", rows=10, dim=4),
    TableSpec("b", rows=7, dim=3, pooling_factor=2.0, access_frequency=0.5),
    TableSpec("c", rows=2, dim=5),
    TableSpec("d", rows=1000, dim=8, pooling_factor=3.0),
]
LAYOUTS = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3)]


def tiny_topology(world_size: int, ranks_per_host: int) -> Topology:
    return Topology(world_size, ranks_per_host, device_bytes=1e9, dram_bytes=0, ssd_bytes=0)


def row_sizes(shards) -> list[int]:
    ordered = sorted(shards, key=lambda s: s.row_start)
    assert [s.row_start for s in ordered[1:]] == [s.row_end for s in ordered[:-1]]
    return [s.rows for s in ordered]


@pytest.mark.parametrize("force", SHARDING_TYPES)
@pytest.mark.parametrize(("world_size", "ranks_per_host"), LAYOUTS)
def test_every_forced_type_gives_a_valid_plan(force, world_size, ranks_per_host):
    plan = plan_sharding(TINY, tiny_topology(world_size, ranks_per_host), 16, force=force)
    plan.validate()
    assert [t.name for t in plan.tables] == [t.name for t in TINY]
    for spec, t in zip(TINY, plan.tables, strict=True):
        assert t.sharding == force
        assert len(set(t.ranks)) == len(t.ranks)
        if world_size == 1:
            assert t.shards == (Shard(0, 0, spec.rows, 0, spec.dim, "device"),)
            continue
        if force == "data_parallel":
            assert sorted(t.ranks) == list(range(world_size))
        elif force == "table_wise":
            assert len(t.shards) == 1
        elif force == "column_wise":
            cols = sorted((s.col_start, s.col_end) for s in t.shards)
            assert len(cols) == min(world_size, spec.dim)
            assert all(s.rows == spec.rows for s in t.shards)
            widths = [b - a for a, b in cols]
            assert max(widths) - min(widths) <= 1
        else:
            group = world_size if force == "row_wise" else ranks_per_host
            sizes = row_sizes(t.shards)
            assert len(sizes) == min(group, spec.rows)
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)
            if force == "table_row_wise":
                assert len({r // ranks_per_host for r in t.ranks}) == 1


def test_row_wise_splits_ten_rows_over_three_ranks_as_four_three_three():
    plan = plan_sharding(TINY, tiny_topology(3, 1), 16, force="row_wise")
    a = plan.table("a")
    assert [(s.rank, s.row_start, s.row_end) for s in a.shards] == [
        (0, 0, 4),
        (1, 4, 7),
        (2, 7, 10),
    ]
    assert row_sizes(plan.table("c").shards) == [1, 1]  # 2 rows: two ranks, not an empty shard


def test_auto_plans_are_valid_and_deterministic():
    for world_size, ranks_per_host in [*LAYOUTS, (4, 2)]:
        topology = tiny_topology(world_size, ranks_per_host)
        first = plan_sharding(TINY, topology, 16)
        second = plan_sharding(TINY, topology, 16)
        first.validate()
        assert first == second
        assert first.estimates["load_seconds"] == second.estimates["load_seconds"]


def test_pinned_tables_keep_their_type_and_win_over_force():
    pins = {"a": "row_wise", "b": "column_wise", "c": "data_parallel", "d": "table_row_wise"}
    plan = plan_sharding(TINY, tiny_topology(4, 2), 16, constraints=pins, force="table_wise")
    assert {t.name: t.sharding for t in plan.tables} == pins
    assert sorted(plan.table("c").ranks) == [0, 1, 2, 3]
    assert len({r // 2 for r in plan.table("d").ranks}) == 1

    plan = plan_sharding(TINY, tiny_topology(4, 2), 16, constraints={"a": "row_wise"})
    assert plan.table("a").sharding == "row_wise"
    assert row_sizes(plan.table("a").shards) == [3, 3, 2, 2]


def test_bad_inputs_name_what_is_wrong():
    topology = tiny_topology(2, 1)
    with pytest.raises(PlanningError, match=r"\['nope'\]"):
        plan_sharding(TINY, topology, 16, constraints={"nope": "row_wise"})
    with pytest.raises(PlanningError, match="a: unknown sharding type 'diagonal'"):
        plan_sharding(TINY, topology, 16, constraints={"a": "diagonal"})
    with pytest.raises(PlanningError, match=r"repeated: \['a'\]"):
        plan_sharding([*TINY, TableSpec("a", 3, 3)], topology, 16)
    with pytest.raises(ValueError, match="not a multiple"):
        Topology(6, 4, 1e9, 0, 0)


def skewed_tables(n: int = 40) -> list[TableSpec]:
    rng = np.random.default_rng(3)
    rows = (2e6 / np.arange(1, n + 1) ** 1.2).astype(int) + 100
    return [
        TableSpec(
            f"f{i}",
            int(rows[i]),
            int(rng.choice([16, 32, 64, 128])),
            float(min(rng.zipf(1.8), 50)),
            float(rng.uniform(0.2, 1.0)),
        )
        for i in rng.permutation(n)
    ]


def test_balance_beats_round_robin_on_a_skewed_model():
    tables = skewed_tables()
    # device memory for the hottest tables only: the rest are read from DRAM, more slowly
    topology = Topology(8, 4, device_bytes=0.2e9, dram_bytes=8e9, ssd_bytes=0)
    plan = plan_sharding(tables, topology, 1024)
    # the naive baseline: whole tables dealt out in turn, each in the planner's tier
    round_robin = ShardingPlan(
        world_size=8,
        ranks_per_host=4,
        tables=tuple(
            TablePlan(
                t.name,
                t.rows,
                t.dim,
                "table_wise",
                (Shard(i % 8, 0, t.rows, 0, t.dim, plan.table(t.name).shards[0].tier),),
            )
            for i, t in enumerate(tables)
        ),
    )
    naive = evaluate_plan(round_robin, tables, topology, 1024)
    planned = plan.estimates
    assert max(planned["load_seconds"]) < 0.75 * max(naive["load_seconds"])
    assert planned["max_over_mean_load"] <= 1.10 < naive["max_over_mean_load"]


def test_estimates_agree_with_evaluating_the_plan():
    tables = skewed_tables(12)
    topology = Topology(4, 2, device_bytes=1e9, dram_bytes=8e9, ssd_bytes=0)
    plan = plan_sharding(tables, topology, 256)
    again = evaluate_plan(plan, tables, topology, 256)
    planner_only = ("refine_rounds", "planning_seconds")
    assert again == {k: v for k, v in plan.estimates.items() if k not in planner_only}
    loads = np.array(plan.estimates["load_seconds"])
    assert plan.estimates["max_over_mean_load"] == pytest.approx(loads.max() / loads.mean())
    for tier, per_rank in plan.estimates["memory_bytes"].items():
        assert max(per_rank) <= getattr(topology, f"{tier}_bytes")


def test_cost_model_counts_the_bytes_of_each_sharding():
    # 100 x 8 float32, 1 ID per sample, 10 samples a rank, 4 ranks in 2 hosts
    table = TableSpec("t", rows=100, dim=8, pooling_factor=2.0, access_frequency=0.5)
    topology = tiny_topology(4, 2)

    def totals(kind: str) -> dict:
        plan = plan_sharding([table], topology, 10, force=kind)
        return evaluate_plan(plan, [table], topology, 10)["totals"]

    tw = totals("table_wise")
    # per other rank: 10 IDs x 8 B + 10 lengths x 4 B in, 10 pooled x 32 B out and back
    assert (tw["all_to_all_intra_host_bytes"], tw["all_to_all_inter_host_bytes"]) == (760, 1520)
    # 40 IDs, each row read, then read and written (3 x 32 B), its Adagrad float twice
    assert tw["lookup_bytes"] == 40 * (3 * 32 + 2 * 4)
    assert tw["allreduce_bytes"] == 0
    assert tw["memory_bytes"]["device"] == 100 * (32 + 4)

    rw, twrw = totals("row_wise"), totals("table_row_wise")
    assert rw["lookup_bytes"] == twrw["lookup_bytes"] == tw["lookup_bytes"]
    # every row-wise shard sends a partial sum per sample to every rank...
    assert rw["all_to_all_inter_host_bytes"] == 4 * (60 + 640) * 2
    # ...table-row-wise sums them inside the host: about table-wise's inter-host bytes
    assert twrw["all_to_all_inter_host_bytes"] == 2 * 2 * (80 + 320)
    assert twrw["all_to_all_intra_host_bytes"] > tw["all_to_all_intra_host_bytes"]

    dp = totals("data_parallel")
    # per rank: reduce-scatter and all-gather in the host (2 x 1/2 x 3200 B), then the
    # cross-host allreduce of its half (2 x 1/2 x 1600 B)
    assert dp["allreduce_bytes"] == 4 * (3200 + 1600)
    assert dp["all_to_all_inter_host_bytes"] == 0
    assert dp["memory_bytes"]["device"] == 4 * 100 * 36


def test_tiny_tables_are_replicated_when_that_is_cheaper():
    tables = [TableSpec("tiny", rows=10, dim=4), TableSpec("big", rows=100_000, dim=64)]
    plan = plan_sharding(tables, tiny_topology(4, 2), 1024)
    # allreducing 160 B beats sending 1024 pooled vectors to 3 ranks; 25.6 MB does not
    assert plan.table("tiny").sharding == "data_parallel"
    assert plan.table("big").sharding != "data_parallel"
    assert plan.estimates["totals"]["allreduce_bytes"] > 0


def test_hot_tables_get_the_fast_tier_and_slow_tiers_cost_more():
    # 680 kB and 816 kB: device memory has room for either one, not for both
    hot = TableSpec("hot", rows=10_000, dim=16, pooling_factor=20.0)
    cold = TableSpec("cold", rows=12_000, dim=16, access_frequency=0.1)
    topology = Topology(1, 1, device_bytes=1e6, dram_bytes=1e8, ssd_bytes=1e9)
    plan = plan_sharding([hot, cold], topology, 64, force="table_wise")
    assert {s.tier for s in plan.table("hot").shards} == {"device"}
    assert {s.tier for s in plan.table("cold").shards} == {"dram"}

    # 952 kB: past the slack tiers are planned with, yet it fits, so it ends in device memory
    snug = plan_sharding([TableSpec("snug", 14_000, 16)], topology, 64)
    assert snug.table("snug").shards[0].tier == "device"

    def with_tier(tier: str) -> ShardingPlan:
        data = plan.to_dict()
        for t in data["tables"]:
            for s in t["shards"]:
                s["tier"] = tier
        return ShardingPlan.from_dict(data)

    seconds = [
        evaluate_plan(with_tier(tier), [hot, cold], topology, 64)["totals"]["load_seconds"]
        for tier in ("device", "dram", "ssd")
    ]
    assert seconds[0] < seconds[1] < seconds[2]


def test_a_model_that_cannot_fit_says_by_how_much():
    # 100M rows x 16 float32 + a row-wise Adagrad float per row: 6.8 GB, on 2 x 1 GB
    big = [TableSpec("huge", rows=100_000_000, dim=16)]
    with pytest.raises(
        PlanningError, match=r"needs 6\.8 GB but the 2 ranks have 2\.0 GB .*4\.8 GB short"
    ):
        plan_sharding(big, Topology(2, 1, 0.5e9, 0.5e9, 0), 16)
    # it fits across the job, but not as one table-wise shard on one rank
    fits_split = Topology(8, 4, device_bytes=1e9, dram_bytes=0, ssd_bytes=0)
    with pytest.raises(PlanningError, match=r"table huge: .*6\.8 GB.*1\.0 GB: 5\.8 GB short"):
        plan_sharding(big, fits_split, 16, force="table_wise")
    plan = plan_sharding(big, fits_split, 16)
    assert plan.table("huge").sharding in ("row_wise", "column_wise")


def test_paper_scale_model_plans_fast_and_balanced():
    tables, topology, batch_size = paper_12t()
    assert (topology.world_size, topology.ranks_per_host) == (128, 8)
    assert 11.5e12 < sum(t.rows * t.dim for t in tables) < 12.5e12
    assert len(tables) >= 300
    assert min(t.rows for t in tables) < 10_000 and max(t.rows for t in tables) > 1e9
    assert {t.dim for t in tables} <= set(range(64, 257))
    assert paper_12t() == (tables, topology, batch_size)

    plan = plan_sharding(tables, topology, batch_size)
    plan.validate()
    assert plan.estimates["planning_seconds"] < 30
    assert plan.estimates["max_over_mean_load"] <= 1.10
    for tier, per_rank in plan.estimates["memory_bytes"].items():
        assert max(per_rank) <= getattr(topology, f"{tier}_bytes")
    assert set(plan.estimates["tables_per_sharding"]) == set(SHARDING_TYPES)


def test_plan_round_trips_through_json():
    plan = plan_sharding(TINY, tiny_topology(3, 3), 16, constraints={"d": "row_wise"})
    loaded = ShardingPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert loaded == plan
    assert loaded.estimates == plan.estimates
    loaded.validate()


def test_format_plan_shows_every_rank_and_truncates_many_tables():
    plan = plan_sharding(skewed_tables(), Topology(8, 4, 16e9, 64e9, 0), 1024)
    text = format_plan(plan, max_tables=10)
    rank_lines = [line.split() for line in text.splitlines() if line[:5].strip().isdigit()]
    assert [int(words[0]) for words in rank_lines] == list(range(8))
    loads = [float(words[1]) for words in rank_lines]
    np.testing.assert_allclose(loads, np.array(plan.estimates["load_seconds"]) * 1e3, atol=1e-3)
    assert "30 smaller tables not shown" in text
    assert f"max/mean load: {plan.estimates['max_over_mean_load']:.3f}" in text
    largest = max(plan.tables, key=lambda t: t.rows * t.dim)
    assert any(line.startswith(largest.name + " ") for line in text.splitlines())


def test_plan_for_config_uses_the_configured_sharding_and_batch():
    spec = FeatureSpec(
        dense=("I1",),
        sparse=(SparseFeature("C1", 5000, 16), SparseFeature("C2", 11, 16)),
    )
    assert tables_from_spec(spec) == [TableSpec("C1", 5000, 16), TableSpec("C2", 11, 16)]
    config = build_config({"train": {"batch_size": 64}, "distributed": {"sharding": "row_wise"}})
    plan = plan_for_config(config, spec, world_size=3, ranks_per_host=3)
    assert [t.sharding for t in plan.tables] == ["row_wise", "row_wise"]
    assert row_sizes(plan.table("C2").shards) == [4, 4, 3]
    assert plan.estimates["batch_size_per_rank"] == 64

    auto = plan_for_config(build_config({}), spec, world_size=2, ranks_per_host=2)
    auto.validate()
    assert {t.name for t in auto.tables} == {"C1", "C2"}

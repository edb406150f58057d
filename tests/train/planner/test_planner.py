"""The sharding planner: valid plans for every sharding type, constraints, tiers, balance,
errors that say by how much, the paper-scale model, the printed and JSON forms, what the
dataset's stats.json changes (pooling factors, cache hit rates), and rank 0's plan for all."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dlrmflow.config import build_config
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.stats.cache_hits import lru_hit_rates
from dlrmflow.ingest.stats.results import DatasetStats, SparseStats, write_stats
from dlrmflow.train.model.plan import SHARDING_TYPES, Shard, ShardingPlan, TablePlan
from dlrmflow.train.planner import (
    CACHE_SHARE,
    DISK_BYTES,
    PlanningError,
    TableSpec,
    Topology,
    cpu_topology,
    evaluate_plan,
    format_plan,
    paper_12t,
    plan_for_config,
    plan_for_dataset,
    plan_for_job,
    plan_preset,
    plan_sharding,
    tables_from_spec,
)

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


def test_format_plan_shows_each_ranks_shards_with_load_memory_tier_and_cache_hits():
    tables = skewed_tables(12)
    topology = Topology(4, 2, 0.05e9, 8e9, 0, cache_load_factor=0.1)
    plan = plan_sharding(tables, topology, 1024)
    plan.estimates["statistics"] = "memory://data/stats.json"
    lines = format_plan(plan, max_shards=100).splitlines()
    assert lines[1] == "statistics: memory://data/stats.json"
    assert lines[2] == "cache: 10% of the rows of each DRAM or SSD shard, in device memory"
    heads = [line.split() for line in lines if line.startswith("rank ")]
    assert [words[1] for words in heads] == [f"{r}:" for r in range(4)]
    loads = [float(words[3]) for words in heads]
    np.testing.assert_allclose(loads, np.array(plan.estimates["load_seconds"]) * 1e3, rtol=1e-3)
    per_table = plan.estimates["tables"]
    seen = []
    for line in lines:
        if line.startswith("rank "):
            rank, last_load = int(line.split()[1][:-1]), np.inf
        elif line.startswith("  f"):
            name, sharding, rows, cols, tier, _, _, load_ms, hit = line.split()
            t = plan.table(name)
            (j, shard), *others = [(j, s) for j, s in enumerate(t.shards) if s.rank == rank]
            assert not others and (sharding, tier) == (t.sharding, shard.tier)
            assert rows == ("all" if shard.rows == t.rows else f"{shard.row_start}:{shard.row_end}")
            assert cols == ("all" if shard.cols == t.dim else f"{shard.col_start}:{shard.col_end}")
            load = per_table[name]["load_seconds"][j]
            assert float(load_ms) == pytest.approx(load * 1e3, rel=1e-3)
            assert load <= last_load  # heaviest first
            last_load = load
            rate = per_table[name]["cache_hit_rate"]
            assert hit == ("-" if tier == "device" else f"{rate:.1%}")
            seen.append(tier)
    assert len(seen) == sum(len(t.shards) for t in plan.tables)
    assert set(seen) == {"device", "dram"}
    # three heaviest shards a rank, the rest summed up
    text = format_plan(plan, max_shards=3)
    for r in range(4):
        held = sum(1 for t in plan.tables for s in t.shards if s.rank == r)
        if held > 3:
            assert f"  ... {held - 3} more shards" in text
    assert f"max/mean load: {plan.estimates['max_over_mean_load']:.3f}" in text

    default = format_plan(plan_sharding(TINY, tiny_topology(2, 2), 16))
    assert "cache:" not in default and "%" not in default
    uncached = format_plan(plan_sharding(tables, Topology(4, 2, 0.05e9, 8e9, 0), 1024), 100)
    dram = [words for words in map(str.split, uncached.splitlines()) if words[4:5] == ["dram"]]
    assert dram and all(words[-2:] == ["no", "cache"] for words in dram)


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


# -- what the data says: stats.json ----------------------------------------------------------


def _sparse(name: str, **fields) -> SparseStats:
    values = {"rows": 1000, "missing": 0, "empty": 0, "ids": 1000, "distinct": 500}
    values.update(fields)
    return SparseStats(name, max_length=1, **values)


def _dataset_stats(url: str, *sparse: SparseStats) -> DatasetStats:
    return DatasetStats(url, 1000, 30, 1, True, (), sparse)


# Che's hit rates of 10,000 IDs accessed Zipf-like, and evenly (100 times each)
ZIPF_HITS = lru_hit_rates(np.floor(1e5 * np.arange(1, 10_001) ** -1.1) + 1)
EVEN_HITS = lru_hit_rates(np.full(10_000, 100.0))


def test_pooling_factor_and_access_rate_from_stats_scale_lookup_bytes():
    spec = FeatureSpec(
        dense=("I1",), sparse=(SparseFeature("C1", 5000, 16), SparseFeature("C2", 5000, 16))
    )
    stats = _dataset_stats(
        "memory://d",
        _sparse("C1", ids=4000),  # multi-hot: 4 IDs a bag
        _sparse("C2", missing=250, ids=750),  # a quarter of the rows without an ID
    )
    defaults = tables_from_spec(spec)
    measured = tables_from_spec(spec, stats)
    assert [(t.pooling_factor, t.access_frequency) for t in defaults] == [(1, 1), (1, 1)]
    assert [(t.pooling_factor, t.access_frequency) for t in measured] == [(4, 1), (1, 0.75)]
    assert [t.distinct_ids for t in measured] == [500, 500]
    topology = tiny_topology(2, 1)

    def lookup_bytes(table: TableSpec) -> float:
        plan = plan_sharding([table], topology, 64, force="table_wise")
        return plan.estimates["totals"]["lookup_bytes"]

    assert lookup_bytes(measured[0]) == 4 * lookup_bytes(defaults[0])
    assert lookup_bytes(measured[1]) == pytest.approx(0.75 * lookup_bytes(defaults[1]), rel=1e-12)
    with pytest.raises(PlanningError, match=r"table C2: memory://d statistics have no .*C2"):
        tables_from_spec(spec, _dataset_stats("memory://d", _sparse("C1")))


def test_hit_rate_comes_from_the_recorded_skew_and_cache_size():
    skewed = TableSpec("s", 10_000, 16, distinct_ids=10_000, cache_hits=ZIPF_HITS)
    even = TableSpec("e", 10_000, 16, distinct_ids=10_000, cache_hits=EVEN_HITS)
    unknown = TableSpec("u", 10_000, 16)
    assert skewed.hit_rate(0.1) == pytest.approx(dict(ZIPF_HITS)[0.1], rel=1e-12)
    assert skewed.hit_rate(0.1) > 0.5 > 0.11 > even.hit_rate(0.1) > 0.09
    assert unknown.hit_rate(0.1) == 0.1  # no stats: accesses spread evenly over the rows
    assert skewed.hit_rate(0.0) == unknown.hit_rate(0.0) == 0.0
    # twice as many rows as IDs (hash buckets): a cache of 10% of the rows holds 20% of IDs
    sparse_rows = TableSpec("h", 20_000, 16, distinct_ids=10_000, cache_hits=ZIPF_HITS)
    assert sparse_rows.hit_rate(0.1) == pytest.approx(dict(ZIPF_HITS)[0.2], rel=1e-12)


def test_skewed_accesses_take_the_cached_slow_tier_and_cost_less_there():
    """Room in device memory for one of two equal tables: the one whose accesses are skewed
    goes to DRAM behind its cache, whichever it is, and costs less there than the evenly
    accessed one would."""
    topology = Topology(1, 1, device_bytes=0.8e6, dram_bytes=1e8, ssd_bytes=0,
                        cache_load_factor=0.1)  # fmt: skip

    def table(name: str, hits) -> TableSpec:
        return TableSpec(name, 10_000, 16, pooling_factor=4.0, distinct_ids=10_000,
                         cache_hits=hits)  # fmt: skip

    def tiers(plan: ShardingPlan) -> dict[str, str]:
        return {t.name: t.shards[0].tier for t in plan.tables}

    a_skewed = [table("a", ZIPF_HITS), table("b", EVEN_HITS)]
    b_skewed = [table("a", EVEN_HITS), table("b", ZIPF_HITS)]
    plan = plan_sharding(a_skewed, topology, 256, force="table_wise")
    assert tiers(plan) == {"a": "dram", "b": "device"}
    assert tiers(plan_sharding(b_skewed, topology, 256, force="table_wise")) == {
        "a": "device",
        "b": "dram",
    }
    assert plan.estimates["tables"]["a"]["cache_hit_rate"] == pytest.approx(
        a_skewed[0].hit_rate(0.1), rel=1e-12
    )
    assert plan.estimates["tables"]["b"]["cache_hit_rate"] is None  # all in device memory
    # a's lookups: 256 samples x 4 IDs, each row read and written back (3 x 64 B) and its
    # Adagrad float twice; the cache's hits at device bandwidth, its misses at DRAM's
    hit = a_skewed[0].hit_rate(0.1)
    lookup = 256 * 4 * (3 * 64 + 2 * 4)
    expected = lookup * (hit / topology.device_bw + (1 - hit) / topology.dram_bw)
    assert plan.estimates["tables"]["a"]["load_seconds"] == [pytest.approx(expected, rel=1e-12)]
    # the same placement costs more with a's accesses even, and more again without a cache
    both_even = [table("a", EVEN_HITS), table("b", EVEN_HITS)]
    even = evaluate_plan(plan, both_even, topology, 256)["tables"]["a"]["load_seconds"][0]
    no_cache = Topology(1, 1, 0.8e6, 1e8, 0)
    uncached = evaluate_plan(plan, a_skewed, no_cache, 256)["tables"]["a"]["load_seconds"][0]
    assert expected < even < uncached == pytest.approx(lookup / topology.dram_bw, rel=1e-12)


def test_caches_take_device_memory():
    # each table: 10,000 rows of 16 float32 and an Adagrad float, 680 kB
    tables = [TableSpec("a", 10_000, 16), TableSpec("b", 10_000, 16, access_frequency=0.5)]

    def memory(device_bytes: float) -> dict:
        topology = Topology(1, 1, device_bytes, 1e8, 0, cache_load_factor=0.25)
        est = plan_sharding(tables, topology, 256, force="table_wise").estimates
        return {
            "device": est["memory_bytes"]["device"][0],
            "dram": est["memory_bytes"]["dram"][0],
            "cache": est["cache_bytes"][0],
        }

    # a and b's 170 kB cache fit in 900 kB of device memory...
    assert memory(0.9e6) == {"device": 850_000, "dram": 680_000, "cache": 170_000}
    # ...not in 800 kB: both go to DRAM, behind caches
    assert memory(0.8e6) == {"device": 340_000, "dram": 1_360_000, "cache": 340_000}
    # no room for even the caches: a clear error
    with pytest.raises(PlanningError, match=r"170\.0 kB of device memory for a cache"):
        memory(0.1e6)


def test_skew_without_a_cache_changes_nothing():
    """Without a cache (the default topology) the recorded skew has nothing to act on: the
    same plan and estimates as the defaults, so plans without stats are as before."""
    topology = Topology(4, 2, device_bytes=0.05e9, dram_bytes=8e9, ssd_bytes=0)
    tables = skewed_tables(12)
    with_skew = [
        TableSpec(t.name, t.rows, t.dim, t.pooling_factor, t.access_frequency, t.rows, ZIPF_HITS)
        for t in tables
    ]
    plain = plan_sharding(tables, topology, 256)
    skewed = plan_sharding(with_skew, topology, 256)
    assert skewed == plain
    assert skewed.estimates["load_seconds"] == plain.estimates["load_seconds"]
    assert {t.shards[0].tier for t in plain.tables} == {"device", "dram"}


def _two_feature_spec() -> FeatureSpec:
    return FeatureSpec(
        dense=("I1",), sparse=(SparseFeature("C1", 5000, 16), SparseFeature("C2", 40, 16))
    )


def _multi_hot_stats(url: str) -> DatasetStats:
    return _dataset_stats(url, _sparse("C1", ids=50_000), _sparse("C2", ids=1000))


def test_plan_for_config_reads_the_datasets_stats_and_says_so(tmp_path):
    spec = _two_feature_spec()
    data = tmp_path / "data"
    data.mkdir()
    config = build_config({"data": {"url": str(data)}})
    without = plan_for_config(config, spec, world_size=2, ranks_per_host=2)
    assert without.estimates["statistics"] == "defaults"
    write_stats(str(data), _multi_hot_stats(str(data)))
    with_stats = plan_for_config(config, spec, world_size=2, ranks_per_host=2)
    assert with_stats.estimates["statistics"] == f"{data}/stats.json"
    lookups = [p.estimates["totals"]["lookup_bytes"] for p in (without, with_stats)]
    assert lookups[1] > 10 * lookups[0]  # 50 IDs a bag in C1, not one
    elsewhere = plan_for_config(config, spec, 2, 2, stats_root=str(tmp_path / "none"))
    assert elsewhere.estimates["statistics"] == "defaults"
    (data / "stats.json").write_text("{")
    with pytest.raises(DataError, match=r"data/stats\.json: not JSON"):
        plan_for_config(config, spec, 2, 2)


def _plan_on_rank(rank: int, world: int, roots: list[str], broken: str) -> tuple[dict, str]:
    """One rank of a job: plans with its own view of the data (``roots[rank]``), then once
    more where rank 0 cannot plan; returns the plan and the error it got."""
    spec = _two_feature_spec()
    config = build_config({"data": {"url": roots[rank]}})
    plan = plan_for_job(config, spec, world, world)
    try:
        plan_for_job(config, spec, world, world, stats_root=broken if rank == 0 else roots[1])
    except PlanningError as e:
        return plan.to_dict(), str(e)
    return plan.to_dict(), ""


def test_plan_for_job_runs_rank_zeros_plan_on_every_rank(tmp_path):
    """Two gloo ranks that would plan differently (only rank 0 sees stats.json) both run
    rank 0's plan; when rank 0 cannot plan, both fail saying so instead of hanging."""
    from dlrmflow.bench.spawn import run_spawned_job

    spec = _two_feature_spec()
    seen, unseen, broken = (str(tmp_path / d) for d in ("seen", "unseen", "broken"))
    write_stats(seen, _multi_hot_stats(seen))
    write_stats(broken, _dataset_stats(broken, _sparse("C1")))  # no C2
    own = [
        plan_for_config(build_config({"data": {"url": root}}), spec, 2, 2)
        for root in (seen, unseen)
    ]
    assert own[0].tables != own[1].tables  # they really would disagree

    results = run_spawned_job(_plan_on_rank, 2, [seen, unseen], broken, threads=1)
    (plan0, error0), (plan1, error1) = (r.result for r in results)
    assert plan1 == plan0
    assert ShardingPlan.from_dict(plan0) == own[0]
    assert plan0["estimates"]["statistics"] == f"{seen}/stats.json"
    assert "statistics have no feature C2" in error0
    assert error1.startswith("rank 0 could not plan: table C2:")


# -- train.embedding_memory_bytes: memory per rank, the rest on disk --------------------------


def test_the_cpu_topology_takes_the_per_rank_embedding_budget():
    assert cpu_topology(2, 2).ssd_bytes == 0  # no budget: memory only, as before
    budget = cpu_topology(2, 2, 1000)
    assert (budget.device_bytes, budget.dram_bytes, budget.ssd_bytes) == (1000, 0, DISK_BYTES)
    assert cpu_topology(2, 2, 1000, cache_share=0.25).device_bytes == 750
    with pytest.raises(ValueError, match="cache_share"):
        cpu_topology(2, 2, 1000, cache_share=1.0)


def test_the_embedding_budget_puts_what_does_not_fit_in_memory_on_disk():
    """Per rank: the shards that fit stay in memory, within the budget less the cache's
    share; the rest go to the disk tier. A budget that holds everything changes nothing."""
    spec = FeatureSpec(
        dense=("I1",),
        sparse=tuple(SparseFeature(f"C{k}", rows, 8) for k, rows in enumerate([40, 300, 900, 70])),
    )

    def plan(budget: int | None) -> ShardingPlan:
        config = build_config({"train": {"batch_size": 16, "embedding_memory_bytes": budget}})
        return plan_for_config(config, spec, world_size=2, ranks_per_host=2)

    def memory(p: ShardingPlan, tier: str) -> list[float]:
        return p.estimates["memory_bytes"][tier]

    without = plan(None)
    assert set(memory(without, "ssd")) == {0.0}
    budget = 20_000  # of the ~52 KB the tables and their state take
    tight = plan(budget)
    tight.validate()
    assert all(b > 0 for b in memory(tight, "ssd"))  # every rank has shards on disk...
    kept = memory(tight, "device")
    assert all(0 < b <= budget * (1 - CACHE_SHARE) for b in kept)  # ...and in memory
    roomy = plan(10**6)
    assert set(memory(roomy, "ssd")) == {0.0}
    assert roomy.tables == without.tables


# -- what `dlrmflow plan` asks for: a preset, or the configuration's model, on other memory --


def _without_timing(plan: ShardingPlan) -> dict:
    record = plan.to_dict()
    del record["estimates"]["planning_seconds"]
    return record


def test_a_topology_with_other_memory_keeps_the_rest_and_is_checked():
    topology = tiny_topology(4, 2)
    assert topology.with_memory() == topology
    other = topology.with_memory(device_bytes=1e9, cache_load_factor=0.5)
    assert (other.device_bytes, other.cache_load_factor) == (1e9, 0.5)
    assert (other.dram_bytes, other.ssd_bytes) == (topology.dram_bytes, topology.ssd_bytes)
    assert other.world_size == 4 and other.device_bw == topology.device_bw
    with pytest.raises(ValueError, match="memory per tier must be >= 0"):
        topology.with_memory(ssd_bytes=-1)


def test_a_preset_is_planned_by_name_on_its_topology_or_on_other_memory():
    tables, topology, batch_size = paper_12t()
    expected = plan_sharding(tables, topology.with_memory(dram_bytes=256e9), batch_size)
    assert _without_timing(plan_preset("paper-12t", dram_bytes=256e9)) == _without_timing(expected)
    with pytest.raises(PlanningError, match=r"unknown preset 'paper-1t' \(known: paper-12t\)"):
        plan_preset("paper-1t")


def test_the_plan_of_a_dataset_is_its_jobs_plan_unless_memory_is_given(tiny_dataset):
    from dlrmflow.ingest.manifest import read_manifest

    config = build_config({"data": {"url": tiny_dataset}})
    spec = FeatureSpec.for_dataset(read_manifest(tiny_dataset), config.features, config.model)
    job = plan_for_config(config, spec, world_size=4, ranks_per_host=2)
    assert _without_timing(plan_for_dataset(config, 4, 2)) == _without_timing(job)
    on_one_host = plan_for_config(config, spec, world_size=2, ranks_per_host=2)
    assert _without_timing(plan_for_dataset(config, 2)) == _without_timing(on_one_host)

    small = plan_for_dataset(config, 2, device_bytes=1e5, ssd_bytes=1e9)
    expected = plan_for_config(
        config, spec, 2, 2, topology=cpu_topology(2, 2).with_memory(device_bytes=1e5, ssd_bytes=1e9)
    )
    assert _without_timing(small) == _without_timing(expected)
    assert max(small.estimates["memory_bytes"]["device"]) <= 1e5

"""A dynamic ID map split into shards by ID: one shard is a plain map bitwise; several are
each a plain map over its own rows fed its own IDs in order; holders of complementary
shards together make exactly the whole map; the shard hash spreads IDs evenly."""

from __future__ import annotations

import numpy as np
import pytest

from dlrmflow.kernels.id_map import DynamicIdMap
from dlrmflow.kernels.id_map_shards import ShardedIdMap, shard_rows
from tests.kernels.test_id_map import churning_days

SETTINGS = {"admit_after": 2, "ttl": 2}


def test_one_shard_is_a_plain_map_bitwise():
    sharded, plain = ShardedIdMap(64, 1, **SETTINGS), DynamicIdMap(64, **SETTINGS)
    for day, ids in churning_days(10):
        assert np.array_equal(sharded.map(ids, day), plain.map(ids, day)), day
        assert np.array_equal(sharded.evict(day), plain.evict(day)), day
    arrays = plain.arrays()
    assert sharded.arrays().keys() == arrays.keys()  # a plain map's checkpoint names
    for key, array in sharded.arrays().items():
        assert np.array_equal(array, arrays[key]), key
    assert sharded.take_stats() == plain.take_stats()


@pytest.mark.parametrize("shards", [2, 5])
def test_each_shard_is_a_plain_map_of_its_own_ids_over_its_own_rows(shards):
    capacity = 120
    sharded = ShardedIdMap(capacity, shards, **SETTINGS)
    sizes = shard_rows(capacity, shards)
    plain = [DynamicIdMap(n + 1, **SETTINGS) for n in sizes]
    starts = np.concatenate([[1], 1 + np.cumsum(sizes)])
    freed_total = 0
    for day, ids in churning_days(12):
        rows = sharded.map(ids, day)
        of = sharded.shard_of(ids)
        for s, part in enumerate(plain):
            local = part.map(ids[of == s], day)
            want = np.where(local > 0, local + starts[s] - 1, 0)
            assert np.array_equal(rows[of == s], want), (day, s)
            # Each shard hands out rows of its own range only.
            mine = rows[of == s]
            assert np.all((mine == 0) | ((mine >= starts[s]) & (mine < starts[s + 1])))
        freed = sharded.evict(day)
        want = [part.evict(day) + starts[s] - 1 for s, part in enumerate(plain)]
        assert np.array_equal(freed, np.sort(np.concatenate(want)))
        freed_total += len(freed)
    assert freed_total > 0 and sharded.rows_in_use == sum(p.rows_in_use for p in plain)
    keys, rows = sharded.frozen()
    assert np.all(np.diff(keys) > 0) and len(keys) == sharded.rows_in_use
    assert np.array_equal(sharded.rows_of(keys), rows)


def test_holders_of_complementary_shards_make_the_whole_map():
    capacity, shards = 90, 3
    whole = ShardedIdMap(capacity, shards, **SETTINGS)
    held = [ShardedIdMap(capacity, shards, owned=o, **SETTINGS) for o in ([0, 2], [1])]
    for day, ids in churning_days(10, seed=3):
        rows = whole.map(ids, day)
        of = whole.shard_of(ids)
        for holder in held:
            mine = np.isin(of, holder.owned)
            assert np.array_equal(holder.map(ids[mine], day), rows[mine]), day
        freed = np.sort(np.concatenate([h.evict(day) for h in held]))
        assert np.array_equal(freed, whole.evict(day))
    together = {**held[0].arrays(), **held[1].arrays()}
    assert together.keys() == whole.arrays().keys()
    for key, array in whole.arrays().items():
        assert np.array_equal(together[key], array), key
    # A holder's state loads into a fresh holder of the same shards, and from the whole.
    again = ShardedIdMap(capacity, shards, owned=[1], **SETTINGS)
    again.load_state_dict(whole.state_dict())
    for key, array in held[1].arrays().items():
        assert np.array_equal(again.arrays()[key], array), key
    with pytest.raises(ValueError, match="IDs of shard 0 reached a map holding shards \\(1,\\)"):
        again.map(np.arange(50), 11)
    with pytest.raises(ValueError, match="needs every shard"):
        again.frozen()


@pytest.mark.parametrize("ids", ["random", "consecutive"])
def test_the_shard_hash_spreads_ids_evenly(ids):
    rng = np.random.default_rng(0)
    raw = rng.integers(-(2**63), 2**63 - 1, 80_000) if ids == "random" else np.arange(80_000)
    counts = np.bincount(ShardedIdMap(1000, 8).shard_of(raw), minlength=8)
    assert np.all(np.abs(counts - 10_000) < 300), counts  # binomial sd is about 94


def test_memory_is_counted_per_shard_held():
    total = ShardedIdMap.bytes_for(1001, 4, admit_after=2)
    assert total == ShardedIdMap(1001, 4, admit_after=2).nbytes
    half = ShardedIdMap.bytes_for(1001, 4, admit_after=2, owned=[1, 3])
    assert half == ShardedIdMap(1001, 4, admit_after=2, owned=[1, 3]).nbytes < total
    assert ShardedIdMap.bytes_for(1001, 1) == DynamicIdMap.bytes_for(1001)


def test_rows_are_split_evenly_and_too_many_shards_are_refused():
    assert shard_rows(11, 3) == [4, 3, 3]
    with pytest.raises(ValueError, match="capacity 4 leaves 3 rows .* too few for 4 shards"):
        ShardedIdMap(4, 4)
    with pytest.raises(ValueError, match="shards must be at least 1"):
        ShardedIdMap(4, 0)

"""The dynamic ID map against a plain-Python reference of its rules, and each rule alone:
stable rows, admission after N sightings, a full table reading the default row, eviction
by age then by frequency, freed rows handed out lowest first, and a saved state that
continues exactly."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from dlrmflow.kernels.id_map import DynamicIdMap


class ReferenceMap:
    """The module docstring's rules with dicts and a heap."""

    def __init__(self, capacity, admit_after=1, ttl=None, headroom=0.05, candidates=None):
        self.capacity, self.admit_after, self.ttl, self.headroom = (
            capacity, admit_after, ttl, headroom,
        )  # fmt: skip
        self.limit = (capacity if candidates is None else candidates) if admit_after > 1 else 0
        self.rows: dict[int, int] = {}
        self.seen: dict[int, int] = {}  # row -> last seen
        self.hits: dict[int, int] = {}
        self.free = list(range(1, capacity))
        self.candidates: dict[int, list[int]] = {}  # id -> [count, last seen]

    def map(self, ids, now, admit=True):
        out = []
        for key in (int(i) for i in ids):
            if key in self.rows:
                row = self.rows[key]
                if admit:
                    self.seen[row], self.hits[row] = now, self.hits[row] + 1
                out.append(row)
                continue
            out.append(0)
            if not admit:
                continue
            if self.admit_after > 1:
                if key in self.candidates:
                    self.candidates[key][0] += 1
                    self.candidates[key][1] = now
                elif len(self.candidates) < self.limit:
                    self.candidates[key] = [1, now]
                else:
                    continue
                if self.candidates[key][0] < self.admit_after:
                    continue
            if not self.free:
                continue
            row = heapq.heappop(self.free)
            self.candidates.pop(key, None)
            self.rows[key], self.seen[row], self.hits[row] = row, now, 1
            out[-1] = row
        return np.array(out, np.int64)

    def evict(self, now):
        in_use = sorted(self.rows.values())
        expired = [r for r in in_use if self.ttl is not None and now - self.seen[r] >= self.ttl]
        keep = [r for r in in_use if r not in set(expired)]
        most = int((self.capacity - 1) * (1.0 - self.headroom))
        keep.sort(key=lambda r: (self.hits[r], self.seen[r], r))
        evicted = sorted(expired + keep[: max(0, len(keep) - most)])
        by_row = {r: k for k, r in self.rows.items()}
        for r in evicted:
            del self.rows[by_row[r]], self.seen[r]
            heapq.heappush(self.free, r)
        self.hits = {r: 0 for r in self.hits if r in self.seen}
        if self.ttl is not None:
            self.candidates = {k: v for k, v in self.candidates.items() if now - v[1] < self.ttl}
        return np.array(evicted, np.int64)


def churning_days(days: int, seed: int = 0):
    """Batches of IDs whose popular set drifts: new IDs born each day, old ones fading,
    negative and huge IDs among them."""
    rng = np.random.default_rng(seed)
    for day in range(days):
        for _ in range(6):
            base = rng.zipf(1.3, 120) % 400 + day * 40
            ids = base.astype(np.int64) * np.int64(2654435761)  # spread over the bits
            ids[::7] = -ids[::7]
            yield day, ids


@pytest.mark.parametrize(
    "settings",
    [
        {"capacity": 64},
        {"capacity": 64, "ttl": 2},
        {"capacity": 200, "admit_after": 3, "ttl": 3, "headroom": 0.2},
        {"capacity": 50, "admit_after": 2, "candidates": 30, "ttl": 1},
    ],
)
def test_the_map_follows_its_rules_over_churning_days(settings):
    ours, reference = DynamicIdMap(**settings), ReferenceMap(**settings)
    evicted_total = 0
    for day, ids in churning_days(12):
        assert np.array_equal(ours.map(ids, day), reference.map(ids, day)), day
        if ids[0] % 3 == 0:  # now and then a lookup without admission
            looked_up = ours.map(ids[:10], day, admit=False)
            assert np.array_equal(looked_up, reference.map(ids[:10], day, admit=False))
        freed = ours.evict(day)
        assert np.array_equal(freed, reference.evict(day))
        evicted_total += len(freed)
    assert evicted_total > 0  # the run exercised eviction
    assert ours.rows_in_use == len(reference.rows)


def test_an_id_keeps_its_row_and_new_ones_take_the_lowest_free_rows():
    m = DynamicIdMap(10)
    assert m.map(np.array([7, -3, 7, 2**62]), 0).tolist() == [1, 2, 1, 3]
    assert m.map(np.array([-3, 99]), 1, admit=False).tolist() == [2, 0]  # no admission
    assert m.rows_of(np.array([99, 7])).tolist() == [0, 1]


def test_an_id_is_admitted_after_it_is_seen_enough():
    m = DynamicIdMap(10, admit_after=3)
    assert m.map(np.array([5, 5, 6, 5, 5]), 0).tolist() == [0, 0, 0, 1, 1]
    stats = m.take_stats()
    assert (stats.admitted, stats.default_lookups, stats.candidates) == (1, 4, 1)


def test_a_full_table_reads_the_default_row_and_says_so():
    m = DynamicIdMap(3)
    assert m.map(np.array([1, 2, 3, 1]), 0).tolist() == [1, 2, 0, 1]
    stats = m.take_stats()
    assert (stats.refused_full, stats.rows_in_use) == (1, 2)


def test_eviction_frees_the_expired_then_the_least_seen():
    m = DynamicIdMap(11, ttl=2, headroom=0.5)  # at most 5 of the 10 rows kept
    m.map(np.array([10, 11]), 0)  # rows 1, 2: not seen again, expire at day 2
    m.map(np.array([20, 21, 22, 23, 24, 25, 20, 21]), 1)  # rows 3-8; 20 and 21 seen twice
    m.map(np.array([22, 23, 24, 25]), 2)
    freed = m.evict(2)
    # Expired: rows 1, 2. Kept at most 5 of the 6 others: the least seen since the last
    # eviction and, of equals, the longest unseen, then the lowest row, goes.
    assert freed.tolist() == [1, 2, 3]
    assert m.map(np.array([30, 31]), 3).tolist() == [1, 2]  # lowest free first
    assert m.rows_of(np.array([10, 20, 21])).tolist() == [0, 0, 4]


def test_a_saved_map_continues_exactly():
    settings = {"capacity": 80, "admit_after": 2, "ttl": 2}
    whole, first = DynamicIdMap(**settings), DynamicIdMap(**settings)
    days = list(churning_days(8, seed=4))
    for day, ids in days[:20]:
        whole.map(ids, day)
        first.map(ids, day)
        if day % 2:
            whole.evict(day), first.evict(day)
    resumed = DynamicIdMap(**settings)
    resumed.load_state_dict(first.state_dict())
    for day, ids in days[20:]:
        assert np.array_equal(whole.map(ids, day), resumed.map(ids, day))
        assert np.array_equal(whole.evict(day), resumed.evict(day))


def test_a_state_of_other_settings_is_refused_naming_the_setting():
    state = DynamicIdMap(80, ttl=2).state_dict()
    with pytest.raises(ValueError, match="saved with capacity 80, this map has 90"):
        DynamicIdMap(90, ttl=2).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with ttl 2, this map has 3"):
        DynamicIdMap(80, ttl=3).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 1}, "capacity must be at least 2"),
        ({"capacity": 8, "admit_after": 0}, "admit_after must be at least 1"),
        ({"capacity": 8, "ttl": 0}, "ttl must be at least 1"),
        ({"capacity": 8, "headroom": 1.0}, "headroom must be in"),
    ],
)
def test_settings_it_cannot_run_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicIdMap(**kwargs)


def test_the_frozen_map_looks_every_id_up_as_rows_of_does():
    m = DynamicIdMap(64, admit_after=2, ttl=3)
    rng = np.random.default_rng(5)
    for now in range(1, 12):
        m.map(rng.integers(-(2**62), 2**62, 20) // 2**56 * 2**56, now)
        if now % 4 == 0:
            m.evict(now)
    keys, rows = m.frozen()
    assert np.all(np.diff(keys) > 0) and len(keys) == m.rows_in_use
    probe = np.concatenate([keys, rng.integers(-(2**62), 2**62, 50), np.array([0, -1])])
    at = np.searchsorted(keys, probe).clip(max=len(keys) - 1)
    looked_up = np.where(keys[at] == probe, rows[at], 0)
    assert np.array_equal(looked_up, m.rows_of(probe))


@pytest.mark.parametrize(
    ("capacity", "admit_after", "candidates"), [(2, 1, None), (1000, 1, None), (1000, 3, None),
                                                (4097, 2, 100)]
)  # fmt: skip
def test_a_maps_memory_is_known_before_it_is_made(capacity, admit_after, candidates):
    made = DynamicIdMap(capacity, admit_after=admit_after, candidates=candidates)
    wanted = DynamicIdMap.bytes_for(capacity, admit_after=admit_after, candidates=candidates)
    assert made.nbytes == wanted
    # A row costs more than its ID alone: the hash table keeps 2-4 slots a row.
    assert wanted > 8 * 5 * capacity

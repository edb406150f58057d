"""ID mappers: the stable hash, ``HashIds`` and the frequency ``Vocabulary``."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmflow.features.ids import (
    HashIds,
    Vocabulary,
    build_vocabulary,
    feature_salt,
    stable_hash,
)
from dlrmflow.features.spec import FeatureSpec, SparseFeature

NAMES3 = ["C1", "C2", "C3"]
EXTREMES = np.array([0, 1, -1, 2**63 - 1, -(2**63), 123456789], np.int64)


def random_ids(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64), EXTREMES])


# -- stable_hash --------------------------------------------------------------------------


def test_stable_hash_outputs_are_pinned():
    # Computed once from this implementation (and identical across processes and hash
    # seeds); a change here silently remaps every hashed feature of every saved model.
    assert [hex(v) for v in stable_hash(EXTREMES).tolist()] == [
        "0x0",
        "0x9364959128e9190d",
        "0xa937d2123a01043f",
        "0x9b3b364099d917",
        "0x6a947b0ec65870fa",
        "0x12af766a594e6671",
    ]
    assert [hex(v) for v in stable_hash(EXTREMES, salt=7).tolist()] == [
        "0x6360fad803344624",
        "0x3b2f52f6e7433616",
        "0x6b2455d5b1b26d9d",
        "0x949423749130208b",
        "0x425bb556fd23f30b",
        "0x4aaae02d528b8301",
    ]
    assert feature_salt("C1") == 0x340EEFE401AB5D9D
    assert feature_salt("C1", seed=1) == 0xF237B045DE3E9905


def test_stable_hash_is_uint64_and_injective():
    ids = random_ids(50_000)
    h = stable_hash(ids, salt=3)
    assert h.dtype == np.uint64 and h.shape == ids.shape
    assert len(np.unique(h)) == len(np.unique(ids))  # a bijection: no collisions before % n


def test_stable_hash_uses_twos_complement_bits():
    as_unsigned = np.array([2**64 - 1, 2**63], np.uint64)
    as_signed = np.array([-1, -(2**63)], np.int64)
    np.testing.assert_array_equal(stable_hash(as_unsigned), stable_hash(as_signed))
    np.testing.assert_array_equal(stable_hash(np.array([5], np.int32)), stable_hash([5]))


def test_stable_hash_depends_on_salt_for_every_id():
    ids = random_ids(10_000)
    assert not np.any(stable_hash(ids, salt=1) == stable_hash(ids, salt=2))


def test_stable_hash_rejects_non_integers():
    with pytest.raises(TypeError, match="expected integer IDs"):
        stable_hash(np.array([1.5]))


# -- HashIds -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 2**31 + 11, 2**32])
def test_hash_rows_stay_in_range(n):
    rows = HashIds({"C1": n}).map("C1", random_ids(20_000))
    assert rows.dtype == np.int64
    assert rows.min() >= 0 and rows.max() < n


def test_hash_rows_are_pinned_and_follow_the_documented_formula():
    ids = HashIds({"C1": 1000, "C2": 1000})
    rows = ids.map("C1", EXTREMES)
    assert rows.tolist() == [467, 435, 728, 145, 78, 276]
    top = stable_hash(EXTREMES, feature_salt("C1")) >> np.uint64(32)
    np.testing.assert_array_equal(rows, (top * np.uint64(1000)) >> np.uint64(32))


def test_hash_map_keyed_follows_the_formula_across_chunks():
    # Parts longer than the hash's in-cache chunk, and of unequal lengths.
    ids = HashIds({"C1": 1000, "C2": 2**32})
    parts = [random_ids(70_000, 7), random_ids(33_000, 8)]
    rows = ids.map_keyed(["C1", "C2"], parts)
    for name, part, got in zip(["C1", "C2"], parts, np.split(rows, [len(parts[0])]), strict=True):
        top = stable_hash(part, feature_salt(name)) >> np.uint64(32)
        n = np.uint64(ids.num_embeddings(name))
        np.testing.assert_array_equal(got, ((top * n) >> np.uint64(32)).view(np.int64))


def test_hash_rows_spread_evenly():
    rows = HashIds({"C1": 100}).map("C1", np.arange(100_000))
    counts = np.bincount(rows, minlength=100)
    assert counts.min() > 850 and counts.max() < 1150  # ideal 1000, sd ~31


def test_equal_ids_of_different_features_land_on_unrelated_rows():
    ids = HashIds({"C1": 1000, "C2": 1000})
    same = np.mean(ids.map("C1", np.arange(20_000)) == ids.map("C2", np.arange(20_000)))
    assert same < 0.005  # chance agreement is 1/1000
    other_seed = HashIds({"C1": 1000}, seed=1)
    assert (
        np.mean(ids.map("C1", np.arange(20_000)) == other_seed.map("C1", np.arange(20_000))) < 0.005
    )


def test_hash_map_keyed_is_the_concatenation_of_map():
    ids = HashIds({"C1": 50, "C2": 7, "C3": 1 << 20})
    parts = [random_ids(100, 1), np.zeros(0, np.int64), random_ids(33, 2)]
    keyed = ids.map_keyed(NAMES3, parts)
    expected = np.concatenate([ids.map(n, p) for n, p in zip(NAMES3, parts, strict=True)])
    np.testing.assert_array_equal(keyed, expected)
    # Equal counts take the broadcast path; it must agree with the per-key one.
    same = [random_ids(64, 3), random_ids(64, 4), random_ids(64, 5)]
    np.testing.assert_array_equal(
        ids.map_keyed(NAMES3, same),
        np.concatenate([ids.map(n, p) for n, p in zip(NAMES3, same, strict=True)]),
    )


def test_hash_map_leaves_its_input_alone():
    src = random_ids(100)
    before = src.copy()
    src.setflags(write=False)  # as Arrow buffers are
    HashIds({"C1": 10}).map("C1", src)
    np.testing.assert_array_equal(src, before)


def test_hash_ids_survive_pickling():
    ids = HashIds({"C1": 1000}, seed=5)
    clone = pickle.loads(pickle.dumps(ids))
    x = random_ids(1000)
    np.testing.assert_array_equal(clone.map("C1", x), ids.map("C1", x))
    assert clone.num_embeddings("C1") == 1000


def test_hash_ids_from_spec_and_errors():
    spec = FeatureSpec(
        dense=("I1",), sparse=(SparseFeature("C1", 10, 4), SparseFeature("C2", 3, 4))
    )
    ids = HashIds.from_spec(spec)
    assert ids.table_rows == {"C1": 10, "C2": 3}
    with pytest.raises(KeyError, match="C9"):
        ids.map("C9", np.arange(3))
    with pytest.raises(ValueError, match="C1"):
        HashIds({"C1": 0})
    with pytest.raises(ValueError, match="C1"):
        HashIds({"C1": 2**32 + 1})


# -- Vocabulary ----------------------------------------------------------------------------

C1_FILE1 = [5, 5, 7, None, 9, 5]
C1_FILE2 = [7, 7, -3, 5, None, 11]
C2_FILE1 = [[1, 2], [2], None, [], [2, None], [3]]
C2_FILE2 = [[1], [2, 2], [], None, [4], [1]]


@pytest.fixture
def two_files(tmp_path):
    """Two Parquet files (the second in row groups of 2): C1 one-hot, C2 multi-hot."""
    schema = pa.schema([("C1", pa.int64()), ("C2", pa.list_(pa.int64())), ("I1", pa.float64())])
    paths = []
    for i, (c1, c2) in enumerate([(C1_FILE1, C2_FILE1), (C1_FILE2, C2_FILE2)]):
        table = pa.table({"C1": c1, "C2": c2, "I1": [0.5] * 6}, schema=schema)
        path = str(tmp_path / f"day{i}.parquet")
        pq.write_table(table, path, row_group_size=2 if i else 6)
        paths.append(path)
    return paths


def test_vocabulary_counts_and_orders_ids(two_files):
    vocab = build_vocabulary(two_files, ["C1", "C2"], min_count=1)
    # C1 counts: 5 x4, 7 x3, then -3, 9, 11 once each (ties by ascending ID).
    assert vocab.ids["C1"].tolist() == [5, 7, -3, 9, 11]
    assert vocab.counts["C1"].tolist() == [4, 3, 1, 1, 1]
    # C2 flattened, nulls (lists and elements) not counted: 2 x5, 1 x3, 3 x1, 4 x1.
    assert vocab.ids["C2"].tolist() == [2, 1, 3, 4]
    assert vocab.counts["C2"].tolist() == [5, 3, 1, 1]
    assert vocab.num_embeddings("C1") == 6 and vocab.table_rows == {"C1": 6, "C2": 5}
    rows = vocab.map("C1", np.array([5, 7, -3, 9, 11, 12, 0, -(2**63)]))
    assert rows.tolist() == [1, 2, 3, 4, 5, 0, 0, 0]


def test_vocabulary_min_count_and_max_size(two_files):
    frequent = build_vocabulary(two_files, ["C1", "C2"], min_count=2)
    assert frequent.ids["C1"].tolist() == [5, 7]
    assert frequent.map("C1", np.array([9, 5, 7, 11])).tolist() == [0, 1, 2, 0]  # rare -> OOV
    assert frequent.ids["C2"].tolist() == [2, 1]
    capped = build_vocabulary(two_files, ["C1"], min_count=1, max_size=1)
    assert capped.ids["C1"].tolist() == [5] and capped.num_embeddings("C1") == 2
    nothing = build_vocabulary(two_files, ["C1"], min_count=100)
    assert nothing.num_embeddings("C1") == 1
    assert nothing.map("C1", np.array([5, 7])).tolist() == [0, 0]


def test_vocabulary_build_errors_name_file_and_column(two_files):
    with pytest.raises(ValueError, match=r"day0\.parquet row group 0: I1: expected int64"):
        build_vocabulary(two_files, ["I1"], min_count=1)
    with pytest.raises(ValueError, match=r"day0\.parquet: missing column\(s\) C7"):
        build_vocabulary(two_files, ["C1", "C7"], min_count=1)
    with pytest.raises(ValueError, match="min_count"):
        build_vocabulary(two_files, ["C1"], min_count=0)


@pytest.mark.parametrize("where", ["file", "memory"])
def test_vocabulary_save_load_round_trip(two_files, tmp_path, where):
    vocab = build_vocabulary(two_files, ["C1", "C2"], min_count=1)
    url = str(tmp_path / "vocab.npz") if where == "file" else f"memory://vocab-{id(vocab)}.npz"
    vocab.save(url)
    loaded = Vocabulary.load(url)
    assert loaded.min_count == 1 and loaded.names == ["C1", "C2"]
    for name in ("C1", "C2"):
        np.testing.assert_array_equal(loaded.ids[name], vocab.ids[name])
        np.testing.assert_array_equal(loaded.counts[name], vocab.counts[name])
    probe = np.array([5, 11, 12, 1, 2, 4])
    assert loaded.map("C1", probe).tolist() == vocab.map("C1", probe).tolist()


def test_vocabulary_load_rejects_other_files(tmp_path):
    bad = tmp_path / "not-a-vocab.npz"
    bad.write_bytes(b"PK\x03\x04 definitely not a zip")
    with pytest.raises(ValueError, match="not-a-vocab.npz"):
        Vocabulary.load(str(bad))
    np.savez(tmp_path / "other.npz", x=np.arange(3))
    with pytest.raises(ValueError, match="other.npz"):
        Vocabulary.load(str(tmp_path / "other.npz"))


def test_vocabulary_lookup_matches_a_dict_on_many_ids():
    # Sequential and high-bit IDs form long probe clusters; random IDs and extremes probe
    # misses. Each feature holds the other's IDs too, so a lookup that ran into the wrong
    # feature's region would be caught.
    rng = np.random.default_rng(0)
    a = np.unique(np.concatenate([np.arange(5000), np.arange(3000) << 40, random_ids(3000)]))
    rng.shuffle(a)
    b = a[::-1].copy()[:7000]
    vocab = Vocabulary({"A": a, "B": b}, {"A": np.ones(len(a)), "B": np.ones(len(b))}, min_count=1)
    queries = np.concatenate([a, random_ids(3000, 9), np.arange(-50, 6000)])
    for name, ranked in (("A", a), ("B", b)):
        row_of = {int(x): i + 1 for i, x in enumerate(ranked)}
        expected = [row_of.get(int(x), 0) for x in queries]
        assert vocab.map(name, queries).tolist() == expected
    keyed = vocab.map_keyed(["A", "B"], [queries[:100], queries[100:250]])
    assert (
        keyed.tolist()
        == vocab.map("A", queries[:100]).tolist() + vocab.map("B", queries[100:250]).tolist()
    )


def test_vocabulary_never_returns_another_features_row():
    # Found by search: these B IDs sit right after A's tiny table and A's one ID occupies
    # their home slot in A, so a probe that ran on past A's end would find them in B.
    a, b = np.array([10004]), np.arange(1, 2001)
    vocab = Vocabulary({"A": a, "B": b}, {"A": np.ones(1), "B": np.ones(len(b))}, min_count=1)
    neighbours = np.array([958, 641, 1271, 1464, 1916, 1282, 412, 1034, 904, 1828, 1213])
    assert vocab.map("A", neighbours).tolist() == [0] * len(neighbours)
    assert vocab.map("A", np.array([10004])).tolist() == [1]
    assert vocab.map("B", neighbours).tolist() == neighbours.tolist()


def test_vocabulary_survives_pickling_and_rejects_bad_input(two_files):
    vocab = build_vocabulary(two_files, ["C1"], min_count=1)
    clone = pickle.loads(pickle.dumps(vocab))
    probe = np.array([5, 7, -3, 100])
    assert clone.map("C1", probe).tolist() == vocab.map("C1", probe).tolist() == [1, 2, 3, 0]
    with pytest.raises(KeyError, match="C2"):
        vocab.map("C2", probe)
    with pytest.raises(ValueError, match="duplicate"):
        Vocabulary({"C1": np.array([1, 1])}, {"C1": np.array([2, 2])}, min_count=1)

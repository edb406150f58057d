"""``Batch`` and ``KeyedJaggedTensor``: take and concat against a per-sample reference."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from dlrmflow.features.batch import Batch
from dlrmflow.sparse import KeyedJaggedTensor

# A sample is, per key, its bag: a list of (ID, weight) pairs (weight None when unweighted).
Sample = list[list[tuple[int, float | None]]]


def samples_of(kjt: KeyedJaggedTensor) -> list[Sample]:
    """The per-sample view of ``kjt``, read entry by entry (the naive reference)."""
    n_keys, stride = len(kjt.keys), kjt.stride
    values, lengths = kjt.values.tolist(), kjt.lengths.tolist()
    weights = None if kjt.weights is None else kjt.weights.tolist()
    assert len(lengths) == n_keys * stride and sum(lengths) == len(values)
    out: list[Sample] = [[[] for _ in range(n_keys)] for _ in range(stride)]
    pos = 0
    for k in range(n_keys):
        for i in range(stride):
            for _ in range(lengths[k * stride + i]):
                out[i][k].append((values[pos], None if weights is None else weights[pos]))
                pos += 1
    return out


def kjt_of(
    keys: list[str], samples: list[Sample], weighted: bool | None = None
) -> KeyedJaggedTensor:
    """The jagged tensor of per-sample bags, built entry by entry (weighted: as the bags)."""
    values, weights, lengths = [], [], []
    for k in range(len(keys)):
        for sample in samples:
            lengths.append(len(sample[k]))
            for value, weight in sample[k]:
                values.append(value)
                weights.append(weight)
    if weighted is None:
        weighted = any(w is not None for w in weights)
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        weights=torch.tensor(weights, dtype=torch.float32) if weighted else None,
    )


def random_samples(
    rng: np.random.Generator, n: int, n_keys: int, *, max_len: int = 3, weighted: bool = False
) -> list[Sample]:
    def bag() -> list[tuple[int, float | None]]:
        size = int(rng.integers(0, max_len + 1))
        return [
            (int(rng.integers(0, 1000)), float(rng.integers(1, 9)) / 4 if weighted else None)
            for _ in range(size)
        ]

    return [[bag() for _ in range(n_keys)] for _ in range(n)]


def assert_kjt_equal(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> None:
    assert a.keys == b.keys and a.stride == b.stride
    assert a.values.dtype == b.values.dtype == torch.int64
    assert a.lengths.dtype == b.lengths.dtype == torch.int32
    assert torch.equal(a.values, b.values) and torch.equal(a.lengths, b.lengths)
    assert (a.weights is None) == (b.weights is None)
    if a.weights is not None:
        assert torch.equal(a.weights, b.weights)


# -- KeyedJaggedTensor.take -----------------------------------------------------------------


def test_take_by_hand_with_empty_bags_repeats_and_weights():
    # x: [1], [2, 3], []; y: [], [6], [5, 5]
    kjt = KeyedJaggedTensor(
        keys=["x", "y"],
        values=torch.tensor([1, 2, 3, 6, 5, 5]),
        lengths=torch.tensor([1, 2, 0, 0, 1, 2], dtype=torch.int32),
        weights=torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0]),
    )
    out = kjt.take(np.array([2, 0, 1, 2]))
    assert out.keys == ["x", "y"] and out.stride == 4
    assert out.lengths.tolist() == [0, 1, 2, 0] + [2, 0, 1, 2]
    assert out.values.tolist() == [1, 2, 3] + [5, 5, 6, 5, 5]
    assert out.weights.tolist() == [0.5, 1.0, 1.5] + [2.5, 3.0, 2.0, 2.5, 3.0]
    assert out.offsets().tolist() == [0, 0, 1, 3, 3, 5, 5, 6, 8]
    assert out.length_per_key() == [3, 5]


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("n_keys", "max_len"), [(1, 3), (4, 3), (3, 1), (5, 0)])
def test_take_matches_the_per_sample_reference(n_keys, max_len, weighted):
    rng = np.random.default_rng(n_keys * 10 + max_len)
    samples = random_samples(rng, 57, n_keys, max_len=max_len, weighted=weighted)
    kjt = kjt_of([f"k{i}" for i in range(n_keys)], samples)
    for indices in (rng.permutation(57), rng.permutation(57)[:13], rng.integers(0, 57, 30)):
        out = kjt.take(indices)
        assert samples_of(out) == [samples[i] for i in indices]
        # torch indices give the same
        assert_kjt_equal(kjt.take(torch.from_numpy(indices)), out)


def test_take_of_nothing_and_from_an_empty_batch():
    kjt = kjt_of(["a", "b"], random_samples(np.random.default_rng(0), 5, 2))
    none = kjt.take(np.zeros(0, np.int64))
    assert none.stride == 0 and none.values.numel() == 0 and none.lengths.numel() == 0
    empty = kjt_of(["a", "b"], [])
    assert empty.stride == 0
    assert empty.take(np.zeros(0, np.int64)).lengths.numel() == 0


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        (np.array([0, 5]), IndexError, r"\[0, 5\), got \[0, 5\]"),
        (np.array([-1, 2]), IndexError, r"\[0, 5\), got \[-1, 2\]"),
        (np.array([[0, 1]]), ValueError, "1-D"),
    ],
)
def test_take_rejects_indices_outside_the_batch(indices, error, match):
    # A stray index would otherwise read another key's bags: key-major storage.
    samples = random_samples(np.random.default_rng(1), 5, 2)
    for kjt in (kjt_of(["a", "b"], samples), one_hot_of(["a", "b"], [[1, -1]] * 5)):
        with pytest.raises(error, match=match):
            kjt.take(indices)
    batch = Batch(torch.zeros(5, 1), kjt_of(["a", "b"], samples), torch.zeros(5))
    with pytest.raises(error, match=match):
        batch.take(indices)


# -- KeyedJaggedTensor.concat ---------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
def test_concat_matches_the_per_sample_reference(weighted):
    rng = np.random.default_rng(3)
    keys = ["a", "b", "c"]
    parts = [random_samples(rng, n, 3, weighted=weighted) for n in (7, 0, 1, 12)]
    out = KeyedJaggedTensor.concat([kjt_of(keys, p, weighted) for p in parts])
    assert samples_of(out) == [s for p in parts for s in p]
    assert_kjt_equal(out, kjt_of(keys, [s for p in parts for s in p], weighted))


def test_concat_then_take_as_the_reader_uses_them():
    rng = np.random.default_rng(4)
    parts = [random_samples(rng, n, 4, max_len=2) for n in (20, 33, 9)]
    window = KeyedJaggedTensor.concat([kjt_of(list("wxyz"), p) for p in parts])
    everything = [s for p in parts for s in p]
    order = rng.permutation(len(everything))
    for start in range(0, len(order), 16):
        indices = order[start : start + 16]
        assert samples_of(window.take(indices)) == [everything[i] for i in indices]


def test_concat_errors():
    a = kjt_of(["a"], [[[(1, None)]]])
    with pytest.raises(ValueError, match="no KeyedJaggedTensor"):
        KeyedJaggedTensor.concat([])
    with pytest.raises(ValueError, match="keys differ"):
        KeyedJaggedTensor.concat([a, kjt_of(["b"], [[[(1, None)]]])])
    with pytest.raises(ValueError, match="some parts have weights"):
        KeyedJaggedTensor.concat([a, kjt_of(["a"], [[[(1, 0.5)]]])])


def test_keyless_tensors_take_and_concat_to_empty():
    none = KeyedJaggedTensor(
        [], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
    )
    assert none.take(np.array([0, 0])).values.numel() == 0
    assert KeyedJaggedTensor.concat([none, none]).lengths.numel() == 0


# -- the one-hot form -------------------------------------------------------------------------


def one_hot_of(keys: list[str], rows: list[list[int]], dtype=torch.int32) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_one_hot(keys, torch.tensor(rows, dtype=dtype).view(-1, len(keys)))


def jagged_of_rows(keys: list[str], rows: list[list[int]]) -> KeyedJaggedTensor:
    return kjt_of(keys, [[[(v, None)] if v >= 0 else [] for v in row] for row in rows])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_one_hot_form_reads_as_its_jagged_equivalent(dtype):
    rows = [[3, -1, 7], [-1, -1, 0], [2**31 - 1, 4, -1]]
    kjt = one_hot_of(["a", "b", "c"], rows, dtype)
    assert kjt.stride == 3
    assert_kjt_equal(kjt, jagged_of_rows(["a", "b", "c"], rows))
    assert kjt.length_per_key() == [2, 1, 2]
    assert kjt.offsets().tolist() == [0, 1, 1, 2, 2, 2, 3, 4, 5, 5]


def test_one_hot_take_and_concat_match_the_jagged_form():
    rng = np.random.default_rng(5)
    keys = ["a", "b", "c", "d"]
    parts = []
    for n in (11, 0, 25):
        rows = rng.integers(0, 50, (n, 4))
        rows[rng.random((n, 4)) < 0.3] = -1
        parts.append(rows.tolist())
    one_hot = [one_hot_of(keys, p) for p in parts]
    jagged = [jagged_of_rows(keys, p) for p in parts]
    window = KeyedJaggedTensor.concat(one_hot)
    reference = KeyedJaggedTensor.concat(jagged)
    assert_kjt_equal(window, reference)
    indices = rng.permutation(36)
    assert_kjt_equal(window.take(indices), reference.take(indices))
    assert_kjt_equal(one_hot[2].take(indices[:9] % 25), jagged[2].take(indices[:9] % 25))
    # a mix of forms concatenates too
    assert_kjt_equal(KeyedJaggedTensor.concat([one_hot[0], jagged[2]]), reference)


def test_one_hot_form_checks_its_rows():
    with pytest.raises(ValueError, match=r"\[B, 2\]"):
        KeyedJaggedTensor.from_one_hot(["a", "b"], torch.zeros(3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32 or int64"):
        KeyedJaggedTensor.from_one_hot(["a"], torch.zeros(3, 1))


@pytest.mark.parametrize("one_hot", [False, True])
def test_both_forms_survive_pickling(one_hot):
    rows = [[1, -1], [5, 6]]
    kjt = one_hot_of(["a", "b"], rows) if one_hot else jagged_of_rows(["a", "b"], rows)
    assert_kjt_equal(pickle.loads(pickle.dumps(kjt)), jagged_of_rows(["a", "b"], rows))


# -- Batch ------------------------------------------------------------------------------------


def make_batch(rng: np.random.Generator, n: int) -> Batch:
    return Batch(
        dense=torch.from_numpy(rng.random((n, 3), dtype=np.float32)),
        sparse=kjt_of(["a", "b"], random_samples(rng, n, 2)),
        labels=torch.from_numpy(rng.integers(0, 2, n).astype(np.float32)),
    )


def test_batch_concat_and_take_keep_rows_together():
    rng = np.random.default_rng(6)
    parts = [make_batch(rng, n) for n in (6, 0, 9)]
    window = Batch.concat(parts)
    assert len(window) == 15
    dense = torch.cat([p.dense for p in parts])
    labels = torch.cat([p.labels for p in parts])
    samples = [s for p in parts for s in samples_of(p.sparse)]
    indices = np.array([14, 3, 0, 7, 7, 11])
    out = window.take(indices)
    assert len(out) == 6
    assert torch.equal(out.dense, dense[indices]) and torch.equal(out.labels, labels[indices])
    assert samples_of(out.sparse) == [samples[i] for i in indices]
    with pytest.raises(ValueError, match="no Batch"):
        Batch.concat([])

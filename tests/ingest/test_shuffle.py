"""The reader's deal of a window's rows to its batches."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from dlrmflow.ingest.shuffle import deal


def test_deal_lists_every_row_once_each_batch_in_file_order():
    bounds = np.array([0, 3, 4099, 8195, 9000])
    order, dest = deal(bounds, np.random.default_rng(0))
    assert np.array_equal(np.sort(order), np.arange(9000))
    assert np.array_equal(dest[order], np.arange(9000))  # dest is order's inverse
    for a, b in itertools.pairwise(bounds):
        assert (np.diff(order[a:b]) > 0).all()
    assert np.array_equal(order, deal(bounds, np.random.default_rng(0))[0])
    assert not np.array_equal(order, deal(bounds, np.random.default_rng(1))[0])


def test_every_split_into_batches_is_equally_likely():
    # 6 rows into batches of 2, 1 and 3: 6! / (2! 1! 3!) = 60 splits, 200 draws expected
    # of each. A biased pick (say, never leaving a row in place) misses some entirely.
    bounds = np.array([0, 2, 3, 6])
    counts = Counter(
        tuple(deal(bounds, np.random.default_rng(seed))[0].tolist()) for seed in range(12_000)
    )
    assert len(counts) == 60
    assert min(counts.values()) > 130 and max(counts.values()) < 280


def test_deal_of_edge_sizes():
    assert deal(np.array([0]), np.random.default_rng(0))[0].tolist() == []
    order, dest = deal(np.array([0, 0, 5]), np.random.default_rng(0))
    assert order.tolist() == dest.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bounds", [[], [1, 4], [0, 5, 3], [[0, 1]]])
def test_deal_refuses_bounds_that_do_not_rise_from_zero(bounds):
    with pytest.raises(ValueError, match="bounds must rise from 0"):
        deal(np.array(bounds, dtype=np.int64), np.random.default_rng(0))

"""What the declared dense transforms take from the statistics: each column's standard
deviation (``standardize``) and quantile sketch (``bucketize`` with ``buckets``), checked
against numpy on the same values, merged exactly in any order, and read from statistics
written before them."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmflow.ingest.stats.results import read_stats
from dlrmflow.ingest.stats.scan import Columns, StatsAccumulator, file_stats, merge_stats
from dlrmflow.ingest.stats.sketches import SKETCH_MANTISSA_BITS, sketch_keys, sketch_values

COLUMNS = Columns("click", ("price", "count"), ())
EXPECTED = pa.schema([("click", pa.int8()), ("price", pa.float64()), ("count", pa.int32())])


def dense_table(rng: np.random.Generator, rows: int) -> pa.Table:
    price = rng.lognormal(3.0, 1.0, rows)
    price[rng.random(rows) < 0.1] = np.nan
    count = rng.integers(-5, 300, rows)
    return pa.table(
        {
            "click": pa.array(rng.integers(0, 2, rows), pa.int8()),
            "price": pa.array(price, pa.float64(), mask=rng.random(rows) < 0.05),
            "count": pa.array(count, pa.int32(), mask=rng.random(rows) < 0.2),
        }
    )


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(4)
    paths = []
    for i in range(3):
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(dense_table(rng, 3000), path, row_group_size=700)
        paths.append(str(path))
    return paths


def present(paths: list[str], name: str) -> np.ndarray:
    column = pa.concat_tables(pq.read_table(p) for p in paths).column(name)
    values = column.drop_null().to_numpy().astype(np.float64)
    return values[~np.isnan(values)]


def test_deviation_and_quantiles_match_numpy(files):
    stats = merge_stats(
        "x", False, (file_stats(p, columns=COLUMNS, expected=EXPECTED) for p in files), COLUMNS
    )
    for d in stats.dense:
        values = present(files, d.name)
        assert d.present == len(values) and sum(d.sketch_counts) == len(values)
        assert d.std == pytest.approx(values.std(), rel=1e-12)
        bounds = d.boundaries(4, fill=0.0)
        # Without missing values the boundaries are quantiles of the present values.
        missing_free = d.__class__(**{**d.__dict__, "missing": 0})
        for q, b in zip((0.25, 0.5, 0.75), missing_free.boundaries(4, 0.0), strict=True):
            exact = np.sort(values)[int(q * len(values))]
            # The bucket's value nearest zero: within the sketch's relative resolution.
            assert abs(b - exact) <= abs(exact) * 2.0**-SKETCH_MANTISSA_BITS, (d.name, q)
        assert list(bounds) == sorted(set(bounds))
    count = stats.dense[1]
    # Integers below 256 have buckets of their own: exact quantiles.
    exact = np.sort(present(files, "count"))
    got = count.__class__(**{**count.__dict__, "missing": 0}).boundaries(10, 0.0)
    assert list(got) == sorted({float(exact[int(i * len(exact) / 10)]) for i in range(1, 10)})


def test_totals_merge_exactly_in_any_order(files):
    parts = [file_stats(p, columns=COLUMNS, expected=EXPECTED) for p in files]
    one_pass = StatsAccumulator(COLUMNS)
    for path in files:
        parquet = pq.ParquetFile(path)
        for group in range(parquet.metadata.num_row_groups):
            one_pass.add(parquet.read_row_group(group), path)
    expected = one_pass.result("x", False).to_dict()
    assert merge_stats("x", False, parts, COLUMNS).to_dict() == expected
    reversed_parts = [file_stats(p, columns=COLUMNS, expected=EXPECTED) for p in files[::-1]]
    assert merge_stats("x", False, reversed_parts, COLUMNS).to_dict() == expected


def test_moments_and_quantiles_after_the_fill():
    acc = StatsAccumulator(Columns("click", ("x",), ()))
    values = [1.0, 2.0, 3.0, 4.0, None, None]
    acc.add(pa.table({"click": pa.array([0] * 6, pa.int8()), "x": pa.array(values)}), "t")
    stats = acc.result("t", False).dense[0]
    assert (stats.mean, stats.std) == (2.5, pytest.approx(np.std([1, 2, 3, 4])))
    mean, std = stats.filled_moments(10.0)
    filled = np.array([1.0, 2.0, 3.0, 4.0, 10.0, 10.0])
    assert mean == pytest.approx(filled.mean()) and std == pytest.approx(filled.std())
    # Ranks 2 and 4 of [1, 2, 3, 4, 10, 10]: the boundaries of three buckets of two rows.
    assert stats.boundaries(3, 10.0) == (3.0, 10.0)
    assert stats.boundaries(3, 0.0) == (1.0, 3.0)  # [0, 0, 1, 2, 3, 4]
    constant = StatsAccumulator(Columns("click", ("x",), ()))
    constant.add(pa.table({"click": pa.array([0] * 3, pa.int8()), "x": pa.array([7] * 3)}), "t")
    flat = constant.result("t", False).dense[0]
    assert flat.std == 0.0 and flat.boundaries(4, 0.0) == (7.0,)
    assert flat.filled_moments(0.0) == (7.0, 0.0)


def test_sketch_keys_are_ordered_like_their_values_and_read_back():
    values = np.array([-1e10, -300.5, -3.0, -1e-300, -0.0, 0.0, 5e-324, 1.0, 255.0, 256.0, 1e30])
    keys = sketch_keys(values)
    assert np.all(np.diff(keys) >= 0)
    assert keys[4] == keys[5] == 0
    back = sketch_values(keys)
    assert back[6] == 0.0  # subnormals share the bucket of zero
    for v, b in zip(np.delete(values, 6), np.delete(back, 6), strict=True):
        assert abs(b) <= abs(v) and abs(v - b) <= abs(v) * 2.0**-SKETCH_MANTISSA_BITS
    ints = np.arange(-255, 256, dtype=np.float64)
    assert np.array_equal(sketch_values(sketch_keys(ints)), ints)


def test_statistics_written_before_deviations_still_read(tmp_path):
    old = {
        "url": str(tmp_path), "rows": 4, "positives": 1, "row_groups": 1, "multi_hot": False,
        "dense": [{"name": "I1", "present": 3, "missing": 1, "min": 0, "max": 9, "mean": 3.0,
                   "negatives": 0}],
        "sparse": [],
    }  # fmt: skip
    (tmp_path / "stats.json").write_text(json.dumps(old))
    dense = read_stats(str(tmp_path)).dense[0]
    assert dense.std is None and dense.sketch_keys == () and dense.sketch_counts == ()

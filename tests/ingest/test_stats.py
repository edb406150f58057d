"""Feature statistics of a Parquet dataset, checked against exact pyarrow/numpy answers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from dlrmflow.config import DataConfig
from dlrmflow.ingest.reader import DataError
from dlrmflow.ingest.schema import DENSE, SPARSE
from dlrmflow.ingest.stats import (
    HyperLogLog,
    dataset_stats,
    read_stats,
    write_stats,
)
from dlrmflow.ingest.synthetic import generate_dataset
from tests.conftest import TINY_DATA


def _all_rows(url: str, days: int) -> pa.Table:
    return pa.concat_tables(pq.read_table(f"{url}/day={d}/part-00000.parquet") for d in range(days))


def test_stats_match_exact_counts(tiny_dataset):
    stats = dataset_stats(tiny_dataset)
    table = _all_rows(tiny_dataset, TINY_DATA["days"])
    assert stats.rows == table.num_rows == 18_000
    assert stats.row_groups == 9
    assert stats.positives == pc.sum(table["label"]).as_py()
    assert [d.name for d in stats.dense] == list(DENSE)
    assert [s.name for s in stats.sparse] == list(SPARSE)
    for d in stats.dense:
        column = table[d.name]
        assert d.missing == column.null_count
        assert d.present == len(column) - column.null_count
        assert d.min == pc.min(column).as_py() and d.max == pc.max(column).as_py()
        assert d.mean == pytest.approx(pc.mean(column).as_py(), rel=1e-12)
        assert d.negatives == pc.sum(pc.less(column, 0)).as_py()
    i2 = stats.dense[1]
    assert i2.negatives > 0 and i2.min < 0  # the synthetic I2 has Criteo's negative counts
    for s in stats.sparse:
        column = table[s.name]
        exact = len(np.unique(column.drop_null().to_numpy()))
        assert s.missing == column.null_count
        assert s.ids == len(column) - column.null_count
        assert s.mean_length == 1.0 and s.empty == 0
        assert abs(s.distinct - exact) <= max(2, 0.02 * exact), (s.name, s.distinct, exact)


def test_multi_hot_lengths_and_empty_lists(tmp_path):
    url = str(tmp_path / "mh")
    config = {**TINY_DATA, "days": 2, "rows_per_day": 1500, "row_group_size": 500}
    generate_dataset(DataConfig(url=url, **config, multi_hot=True))
    stats = dataset_stats(url)
    table = _all_rows(url, 2)
    assert stats.multi_hot
    for s in stats.sparse:
        lengths = pc.list_value_length(table[s.name]).to_numpy(zero_copy_only=False)
        assert s.ids == int(np.nansum(lengths))
        assert s.empty == int(np.sum(lengths == 0))
        assert s.max_length == int(np.nanmax(lengths))
        values = pc.list_flatten(table[s.name]).to_numpy()
        exact = len(np.unique(values))
        assert abs(s.distinct - exact) <= max(2, 0.02 * exact)
    assert max(s.mean_length for s in stats.sparse) > 3


def test_stats_round_trip_and_are_deterministic(tiny_dataset, tmp_path):
    stats = dataset_stats(tiny_dataset)
    assert dataset_stats(tiny_dataset) == stats
    root = str(tmp_path / "copy")
    write_stats(root, stats)
    assert read_stats(root) == stats
    with pytest.raises(FileNotFoundError, match="stats.json"):
        read_stats(str(tmp_path / "nowhere"))


def _small_dataset(tmp_path) -> str:
    """Two days of 400 rows in row groups of 200, for tests that break day 0."""
    url = str(tmp_path / "bad")
    config = {**TINY_DATA, "days": 2, "rows_per_day": 400, "row_group_size": 200}
    generate_dataset(DataConfig(url=url, **config))
    return url


def test_bad_label_names_file_row_group_and_column(tmp_path):
    url = _small_dataset(tmp_path)
    path = f"{url}/day=0/part-00000.parquet"
    table = pq.read_table(path)
    labels = table["label"].to_numpy().copy()
    labels[250] = 2  # second row group
    table = table.set_column(0, table.schema.field(0), pa.array(labels, pa.int8()))
    pq.write_table(table, path, row_group_size=200)
    with pytest.raises(DataError, match=r"day=0/part-00000\.parquet, row group 1: column label"):
        dataset_stats(url)


def test_schema_drift_names_file_and_column(tmp_path):
    url = _small_dataset(tmp_path)
    path = f"{url}/day=0/part-00000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(["C7"]), path)
    with pytest.raises(DataError, match=r"part-00000\.parquet: column C7: missing"):
        dataset_stats(url)
    pq.write_table(table.set_column(1, "I1", table["I1"].cast(pa.float64())), path)
    with pytest.raises(DataError, match=r"column I1: type double, the manifest says int32"):
        dataset_stats(url)


def test_hyperloglog_accuracy_merge_and_order():
    rng = np.random.default_rng(3)
    values = rng.integers(-(2**62), 2**62, 200_000)
    whole = HyperLogLog()
    whole.add(np.concatenate([values, values[:50_000]]))  # repeats do not count
    assert whole.estimate() == pytest.approx(200_000, rel=0.03)

    first, second = HyperLogLog(), HyperLogLog()
    second.add(values[100_000:])
    first.add(values[:100_000])
    first.merge(second)
    assert np.array_equal(first.registers, whole.registers)

    small = HyperLogLog()
    small.add(np.arange(37))  # sequential IDs still hash evenly
    assert round(small.estimate()) == 37
    assert HyperLogLog().estimate() == 0.0


def test_per_file_totals_merge_to_the_one_pass_statistics(tiny_dataset):
    """Merging per-day totals (as the ingest flow does) equals adding every row group to
    one accumulator, bit for bit, in any order of the days."""
    from dlrmflow.ingest.manifest import read_manifest
    from dlrmflow.ingest.stats import StatsAccumulator, file_stats, merge_stats

    manifest = read_manifest(tiny_dataset)
    paths = manifest.day_paths(tiny_dataset)
    one_pass = StatsAccumulator()
    for path in paths:
        parquet = pq.ParquetFile(path)
        for group in range(parquet.metadata.num_row_groups):
            one_pass.add(parquet.read_row_group(group), path)
    expected = one_pass.result(tiny_dataset, manifest.multi_hot).to_dict()
    parts = [file_stats(path) for path in paths]
    assert merge_stats(tiny_dataset, False, parts).to_dict() == expected
    assert merge_stats(tiny_dataset, False, parts[::-1]).to_dict() == expected
    assert dataset_stats(tiny_dataset).to_dict() == expected

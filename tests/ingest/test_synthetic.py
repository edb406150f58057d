"""The synthetic generator: layout, schema, determinism, realism and ground-truth metrics."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from dlrmflow.config import DataConfig
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.schema import CRITEO_CARDINALITIES, DENSE, LABEL, SPARSE, criteo_schema
from dlrmflow.ingest.synthetic import day_file_name, generate_dataset
from tests.ingest.digests import content_digest


def _config(root, **overrides) -> DataConfig:
    values = dict(
        url=str(root),
        days=3,
        rows_per_day=2500,
        row_group_size=1000,
        cardinality_scale=0.001,
        max_cardinality=40,
        seed=7,
    )
    values.update(overrides)
    return DataConfig(**values)


def _read_all(root: str, days: int) -> pa.Table:
    paths = read_manifest(root).day_paths(root)
    assert len(paths) == days
    return pa.concat_tables(pq.read_table(path) for path in paths)


@pytest.fixture(scope="module")
def one_hot(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_hot") / "data"
    config = _config(root)
    manifest = generate_dataset(config)
    return config, manifest, _read_all(str(root), config.days)


def test_layout_row_groups_and_manifest(one_hot):
    config, manifest, _ = one_hot
    assert read_manifest(config.url) == manifest
    assert manifest.source == "synthetic"
    assert (manifest.days, manifest.test_day, manifest.rows) == (3, 2, 7500)
    assert [f.day for f in manifest.files] == [0, 1, 2]
    assert manifest.train_days() == [0, 1]
    assert manifest.schema_ == [
        {"name": f.name, "type": str(f.type)} for f in criteo_schema(multi_hot=False)
    ]
    for day_file in manifest.files:
        assert day_file.path == f"day={day_file.day}/{day_file_name(config, day_file.day)}"
        assert re.fullmatch(r"part-[0-9a-f]{16}\.parquet", day_file.path.split("/")[1])
        parquet = pq.ParquetFile(f"{config.url}/{day_file.path}")
        path = f"{config.url}/{day_file.path}"
        assert (day_file.bytes, day_file.digest) == (os.path.getsize(path), content_digest(path))
        assert parquet.schema_arrow == criteo_schema(multi_hot=False)
        groups = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
        assert groups == [1000, 1000, 500]
        labels = parquet.read(columns=[LABEL])[LABEL].to_numpy()
        assert day_file.rows == labels.size == 2500
        assert day_file.positive_rate == pytest.approx(labels.mean())
    assert manifest.generator["seed"] == 7


def test_cardinalities_follow_criteo_scaled_and_capped(one_hot):
    config, manifest, table = one_hot
    expected = {
        name: min(max(round(n * config.cardinality_scale), 2), config.max_cardinality)
        for name, n in zip(SPARSE, CRITEO_CARDINALITIES, strict=True)
    }
    assert manifest.cardinalities == expected
    assert max(expected.values()) == 40 and min(expected.values()) == 2
    for name in SPARSE:
        ids = table[name].drop_null().to_numpy()
        distinct = np.unique(ids)
        assert distinct.size <= expected[name], name
        assert ids.min() >= 0 and ids.max() < 2**32, name
    # IDs are scattered hashes, not ranks; and popularity is skewed (Zipf), not uniform.
    c3 = table["C3"].drop_null().to_numpy()
    assert np.unique(c3).size == 40
    assert c3.max() > 2**24
    _, counts = np.unique(c3, return_counts=True)
    assert counts.max() > 5 * counts.min()


def test_dense_features_have_criteo_like_missing_and_negative_values(one_hot):
    _, _, table = one_hot
    missing = {name: table[name].null_count / table.num_rows for name in DENSE}
    assert missing["I1"] == pytest.approx(0.45, abs=0.04)
    assert missing["I10"] == pytest.approx(0.45, abs=0.04)
    assert missing["I12"] == pytest.approx(0.77, abs=0.04)
    assert missing["I2"] == 0.0
    assert all(rate < 0.3 for name, rate in missing.items() if name not in ("I1", "I10", "I12"))
    i2 = table["I2"].to_numpy()
    assert set(np.unique(i2[i2 < 0])) <= {-1, -2, -3} and (i2 < 0).any()
    for name in DENSE:
        values = table[name].drop_null().to_numpy()
        if name != "I2":
            assert values.min() >= 0, name
    # Heavy tails: I5's counts span orders of magnitude.
    i5 = table["I5"].drop_null().to_numpy()
    assert np.percentile(i5, 99) > 20 * max(np.percentile(i5, 50), 1)


def test_categorical_missing_values(one_hot):
    _, _, table = one_hot
    assert table["C1"].null_count == 0
    assert table["C22"].null_count / table.num_rows == pytest.approx(0.76, abs=0.04)
    assert table["C19"].null_count / table.num_rows == pytest.approx(0.44, abs=0.04)


def test_same_seed_same_data_other_seed_other_data(one_hot, tmp_path):
    config, manifest, table = one_hot
    again = generate_dataset(config, url=str(tmp_path / "again"))
    assert _read_all(str(tmp_path / "again"), config.days).equals(table)
    assert again == manifest
    other = generate_dataset(config.model_copy(update={"seed": 8}), url=str(tmp_path / "other"))
    other_table = _read_all(str(tmp_path / "other"), config.days)
    assert not other_table.equals(table)
    assert not np.array_equal(other_table["C3"].to_numpy(), table["C3"].to_numpy())
    assert other.bayes_auc != manifest.bayes_auc
    # Same parameters, same files (names and digests); another seed, other ones.
    assert {f.digest for f in other.files}.isdisjoint(f.digest for f in manifest.files)
    assert {f.path for f in other.files}.isdisjoint(f.path for f in manifest.files)


@pytest.mark.parametrize("target", [0.25, 0.1])
def test_positive_rate_and_bayes_metrics(tmp_path, target):
    config = _config(tmp_path, days=2, rows_per_day=20_000, row_group_size=8192)
    config.positive_rate = target
    manifest = generate_dataset(config)
    labels = _read_all(config.url, 2)[LABEL].to_numpy()
    assert manifest.positive_rate == pytest.approx(labels.mean())
    assert manifest.positive_rate == pytest.approx(target, abs=0.01)
    assert 0.65 < manifest.bayes_auc < 0.95
    # The true probabilities beat predicting the base rate by a wide margin.
    entropy = -(target * math.log(target) + (1 - target) * math.log(1 - target))
    assert manifest.bayes_logloss < 0.95 * entropy


def test_multi_hot_lists(tmp_path):
    config = _config(tmp_path, days=2, rows_per_day=1500, multi_hot=True)
    manifest = generate_dataset(config)
    assert manifest.multi_hot
    assert manifest.schema_[-1] == {"name": "C26", "type": "list<item: int64>"}
    table = _read_all(config.url, 2)
    assert table.schema == criteo_schema(multi_hot=True)
    for name in SPARSE:
        column = table[name]
        assert column.null_count == 0, name
        lengths = pc.list_value_length(column).to_numpy()
        ids = pc.list_flatten(column).to_numpy()
        assert np.unique(ids).size <= manifest.cardinalities[name], name
        if name == "C22":  # usually missing: missing rows are empty lists
            assert (lengths == 0).mean() == pytest.approx(0.76, abs=0.05)
        if name == "C1":  # never missing
            assert lengths.min() >= 1
    all_lengths = np.concatenate([pc.list_value_length(table[n]).to_numpy() for n in SPARSE])
    assert np.unique(all_lengths).size > 10
    assert 0.6 < manifest.bayes_auc < 0.95
    assert set(manifest.generator["mean_lengths"]) == set(SPARSE)


def test_memory_url_overrides_config_url_and_reports_progress(tmp_path):
    config = _config(tmp_path / "unused", days=2, rows_per_day=1200, row_group_size=500)
    url = "memory://dlrmflow-test-synthetic/data"
    calls: list[int] = []
    try:
        manifest = generate_dataset(config, url=url, progress=calls.append)
        assert read_manifest(url) == manifest
        with fsspec.open(f"{url}/{manifest.files[1].path}", "rb") as f:
            assert pq.ParquetFile(f).metadata.num_rows == 1200
    finally:
        fsspec.filesystem("memory").rm("/dlrmflow-test-synthetic", recursive=True)
    assert calls == [500, 500, 200] * 2
    assert not (tmp_path / "unused").exists()


def test_negative_seed_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="data.seed"):
        generate_dataset(_config(tmp_path, seed=-1))


def test_unwritable_location_names_the_file(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"not-a-directory: cannot be the dataset's folder: File"):
        generate_dataset(_config(blocker, rows_per_day=10))
    inside = tmp_path / "data"
    (inside / "day=0").mkdir(parents=True)
    (inside / "day=0" / day_file_name(_config(inside, rows_per_day=10), 0)).mkdir()
    with pytest.raises(OSError, match=r"day 0: .*data/day=0/part-\w+\.parquet"):
        generate_dataset(_config(inside, rows_per_day=10))


HOLD_DATASET = """
import sys, time
from dlrmflow.ingest.lock import dataset_lock
with dataset_lock(sys.argv[1], "generate"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_generate_into_one_folder_says_another_writer_holds_it(tmp_path):
    """Two writers would remove each other's temporaries and publish half-written days:
    the second fails at once in one line naming the holder, touching nothing; once the
    holder is gone (even killed) the folder is free."""
    url = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "DLRMFLOW_HELD_RUN_DIRS"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_DATASET, str(url)], stdout=subprocess.PIPE, text=True, env=env
    )
    generate = [sys.executable, "-m", "dlrmflow", "generate", "--out", str(url)]
    generate += ["--set", "data.days=2", "--set", "data.rows_per_day=50"]
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused = subprocess.run(generate, capture_output=True, text=True, env=env, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 1
    [line] = refused.stderr.strip().splitlines()
    assert f"{url} is in use by pid {holder.pid}" in line, line
    assert "another writer holds the dataset" in line, line
    assert not list(url.glob("day=*")) and not (url / "manifest.json").exists()
    done = subprocess.run(generate, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (url / "manifest.json").is_file()

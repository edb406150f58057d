"""The readers benchmark at tiny size: its record, its report section and its artificial
cost, never its speed."""

import math
import time

import pyarrow.parquet as pq
import pytest
import torch

from dlrmflow.bench.readers import BASELINE, CostlyTransform, burn_cpu, run_readers_benchmark
from dlrmflow.bench.report import readers_section
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.train.run.data import batch_loader, fit_features
from tests.conftest import tiny_run_config
from tests.test_bench_helpers import report_section, table_rows

CASES = {BASELINE, "local_2_readers", "remote_1_server", "remote_2_servers"}


def test_burn_cpu_spends_this_threads_cpu_time():
    start = time.thread_time()
    burn_cpu(0.05)
    assert 0.05 <= time.thread_time() - start < 0.5


def test_costly_transform_gives_the_same_batch_at_its_cost(tiny_dataset, tmp_path):
    config = tiny_run_config(tiny_dataset, tmp_path)
    manifest = read_manifest(tiny_dataset)
    spec, ids = fit_features(config, manifest)
    table = pq.read_table(manifest.day_paths(tiny_dataset)[0], columns=spec.columns)
    transform = CostlyTransform(spec, ids, us_per_row=20.0)
    start = time.thread_time()
    transform.validate(table)
    assert time.thread_time() - start >= table.num_rows * 20e-6
    costly, plain = transform(table), BatchTransform(spec, ids)(table)
    assert torch.equal(costly.dense, plain.dense) and torch.equal(costly.labels, plain.labels)
    assert torch.equal(costly.sparse.one_hot_rows, plain.sparse.one_hot_rows)


def test_a_reader_spends_the_cost_on_every_row_it_reads(tiny_dataset, tmp_path):
    # The reader writes rows through the compiled window path, never calling the
    # transform on a table: the cost must be spent all the same.
    config = tiny_run_config(tiny_dataset, tmp_path)
    manifest = read_manifest(tiny_dataset)
    spec, ids = fit_features(config, manifest)
    paths = manifest.day_paths(tiny_dataset, manifest.train_days())

    def cpu_to_read(transform: BatchTransform) -> tuple[int, float]:
        _, loader = batch_loader(
            paths, spec, ids, batch_size=256, num_workers=1, shuffle=True, transform=transform
        )
        start = time.process_time()
        rows = sum(len(batch) for batch in loader)
        return rows, time.process_time() - start

    cpu_to_read(BatchTransform(spec, ids))  # compiled code loaded, threads warmed
    rows, plain = cpu_to_read(BatchTransform(spec, ids))
    costly_rows, costly = cpu_to_read(CostlyTransform(spec, ids, us_per_row=50.0))
    assert rows == costly_rows == sum(pq.ParquetFile(p).metadata.num_rows for p in paths)
    assert costly - plain >= 0.8 * rows * 50e-6


@pytest.fixture(scope="module")
def record() -> dict:
    return run_readers_benchmark(
        rows=3000, batch_size=256, us_per_row=2.0, step_ms=1.0, row_group_size=500, repeats=2
    )


def test_tiny_benchmark_record(record):
    assert record["benchmark"] == "readers" and BASELINE in record["baseline"]
    assert record["repeats"] == 2
    results = record["results"]
    assert set(results) == CASES
    for case, r in results.items():
        # Every case reads the one epoch whole, in as many steps, none failing over.
        assert (r["rows"], r["steps"], r["failovers"]) == (3000, 12, 0), case
        assert 0 <= r["wait_s"] <= r["seconds"] and 0 <= r["wait_share"] <= 1, case
        assert r["samples_per_s"] == r["rows"] / r["seconds"], case
    assert set(record["ratios"]) == {f"{case}_vs_{BASELINE}" for case in CASES - {BASELINE}}
    base = results[BASELINE]["samples_per_s"]
    for case in CASES - {BASELINE}:
        ratio = record["ratios"][f"{case}_vs_{BASELINE}"]
        assert math.isfinite(ratio) and ratio == results[case]["samples_per_s"] / base
    assert record["machine"]["cpu_count"] >= 1
    assert set(record["load_average_1m"]) == {"before", "after"}


def test_the_report_section_has_a_row_per_case_against_the_baseline(record):
    section = report_section(readers_section, record)
    assert section.startswith("## Reader services")
    rows = table_rows(section)
    assert [row[0] for row in rows] == list(record["results"])
    by_case = {row[0]: row for row in rows}
    assert by_case[BASELINE][2] == "1"  # the baseline ÷ itself

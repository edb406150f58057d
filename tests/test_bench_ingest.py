"""The ingest benchmark at tiny size: equal threads and footers on both sides, its report
sections and a run apart in the documents, never speed."""

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from dlrmflow.bench.ingest import (
    decode_transform,
    pyarrow_decode,
    run_ingest_benchmark,
    written_bytes_per_row,
)
from dlrmflow.bench.report import ingest_section
from dlrmflow.config import ConfigError, DataConfig, FeaturesConfig, ModelConfig
from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.loader import reader_threads
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.splits import list_splits
from dlrmflow.ingest.synthetic_logs import generate_logs_dataset
from dlrmflow.runtime.glibc_malloc import applied_threshold
from tests.conftest import run_cli
from tests.test_bench_helpers import report_section, table_rows

COMMITTED_REPORT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.json"


@pytest.fixture(scope="module")
def record():
    return run_ingest_benchmark(rows=12_000, workers=(1, 2), batch_size=1024, repeats=1)


@pytest.fixture(scope="module")
def logs_record():
    return run_ingest_benchmark(rows=8000, workers=(1,), batch_size=1024, repeats=1, shape="logs")


def test_both_sides_run_as_many_threads(record):
    assert set(record["results"]) == {"workers_1", "workers_2"}
    for n in (1, 2):
        r = record["results"][f"workers_{n}"]
        assert r["reader_threads_per_worker"] == reader_threads(n)
        assert r["pyarrow_decode_threads"] == r["reader_threads_total"] == n * reader_threads(n)
    assert "as many threads as our N readers" in record["baseline"]
    assert record["shape"] == "criteo"
    assert "footer" in record["baseline"] and "footers" in record
    # Criteo's IDs are integers: nothing is read as a dictionary, no plain-strings case.
    assert record["dictionary_reads"] == []
    assert not any("plain_strings" in key for key in record["ratios"])


def test_record_has_rates_cpu_and_ratios(record):
    for n in (1, 2):
        r = record["results"][f"workers_{n}"]
        for side in ("pyarrow_decode", "reader_transform", "reader_only", "decode_transform"):
            assert r[f"{side}_rows_per_s"] > 0
            assert math.isfinite(r[f"{side}_cpu_s_per_m_rows"])
            assert r[f"{side}_cpu_s_per_m_rows"] >= 0
        ratio = record["ratios"][f"reader_transform_vs_pyarrow_decode_{n}w"]
        assert ratio == r["reader_transform_rows_per_s"] / r["pyarrow_decode_rows_per_s"]
        bare = record["ratios"][f"decode_transform_vs_pyarrow_decode_{n}w"]
        assert bare == r["decode_transform_rows_per_s"] / r["pyarrow_decode_rows_per_s"]
    # Both sides ran in this process, under the allocator setting it records.
    assert record["machine"]["malloc_mmap_threshold"] == applied_threshold()


def test_benchmark_leaves_torch_threads_as_it_found_them():
    # It sets them per worker count (for the cores the readers leave); the next benchmark
    # in the process must not inherit that.
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        run_ingest_benchmark(rows=4000, workers=(2,), batch_size=1024, repeats=1)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


def test_pyarrow_decode_reads_every_row_of_every_split(tiny_dataset):
    splits = list_splits(read_manifest(tiny_dataset).day_paths(tiny_dataset))
    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in {s.path for s in splits})
    for threads in (1, 3):
        assert pyarrow_decode(splits, ["label", "I1", "C1"], threads) == rows


def _transform(data_url: str) -> tuple[list, list[str], BatchTransform]:
    manifest = read_manifest(data_url)
    spec = FeatureSpec.for_dataset(manifest, FeaturesConfig(), ModelConfig())
    return (
        list_splits(manifest.day_paths(data_url)),
        spec.columns,
        BatchTransform(spec, HashIds.from_spec(spec)),
    )


def test_decode_transform_transforms_every_row_of_every_split(tiny_dataset):
    splits, columns, transform = _transform(tiny_dataset)
    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in {s.path for s in splits})
    for threads in (1, 3):
        assert decode_transform(splits, columns, threads, transform) == rows


def test_written_bytes_per_row_are_the_batches_sizes(tiny_dataset):
    splits, columns, transform = _transform(tiny_dataset)
    written = written_bytes_per_row(splits, columns, 64, transform)
    n_dense, n_sparse = len(transform.spec.dense), len(transform.spec.sparse)
    # float32 dense and label, and one row index of 4 or 8 bytes per one-hot sparse column.
    assert written["reader_transform"] in (
        4 * (n_dense + 1) + 4 * n_sparse,
        4 * (n_dense + 1) + 8 * n_sparse,
    )
    # The Arrow columns: at least 8 bytes a sparse ID, and values for every dense column.
    assert written["reader_only"] >= 8 * n_sparse + n_dense


def test_the_logs_shape_is_benchmarked_on_the_columns_its_schema_declares(logs_record):
    record = logs_record
    assert record["shape"] == "logs" and record["rows"] == 8000
    r = record["results"]["workers_1"]
    # Ours reads the string IDs and the list of recent items as dictionaries, and so does
    # the second baseline; the ratios are against the faster one.
    assert record["dictionary_reads"] == ["user_id", "item_id", "recent_items"]
    assert "read_dictionary" in record["baseline"]
    faster = max(r["pyarrow_decode_rows_per_s"], r["pyarrow_decode_dictionaries_rows_per_s"])
    assert math.isfinite(r["pyarrow_decode_dictionaries_cpu_s_per_m_rows"])
    ratio = record["ratios"]["reader_transform_vs_pyarrow_decode_1w"]
    assert ratio == r["reader_transform_rows_per_s"] / faster > 0
    bare = record["ratios"]["decode_transform_vs_pyarrow_decode_1w"]
    assert bare == r["decode_transform_rows_per_s"] / faster
    # Every string decoded plain on both sides: what the dictionary reads gain.
    plain = record["ratios"]["reader_transform_plain_strings_vs_pyarrow_decode_1w"]
    assert plain == r["reader_transform_plain_strings_rows_per_s"] / r["pyarrow_decode_rows_per_s"]
    assert math.isfinite(r["reader_transform_plain_strings_cpu_s_per_m_rows"])


def test_the_report_sections_have_a_row_per_worker_count(record, logs_record):
    section = report_section(ingest_section, record)
    assert section.startswith("## Ingest\n") and "Run apart" not in section
    assert [row[0] for row in table_rows(section)] == ["1", "2"]
    assert "ours CPU s per M rows" in section and "Bytes written per row" in section
    logs = report_section(ingest_section, logs_record)
    assert logs.startswith("## Ingest, logs shape\n")
    assert "pyarrow decode, dictionaries rows/s" in logs
    assert [row[0] for row in table_rows(logs)] == ["1"]


def _report_with(tmp_path: Path, key: str, own_run: dict) -> Path:
    """A report.json whose ``key`` benchmark is ``own_run`` (the report's own run of it),
    the other benchmarks the committed report's."""
    report = {**json.loads(COMMITTED_REPORT.read_text()), key: own_run}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def test_an_ingest_run_apart_replaces_the_reports(record, tmp_path):
    from dlrmflow.bench.docs import BASELINES, RESULTS_END, RESULTS_START, write_docs

    report = _report_with(tmp_path, "ingest", record)
    apart = json.loads(json.dumps(record))
    apart["ratios"]["reader_transform_vs_pyarrow_decode_1w"] = 0.123456
    (tmp_path / "ingest.json").write_text(json.dumps(apart))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{RESULTS_START}\n{RESULTS_END}\n")
    write_docs(report, tmp_path / "docs", readme, ingest_run=tmp_path / "ingest.json")
    markdown = (tmp_path / "docs" / "benchmarks.md").read_text()
    ingest = markdown.split("## Ingest", 1)[1].split("\n## ", 1)[0]
    assert "Run apart from the report (`dlrmflow bench ingest`)" in ingest
    assert "0.123" in ingest and "Bytes written per row" in ingest
    row = f"| Ingest | `reader_transform_vs_pyarrow_decode_1w` | {BASELINES['ingest']} | 0.12 |"
    assert row in readme.read_text()


def test_a_logs_shape_run_apart_replaces_the_reports(logs_record, tmp_path):
    from dlrmflow.bench.docs import BASELINES, RESULTS_END, RESULTS_START, write_docs

    report = _report_with(tmp_path, "ingest_logs", logs_record)
    apart = json.loads(json.dumps(logs_record))
    # The baseline reads strings as dictionaries as ours does: the README's headline is
    # against it, not the plain-strings figure.
    apart["ratios"]["reader_transform_vs_pyarrow_decode_1w"] = 0.654321
    apart["ratios"]["reader_transform_plain_strings_vs_pyarrow_decode_1w"] = 0.987654
    (tmp_path / "logs.json").write_text(json.dumps(apart))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{RESULTS_START}\n{RESULTS_END}\n")
    write_docs(report, tmp_path / "docs", readme, ingest_logs_run=tmp_path / "logs.json")
    markdown = (tmp_path / "docs" / "benchmarks.md").read_text()
    logs = markdown.split("## Ingest, logs shape", 1)[1].split("\n## ", 1)[0]
    assert "`dlrmflow bench ingest --shape logs`" in logs and "0.654" in logs
    assert "pyarrow decode, dictionaries rows/s" in logs
    fair = "| Ingest, logs shape | `reader_transform_vs_pyarrow_decode_1w` |"
    assert f"{fair} {BASELINES['ingest_logs']} | 0.65 |" in readme.read_text()
    assert "plain_strings" not in readme.read_text()


def test_pyarrow_decode_with_dictionaries_reads_lists_of_strings_as_dictionaries(tmp_path):
    path = tmp_path / "day=0" / "part.parquet"
    path.parent.mkdir()
    items = pa.array([["a", "b"], None, ["b"], []] * 50, pa.list_(pa.string()))
    pq.write_table(pa.table({"items": items, "label": pa.array([0, 1] * 100, pa.int8())}), path)
    splits = list_splits([str(path)])
    # read_dictionary names the list's leaf column (``items.list.element``), not the list.
    assert pyarrow_decode(splits, ["items", "label"], 2, lambda schema: ["items"]) == 200


def test_an_existing_dataset_is_recorded_under_its_shape_and_its_jagged_bytes(tmp_path):
    data = str(tmp_path / "logs")
    generate_logs_dataset(DataConfig(url=data, days=2, rows_per_day=2000, cardinality_scale=0.0001))
    record = run_ingest_benchmark(data_url=data, workers=(1,), batch_size=512, repeats=1)
    assert record["shape"] == "logs" and record["rows"] == 4000
    # The first batch's tensors: a row's label and two dense floats and an int32 length
    # for each of its four keys; an int64 row and a float32 weight for each user, item,
    # recent item and tag ID (a batch with weights has one for every ID: 1 where none is
    # declared).
    first = read_manifest(data).day_paths(data, [0])[0]
    rows = pq.ParquetFile(first).read_row_group(0).slice(0, 512)
    tags = pc.sum(pc.list_value_length(rows.column("tags"))).as_py()
    recent = pc.sum(pc.list_value_length(rows.column("recent_items"))).as_py()
    ids = 512 - rows.column("user_id").null_count + 512 + recent + tags
    want = (512 * (4 * 3 + 4 * 4) + ids * (8 + 4)) / 512
    assert record["written_bytes_per_row"]["reader_transform"] == want


def test_an_unknown_shape_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^shape must be one of criteo, logs, not 'tsv'$"):
        run_ingest_benchmark(rows=100, shape="tsv")


def test_bench_ingest_takes_the_shape_and_refuses_an_unknown_one_in_one_line(
    monkeypatch, capsys, tmp_path
):
    out = tmp_path / "ingest.json"
    args = ["bench", "ingest", "--rows", "4000", "--repeats", "1", "--shape", "logs"]
    code, _, _ = run_cli(monkeypatch, capsys, *args, "--json", str(out))
    assert code == 0
    assert json.loads(out.read_text())["shape"] == "logs"
    code, _, err = run_cli(
        monkeypatch, capsys, "bench", "ingest", "--rows", "100", "--shape", "tsv"
    )
    assert code == 1
    assert len(err) == 1 and err[0].endswith("shape must be one of criteo, logs, not 'tsv'")

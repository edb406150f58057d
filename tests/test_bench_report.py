"""The benchmark report at quick size: files, tables, plots and records; never speed."""

import importlib.util
import json

import matplotlib.image
import pytest

import dlrmflow.flows.ingest as ingest_flow
from dlrmflow.bench.machine import available_cores
from dlrmflow.bench.report import PLOTS, run_report, torchrec_section
from dlrmflow.bench.torchrec_compare import MODES, WORLD_SIZES, torchrec_missing
from dlrmflow.runtime.glibc_malloc import applied_threshold
from tests.test_bench_ingest_days import FakeIngest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TORCHREC_INSTALLED = importlib.util.find_spec("torchrec") is not None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One quick report for every test here (it runs each benchmark once). The ingest-days
    benchmark times the ingest flow on Dask and on threads, which
    ``tests/flows/test_ingest_days.py`` checks; here ``FakeIngest`` stands in for the flow
    (as in ``tests/test_bench_ingest_days.py``), so the report is checked without starting
    a Prefect server and two Dask clusters."""
    out = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ingest_flow, "run_ingest", FakeIngest())
        return out, run_report(out, quick=True)


def test_report_writes_json_markdown_and_valid_plots(report):
    out, record = report
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(record))
    assert record["quick"] is True and record["plots"] == sorted(PLOTS.values())
    for name in PLOTS.values():
        path = out / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 200 and width > 300, name
    markdown = (out / "report.md").read_text()
    for section in ("## Ingest", "## Kernels", "## Training", "## Tiered", "## TorchRec"):
        assert section in markdown
    for name in PLOTS.values():
        assert f"]({name})" in markdown  # every plot is shown in the report


def test_markdown_tables_hold_every_result(report):
    out, record = report
    lines = (out / "report.md").read_text().splitlines()
    table_rows = [line for line in lines if line.startswith("| ")]
    for benchmark in ("kernels", "train"):
        for name in record[benchmark]["results"]:
            assert any(line.startswith(f"| {name} |") for line in table_rows), name
    tiered = record["tiered"]["results"]
    tiered_rows = [line for line in table_rows if line.startswith(("| LRU |", "| prefetch |"))]
    assert len(tiered_rows) == len(tiered) >= 4
    base = record["train"]["baseline_result"]["samples_per_s"]
    assert any(
        line.startswith(f"| single-process DLRM (baseline) | {base:,.0f} | 1 |") for line in lines
    )


def test_tiered_record_has_sane_hit_rates(report):
    tiered = report[1]["tiered"]
    runs = tiered["results"].values()
    need = 2 * tiered["max_distinct_rows_per_batch"]
    assert all(need <= r["cache_rows"] <= tiered["config"]["table_rows"] for r in runs)
    assert all(0 < r["hit_rate"] <= 1 and r["samples_per_s"] > 0 for r in runs)
    for r in runs:
        if r["prefetch"]:
            # Every timed batch was prefetched whole: its forward found all its rows.
            assert r["hit_rate"] == 1.0 and r["prefetched_per_step"] > 0
    lru = sorted(
        (r["cache_rows"], r["hit_rate"], r["evictions_per_step"]) for r in runs if not r["prefetch"]
    )
    # The cache that holds every row only misses rows never seen: no smaller one does better.
    assert lru[-1][2] == 0 and all(hit <= lru[-1][1] for _, hit, _ in lru)
    assert lru[0][2] > 0  # the smallest cache does evict
    assert set(tiered["ratios"]) == set(tiered["results"])


def test_skipped_comparison_says_why():
    section = torchrec_section(None, "ModuleNotFoundError: No module named 'torchrec'")
    assert section.startswith("## TorchRec comparison")
    assert "Skipped: ModuleNotFoundError: No module named 'torchrec'." in section
    assert "|" not in section


def test_torchrec_section_matches_the_environment(report):
    out, record = report
    markdown = (out / "report.md").read_text()
    missing = torchrec_missing()
    if missing is not None:
        assert record["torchrec"] == {"skipped": missing}
        assert f"Skipped: {missing}." in markdown
    else:
        assert "Skipped" not in markdown.split("## TorchRec comparison")[1]


@pytest.mark.skipif(not TORCHREC_INSTALLED, reason="the optional torchrec extra is not installed")
def test_torchrec_comparison_record(report):
    comparison = report[1]["torchrec"]
    assert set(comparison["ratios"]) == set(MODES)
    for name, mode in MODES.items():
        r = comparison["results"][name]
        assert r["torchrec"]["shardings"] == [mode.sharding]
        assert r["ours"]["samples_per_s"] > 0 and r["torchrec"]["samples_per_s"] > 0
        assert (
            comparison["ratios"][name]
            == r["ours"]["samples_per_s"] / r["torchrec"]["samples_per_s"]
        )
        if mode.ours == "sharded":
            assert r["ours"]["shardings"] == [mode.sharding]
            assert r["ours_model"].startswith("DLRM with sharded embeddings")
        else:
            assert "one process" in r["ours_model"]
    # At world size 1 both of our models face the one TorchRec run.
    results = comparison["results"]
    assert results["w1_plain"]["torchrec"] == results["w1_table_wise"]["torchrec"]
    assert comparison["versions"]["torchrec"]
    assert comparison["pick"] == "best round of each side"
    markdown = (report[0] / "report.md").read_text()
    for name in MODES:
        assert f"| {name} |" in markdown


@pytest.mark.skipif(not TORCHREC_INSTALLED, reason="the optional torchrec extra is not installed")
def test_torchrec_sides_share_threads_and_allocator(report):
    comparison = report[1]["torchrec"]
    cores = available_cores()
    per_rank = {f"w{w}": max(1, cores // w) for w in WORLD_SIZES}
    assert comparison["threads"] == {"cores": cores, "per_rank": per_rank}
    processes = comparison["processes"]
    assert sorted((p["world"], p["rank"]) for p in processes) == [(1, 0), (2, 0), (2, 1)]
    for p in processes:
        # Both sides ran in each of these processes, so these are both sides' settings.
        assert p["torch_threads"] == per_rank[f"w{p['world']}"]
        assert p["malloc_mmap_threshold"] == applied_threshold()


def test_every_benchmark_records_equal_threads_and_allocator(report):
    _, record = report
    setting = applied_threshold()  # run_report tuned this process as the CLI does
    for name, r in record["ingest"]["results"].items():
        assert r["pyarrow_decode_threads"] == r["reader_threads_total"], name
    assert record["ingest"]["machine"]["malloc_mmap_threshold"] == setting
    assert record["kernels"]["malloc_mmap_threshold"] == setting
    assert record["kernels"]["naive_baseline"].startswith("naive user")
    train = record["train"]
    for world in (1, 2):
        job = [p for p in train["processes"] if p["world"] == world]
        assert sum(p["torch_threads"] for p in job) == train["threads"]["baseline"]
    assert {p["malloc_mmap_threshold"] for p in train["processes"]} == {setting}
    markdown = (report[0] / "report.md").read_text()
    assert "Naive line: naive user" in markdown and "naive user / ours" in markdown
    assert "ours CPU s per M rows" in markdown


def test_docs_are_generated_from_the_report_json(report, tmp_path):
    from dlrmflow.bench.docs import RESULTS_END, RESULTS_START, write_docs

    out, record = report
    assert "## Reader services" in (out / "report.md").read_text()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{RESULTS_START}\nold figures\n{RESULTS_END}\n\nafter\n")
    write_docs(out / "report.json", tmp_path / "docs", readme)
    assert json.loads((tmp_path / "docs" / "benchmarks.json").read_text()) == json.loads(
        json.dumps(record)
    )
    markdown = (tmp_path / "docs" / "benchmarks.md").read_text()
    for title in ("## Ingest", "## Kernels", "## Training", "## Reader services", "## TorchRec"):
        assert title in markdown
    assert markdown.count("### How it runs") >= 5 and "Quick run" in markdown
    text = readme.read_text()
    assert "old figures" not in text and text.endswith("after\n")
    ratio = record["ingest"]["ratios"]["reader_transform_vs_pyarrow_decode_1w"]
    row = "| Ingest | `reader_transform_vs_pyarrow_decode_1w` | pyarrow decode, same threads |"
    assert f"{row} {ratio:.2f} |" in text


def test_the_ingest_days_record_has_its_section_with_a_row_per_runner(report):
    from dlrmflow.bench.ingest_days import BASELINE

    out, record = report
    days = record["ingest_days"]
    assert days["benchmark"] == "ingest_days" and days["baseline"].startswith(BASELINE)
    section = (out / "report.md").read_text().split("## Ingest days on Dask", 1)[1]
    section = section.split("\n## ", 1)[0]
    assert f"{days['days']} raw days of {days['rows_per_day']:,} rows" in section
    for name in (BASELINE, "dask_2_workers", "threads"):
        assert f"| {name} |" in section, name


def test_precision_record_compares_bf16_with_fp32_of_each_config(report):
    from dlrmflow.bench.precision import BASELINE, CONFIGS

    out, record = report
    precision = record["precision"]
    assert precision["baseline"] == BASELINE
    assert set(precision["results"]) == set(CONFIGS)
    for name, result in precision["results"].items():
        fp32, bf16 = result["fp32"], result["bf16"]
        ratio = precision["ratios"][f"{name}_bf16_samples_per_s"]
        assert ratio == pytest.approx(bf16["samples_per_s"] / fp32["samples_per_s"])
        assert 0.5 < fp32["auc"] < 1 and 0.5 < bf16["auc"] < 1
        # One epoch of the training days: both precisions trained the same steps.
        assert fp32["steps"] == bf16["steps"] > 0
        assert fp32["final_loss"] != bf16["final_loss"]  # bf16 really computed in bf16
    assert "## Precision: bf16 against fp32" in (out / "report.md").read_text()


def test_an_ingest_run_apart_replaces_the_reports(report, tmp_path):
    from dlrmflow.bench.docs import RESULTS_END, RESULTS_START, write_docs

    out, record = report
    apart = json.loads(json.dumps(record["ingest"]))
    apart["ratios"]["reader_transform_vs_pyarrow_decode_1w"] = 0.123456
    (tmp_path / "ingest.json").write_text(json.dumps(apart))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{RESULTS_START}\n{RESULTS_END}\n")
    write_docs(out / "report.json", tmp_path / "docs", readme, ingest_run=tmp_path / "ingest.json")
    markdown = (tmp_path / "docs" / "benchmarks.md").read_text()
    ingest = markdown.split("## Ingest", 1)[1].split("\n## ", 1)[0]
    assert "Run apart from the report (`dlrmflow bench ingest`)" in ingest
    assert "0.123" in ingest and "Bytes written per row" in ingest
    assert "| Ingest | `reader_transform_vs_pyarrow_decode_1w` |" in readme.read_text()
    assert "0.12 |" in readme.read_text()


def test_the_logs_shape_ingest_has_its_section_and_a_run_apart_replaces_it(report, tmp_path):
    from dlrmflow.bench.docs import RESULTS_END, RESULTS_START, write_docs

    out, record = report
    assert record["ingest_logs"]["shape"] == "logs" and record["ingest"]["shape"] == "criteo"
    assert "## Ingest, logs shape" in (out / "report.md").read_text()
    apart = json.loads(json.dumps(record["ingest_logs"]))
    # The baseline reads strings as dictionaries as ours does: the README's headline is
    # against it, not the plain-strings figure.
    apart["ratios"]["reader_transform_vs_pyarrow_decode_1w"] = 0.654321
    apart["ratios"]["reader_transform_plain_strings_vs_pyarrow_decode_1w"] = 0.987654
    (tmp_path / "logs.json").write_text(json.dumps(apart))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{RESULTS_START}\n{RESULTS_END}\n")
    write_docs(
        out / "report.json", tmp_path / "docs", readme, ingest_logs_run=tmp_path / "logs.json"
    )
    markdown = (tmp_path / "docs" / "benchmarks.md").read_text()
    logs = markdown.split("## Ingest, logs shape", 1)[1].split("\n## ", 1)[0]
    assert "`dlrmflow bench ingest --shape logs`" in logs and "0.654" in logs
    assert "pyarrow decode, dictionaries rows/s" in logs
    fair = "| Ingest, logs shape | `reader_transform_vs_pyarrow_decode_1w` |"
    assert fair in readme.read_text() and "0.65 |" in readme.read_text()
    assert "plain_strings" not in readme.read_text()


def test_an_older_logs_record_keeps_the_plain_strings_headline():
    """Records from before the baseline read dictionaries: ours read them alone, so the
    fairer figure was every string decoded plain on both sides."""
    from dlrmflow.bench.docs import _ingest_headline

    older = {
        "results": {"workers_1": {"pyarrow_decode_rows_per_s": 1.0}},
        "ratios": {
            "reader_transform_vs_pyarrow_decode_1w": 0.7,
            "reader_transform_plain_strings_vs_pyarrow_decode_1w": 0.5,
        },
    }
    assert [k for k in older["ratios"] if _ingest_headline(older, k)] == [
        "reader_transform_plain_strings_vs_pyarrow_decode_1w"
    ]
    newer = json.loads(json.dumps(older))
    newer["results"]["workers_1"]["pyarrow_decode_dictionaries_rows_per_s"] = 2.0
    assert [k for k in newer["ratios"] if _ingest_headline(newer, k)] == [
        "reader_transform_vs_pyarrow_decode_1w"
    ]

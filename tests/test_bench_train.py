"""The training benchmark at quick size, and the TorchRec comparison on its config and
batches: the records' structure and sane values, their report sections and the plot they
share, never speed."""

import math

import pytest
from typer.testing import CliRunner

from dlrmflow.bench.machine import available_cores, thread_budget
from dlrmflow.bench.report import (
    PLOTS,
    plot_bytes_by_codec,
    plot_throughput,
    torchrec_section,
    train_section,
)
from dlrmflow.bench.torchrec_compare import MODES, run_torchrec_comparison, torchrec_missing
from dlrmflow.bench.torchrec_compare import WORLD_SIZES as TORCHREC_WORLD_SIZES
from dlrmflow.bench.train import (
    BASELINE_KEY,
    QUICK,
    WORLD_SIZES,
    _run_job,
    benchmark_modes,
    run_train_benchmark,
)
from dlrmflow.cli import app
from dlrmflow.runtime.glibc_malloc import tune_allocator
from dlrmflow.train.model.plan import SHARDING_TYPES
from tests.test_bench_helpers import check_plot, report_section, table_rows


def test_modes_cover_every_sharding_type_and_codec():
    names = {m["name"] for m in benchmark_modes(2)}
    assert {f"w2_{s}_fp32" for s in SHARDING_TYPES} <= names
    assert {f"w2_row_wise_{c}" for c in ("fp16", "bf16", "fp8", "int8")} <= names
    assert "w2_row_wise_fp32_no_pipeline" in names
    assert {m["name"] for m in benchmark_modes(1)} == {f"w1_{s}_fp32" for s in SHARDING_TYPES}


def test_two_rank_modes_report_throughput_and_bytes_by_codec():
    modes = [m for m in benchmark_modes(2) if m["name"] in ("w2_row_wise_fp32", "w2_row_wise_fp16")]
    ranks = _run_job(2, QUICK, modes, warmup=1, steps=2, threads=1)
    assert [r.rank for r in ranks] == [0, 1]
    results = ranks[0].result
    assert BASELINE_KEY not in results  # the baseline runs in the one-process job only
    fp32, fp16 = results["w2_row_wise_fp32"], results["w2_row_wise_fp16"]
    for r in (fp32, fp16):
        assert math.isfinite(r["samples_per_s"]) and r["samples_per_s"] > 0
        assert r["shardings"] == ["row_wise"]
    # Row-wise over 2 ranks: each rank returns its partial sums of the other rank's 128
    # samples x 26 tables x dim 8 in 4-byte floats, and half that in fp16.
    assert fp32["bytes_per_step"]["forward"] == 128 * 26 * 8 * 4
    assert fp16["bytes_per_step"]["forward"] == 128 * 26 * 8 * 2
    assert fp16["bytes_per_step"]["backward"] == fp32["bytes_per_step"]["backward"]


@pytest.fixture(scope="module")
def record():
    return run_train_benchmark(quick=True, steps=2)


def test_record_gives_every_side_the_same_cores(record):
    budget = thread_budget(WORLD_SIZES)
    threads = record["threads"]
    assert threads["cores"] == available_cores() and threads["total_per_job"] == budget
    # The baseline uses the whole budget; every job splits the same budget over its ranks.
    assert threads["baseline"] == record["baseline_result"]["torch_threads"] == budget
    assert threads["per_rank"] == {f"w{w}": budget // w for w in WORLD_SIZES}
    processes = record["processes"]
    assert sorted((p["world"], p["rank"]) for p in processes) == [(1, 0), (2, 0), (2, 1)]
    for world in WORLD_SIZES:
        job = [p for p in processes if p["world"] == world]
        assert sum(p["torch_threads"] for p in job) == budget, world


def test_record_lists_the_allocator_setting_of_every_process(record):
    # Each rank, the baseline's among them, ran under the setting this process gets.
    expected = tune_allocator()
    assert [p["malloc_mmap_threshold"] for p in record["processes"]] == [expected] * 3


def test_record_has_a_ratio_per_mode_against_the_baseline(record):
    names = {m["name"] for w in WORLD_SIZES for m in benchmark_modes(w)}
    assert set(record["results"]) == set(record["ratios"]) == names
    base = record["baseline_result"]["samples_per_s"]
    assert base > 0 and "single-process DLRM" in record["baseline"]
    for name, ratio in record["ratios"].items():
        assert ratio == record["results"][name]["samples_per_s"] / base


def test_the_report_section_has_the_baseline_and_a_row_per_mode(record):
    section = report_section(train_section, record)
    assert section.startswith("## Training")
    rows = table_rows(section)
    assert [row[0] for row in rows] == ["single-process DLRM (baseline)", *record["results"]]
    base = record["baseline_result"]["samples_per_s"]
    assert f"| single-process DLRM (baseline) | {base:,.0f} | 1 |" in section
    for name in (PLOTS["throughput"], PLOTS["bytes"]):
        assert f"]({name})" in section  # every plot is shown in the report


@pytest.fixture(scope="module")
def comparison():
    """The TorchRec comparison at quick size, as the report runs it; None where TorchRec
    cannot be imported (the report then skips it, saying why)."""
    return run_torchrec_comparison(quick=True) if torchrec_missing() is None else None


@pytest.fixture
def torchrec_record(comparison):
    if comparison is None:
        pytest.skip(f"TorchRec cannot be imported here: {torchrec_missing()}")
    return comparison


def test_the_plots_are_valid_pngs(record, comparison, tmp_path):
    # The throughput plot marks TorchRec's runs where the report compared them.
    plot_throughput(record, tmp_path / PLOTS["throughput"], comparison)
    plot_bytes_by_codec(record, tmp_path / PLOTS["bytes"])
    for name in (PLOTS["throughput"], PLOTS["bytes"]):
        check_plot(tmp_path / name)


def test_torchrec_comparison_record(torchrec_record):
    comparison = torchrec_record
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


def test_torchrec_sides_share_threads_and_allocator(torchrec_record):
    cores = available_cores()
    per_rank = {f"w{w}": max(1, cores // w) for w in TORCHREC_WORLD_SIZES}
    assert torchrec_record["threads"] == {"cores": cores, "per_rank": per_rank}
    processes = torchrec_record["processes"]
    assert sorted((p["world"], p["rank"]) for p in processes) == [(1, 0), (2, 0), (2, 1)]
    expected = tune_allocator()  # what this process gets; every rank applied the same
    for p in processes:
        # Both sides ran in each of these processes, so these are both sides' settings.
        assert p["torch_threads"] == per_rank[f"w{p['world']}"]
        assert p["malloc_mmap_threshold"] == expected


def test_the_torchrec_section_has_a_row_per_mode(torchrec_record):
    section = report_section(lambda r: torchrec_section(r, None), torchrec_record)
    assert section.startswith("## TorchRec comparison") and "Skipped" not in section
    assert [row[0] for row in table_rows(section)] == list(torchrec_record["results"])


def test_cli_lists_the_command():
    result = CliRunner().invoke(app, ["bench", "train", "--help"])
    assert result.exit_code == 0 and "--quick" in result.output

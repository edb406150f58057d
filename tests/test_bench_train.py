"""The training benchmark at quick size: the record's structure and sane values, never speed."""

import math

import pytest
from typer.testing import CliRunner

from dlrmflow.bench.machine import available_cores, thread_budget
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


def test_cli_lists_the_command():
    result = CliRunner().invoke(app, ["bench", "train", "--help"])
    assert result.exit_code == 0 and "--quick" in result.output

"""The training benchmark at quick size: the record's structure and sane values, never speed."""

import math

from typer.testing import CliRunner

from dlrmflow.bench.train import QUICK, _run_job, benchmark_modes, run_baseline
from dlrmflow.cli import app
from dlrmflow.train.sharding import SHARDING_TYPES


def test_modes_cover_every_sharding_type_and_codec():
    names = {m["name"] for m in benchmark_modes(2)}
    assert {f"w2_{s}_fp32" for s in SHARDING_TYPES} <= names
    assert {f"w2_row_wise_{c}" for c in ("fp16", "bf16", "fp8", "int8")} <= names
    assert "w2_row_wise_fp32_no_pipeline" in names
    assert {m["name"] for m in benchmark_modes(1)} == {f"w1_{s}_fp32" for s in SHARDING_TYPES}


def test_two_rank_modes_report_throughput_and_bytes_by_codec():
    baseline = run_baseline(QUICK, warmup=1, steps=2)
    assert baseline["samples_per_s"] > 0
    modes = [m for m in benchmark_modes(2) if m["name"] in ("w2_row_wise_fp32", "w2_row_wise_fp16")]
    results = _run_job(2, QUICK, modes, warmup=1, steps=2)
    fp32, fp16 = results["w2_row_wise_fp32"], results["w2_row_wise_fp16"]
    for r in (fp32, fp16):
        assert math.isfinite(r["samples_per_s"]) and r["samples_per_s"] > 0
        assert r["shardings"] == ["row_wise"]
    # Row-wise over 2 ranks: each rank returns its partial sums of the other rank's 128
    # samples x 26 tables x dim 8 in 4-byte floats, and half that in fp16.
    assert fp32["bytes_per_step"]["forward"] == 128 * 26 * 8 * 4
    assert fp16["bytes_per_step"]["forward"] == 128 * 26 * 8 * 2
    assert fp16["bytes_per_step"]["backward"] == fp32["bytes_per_step"]["backward"]


def test_cli_lists_the_command():
    result = CliRunner().invoke(app, ["bench", "train", "--help"])
    assert result.exit_code == 0 and "--quick" in result.output

"""``dlrmflow bench step`` at its quick size: the step and its multiply-bound ceiling are
measured for both precisions, the profile names the multiplies, and the docs render it
(never speed: the model is tiny)."""

from __future__ import annotations

import pytest

from dlrmflow.bench.docs import BENCHMARKS, results_table
from dlrmflow.bench.report import step_section
from dlrmflow.bench.step import run_step_benchmark
from tests.test_bench_helpers import report_section


@pytest.fixture(scope="module")
def record() -> dict:
    return run_step_benchmark(quick=True)


def test_both_precisions_are_timed_against_their_own_ceiling(record: dict) -> None:
    for precision in ("fp32", "bf16"):
        r = record["results"][precision]
        assert r["step_s"] > 0 and r["ceiling_step_s"] > 0
        assert r["ceiling_fraction"] == pytest.approx(r["ceiling_step_s"] / r["step_s"])
        assert r["mlp_flops_per_sample"] > 0
        # The parts timed alone add up with the rest to the step, and bound its fraction.
        assert r["embeddings_s"] > 0 and r["interaction_s"] > 0
        assert r["ceiling_step_s"] + r["embeddings_s"] + r["interaction_s"] + r[
            "rest_s"
        ] == pytest.approx(r["step_s"])
        assert r["three_parts_ceiling_fraction"] == pytest.approx(
            r["ceiling_step_s"] / (r["step_s"] - r["rest_s"])
        )
        ops = {op["op"] for op in r["ops"]}
        assert {"aten::mm", "aten::addmm"} & ops, ops
    ratios = record["ratios"]
    assert ratios["bf16_vs_fp32_samples_per_s"] == pytest.approx(
        record["results"]["bf16"]["samples_per_s"] / record["results"]["fp32"]["samples_per_s"]
    )
    assert record["instruction_set"]["torch_cpu_capability"]


def test_the_docs_show_the_step_and_its_ratios(record: dict) -> None:
    text = report_section(step_section, {**record, "run_apart": True})
    assert "## Training step" in text and "Run apart from the report" in text
    assert "| fp32 |" in text and "| bf16 |" in text
    assert "three parts' fraction" in text
    assert "step" in [key for key, *_ in BENCHMARKS]
    table = results_table({"quick": False, "step": record})
    assert "`fp32_ceiling_fraction`" in table and "`bf16_vs_fp32_samples_per_s`" in table


def test_the_op_breakdown_is_the_median_step_so_a_stall_does_not_count() -> None:
    import time

    import torch
    from torch.profiler import record_function

    from dlrmflow.bench.step import op_breakdown

    calls = []

    def step(_: object) -> None:
        torch.ones(64, 64).sum()
        if not calls:  # the first profiled step stalls in an op of its own
            with record_function("stall"):
                time.sleep(0.05)
        calls.append(1)

    ops = {op["op"]: op for op in op_breakdown(step, [object()], steps=5)}
    assert len(calls) == 5
    assert "stall" not in ops  # its median over the five steps is 0
    assert ops["aten::sum"]["calls"] == 1 and ops["aten::sum"]["self_cpu_ms"] < 50

"""The precision benchmark at quick size: bf16 against fp32 of each config, its record and
its report section, never speed."""

import pytest

from dlrmflow.bench.precision import BASELINE, CONFIGS, run_precision_benchmark
from dlrmflow.bench.report import precision_section
from tests.test_bench_helpers import report_section, table_rows


@pytest.fixture(scope="module")
def record() -> dict:
    return run_precision_benchmark(quick=True)


def test_precision_record_compares_bf16_with_fp32_of_each_config(record):
    assert record["baseline"] == BASELINE
    assert set(record["results"]) == set(CONFIGS)
    for name, result in record["results"].items():
        fp32, bf16 = result["fp32"], result["bf16"]
        ratio = record["ratios"][f"{name}_bf16_samples_per_s"]
        assert ratio == pytest.approx(bf16["samples_per_s"] / fp32["samples_per_s"])
        assert 0.5 < fp32["auc"] < 1 and 0.5 < bf16["auc"] < 1
        # One epoch of the training days: both precisions trained the same steps.
        assert fp32["steps"] == bf16["steps"] > 0
        assert fp32["final_loss"] != bf16["final_loss"]  # bf16 really computed in bf16


def test_the_report_section_has_a_row_per_config(record):
    section = report_section(precision_section, record)
    assert section.startswith("## Precision: bf16 against fp32")
    rows = table_rows(section)
    assert [row[0] for row in rows] == list(record["results"])
    for row, result in zip(rows, record["results"].values(), strict=True):
        assert row[4:] == [f"{result['fp32']['auc']:.4f}", f"{result['bf16']['auc']:.4f}"]

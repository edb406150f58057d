"""The kernel benchmark's record, at quick size: structure, sane values and its report
section, never speed."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from dlrmflow.bench.kernels import (
    TorchRowWiseAdagrad,
    make_batches,
    stacked_inputs,
    table_sizes,
    zipf_ids,
)
from dlrmflow.bench.report import kernels_section
from dlrmflow.cli import app
from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels.optimizers import SGD, RowWiseAdagrad
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.runtime.glibc_malloc import applied_threshold
from tests.test_bench_helpers import report_section, table_rows

TBE_KEYS = {
    f"tbe_{opt}_step_{form}_d8"
    for opt in ("sgd", "rowwise_adagrad")
    for form in ("onehot", "multihot")
}
EXPECTED_RATIOS = TBE_KEYS | {"interaction_fwd_bwd_d8"}


def _check_record(record: dict) -> None:
    assert record["benchmark"] == "kernels"
    # The headline baseline runs the same algorithms; the element-wise one is the naive line.
    assert "stacked in one" in record["baseline"] and "TorchRowWiseAdagrad" in record["baseline"]
    assert "element-wise" not in record["baseline"]
    assert record["naive_baseline"].startswith("naive user")
    assert "element-wise" in record["naive_baseline"]
    assert set(record["ratios"]) == EXPECTED_RATIOS
    for key, ratio in record["ratios"].items():
        assert isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0, key
        times = record["results"][key]
        assert times["baseline_s"] / times["ours_s"] == ratio
    # The naive line is kept apart from the headline ratios, for the TBE steps only.
    assert set(record["naive_ratios"]) == TBE_KEYS
    for key, ratio in record["naive_ratios"].items():
        times = record["results"][key]
        assert math.isfinite(ratio) and times["naive_s"] / times["ours_s"] == ratio
    # Every side ran in this one process: its threads and allocator setting are recorded.
    assert record["torch_threads"] == record["machine"]["torch_threads"] >= 1
    assert record["malloc_mmap_threshold"] == applied_threshold()
    assert set(record["bandwidth_share"]) == TBE_KEYS
    for key, share in record["bandwidth_share"].items():
        assert 0 < share <= 10, (key, share)
    assert record["copy_bandwidth_bytes_per_s"] > 0
    assert record["machine"]["cpu_count"] >= 1
    assert record["batch_size"] == 256 and record["dims"] == [8]


def test_zipf_ids_are_skewed_in_range_and_deterministic():
    ids = zipf_ids(np.random.default_rng(1), 1000, 50_000)
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.sort(np.bincount(ids, minlength=1000))[::-1]
    assert counts[0] > 20 * np.median(counts)  # a hot head, not uniform
    assert np.array_equal(ids, zipf_ids(np.random.default_rng(1), 1000, 50_000))


def test_batches_cover_every_table_within_its_rows():
    sizes = table_sizes(500)
    assert len(sizes) == 26 and max(sizes) == 500 and min(sizes) < 500
    batches = make_batches(sizes, 32)
    for form, per_bag in (("onehot", 1), ("multihot", 20)):
        kjt = batches[form]
        assert kjt.length_per_key() == [32 * per_bag] * 26
        for (values, _), size in zip(kjt.split_by_key().values(), sizes, strict=True):
            assert int(values.min()) >= 0 and int(values.max()) < size


def test_the_cli_writes_a_quick_record(tmp_path):
    # One quick run serves the command's output, the record's checks and its section's.
    out = tmp_path / "bench" / "kernels.json"
    result = CliRunner().invoke(app, ["bench", "kernels", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    _check_record(record)
    assert json.loads(result.stdout)["ratios"].keys() == record["ratios"].keys()
    results = record["results"]
    # 26 tables x 256 samples, one ID each or 20 each; distinct rows can't exceed either.
    onehot, multihot = results["tbe_sgd_step_onehot_d8"], results["tbe_sgd_step_multihot_d8"]
    assert onehot["ids"] == 26 * 256 and multihot["ids"] == 26 * 256 * 20
    assert 0 < onehot["distinct_rows"] <= min(onehot["ids"], sum(record["table_rows"]))
    # Same IDs, so Adagrad touches the same rows plus 8 bytes of state per row.
    adagrad = results["tbe_rowwise_adagrad_step_onehot_d8"]
    assert adagrad["bytes_touched"] == onehot["bytes_touched"] + 8 * onehot["distinct_rows"]
    # Its report section: a row per step, the naive line beside the headline baseline.
    section = report_section(kernels_section, record)
    assert section.startswith("## Kernels") and "Run apart" not in section
    assert [row[0] for row in table_rows(section)] == list(results)
    assert "Naive line: naive user" in section and "naive user / ours" in section


@pytest.mark.parametrize("form", ["onehot", "multihot"])
def test_stacked_inputs_pool_as_the_tables_do(form):
    sizes = table_sizes(50)
    kjt = make_batches(sizes, 16, seed=3)[form]
    tables = [SparseFeature(f"C{k + 1}", n, 4) for k, n in enumerate(sizes)]
    tbe = TableBatchedEmbeddingBag(tables, SGD(0.1))
    weight = torch.cat([tbe.table(t.name) for t in tables])
    values, offsets = stacked_inputs(kjt, sizes)
    pooled = nn.functional.embedding_bag(values, weight, offsets, mode="sum")
    assert torch.allclose(pooled.view(16, -1), tbe(kjt), atol=1e-6)


@pytest.mark.parametrize("form", ["onehot", "multihot"])
def test_torch_rowwise_adagrad_is_the_tbes_algorithm(form):
    """The baseline's optimizer gives our TBE's weights and state after a few steps, so the
    kernel benchmark compares one algorithm on both sides."""
    sizes = table_sizes(40)
    kjt = make_batches(sizes, 32, seed=5)[form]
    tables = [SparseFeature(f"C{k + 1}", n, 8) for k, n in enumerate(sizes)]
    tbe = TableBatchedEmbeddingBag(tables, RowWiseAdagrad(0.05))
    bag = nn.EmbeddingBag(sum(sizes), 8, mode="sum", sparse=True)
    with torch.no_grad():
        bag.weight.copy_(torch.cat([tbe.table(t.name) for t in tables]))
    optimizer = TorchRowWiseAdagrad(bag.parameters(), lr=0.05)
    values, offsets = stacked_inputs(kjt, sizes)
    gen = torch.Generator().manual_seed(0)
    start = bag.weight.detach().clone()
    for _ in range(4):
        grad = torch.randn(32, len(tables) * 8, generator=gen)
        tbe(kjt).backward(grad)
        bag(values, offsets).view(grad.shape).backward(grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    ours = torch.cat([tbe.table(t.name) for t in tables])
    assert not torch.equal(ours, start)  # it trained
    assert torch.allclose(bag.weight.detach(), ours, rtol=1e-5, atol=1e-6)
    state = optimizer.state[bag.weight]["sum_squares"]
    assert torch.allclose(state, tbe.sum_squares, rtol=1e-5, atol=1e-9)

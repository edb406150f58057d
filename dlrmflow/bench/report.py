"""The benchmark report: every benchmark in one run, as ``report.json``, ``report.md`` and plots.

``run_report(out_dir)`` runs the ingest, kernel and training benchmarks, the tiered-cache
benchmark defined here, and the TorchRec comparison when TorchRec is installed (otherwise
the report says so and skips it), then writes, under ``out_dir``:

- ``report.json``: every benchmark's record as it returned it;
- ``report.md``: one markdown table per benchmark, each figure next to its named baseline;
- ``throughput_vs_world_size.png``, ``bytes_per_step_by_codec.png`` and
  ``cache_hit_rate.png``.

Tiered-cache benchmark: 26 Criteo-like one-hot tables (``dlrmflow.bench.kernels`` sizes
and Zipf(1.1) IDs, hot rows fixed per table for the whole stream, as in real traffic)
trained by the ``TieredEmbeddingBag`` with row-wise Adagrad at several cache sizes, each
against the in-memory ``TableBatchedEmbeddingBag`` on the same batches (the baseline).
A step is forward, backward of a fixed output gradient, and the fused update; after a
warm-up the counters are reset and the next ``steps`` distinct batches are timed, in turn
with the baseline, best of ``repeats``. Each size runs twice: plain LRU (its hit rate is
the cache's) and with ``prefetch`` of the next batch (its hit rate is the share of rows
that forward found already loaded). The file lives in the OS page cache unless memory is
short, so the figures measure the cache's own cost, not SSD latency.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.bench.ingest import run_ingest_benchmark
from dlrmflow.bench.ingest_days import BASELINE as INGEST_DAYS_BASELINE
from dlrmflow.bench.ingest_days import run_ingest_days_benchmark
from dlrmflow.bench.kernels import run_kernel_benchmark, table_sizes, zipf_ids
from dlrmflow.bench.machine import describe_machine
from dlrmflow.bench.precision import run_precision_benchmark
from dlrmflow.bench.readers import BASELINE as READERS_BASELINE
from dlrmflow.bench.readers import run_readers_benchmark
from dlrmflow.bench.step import run_step_benchmark
from dlrmflow.bench.torchrec_compare import MODES as TORCHREC_MODES
from dlrmflow.bench.torchrec_compare import run_torchrec_comparison, torchrec_missing
from dlrmflow.bench.train import CODECS, run_train_benchmark
from dlrmflow.bench.turns import best_of_turns
from dlrmflow.features.spec import SparseFeature
from dlrmflow.ingest.synthetic_logs import SHAPE as LOGS_SHAPE
from dlrmflow.kernels.optimizers import RowWiseAdagrad
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.kernels.tiered import TieredEmbeddingBag
from dlrmflow.runtime.glibc_malloc import tune_allocator
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.plan import SHARDING_TYPES

TIERED_FULL = {"rows": 100_000, "dim": 64, "batch": 4096, "warmup": 8, "steps": 24, "repeats": 3}
TIERED_QUICK = {"rows": 1_000, "dim": 8, "batch": 256, "warmup": 2, "steps": 4, "repeats": 1}
# Cache sizes as shares of all rows; each is raised to hold two batches' rows (the batch in
# flight and the prefetched one).
CACHE_FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)
TIERED_LR = 0.01
READERS_QUICK = {"rows": 20_000, "repeats": 1}
INGEST_QUICK = {"rows": 20_000, "workers": (1,), "batch_size": 1024, "repeats": 1}
NOISE_NOTE = (
    "Timings come from a shared machine (other jobs may run beside the benchmark), so they "
    "are noisy; every ratio divides two figures measured in the same run."
)
PLOTS = {
    "throughput": "throughput_vs_world_size.png",
    "bytes": "bytes_per_step_by_codec.png",
    "cache": "cache_hit_rate.png",
}


# -- the tiered-cache benchmark -------------------------------------------------------------


def _zipf_stream(sizes: Sequence[int], batch: int, count: int, seed: int = 0):
    """``count`` one-hot batches; each table keeps one hot-row permutation for all of them."""
    rng = np.random.default_rng(seed)
    ids = np.stack([zipf_ids(rng, n, batch * count) for n in sizes], axis=1)
    keys = [f"C{k + 1}" for k in range(len(sizes))]
    return [
        KeyedJaggedTensor.from_one_hot(keys, torch.from_numpy(part))
        for part in np.split(ids, count)
    ]


def _time_stream(
    step: Callable[[int], None], warmup: int, steps: int, at_start: Callable[[], None]
) -> float:
    for i in range(warmup):
        step(i)
    at_start()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    return time.perf_counter() - start


def _train_step(bag, stream, grad: torch.Tensor, prefetch: bool = False) -> Callable[[int], None]:
    """Step ``i``: (prefetch batch ``i + 1``,) forward batch ``i``, backward ``grad``."""

    def step(i: int) -> None:
        if prefetch:
            bag.prefetch(stream[i + 1])
        bag(stream[i]).backward(grad)

    return step


def run_tiered_benchmark(quick: bool = False) -> dict:
    """Hit rate and samples/s of the tiered bag at several cache sizes, against in-memory."""
    size = TIERED_QUICK if quick else TIERED_FULL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer's one thread per rank; the prefetch thread aside
    try:
        return _tiered_record(size)
    finally:
        torch.set_num_threads(threads)


def _tiered_record(size: dict) -> dict:
    sizes = table_sizes(size["rows"])
    tables = [SparseFeature(f"C{k + 1}", n, size["dim"]) for k, n in enumerate(sizes)]
    optimizer = RowWiseAdagrad(TIERED_LR)
    warmup, steps, batch = size["warmup"], size["steps"], size["batch"]
    stream = _zipf_stream(sizes, batch, warmup + steps + 1)
    grad = torch.randn(batch, len(tables) * size["dim"], generator=torch.Generator().manual_seed(0))
    total = sum(sizes)
    distinct = max(int(torch.unique(kjt.one_hot_rows + _starts(sizes)).numel()) for kjt in stream)
    cache_sizes = sorted({min(total, max(int(f * total), 2 * distinct)) for f in CACHE_FRACTIONS})

    memory = TableBatchedEmbeddingBag(tables, optimizer)
    memory_step = _train_step(memory, stream, grad)
    results: dict[str, dict] = {}
    for rows in cache_sizes:
        for prefetch in (False, True):

            def tiered(rows: int = rows, prefetch: bool = prefetch) -> dict:
                with tempfile.TemporaryDirectory(prefix="dlrmflow-tiered-") as tmp:
                    bag = TieredEmbeddingBag(tables, optimizer, tmp, cache_rows=rows)
                    step = _train_step(bag, stream, grad, prefetch)
                    seconds = _time_stream(step, warmup, steps, bag.reset_stats)
                    # The stats are the same in every repeat: the bookkeeping is exact.
                    run = {"s": seconds, "stats": bag.stats, "bytes": bag.path.stat().st_size}
                    bag.close()
                return run

            best = best_of_turns(
                {
                    "memory": lambda: {"s": _time_stream(memory_step, warmup, steps, lambda: None)},
                    "tiered": tiered,
                },
                size["repeats"],
                key=lambda run: run["s"],
                lowest=True,
            )
            memory_s, seconds = best["memory"]["s"], best["tiered"]["s"]
            stats, file_bytes = best["tiered"]["stats"], best["tiered"]["bytes"]
            results[f"cache_{rows}_{'prefetch' if prefetch else 'lru'}"] = {
                "cache_rows": rows,
                "cache_fraction": rows / total,
                "prefetch": prefetch,
                "samples_per_s": steps * batch / seconds,
                "in_memory_samples_per_s": steps * batch / memory_s,
                "step_s": seconds / steps,
                "hit_rate": stats.hit_rate,
                "evictions_per_step": stats.evictions / steps,
                "prefetched_per_step": stats.prefetched / steps,
                "stats": stats.to_dict(),
                "file_bytes": file_bytes,
            }
    in_memory = [r["in_memory_samples_per_s"] for r in results.values()]
    return {
        "benchmark": "tiered",
        "baseline": "in-memory TableBatchedEmbeddingBag (row-wise Adagrad) on the same batches, "
        "timed in turn with each case, best of the repeats; ratios are tiered samples/s / that "
        "in-memory samples/s (< 1: the cache's cost)",
        "config": {
            **size,
            "tables": len(tables),
            "table_rows": total,
            "optimizer": "rowwise_adagrad",
        },
        "max_distinct_rows_per_batch": distinct,
        "threads": 1,
        "baseline_result": {"samples_per_s": float(np.median(in_memory)), "runs": in_memory},
        "results": results,
        "ratios": {
            k: r["samples_per_s"] / r["in_memory_samples_per_s"] for k, r in results.items()
        },
        "machine": describe_machine(),
    }


def _starts(sizes: Sequence[int]) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(sizes)[:-1]]), dtype=torch.int64)


# -- markdown ------------------------------------------------------------------------------


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1000:
            return f"{value:.3g}"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.2e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _run_apart(record: dict, benchmark: str) -> str:
    """The sentence that says a section's run was made apart from the report (``bench docs
    --kernels/--step/--ingest``), on which machine; empty for the report's own run."""
    if not record.get("run_apart"):
        return ""
    machine = record["machine"]
    return (
        f" Run apart from the report (`dlrmflow bench {benchmark}`), on {machine['cpu']} "
        f"with {machine['cpu_count']} CPUs."
    )


def ingest_section(record: dict) -> str:
    rows = []
    for name, r in record["results"].items():
        n = name.removeprefix("workers_")
        rows.append(
            [
                n,
                r["pyarrow_decode_threads"],
                r["pyarrow_decode_rows_per_s"],
                # Strings read as dictionaries, as ours does; absent where there are none.
                r.get("pyarrow_decode_dictionaries_rows_per_s", ""),
                r["reader_transform_rows_per_s"],
                r["reader_only_rows_per_s"],
                r["reader_transform_no_shuffle_rows_per_s"],
                r.get("decode_transform_rows_per_s", ""),  # older records lack it
                record["ratios"][f"reader_transform_vs_pyarrow_decode_{n}w"],
                # Strings decoded plain on both sides; absent where there are none.
                record["ratios"].get(f"reader_transform_plain_strings_vs_pyarrow_decode_{n}w", ""),
                record["ratios"].get(f"decode_transform_vs_pyarrow_decode_{n}w", ""),
                r["pyarrow_decode_cpu_s_per_m_rows"],
                r["reader_transform_cpu_s_per_m_rows"],
                r["reader_only_cpu_s_per_m_rows"],
            ]
        )
    written = record.get("written_bytes_per_row")
    bytes_line = (
        f" Bytes written per row handed on: reader only {written['reader_only']:.0f} (the "
        f"decoded Arrow columns), reader + transform {written['reader_transform']:.0f} "
        "(the tensors)."
        if written
        else ""
    )
    shape = record.get("shape", "criteo")  # older records are Criteo's
    apart = _run_apart(record, "ingest" if shape == "criteo" else f"ingest --shape {shape}")
    return "\n\n".join(
        [
            "## Ingest" if shape == "criteo" else f"## Ingest, {shape} shape",
            f"Baseline: {record['baseline']}. {record['rows']:,} rows in {record['splits']} "
            "splits; both sides in one process under the same allocator setting "
            f'({_threshold(record["machine"]["malloc_mmap_threshold"])}). "Decode + '
            'transform" is our decode and transform with no reader: the ratio reader + '
            f"transform would reach were the reader free.{bytes_line}{apart}",
            markdown_table(
                [
                    "workers",
                    "threads (each side)",
                    "pyarrow decode rows/s",
                    "pyarrow decode, dictionaries rows/s",
                    "reader + transform rows/s",
                    "reader only rows/s",
                    "no shuffle rows/s",
                    "decode + transform rows/s",
                    "ratio (reader + transform / decode)",
                    "ratio, plain strings",
                    "ratio (decode + transform / decode)",
                    "pyarrow CPU s per M rows",
                    "ours CPU s per M rows",
                    "reader only CPU s per M rows",
                ],
                rows,
            ),
        ]
    )


def kernels_section(record: dict) -> str:
    rows = [
        [
            key,
            r["ours_s"] * 1e3,
            r["baseline_s"] * 1e3,
            record["ratios"][key],
            r.get("ours_bandwidth_share", ""),
            r["naive_s"] * 1e3 if "naive_s" in r else "",
            record["naive_ratios"].get(key, ""),
            r["fbgemm_s"] * 1e3 if "fbgemm_s" in r else "",
            record.get("fbgemm_ratios", {}).get(key, ""),
        ]
        for key, r in record["results"].items()
    ]
    fbgemm = record.get("fbgemm", "not run: the report predates the FBGEMM baseline")
    apart = _run_apart(record, "kernels")
    return "\n\n".join(
        [
            "## Kernels",
            f"Baseline: {record['baseline']}",
            f"Naive line: {record['naive_baseline']}.",
            f"FBGEMM line ({fbgemm}): {record.get('fbgemm_baseline', '')}",
            f"Batch {record['batch_size']}, dims {record['dims']}; every side in one process "
            f"with {record['torch_threads']} torch threads under the same allocator setting "
            f"({_threshold(record['malloc_mmap_threshold'])}).{apart}",
            markdown_table(
                [
                    "step",
                    "ours ms",
                    "baseline ms",
                    "ratio (baseline / ours)",
                    "bandwidth share",
                    "naive user ms",
                    "naive user / ours",
                    "FBGEMM ms",
                    "FBGEMM / ours",
                ],
                rows,
            ),
        ]
    )


def step_section(record: dict[str, object]) -> str:
    """The step benchmark's section of docs/benchmarks.md: each precision's step against
    its ceiling, and the ops that cost the most per step."""
    results: dict = record["results"]  # type: ignore[assignment]
    isa: dict = record["instruction_set"]  # type: ignore[assignment]
    machine: dict = record["machine"]  # type: ignore[assignment]
    cfg: dict = record["config"]  # type: ignore[assignment]
    rows = [
        [
            precision,
            r["step_s"] * 1e3,
            r["samples_per_s"],
            r["ceiling_step_s"] * 1e3,
            r["ceiling_samples_per_s"],
            r["multiply_gflop_per_s"],
            r["ceiling_fraction"],
        ]
        for precision, r in results.items()
    ]
    parts = [
        [
            precision,
            r["ceiling_step_s"] * 1e3,
            r["embeddings_s"] * 1e3,
            r["interaction_s"] * 1e3,
            r["rest_s"] * 1e3,
            r["step_s"] * 1e3,
            r["three_parts_ceiling_fraction"],
        ]
        for precision, r in results.items()
        if "embeddings_s" in r  # records from before the parts were timed lack them
    ]
    ops = [
        [op["op"], *(_op_ms(results[p], op["op"]) for p in results)]
        for op in results["fp32"]["ops"]
    ]
    ratios = ", ".join(f"`{k}` {v:.3f}" for k, v in record["ratios"].items())  # type: ignore[union-attr]
    apart = _run_apart(record, "step")
    return "\n\n".join(
        [
            "## Training step",
            f"Baseline: {record['baseline']}. Model: {cfg['rows']:,} rows a table, dim "
            f"{cfg['dim']}, bottom {cfg['bottom']}, top {cfg['top']}, batch {cfg['batch']}; "
            f"{machine['torch_threads']} torch threads; torch dispatches to "
            f"{isa['torch_cpu_capability']}, CPU flags {', '.join(isa['cpu_flags'])}. "
            f"Ratios: {ratios}.{apart}",
            markdown_table(
                [
                    "precision",
                    "step ms",
                    "samples/s",
                    "ceiling ms",
                    "ceiling samples/s",
                    "multiply GFLOP/s",
                    "ceiling fraction",
                ],
                rows,
            ),
            *(
                [
                    "Where the step's time goes: its multiplies, its embeddings (lookup and "
                    "fused update) and its dot interaction (forward and backward), each timed "
                    "alone; the rest is elementwise work, the dense optimizer, and what the "
                    "three cost more inside the step. The last column is the ceiling fraction "
                    "a step of only those three parts, each as fast as alone, would reach:",
                    markdown_table(
                        [
                            "precision",
                            "multiplies ms",
                            "embeddings ms",
                            "interaction ms",
                            "rest ms",
                            "step ms",
                            "three parts' fraction",
                        ],
                        parts,
                    ),
                ]
                if parts
                else []
            ),
            "Each op's own CPU milliseconds per step (torch's profiler, the median of the "
            "profiled steps), the fp32 step's largest first:",
            markdown_table(["op", *(f"{p} ms" for p in results)], ops),
        ]
    )


def _op_ms(result: dict, name: str) -> float | str:
    for op in result["ops"]:
        if op["op"] == name:
            return op["self_cpu_ms"]
    return ""


def train_section(record: dict) -> str:
    base = record["baseline_result"]
    rows = [["single-process DLRM (baseline)", base["samples_per_s"], 1.0, "", "", "", ""]]
    for name, r in record["results"].items():
        sent = r["bytes_per_step"]
        rows.append(
            [
                name,
                r["samples_per_s"],
                record["ratios"][name],
                sent.get("input", 0),
                sent.get("forward", 0),
                sent.get("backward", 0),
                sent.get("dense", 0),
            ]
        )
    threads = record["threads"]
    per_rank = ", ".join(f"{n} per rank at {w}" for w, n in threads["per_rank"].items())
    return "\n\n".join(
        [
            "## Training",
            f"Baseline: {record['baseline']}. Config: {record['config']}. Torch threads: "
            f"{threads['baseline']} for the baseline, {per_rank} ({threads['cores']} cores); "
            f"allocator setting of every process: {_process_settings(record['processes'])}.",
            markdown_table(
                [
                    "mode",
                    "samples/s",
                    "ratio",
                    "input B/step",
                    "forward B/step",
                    "backward B/step",
                    "dense B/step",
                ],
                rows,
            ),
            f"![samples/s against world size]({PLOTS['throughput']})",
            f"![bytes per step by codec]({PLOTS['bytes']})",
        ]
    )


def _threshold(value: int | None) -> str:
    return "glibc defaults" if value is None else f"malloc mmap threshold {value:,} bytes"


def _process_settings(processes: list[dict]) -> str:
    """The allocator settings the processes ran with: one when they all agree."""
    settings = {_threshold(p["malloc_mmap_threshold"]) for p in processes}
    if len(settings) == 1:
        return f"{settings.pop()} in all {len(processes)}"
    return "; ".join(
        f"w{p['world']} rank {p['rank']}: {_threshold(p['malloc_mmap_threshold'])}"
        for p in processes
    )


def readers_section(record: dict) -> str:
    rows = [
        [
            case,
            r["samples_per_s"],
            r["samples_per_s"] / record["results"][READERS_BASELINE]["samples_per_s"],
            r["wait_share"],
        ]
        for case, r in record["results"].items()
    ]
    return "\n\n".join(
        [
            "## Reader services",
            f"Baseline: {record['baseline']}. {record['rows']:,} rows, batch "
            f"{record['batch_size']}, {record['preprocessing_cost_us_per_row']} µs of "
            f"preprocessing a row; consumer: {record['consumer']}. {record['note']}.",
            markdown_table(["source", "samples/s", "÷ baseline", "data-wait share"], rows),
        ]
    )


def ingest_days_section(record: dict) -> str:
    rows = [
        [
            name,
            r["seconds"],
            r["days_per_minute"],
            record["ratios"].get(f"{name}_vs_{INGEST_DAYS_BASELINE}", 1.0),
        ]
        for name, r in record["results"].items()
    ]
    return "\n\n".join(
        [
            "## Ingest days on Dask",
            f"Baseline: {record['baseline']}. {record['days']} raw days of "
            f"{record['rows_per_day']:,} rows, best of {record['repeats']} rounds.",
            markdown_table(["runner", "seconds", "days per minute", "÷ baseline"], rows),
        ]
    )


def tiered_section(record: dict) -> str:
    base = record["baseline_result"]
    rows = [["in-memory TBE (baseline, median)", "", "", "", base["samples_per_s"], 1.0, ""]]
    for key, r in record["results"].items():
        rows.append(
            [
                "prefetch" if r["prefetch"] else "LRU",
                r["cache_rows"],
                r["cache_fraction"],
                r["hit_rate"],
                r["samples_per_s"],
                record["ratios"][key],
                r["evictions_per_step"],
            ]
        )
    config = record["config"]
    return "\n\n".join(
        [
            "## Tiered embeddings (rows on disk, hot rows cached)",
            f"Baseline: {record['baseline']}. {config['tables']} tables, "
            f"{config['table_rows']:,} rows of dim {config['dim']}, batch {config['batch']}, "
            f"{config['steps']} timed steps after {config['warmup']}; a batch touches up to "
            f"{record['max_distinct_rows_per_batch']:,} distinct rows.",
            markdown_table(
                [
                    "mode",
                    "cache rows",
                    "share of rows",
                    "hit rate",
                    "samples/s",
                    "ratio",
                    "evictions/step",
                ],
                rows,
            ),
            f"![cache hit rate against cache size]({PLOTS['cache']})",
        ]
    )


def _gib(values: list[int] | int | None) -> str:
    if values is None:
        return "none"
    if isinstance(values, int):
        return f"{values / 2**30:.2f}"
    return " / ".join(f"{v / 2**30:.2f}" for v in values)


def scale_section(record: dict) -> str:
    """``dlrmflow bench scale``: Criteo's cardinalities under a per-rank budget."""
    data = record["data"]
    runs = [
        ("disk tier (budget)", record["tiered"]),
        ("all in memory (baseline)", record["memory"]),
    ]
    rows = []
    for name, r in runs:
        cache = r["embedding_cache"]
        rows.append(
            [
                name,
                _gib(r["budget_bytes"]),
                _gib(r["table_bytes_per_rank"]),
                r["samples_per_s"],
                _gib(r["train_peak_rss_bytes"]),
                _gib(r["eval_peak_rss_bytes"]),
                _gib(r["overhead_bytes"]),
                cache.get("hit_rate", "") if cache else "",
                cache.get("cached_rate", "") if cache else "",
                f"{r['auc']:.6f}",
            ]
        )
    tiered = record["tiered"]
    return "\n\n".join(
        [
            "## Criteo scale (tables beyond a rank's memory)",
            f"Baseline: {record['baseline']}. {data['days'] - 1} training days and a test day "
            f"of {data['rows_per_day']:,} rows; {data['distinct_ids']:,} distinct IDs, one "
            f"table row each (largest table {data['largest_feature']:,} rows), dim "
            f"{record['model']['embedding_dim']}: {tiered['table_bytes'] / 1e9:.1f} GB of "
            f"weights and row-wise Adagrad state on {record['ranks']} ranks. Memory in GiB "
            "per rank (rank 0 / rank 1); overhead = the higher peak less the budget (disk "
            "tier) or less the rank's tables (in memory).",
            markdown_table(
                [
                    "run",
                    "budget",
                    "tables",
                    "samples/s",
                    "peak RSS train",
                    "peak RSS eval",
                    "overhead",
                    "hit rate",
                    "cached before",
                    "test AUC",
                ],
                rows,
            ),
            f"Ratio (disk tier ÷ in memory, samples/s): "
            f"{record['ratios']['tiered_vs_memory']:.2f}; the same AUC and log loss to every "
            f"digit: {'yes' if record['same_auc'] else 'no'}. Rows on disk cost "
            f"{_gib(tiered['row_map_bytes_per_rank'])} GiB of row map per rank, outside the "
            "budget. `generate`: "
            f"{data['generate_seconds']:.0f} s, peak RSS {_gib(data['generate_peak_rss_bytes'])}"
            f" GiB; `stats`: {data['stats_seconds']:.0f} s, peak RSS "
            f"{_gib(data['stats_peak_rss_bytes'])} GiB.",
        ]
    )


def precision_section(record: dict) -> str:
    rows = []
    for name, result in record["results"].items():
        fp32, bf16 = result["fp32"], result["bf16"]
        rows.append(
            [
                name,
                f"{fp32['samples_per_s']:,.0f}",
                f"{bf16['samples_per_s']:,.0f}",
                _fmt(record["ratios"][f"{name}_bf16_samples_per_s"]),
                f"{fp32['auc']:.4f}",
                f"{bf16['auc']:.4f}",
            ]
        )
    native = "native (AVX512-BF16/AMX)" if record["bf16_native"] else "emulated"
    return "\n\n".join(
        [
            "## Precision: bf16 against fp32",
            f"Baseline: {record['baseline']}. One epoch of {record['train_rows']:,} rows per "
            f"run on {record['device']} (bf16 {native}), {record['torch_threads']} torch "
            f"threads, best of {record['rounds']} round(s).",
            markdown_table(
                [
                    "config",
                    "fp32 samples/s",
                    "bf16 samples/s",
                    "bf16 ÷ fp32",
                    "fp32 AUC",
                    "bf16 AUC",
                ],
                rows,
            ),
        ]
    )


def torchrec_section(record: dict | None, missing: str | None) -> str:
    """The comparison's table, or the reason it was skipped."""
    if record is None:
        return "## TorchRec comparison\n\nSkipped: " + (missing or "not requested") + "."
    rows = [
        [
            name,
            r["ours_model"],
            r["ours"]["samples_per_s"],
            r["torchrec"]["samples_per_s"],
            record["ratios"][name],
            ", ".join(r["torchrec"]["shardings"]),
        ]
        for name, r in record["results"].items()
    ]
    versions = ", ".join(f"{k} {v}" for k, v in record["versions"].items())
    per_rank = ", ".join(f"{n} per rank at {w}" for w, n in record["threads"]["per_rank"].items())
    return "\n\n".join(
        [
            "## TorchRec comparison",
            f"Baseline: {record['baseline']}. {versions}; {record['pick']} of "
            f"{record['rounds']} rounds of {record['steps']} steps after "
            f"{record['warmup_steps']} warm-up steps. Torch threads, both sides: {per_rank}; "
            f"allocator setting: {_process_settings(record['processes'])}.",
            markdown_table(
                [
                    "mode",
                    "ours",
                    "ours samples/s",
                    "TorchRec samples/s",
                    "ratio (ours / TorchRec)",
                    "TorchRec sharding",
                ],
                rows,
            ),
        ]
    )


# -- plots ---------------------------------------------------------------------------------


def plot_throughput(record: dict, path: Path, comparison: dict | None = None) -> None:
    """Samples/s of every fp32 sharding type at each world size, the single-process
    baseline, and TorchRec's DLRM when it was compared."""
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    worlds = {name: int(name[1 : name.index("_")]) for name in record["results"]}
    for sharding in SHARDING_TYPES:
        points = sorted(
            (worlds[name], r["samples_per_s"])
            for name, r in record["results"].items()
            if name.endswith(f"_{sharding}_fp32")
        )
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=sharding)
    baseline = record["baseline_result"]["samples_per_s"]
    ax.scatter([1], [baseline], marker="*", s=140, c="k", label="single-process DLRM", zorder=3)
    if comparison is not None:
        # Our plain and sharded models at world size 1 face the one TorchRec run.
        points = {
            (TORCHREC_MODES[name].world, TORCHREC_MODES[name].sharding): r["torchrec"]
            for name, r in comparison["results"].items()
        }
        for (world, sharding), r in points.items():
            ax.scatter(
                [world],
                [r["samples_per_s"]],
                marker="x" if sharding == "table_wise" else "+",
                color="k",  # apart from our lines' colours
                s=80,
                zorder=3,
                label=f"TorchRec {sharding} (world {world})",
            )
    ax.set(xlabel="world size (ranks)", ylabel="samples/s", title="Training throughput")
    ax.set_xticks(sorted(set(worlds.values())))
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def plot_bytes_by_codec(record: dict, path: Path) -> None:
    """Bytes one rank sends per step, by kind, for row-wise sharding at world size 2."""
    codecs = ["fp32", *CODECS]
    sent = [record["results"][f"w2_row_wise_{c}"]["bytes_per_step"] for c in codecs]
    kinds = sorted({k for s in sent for k in s if any(x.get(k) for x in sent)})
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    bottom = np.zeros(len(codecs))
    for kind in kinds:
        values = np.array([s.get(kind, 0) for s in sent], dtype=np.float64)
        ax.bar(codecs, values, bottom=bottom, label=kind)
        bottom += values
    ax.set(
        xlabel="forward embedding codec",
        ylabel="bytes per step (one rank)",
        title="Communication per step, row-wise, 2 ranks",
    )
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def plot_cache(record: dict, path: Path) -> None:
    """Hit rate, and samples/s over in-memory, against the cache's share of the rows."""
    fig = Figure(figsize=(10, 4))
    hit_ax, speed_ax = fig.subplots(1, 2)
    for prefetch, label in ((False, "LRU"), (True, "LRU + prefetch")):
        runs = sorted(
            (r["cache_fraction"], r["hit_rate"], record["ratios"][k])
            for k, r in record["results"].items()
            if r["prefetch"] == prefetch
        )
        share, hits, ratios = zip(*runs, strict=True)
        hit_ax.plot(share, hits, marker="o", label=label)
        speed_ax.plot(share, ratios, marker="o", label=label)
    hit_ax.set(
        xlabel="cache size (share of all rows)",
        ylabel="hit rate",
        title="Cache hit rate",
        ylim=(0, 1.02),
    )
    speed_ax.set(
        xlabel="cache size (share of all rows)",
        ylabel="samples/s / in-memory",
        title="Throughput against all-in-memory",
    )
    speed_ax.axhline(1.0, color="k", linewidth=0.8)
    for ax in (hit_ax, speed_ax):
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")


# -- the report ----------------------------------------------------------------------------


def run_report(out_dir: str | Path, quick: bool = False, *, torchrec: bool = True) -> dict:
    """Run every benchmark, write ``report.json``, ``report.md`` and the plots under
    ``out_dir``; return the JSON record. ``quick`` runs each benchmark at its tiny sizes
    (checks the report, not speed); ``torchrec=False`` leaves the TorchRec comparison out."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tune_allocator()  # the in-process benchmarks (tiered too) run as the CLI's would
    ingest = run_ingest_benchmark(**INGEST_QUICK) if quick else run_ingest_benchmark()
    # A team's layout (string IDs, a weighted list, declared transforms): the jagged path.
    ingest_logs = run_ingest_benchmark(**(INGEST_QUICK if quick else {}), shape=LOGS_SHAPE)
    kernels = run_kernel_benchmark(quick=quick)
    train = run_train_benchmark(quick=quick)
    step = run_step_benchmark(quick=quick)
    tiered = run_tiered_benchmark(quick=quick)
    readers = run_readers_benchmark(**READERS_QUICK) if quick else run_readers_benchmark()
    ingest_days = run_ingest_days_benchmark(quick=quick)
    precision = run_precision_benchmark(quick=quick)
    missing = torchrec_missing() if torchrec else "not requested (torchrec=False)"
    comparison = run_torchrec_comparison(quick=quick) if missing is None else None
    plot_throughput(train, out / PLOTS["throughput"], comparison)
    plot_bytes_by_codec(train, out / PLOTS["bytes"])
    plot_cache(tiered, out / PLOTS["cache"])
    record = {
        "quick": quick,
        "seconds": time.perf_counter() - started,
        "noise": NOISE_NOTE,
        "ingest": ingest,
        "ingest_logs": ingest_logs,
        "kernels": kernels,
        "train": train,
        "step": step,
        "tiered": tiered,
        "readers": readers,
        "ingest_days": ingest_days,
        "precision": precision,
        "torchrec": comparison if comparison is not None else {"skipped": missing},
        "plots": sorted(PLOTS.values()),
        "machine": describe_machine(),
    }
    write_atomic(out / "report.json", json.dumps(record, indent=2) + "\n")
    machine = record["machine"]
    header = "\n\n".join(
        [
            "# dlrmflow benchmark report" + (" (quick: tiny sizes, not speed)" if quick else ""),
            f"{machine['cpu']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, "
            f"Python {machine['python']}. {NOISE_NOTE}",
        ]
    )
    sections = [
        header,
        ingest_section(ingest),
        ingest_section(ingest_logs),
        kernels_section(kernels),
        train_section(train),
        step_section(step),
        tiered_section(tiered),
        readers_section(readers),
        ingest_days_section(ingest_days),
        precision_section(precision),
        torchrec_section(comparison, missing),
    ]
    write_atomic(out / "report.md", "\n\n".join(sections) + "\n")
    return record

"""Ingest benchmark: our reader + feature transform against plain pyarrow decode.

Both sides read the same row groups of the same files with N-way parallelism (N readers
for ours, each preparing windows in the threads ``reader_threads`` gives it: two where the
cores allow, else one; N decode threads for the baseline). The cases take turns within
each of ``repeats`` rounds and the best run of each counts, so that a noisy neighbour hurts
all alike. The baseline only decodes Parquet into Arrow; ours also shuffles, batches and
turns rows into tensors (dense log transform, sparse-ID hashing, jagged layout), so a
ratio near 1 means preprocessing is hidden behind decode. CPU seconds per million rows
are reported too: wall-clock ratios can hide work done on a spare core.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import fsspec
import pyarrow.parquet as pq
import torch

from dlrmflow.bench.machine import describe_machine
from dlrmflow.config import DataConfig, FeaturesConfig, ModelConfig
from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset, Split, list_splits, make_loader
from dlrmflow.ingest.synthetic import generate_dataset


def _best_rates(
    cases: dict[str, Callable[[], int]], repeats: int
) -> dict[str, tuple[float, float]]:
    """Each case's best rows/s over ``repeats`` runs, and the CPU seconds per million rows
    of that run.

    The cases take turns within each repeat, so that a noisy neighbour or a drift of the
    machine's speed hurts them all alike rather than whichever case ran during it.
    """
    best: dict[str, tuple[float, float]] = {case: (0.0, 0.0) for case in cases}
    for _ in range(repeats):
        for case, run in cases.items():
            start, cpu = time.perf_counter(), time.process_time()
            rows = run()
            rate = rows / (time.perf_counter() - start)
            if rate > best[case][0]:
                best[case] = (rate, (time.process_time() - cpu) / rows * 1e6)
    return best


def pyarrow_decode(splits: Sequence[Split], columns: list[str], workers: int) -> int:
    """The baseline: decode every split's columns with ``workers`` threads; returns rows."""

    def read(split: Split) -> int:
        with fsspec.open(split.path, "rb") as f:
            table = pq.ParquetFile(f).read_row_group(
                split.row_group, columns=columns, use_threads=False
            )
        return table.num_rows

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(read, splits))


def reader_rows(
    splits: Sequence[Split],
    columns: list[str],
    workers: int,
    batch_size: int,
    transform: BatchTransform | None,
    shuffle: bool = True,
) -> int:
    """Ours: the reader with ``workers`` reader threads (+ transform when given); returns rows."""
    dataset = ParquetBatchDataset(
        splits,
        columns,
        batch_size,
        shuffle=shuffle,
        validate=None if transform is None else transform.validate,
        transform=transform,
    )
    rows = 0
    for batch in make_loader(dataset, num_workers=workers):
        rows += len(batch) if transform is not None else batch.num_rows
    return rows


def run_ingest_benchmark(
    *,
    rows: int = 1_000_000,
    data_url: str | None = None,
    workers: Sequence[int] = (1, 2),
    batch_size: int = 4096,
    repeats: int = 5,
) -> dict[str, object]:
    """Measure rows/s of both sides at each worker count and return the JSON record."""
    with tempfile.TemporaryDirectory(prefix="dlrmflow-bench-") as tmp:
        if data_url is None:
            data_url = f"{tmp}/data"
            generate_dataset(
                DataConfig(url=data_url, days=2, rows_per_day=max(rows // 2, 1), seed=0)
            )
        manifest = read_manifest(data_url)
        spec = FeatureSpec.for_dataset(manifest, FeaturesConfig(), ModelConfig())
        transform = BatchTransform(spec, HashIds.from_spec(spec))
        splits = list_splits(manifest.day_paths(data_url))
        total = sum(s.num_rows for s in splits)
        columns = spec.columns
        pyarrow_decode(splits, columns, max(workers))  # warm the page cache for both sides

        results: dict[str, dict[str, float]] = {}
        ratios: dict[str, float] = {}
        for n in workers:
            # As in training: torch keeps the cores the readers leave (see compute_threads).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) - n))
            best = _best_rates(
                {
                    "base": lambda n=n: pyarrow_decode(splits, columns, n),
                    "ours": lambda n=n: reader_rows(splits, columns, n, batch_size, transform),
                    "read_only": lambda n=n: reader_rows(splits, columns, n, batch_size, None),
                    # The row shuffle's scattered writes are a large share of the cost; this
                    # isolates it.
                    "unshuffled": lambda n=n: reader_rows(
                        splits, columns, n, batch_size, transform, False
                    ),
                },
                repeats,
            )
            (base, base_cpu), (ours, ours_cpu) = best["base"], best["ours"]
            (read_only, read_cpu), (unshuffled, unshuffled_cpu) = (
                best["read_only"],
                best["unshuffled"],
            )
            results[f"workers_{n}"] = {
                "pyarrow_decode_rows_per_s": base,
                "reader_transform_rows_per_s": ours,
                "reader_only_rows_per_s": read_only,
                "reader_transform_no_shuffle_rows_per_s": unshuffled,
                "pyarrow_decode_cpu_s_per_m_rows": base_cpu,
                "reader_transform_cpu_s_per_m_rows": ours_cpu,
                "reader_only_cpu_s_per_m_rows": read_cpu,
                "reader_transform_no_shuffle_cpu_s_per_m_rows": unshuffled_cpu,
            }
            ratios[f"reader_transform_vs_pyarrow_decode_{n}w"] = ours / base
            ratios[f"reader_only_vs_pyarrow_decode_{n}w"] = read_only / base
            ratios[f"reader_transform_no_shuffle_vs_pyarrow_decode_{n}w"] = unshuffled / base
    return {
        "benchmark": "ingest",
        "baseline": "pyarrow.parquet read_row_group of the same splits and columns, "
        "N threads (use_threads=False each)",
        "rows": total,
        "splits": len(splits),
        "batch_size": batch_size,
        "repeats": repeats,
        "results": results,
        "ratios": ratios,
        "machine": describe_machine(),
    }

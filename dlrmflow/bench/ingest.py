"""Ingest benchmark: our reader + feature transform against plain pyarrow decode.

Both sides read the same row groups of the same files with the same number of threads:
ours runs N readers, each preparing windows in the threads ``reader_threads`` gives it
(two where the cores allow, else one), and the baseline decodes the splits in a pool of
as many threads in total. Both open each split's file natively, with Arrow's pre-buffered
reads (``pq.read_table``'s default) and without Arrow's own thread pool, and both keep a
file's footer from its first read for its other row groups (ours once per reader and
pass, the baseline once per run: with several readers ours reads a footer a few more
times, which only favours the baseline). Both run in this process, under the allocator
setting of ``runtime.glibc_malloc`` (applied here too, so that a run outside the CLI is tuned
as well).

The cases take turns within each of ``repeats`` rounds, after one untimed round, and the
best run of each counts (``dlrmflow.bench.turns``), so that a noisy neighbour hurts all
alike. The baseline only decodes Parquet into Arrow; ours also shuffles, batches and
turns rows into tensors (dense log transform, sparse-ID hashing, jagged layout), so a
ratio near 1 means preprocessing is hidden behind decode. CPU seconds per million rows
(of the whole process, every thread) are reported beside rows/s: wall-clock ratios can
hide work done on a spare core.

The dataset is generated (``rows`` rows over two days) in Criteo's layout, or with
``shape="logs"`` in a team's (``ingest.synthetic_logs``: string IDs hashed, a list of
IDs, clipped and logged floats), or is an existing one (``data_url``); either way both
sides read the columns its feature spec names, and the record says which shape it is.

Ours decodes as the reader does: string ID columns (strings, or lists of them) that a
file stores dictionary-encoded are read as dictionaries where the transform takes them
(``BatchTransform.dictionary_columns``), so each distinct string is decoded and hashed
once. Where a dataset has such columns the baseline runs twice, decoding every string as
a plain read of the columns does, and reading the same columns as dictionaries as ours
does; every ratio is against the faster of the two. "Plain strings" runs ours with every
string decoded plain, against the plain decode: what the dictionary reads gain, and what
ours reaches on files whose writer did not dictionary-encode its strings.

Two figures say what bounds ours. "decode + transform" runs our decode (the baseline's,
with the dictionary reads) and our transform of each row group straight after it, in the
baseline's pool and without the reader: the ratio reader + transform would reach were
the reader free. And the bytes each path writes per row: the reader alone copies the
decoded Arrow columns into its shuffled windows, the transform writes narrower tensors,
so the reader alone moves more.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from fsspec.implementations.local import LocalFileSystem

from dlrmflow.bench.machine import available_cores, describe_machine
from dlrmflow.bench.turns import best_of_turns
from dlrmflow.config import ConfigError, DataConfig, FeaturesConfig, ModelConfig
from dlrmflow.features.batch import Batch
from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform, WindowWriter
from dlrmflow.ingest.decode import leaf_paths
from dlrmflow.ingest.loader import make_loader, reader_threads
from dlrmflow.ingest.manifest import Manifest, read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.splits import Split, list_splits
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.ingest.synthetic_logs import SHAPE as LOGS_SHAPE
from dlrmflow.ingest.synthetic_logs import generate_logs_dataset
from dlrmflow.runtime.glibc_malloc import tune_allocator


def _rate(run: Callable[[], int]) -> tuple[float, float]:
    """Rows/s of one run and the process's CPU seconds per million rows during it."""
    start, cpu = time.perf_counter(), time.process_time()
    rows = run()
    return rows / (time.perf_counter() - start), (time.process_time() - cpu) / rows * 1e6


def pyarrow_decode(
    splits: Sequence[Split],
    columns: list[str],
    threads: int,
    dictionaries: Callable[[pa.Schema], list[str]] | None = None,
) -> int:
    """The baseline: decode every split's columns in a pool of ``threads`` threads; the
    first read of a file keeps its footer for the file's other row groups; returns rows.
    ``dictionaries``: the columns of a file's schema to read as dictionaries (as ours
    does), else every string is decoded plain (as ``pq.read_table`` does)."""
    footers: dict[str, pq.FileMetaData] = {}

    def read(split: Split) -> int:
        return _decoded(split, columns, footers, dictionaries).num_rows

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read, splits))


def _decoded(
    split: Split,
    columns: list[str],
    footers: dict[str, pq.FileMetaData],
    dictionaries: Callable[[pa.Schema], list[str]] | None = None,
) -> pa.Table:
    """The baseline's decode of one split: its file opened natively, pre-buffered, no Arrow
    threads, the file's footer taken from ``footers`` when an earlier read left it there.
    ``dictionaries``: the columns of a file's schema to read as dictionaries."""
    with _open(split.path) as f:
        parquet = pq.ParquetFile(f, metadata=footers.get(split.path), pre_buffer=True)
        footers[split.path] = parquet.metadata
        wanted = [] if dictionaries is None else dictionaries(parquet.schema_arrow)
        if wanted:
            parquet = pq.ParquetFile(
                f,
                metadata=parquet.metadata,
                pre_buffer=True,
                read_dictionary=leaf_paths(parquet, wanted),
            )
        return parquet.read_row_group(split.row_group, columns=columns, use_threads=False)


def decode_transform(
    splits: Sequence[Split], columns: list[str], threads: int, transform: BatchTransform
) -> int:
    """Our decode (the baseline's, with the string ID columns the transform takes as
    dictionaries read so) and our validation and transform of each row group straight
    after it, in the baseline's pool: no reader (no shuffle, windows or batches). What
    reader + transform could reach were the reader free; returns rows."""
    footers: dict[str, pq.FileMetaData] = {}

    def read(split: Split) -> int:
        table = _decoded(split, columns, footers, transform.dictionary_columns)
        transform.validate(table)
        return len(transform(table))

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read, splits))


def written_bytes_per_row(
    splits: Sequence[Split], columns: list[str], batch_size: int, transform: BatchTransform
) -> dict[str, float]:
    """Bytes each of our paths writes per row it hands on, from one batch of each: the
    reader alone copies the decoded Arrow columns (values and validity), the transform
    writes tensors (float32 dense, int32 or int64 rows, or jagged int64 rows with int32
    lengths and float32 per-ID weights, float32 labels)."""
    raw = _decoded(splits[0], columns, {}).slice(0, batch_size)  # nbytes: the slice's own
    batch = transform(raw)
    sparse = batch.sparse
    tensors = [batch.dense, batch.labels]
    if sparse.one_hot_rows is not None:
        tensors.append(sparse.one_hot_rows)
    else:
        tensors += [sparse.values, sparse.lengths]
        tensors += [] if sparse.weights is None else [sparse.weights]
    return {
        "reader_only": raw.nbytes / raw.num_rows,
        "reader_transform": sum(t.nbytes for t in tensors) / len(batch),
    }


def _open(path: str):
    """``path`` as Arrow opens a local path itself (a native file), else through fsspec."""
    fs, local_path = fsspec.core.url_to_fs(path)
    if isinstance(fs, LocalFileSystem):
        return pa.OSFile(local_path)
    return fs.open(local_path, "rb")


class PlainStrings:
    """``transform`` as a reader sees it, less ``dictionary_columns``: the reader then
    decodes every string plain (what the dictionary reads gain, for the record)."""

    def __init__(self, transform: BatchTransform) -> None:
        self._transform = transform
        self.validate = transform.validate

    def __call__(self, table: pa.Table) -> Batch:
        return self._transform(table)

    def window_writer(self, order: np.ndarray, dest: np.ndarray | None = None) -> WindowWriter:
        return self._transform.window_writer(order, dest)


def reader_rows(
    splits: Sequence[Split],
    columns: list[str],
    workers: int,
    batch_size: int,
    transform: BatchTransform | PlainStrings | None,
    shuffle: bool = True,
) -> int:
    """Ours: ``workers`` readers of ``reader_threads(workers)`` threads each (+ transform
    when given); returns rows."""
    dataset = ParquetBatchDataset(
        splits,
        columns,
        batch_size,
        shuffle=shuffle,
        validate=None if transform is None else transform.validate,
        transform=transform,
    )
    rows = 0
    for batch in make_loader(dataset, num_workers=workers, threads=reader_threads(workers)):
        rows += len(batch) if transform is not None else batch.num_rows
    return rows


def run_ingest_benchmark(
    *,
    rows: int = 1_000_000,
    data_url: str | None = None,
    workers: Sequence[int] = (1, 2),
    batch_size: int = 4096,
    repeats: int = 5,
    shape: str = "criteo",
) -> dict[str, object]:
    """Measure rows/s of both sides at each worker count and return the JSON record.

    ``shape``: the generated dataset's, ``criteo`` or ``logs`` (not used with
    ``data_url``)."""
    generators = {"criteo": generate_dataset, LOGS_SHAPE: generate_logs_dataset}
    if shape not in generators:
        raise ConfigError(f"shape must be one of {', '.join(generators)}, not {shape!r}")
    tune_allocator()
    torch_threads = torch.get_num_threads()
    try:
        return _ingest_record(rows, data_url, workers, batch_size, repeats, generators[shape])
    finally:
        torch.set_num_threads(torch_threads)  # the next benchmark in this process starts as it did


def dataset_shape(manifest: Manifest) -> str:
    """What a dataset's columns are: ``criteo`` (no declared schema), the generator's
    shape, or ``registered`` (a user's own data)."""
    if manifest.features is None:
        return "criteo"
    return (manifest.generator or {}).get("shape", manifest.source)


def _ingest_record(
    rows: int,
    data_url: str | None,
    workers: Sequence[int],
    batch_size: int,
    repeats: int,
    generate: Callable[[DataConfig], Manifest],
) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="dlrmflow-bench-") as tmp:
        if data_url is None:
            data_url = f"{tmp}/data"
            generate(DataConfig(url=data_url, days=2, rows_per_day=max(rows // 2, 1), seed=0))
        manifest = read_manifest(data_url)
        shape = dataset_shape(manifest)
        spec = FeatureSpec.for_dataset(manifest, FeaturesConfig(), ModelConfig())
        transform = BatchTransform(spec, HashIds.from_spec(spec))
        splits = list_splits(manifest.day_paths(data_url))
        total = sum(s.num_rows for s in splits)
        columns = spec.columns
        results: dict[str, dict[str, float]] = {}
        ratios: dict[str, float] = {}
        bytes_per_row = written_bytes_per_row(splits, columns, batch_size, transform)
        # Whether ours reads any string as a dictionary here (the first file tells).
        with _open(splits[0].path) as f:
            dictionaries = transform.dictionary_columns(pq.ParquetFile(f).schema_arrow)
        plain = PlainStrings(transform)
        for n in workers:
            threads = n * reader_threads(n)  # ours in total; the baseline gets as many
            # As in training: torch keeps the cores the readers leave (see compute_threads).
            torch.set_num_threads(max(1, available_cores() - n))
            best = best_of_turns(
                {
                    "base": lambda t=threads: _rate(lambda: pyarrow_decode(splits, columns, t)),
                    # The same decode as ours: strings the files store as dictionaries read
                    # as dictionaries.
                    **(
                        {
                            "base_dictionaries": lambda t=threads: _rate(
                                lambda: pyarrow_decode(
                                    splits, columns, t, transform.dictionary_columns
                                )
                            )
                        }
                        if dictionaries
                        else {}
                    ),
                    "ours": lambda n=n: _rate(
                        lambda: reader_rows(splits, columns, n, batch_size, transform)
                    ),
                    "read_only": lambda n=n: _rate(
                        lambda: reader_rows(splits, columns, n, batch_size, None)
                    ),
                    # The row shuffle's scattered writes are a large share of the cost; this
                    # isolates it.
                    "unshuffled": lambda n=n: _rate(
                        lambda: reader_rows(splits, columns, n, batch_size, transform, False)
                    ),
                    # No reader at all: the bound the transform's own cost sets.
                    "decode_transform": lambda t=threads: _rate(
                        lambda: decode_transform(splits, columns, t, transform)
                    ),
                    # Every string decoded plain: what the dictionary reads gain.
                    **(
                        {
                            "plain_strings": lambda n=n: _rate(
                                lambda: reader_rows(splits, columns, n, batch_size, plain)
                            )
                        }
                        if dictionaries
                        else {}
                    ),
                },
                repeats,
                key=lambda r: r[0],
                # Untimed: the page cache, the reader's compiled code and thread pools warm
                # for every case alike.
                warmup_rounds=1,
            )
            (plain_base, base_cpu), (ours, ours_cpu) = best["base"], best["ours"]
            # Every ratio but the plain-strings one is against the faster baseline.
            base = max(plain_base, best.get("base_dictionaries", (0.0, 0.0))[0])
            (read_only, read_cpu), (unshuffled, unshuffled_cpu) = (
                best["read_only"],
                best["unshuffled"],
            )
            bare, bare_cpu = best["decode_transform"]
            results[f"workers_{n}"] = {
                "pyarrow_decode_threads": threads,
                "reader_threads_per_worker": reader_threads(n),
                "reader_threads_total": threads,
                "pyarrow_decode_rows_per_s": plain_base,
                "reader_transform_rows_per_s": ours,
                "reader_only_rows_per_s": read_only,
                "reader_transform_no_shuffle_rows_per_s": unshuffled,
                "pyarrow_decode_cpu_s_per_m_rows": base_cpu,
                "reader_transform_cpu_s_per_m_rows": ours_cpu,
                "reader_only_cpu_s_per_m_rows": read_cpu,
                "reader_transform_no_shuffle_cpu_s_per_m_rows": unshuffled_cpu,
                "decode_transform_rows_per_s": bare,
                "decode_transform_cpu_s_per_m_rows": bare_cpu,
            }
            ratios[f"reader_transform_vs_pyarrow_decode_{n}w"] = ours / base
            ratios[f"reader_only_vs_pyarrow_decode_{n}w"] = read_only / base
            ratios[f"reader_transform_no_shuffle_vs_pyarrow_decode_{n}w"] = unshuffled / base
            ratios[f"decode_transform_vs_pyarrow_decode_{n}w"] = bare / base
            if "base_dictionaries" in best:
                dict_rate, dict_cpu = best["base_dictionaries"]
                results[f"workers_{n}"]["pyarrow_decode_dictionaries_rows_per_s"] = dict_rate
                results[f"workers_{n}"]["pyarrow_decode_dictionaries_cpu_s_per_m_rows"] = dict_cpu
            if "plain_strings" in best:
                plain_rate, plain_cpu = best["plain_strings"]
                results[f"workers_{n}"]["reader_transform_plain_strings_rows_per_s"] = plain_rate
                results[f"workers_{n}"]["reader_transform_plain_strings_cpu_s_per_m_rows"] = (
                    plain_cpu
                )
                # Plain strings on both sides: against the plain decode.
                ratios[f"reader_transform_plain_strings_vs_pyarrow_decode_{n}w"] = (
                    plain_rate / plain_base
                )
    return {
        "benchmark": "ingest",
        "shape": shape,
        "baseline": "pyarrow.parquet ParquetFile.read_row_group of the same splits and columns "
        "in a pool of as many threads as our N readers run in total, native files, "
        "pre_buffer=True, use_threads=False, each file's footer kept from its first read (as ours)"
        + (
            ", strings decoded plain and, apart, with read_dictionary for the columns ours reads "
            "as dictionaries; ratios are against the faster of the two"
            if dictionaries
            else ""
        ),
        "footers": "kept from a file's first read for its other row groups on both sides "
        "(ours per reader, the baseline per run)",
        "dictionary_reads": dictionaries,
        "rows": total,
        "splits": len(splits),
        "batch_size": batch_size,
        "repeats": repeats,
        "warmup_rounds": 1,
        "written_bytes_per_row": bytes_per_row,
        "results": results,
        "ratios": ratios,
        "machine": describe_machine(),
    }

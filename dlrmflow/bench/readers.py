"""Readers benchmark: a data-starved trainer fed by a local reader, then by reader servers.

The consumer is an accelerator-bound trainer: each step holds the batch for ``step_ms``
while its CPU stays free (a sleep), so samples/s and the share of time spent waiting for
data show whether preprocessing keeps up. Preprocessing is made expensive on purpose:
``CostlyTransform`` is the real ``BatchTransform`` plus ``us_per_row`` microseconds of CPU
time per row (spent as each decoded row group is validated), in numpy calls that release
the GIL as vectorized preprocessing does, and measured on the thread's own CPU clock, so
that a row costs the same CPU whether or not cores are contended. Every case runs that
same transform, and every reader prepares its windows in one thread:

* ``local_1_reader`` (the baseline): one reader thread beside the trainer, what a trainer
  host with one spare core gets;
* ``local_2_readers``: two reader threads, for reference;
* ``remote_1_server``: one reader server with one preprocessing slot, in its own process,
  over Flight on loopback, read as two streams (``train.num_workers=2``);
* ``remote_2_servers``: two such servers, one stream each.

All cases read the same epoch and deliver identical batches; they take turns within each
of ``repeats`` rounds and each keeps its best (``dlrmflow.bench.turns``). ``ratios``
divide each case's samples/s by the baseline's, measured in the same run.

On loopback the servers share this machine's cores with the trainer process. With few cores
(2 on the development machine) a second server cannot add CPU that the local readers lack:
``remote_2_servers`` can at best match ``local_2_readers``, and the ratio of
``remote_1_server`` to the baseline measures what Flight costs (encoding, the copy through
gRPC, decoding) rather than what disaggregation gains. On separate hosts each server brings
its own cores, which is the point of the design.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import ExitStack
from functools import partial

import numpy as np
import pyarrow as pa

from dlrmflow.bench.machine import describe_machine
from dlrmflow.bench.turns import best_of_turns
from dlrmflow.config import DataConfig, RunConfig, build_config
from dlrmflow.features.ids import IdMapper
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.launch.reader_servers import reader_processes
from dlrmflow.train.run.data import TrainLoader, batch_loader, fit_features, make_train_loader

BASELINE = "local_1_reader"


def burn_cpu(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time on numpy work that releases the GIL."""
    if seconds <= 0:
        return
    # 64 KiB: stays in cache, and each call is short, so the loop ends close to ``seconds``.
    scratch = np.linspace(1.0, 2.0, 8192)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        np.sqrt(scratch, out=scratch)


class CostlyTransform(BatchTransform):
    """``BatchTransform`` plus ``us_per_row`` microseconds of CPU per row read: heavier
    preprocessing, with the same output. Picklable, so reader server processes get it."""

    def __init__(self, spec: FeatureSpec, ids: IdMapper, *, us_per_row: float) -> None:
        super().__init__(spec, ids)
        self.us_per_row = us_per_row

    def validate(self, table: pa.Table) -> None:
        """``BatchTransform.validate``, then the extra cost for ``table``'s rows.

        Spent here because every reader path validates each decoded row group exactly
        once, in the thread that then transforms it, whereas ``__call__`` is skipped by
        the compiled window path (the reader writes rows through ``window_writer``).
        """
        super().validate(table)
        burn_cpu(table.num_rows * self.us_per_row * 1e-6)


def consume(loader: TrainLoader, step_s: float) -> dict[str, float]:
    """One epoch through ``loader``, holding each batch ``step_s`` as a training step would."""
    loader.set_epoch(0)
    rows = steps = 0
    first_batch_s = 0.0
    start = time.perf_counter()
    for batch in loader:
        if steps == 0:
            first_batch_s = time.perf_counter() - start
        rows += len(batch)
        steps += 1
        time.sleep(step_s)
    seconds = time.perf_counter() - start
    return {
        "rows": rows,
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": rows / seconds,
        "wait_s": loader.wait_seconds,
        "wait_share": loader.wait_seconds / seconds,
        "first_batch_s": first_batch_s,
        "failovers": loader.failovers,
    }


def _config(data_url: str, batch_size: int, shuffle_window: int, readers: list[str]) -> RunConfig:
    return build_config(
        {
            "data": {"url": data_url},
            "train": {
                "batch_size": batch_size,
                "num_workers": 2,
                "shuffle_window": shuffle_window,
            },
            "distributed": {"readers": readers},
        }
    )


def run_readers_benchmark(
    *,
    rows: int = 400_000,
    data_url: str | None = None,
    batch_size: int = 4096,
    us_per_row: float = 8.0,
    step_ms: float = 20.0,
    row_group_size: int = 16_384,
    shuffle_window: int = 2,
    repeats: int = 3,
) -> dict[str, object]:
    """Measure the four cases on one epoch of the training days, best of ``repeats`` each,
    and return the JSON record.

    Without ``data_url`` a synthetic dataset of ``rows`` training rows (and as many test
    rows, which are not read) is generated in a temporary directory.
    """
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dlrmflow-bench-") as tmp, ExitStack() as stack:
        if data_url is None:
            data_url = f"{tmp}/data"
            generate_dataset(
                DataConfig(url=data_url, days=2, rows_per_day=rows, row_group_size=row_group_size)
            )
        config = _config(data_url, batch_size, shuffle_window, [])
        manifest = read_manifest(data_url)
        spec, ids = fit_features(config, manifest)
        paths = manifest.day_paths(data_url, manifest.train_days())
        step_s = step_ms / 1000
        costly = partial(CostlyTransform, us_per_row=us_per_row)

        def local(num_workers: int) -> dict[str, float]:
            dataset, loader = batch_loader(
                paths,
                spec,
                ids,
                batch_size=batch_size,
                num_workers=num_workers,
                shuffle=True,
                shuffle_window=shuffle_window,
                transform=costly(spec, ids),
                threads=1,  # as the servers' readers
            )
            return consume(TrainLoader(loader, dataset), step_s)

        def remote(endpoints: list[str]) -> dict[str, float]:
            remote_config = _config(data_url, batch_size, shuffle_window, endpoints)
            with make_train_loader(remote_config, spec, ids, paths) as loader:
                return consume(loader, step_s)

        processes = stack.enter_context(reader_processes(config, 2, 1, transform=costly))
        servers = [str(p.endpoint) for p in processes]
        cases = {
            BASELINE: lambda: local(1),
            "local_2_readers": lambda: local(2),
            "remote_1_server": lambda: remote(servers[:1]),
            "remote_2_servers": lambda: remote(servers),
        }
        results = best_of_turns(cases, repeats, key=lambda r: r["samples_per_s"])
    base = results[BASELINE]["samples_per_s"]
    return {
        "benchmark": "readers",
        "baseline": f"{BASELINE}: one local reader thread running the same costly transform",
        "consumer": f"an accelerator-bound trainer: each step holds its batch {step_ms} ms, "
        "CPU idle",
        "preprocessing_cost_us_per_row": us_per_row,
        "batch_size": batch_size,
        "rows": results[BASELINE]["rows"],
        "row_group_size": row_group_size,
        "shuffle_window": shuffle_window,
        "repeats": repeats,
        "results": results,
        "ratios": {
            f"{case}_vs_{BASELINE}": r["samples_per_s"] / base
            for case, r in results.items()
            if case != BASELINE
        },
        "note": f"servers on loopback share this machine's {os.cpu_count()} cores with the "
        "trainer: they add no CPU, so the remote ratios show Flight's overhead and the "
        "parallel preprocessing these cores allow, not the gain of separate reader hosts",
        # Other processes' load skews every figure; the 1-minute load average tells.
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "machine": describe_machine(),
    }

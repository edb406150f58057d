"""One scoring process: share ``S`` of ``N`` of every day to score, one part per day.

``score_shares`` runs in the command's own process for ``--nproc 1``; for more, each
rank of a job runs ``python -m dlrmflow.score.worker`` (started by the project's
launcher, see ``dlrmflow.score.launch``), scoring share RANK of WORLD_SIZE. The ranks
need no collective: each loads the model whole and writes its own parts, so none waits
for another. A rank reports its progress as ``scored N`` lines, fails as one ``error:
rank N: ...`` line (which the launcher turns into the command's one-line error), and rank
0 ends with the ``result`` line the launcher expects.
"""

from __future__ import annotations

from dlrmflow import supervise

if __name__ == "__main__":
    # First, before the imports below take seconds: a rank dies with its agent.
    supervise.join_job()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from dlrmflow.ingest.manifest import Manifest, read_manifest  # noqa: E402
from dlrmflow.ingest.shares import day_shares  # noqa: E402
from dlrmflow.score.batches import share_batches  # noqa: E402
from dlrmflow.score.keys import decode_schema  # noqa: E402
from dlrmflow.score.model import ModelIdentity, ScoringModel, load_model  # noqa: E402
from dlrmflow.score.output import (  # noqa: E402
    PartWriter,
    day_digest,
    part_path,
    read_part,
)
from dlrmflow.train.model.device import resolve_device, use_device  # noqa: E402
from dlrmflow.train.run.evaluate import NonFinitePredictions  # noqa: E402
from dlrmflow.train.run.rank import DistEnv, compute_threads  # noqa: E402

SCRATCH_DIR = ".scratch"  # under --out: rows of a model trained under a memory budget
PROGRESS_PREFIX = "scored "
PROGRESS_EVERY_S = 0.5  # a rank's progress lines, at most this often


def share_limit(max_rows: int | None, share: int, count: int) -> int | None:
    """Share ``share``'s part of ``max_rows`` rows a day: the rows split as evenly as the
    shares allow, so a day's parts hold ``max_rows`` rows in all (fewer if it has fewer)."""
    if max_rows is None:
        return None
    return max_rows // count + (1 if share < max_rows % count else 0)


def labeled_days(manifest: Manifest, label: str) -> bool:
    """Whether the dataset's rows have labels (its manifest's schema names the column)."""
    return any(column.get("name") == label for column in manifest.schema_)


def reader_threads_per_process(count: int) -> int:
    """Preparation threads of each process's reader: two where its cores allow."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 2 if (cores or 1) // count >= 4 else 1


def score_part(
    model: ScoringModel,
    url: str,
    manifest: Manifest,
    day: int,
    share: int,
    count: int,
    out: Path,
    *,
    batch_size: int,
    max_rows: int | None,
    labeled: bool,
    threads: int,
    progress: Callable[[int], None],
    keys: pa.Schema | None = None,
) -> int:
    """Write the part of share ``share`` of ``count`` of ``day``, with the key columns
    ``keys`` (fields; none by default) beside each prediction; its rows."""
    mine = day_shares(url, manifest, day, count)[share]
    footer = {
        "model_digest": model.identity.digest,
        "day_digest": day_digest(manifest, day),
        "day": day,
        "share": share,
        "shares": count,
        "max_rows": max_rows,
    }
    with PartWriter(part_path(out, day, share, count), footer, keys) as writer:
        batches = share_batches(
            mine,
            model.spec,
            model.ids,
            batch_size=batch_size,
            labeled=labeled,
            limit=share_limit(max_rows, share, count),
            threads=threads,
            keys=keys,
        )
        for keyed in batches:
            probs = model.predict(keyed.batch)
            finite = torch.isfinite(probs)
            if not bool(finite.all()):
                first = int(keyed.rows[int((~finite).nonzero()[0, 0])])
                raise NonFinitePredictions(
                    f"{model.identity.path}: the model predicts NaN or infinity for "
                    f"{int((~finite).sum())} of {len(probs)} rows of a batch of day {day} "
                    f"(the first: row {first}); its weights are not usable"
                )
            labels = keyed.batch.labels.numpy() if labeled else None
            writer.write(day, keyed.rows, labels, probs.numpy(), keyed.keys)
            supervise.beat()
            progress(len(probs))
        writer.commit()
        return writer.rows


def score_shares(
    identity: ModelIdentity,
    url: str,
    days: list[int],
    out: Path,
    *,
    share: int = 0,
    count: int = 1,
    batch_size: int | None = None,
    max_rows: int | None = None,
    device: str = "auto",
    kernels: str = "auto",
    progress: Callable[[int], None] | None = None,
    keys: pa.Schema | None = None,
) -> dict[str, Any]:
    """Score share ``share`` of ``count`` of each of ``days`` (those the caller found not
    done) into ``out``, the key columns ``keys`` (fields, see ``dlrmflow.score.keys``)
    beside each prediction; a part already there (written by a run that was stopped after
    it) is kept and counted. Returns the rows scored and kept, and the model's step."""
    progress = progress or (lambda n: None)
    env = DistEnv.from_env()
    where = resolve_device(device, env.local_rank, key="score --device")
    use_device(where)
    scratch = out / SCRATCH_DIR / f"rank{share}"
    try:
        model = load_model(identity, where, kernels, scratch=scratch)
        torch.set_num_threads(compute_threads(model.config, env))
        size = batch_size if batch_size is not None else model.config.eval.batch_size
        if model.largest_batch is not None:
            size = min(size, model.largest_batch)
        manifest = read_manifest(url)
        labeled = labeled_days(manifest, model.spec.label)
        threads = reader_threads_per_process(count)
        scored = kept = 0
        for day in days:
            done = part_path(out, day, share, count)
            if done.is_file():
                rows = read_part(done).rows
                kept += rows
                progress(rows)
                continue
            scored += score_part(
                model,
                url,
                manifest,
                day,
                share,
                count,
                out,
                batch_size=size,
                max_rows=max_rows,
                labeled=labeled,
                threads=threads,
                progress=progress,
                keys=keys,
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(OSError):
            scratch.parent.rmdir()  # the last process's to go removes the folder
    return {
        "rows_scored": scored,
        "rows_kept": kept,
        "step": model.identity.step,
        "batch_size": size,
        "labeled": labeled,
    }


class _ProgressLines:
    """A rank's progress as ``scored N`` lines on stdout, at most every PROGRESS_EVERY_S."""

    def __init__(self) -> None:
        self.pending = 0
        self.last = time.monotonic()

    def __call__(self, n: int) -> None:
        self.pending += n
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            print(f"{PROGRESS_PREFIX}{self.pending}", flush=True)
        self.pending, self.last = 0, time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrmflow.score.worker", description=__doc__)
    parser.add_argument("--model", required=True, help="JSON of the pinned ModelIdentity")
    parser.add_argument("--data", required=True, help="the dataset URL")
    parser.add_argument("--out", required=True, help="the output directory")
    parser.add_argument("--days", required=True, help="days to score, comma-separated")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-rows", type=int)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--keys", help="the key columns' fields (``keys.encode_schema``)")
    args = parser.parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    lines = _ProgressLines()
    try:
        result = score_shares(
            ModelIdentity(**json.loads(args.model)),
            args.data,
            [int(d) for d in args.days.split(",") if d],
            Path(args.out),
            share=rank,
            count=world,
            batch_size=args.batch_size,
            max_rows=args.max_rows,
            device=args.device,
            kernels=args.kernels,
            progress=lines,
            keys=decode_schema(args.keys) if args.keys else None,
        )
    except Exception as e:
        if os.environ.get("DLRMFLOW_DEBUG"):
            raise
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"error: rank {rank}: {type(e).__name__}: {text}", file=sys.stderr, flush=True)
        return 1
    lines.flush()
    if rank == 0:
        print("result " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

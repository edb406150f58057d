"""``score_dataset``: a model's predictions for days of a dataset, as resumable Parquet parts.

What ``dlrmflow score`` and the ``score`` flow run. Before any row is read: the options,
the model (pinned, see ``model.identify_model``), the dataset and its days (the footers of
their files, ``check_dataset``) and the output directory (``output.claim``) are checked,
each failure one line naming it. Then, under the output directory's lock, the days not yet
complete are scored, in this process (``nproc`` 1) or in ``nproc`` processes each scoring
its share of every day's row groups, and the manifest is written last, from the parts
found on disk: whatever did the scoring, it describes exactly what the directory holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dlrmflow.config import ConfigError
from dlrmflow.days import select_days
from dlrmflow.features.spec import dataset_schema
from dlrmflow.ingest.manifest import Manifest, check_dataset, read_manifest
from dlrmflow.score.keys import key_names, key_schema
from dlrmflow.score.model import identify_model, trained_on_multi_hot
from dlrmflow.score.output import (
    SCORES_FILE,
    OutputIdentity,
    claim,
    day_digest,
    list_parts,
    output_dir,
    settle_days,
    write_scores_manifest,
)
from dlrmflow.score.worker import labeled_days, score_shares, share_limit
from dlrmflow.supervise import interrupt_on_signals
from dlrmflow.train.run.checkpoint import dataset_digest
from dlrmflow.train.run.evaluate import refuse_multi_hot
from dlrmflow.train.run.rundir import run_dir_lock

DAYS_KEY = "--days"


def _check_options(nproc: int, batch_size: int | None, max_rows: int | None) -> None:
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, not {nproc}")
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, not {batch_size}")
    if max_rows is not None and max_rows < 1:
        raise ConfigError(f"--max-rows must be at least 1, not {max_rows}")


def planned_rows(
    rows_by_day: dict[int, int], days: list[int], max_rows: int | None, nproc: int
) -> int:
    """The rows a scoring of ``days`` writes (each day's, or its ``max_rows`` cap)."""
    if max_rows is None:
        return sum(rows_by_day.get(d, 0) for d in days)
    cap = sum(share_limit(max_rows, s, nproc) or 0 for s in range(nproc))
    return sum(min(rows_by_day.get(d, 0), cap) for d in days)


def _rows_by_day(manifest: Manifest) -> dict[int, int]:
    rows: dict[int, int] = {}
    for f in manifest.files:
        rows[f.day] = rows.get(f.day, 0) + f.rows
    return rows


def scored_days(manifest: Manifest, days: str | list[int] | None) -> list[int]:
    """The days of ``manifest``'s dataset that window ``days`` selects (all by default);
    a day it does not have is one line naming ``--days`` and the day."""
    return select_days(
        days if days is not None else "all", sorted(_rows_by_day(manifest)), DAYS_KEY
    )


def planned_total(data: str, days: str | list[int] | None, max_rows: int | None, nproc: int) -> int:
    """The rows ``score_dataset`` will have written for these arguments (for a progress
    bar or artifact sized before the work starts)."""
    _check_options(nproc, None, max_rows)
    manifest = read_manifest(data)
    return planned_rows(_rows_by_day(manifest), scored_days(manifest, days), max_rows, nproc)


def score_dataset(
    model: str | Path,
    data: str,
    out: str | Path,
    *,
    days: str | list[int] | None = None,
    nproc: int = 1,
    batch_size: int | None = None,
    max_rows: int | None = None,
    device: str = "auto",
    kernels: str = "auto",
    overwrite: bool = False,
    keys: str | Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    on_line: Callable[[str], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write ``model``'s predictions for ``days`` (a window, see ``dlrmflow.days``; all
    of the dataset's by default) of the dataset at ``data`` under the directory ``out``.

    ``model``: a run directory, a checkpoint directory or a servable export file.
    ``nproc`` processes score, each its share of every day's row groups, in batches of
    ``batch_size`` rows (the run's ``eval.batch_size`` by default); ``max_rows`` caps
    the rows scored of each day. A rerun into the same ``out`` for the same model and
    day files scores only what is missing; another model's predictions there are
    refused unless ``overwrite``. ``keys``: the columns copied beside each prediction
    (names, or a comma-separated string; empty for none), by default those the dataset's
    schema declares (``dlrmflow.score.keys``). ``progress(n)`` gets the rows done (those
    of parts kept from an earlier run included), ``on_plan(total)`` the rows planned,
    first; ``on_line`` the workers' other output lines. Returns the manifest's summary.
    """
    _check_options(nproc, batch_size, max_rows)
    out_dir = output_dir(out)
    identity = identify_model(model)
    manifest = read_manifest(data)
    rows_by_day = _rows_by_day(manifest)
    chosen = scored_days(manifest, days)
    # The chosen days' files (empty days need none read): every file present and intact.
    check_dataset(
        data, manifest, training=False, eval_days=[d for d in chosen if rows_by_day[d] > 0]
    )
    refuse_multi_hot(trained_on_multi_hot(identity), manifest, data, identity.path)
    key_fields = key_schema(data, manifest, chosen, key_names(manifest, keys))
    wanted = OutputIdentity(
        identity.record(),
        max_rows,
        {day: day_digest(manifest, day) for day in chosen},
        tuple(key_fields.names),
    )
    dataset = {"url": data, "digest": dataset_digest(manifest)}
    if on_plan is not None:
        on_plan(planned_rows(rows_by_day, chosen, max_rows, nproc))
    start = time.perf_counter()
    with run_dir_lock(out_dir, "dlrmflow score"):
        previous = claim(out_dir, wanted, overwrite)
        todo = settle_days(out_dir, chosen, nproc)
        before = {p.path for p in list_parts(out_dir)}
        if progress is not None:
            progress(sum(p.rows for p in list_parts(out_dir) if p.day in set(chosen) - set(todo)))
        write_scores_manifest(out_dir, wanted, dataset, complete=False, previous=previous)
        result: dict[str, Any] = {}
        if todo and nproc == 1:
            with interrupt_on_signals("scoring"):
                result = score_shares(
                    identity,
                    data,
                    todo,
                    out_dir,
                    batch_size=batch_size,
                    max_rows=max_rows,
                    device=device,
                    kernels=kernels,
                    progress=progress,
                    keys=key_fields,
                )
        elif todo:
            from dlrmflow.score.launch import launch_workers

            result = launch_workers(
                identity,
                data,
                todo,
                out_dir,
                nproc,
                batch_size=batch_size,
                max_rows=max_rows,
                device=device,
                kernels=kernels,
                progress=progress,
                on_line=on_line,
                keys=key_fields,
            )
        if result.get("step") is not None:
            wanted.model["step"] = result["step"]  # a servable's, known once loaded
        written = write_scores_manifest(out_dir, wanted, dataset, complete=True, previous=previous)
    parts = [p for p in list_parts(out_dir) if p.day in chosen]
    return {
        "out": str(out_dir),
        "manifest": str(out_dir / SCORES_FILE),
        "model": written["model"],
        "data_url": data,
        "days": chosen,
        "rows": sum(p.rows for p in parts),
        "rows_scored": sum(p.rows for p in parts if p.path not in before),
        "parts": len(parts),
        "parts_kept": sum(1 for p in parts if p.path in before),
        "labeled": labeled_days(manifest, dataset_schema(manifest).label),
        "nproc": nproc,
        **({"keys": list(key_fields.names)} if len(key_fields) else {}),
        "seconds": time.perf_counter() - start,
        "total_rows": written["rows"],
    }

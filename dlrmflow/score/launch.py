"""``--nproc N`` scoring: N ranks of ``python -m dlrmflow.score.worker`` on this host.

Scoring needs no collective, so plain processes would do; the ranks are started the way
``evaluate --nproc`` starts its own (torchrun through ``dlrmflow.train.launch.agent``,
supervised by ``dlrmflow.train.launch.job``) for what that launcher already guarantees:
the ranks die with the command, even killed by SIGKILL; SIGTERM or Ctrl-C stops them and
ends in one line; a rank that makes no progress is named; the output directory's lock
passes to the job; and a failed rank ends the command with one line naming it (the first
to fail, its own error), the others stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from dlrmflow.config import DistributedConfig
from dlrmflow.score.keys import encode_schema
from dlrmflow.score.model import ModelIdentity
from dlrmflow.score.worker import PROGRESS_PREFIX
from dlrmflow.train.launch.job import launch_command, run_job


def launch_workers(
    identity: ModelIdentity,
    url: str,
    days: list[int],
    out: Path,
    nproc: int,
    *,
    batch_size: int | None = None,
    max_rows: int | None = None,
    device: str = "auto",
    kernels: str = "auto",
    progress: Callable[[int], None] | None = None,
    on_line: Callable[[str], None] | None = None,
    keys: pa.Schema | None = None,
) -> dict[str, Any]:
    """Score ``days`` in ``nproc`` processes, share RANK of ``nproc`` each, the key
    columns ``keys`` (fields) beside each prediction; rank 0's result. ``progress(n)``
    gets the rows the ranks report; other lines go to ``on_line``. A failed rank raises
    ``TrainingFailed`` naming it."""
    args = [
        "--model", json.dumps(identity.record()),
        "--data", url,
        "--out", str(out),
        "--days", ",".join(str(d) for d in days),
        "--device", device,
        "--kernels", kernels,
    ]  # fmt: skip
    for flag, value in (("--batch-size", batch_size), ("--max-rows", max_rows)):
        if value is not None:
            args += [flag, str(value)]
    if keys is not None and len(keys):
        args += ["--keys", encode_schema(keys)]

    def line(text: str) -> None:
        if text.startswith(PROGRESS_PREFIX) and text[len(PROGRESS_PREFIX) :].isdigit():
            if progress is not None:
                progress(int(text[len(PROGRESS_PREFIX) :]))
        elif on_line is not None:
            on_line(text)

    # The launcher agent (torchrun) running the workers on this host alone.
    command = launch_command(None, nproc, None, *args, module="dlrmflow.score.worker")
    what = f"scoring with {nproc} processes"
    result = run_job(command, None, what, line, timeout_s=DistributedConfig().timeout_s)
    assert result is not None  # one host: rank 0 ran here, and run_job checked its result
    return result

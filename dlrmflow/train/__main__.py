"""``python -m dlrmflow.train --config FILE [--set KEY=VALUE ...]``: one rank of a job.

``--evaluate RUN_DIR`` instead scores that run's checkpoint on the test day (``--checkpoint``,
``--data``, ``--max-rows``, ``--batch-size``, ``--eval-days``, ``--device`` and
``--kernels`` as for ``dlrmflow evaluate``).

torchrun starts this on every rank (``dlrmflow train --nproc N``, with ``--nnodes`` and
``--node-rank`` on many hosts, starts it through ``dlrmflow.train.launch.agent``). Rank 0 prints
the metrics records. A rank dies with the agent that started it and keeps a heartbeat for
the launcher's watchdog (``dlrmflow.supervise``).
Started by hand (``torchrun ... -m dlrmflow.train``), a rank resolves its configuration as
the CLI does: the file, then ``DLRMFLOW_SECTION__KEY`` variables, then ``--set``. Started
by ``dlrmflow train`` it gets ``--resolved``: the launcher's ``config.json`` already holds
the environment, and a ``--set`` that overrode a variable there must not be undone here.
"""

from __future__ import annotations

from dlrmflow import supervise

if __name__ == "__main__":
    # First, before the imports below take seconds: a rank dies with its agent.
    supervise.join_job()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from typing import NoReturn  # noqa: E402

from dlrmflow.config import ConfigError, load_config  # noqa: E402
from dlrmflow.runtime.glibc_malloc import tune_allocator  # noqa: E402
from dlrmflow.train.run.evaluate import evaluate  # noqa: E402
from dlrmflow.train.run.trainer import train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrmflow.train", description=__doc__)
    parser.add_argument("--config", help="run configuration file (YAML, JSON or TOML)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="KEY=VALUE override"
    )
    parser.add_argument(
        "--resolved",
        action="store_true",
        help="--config is a resolved configuration: ignore DLRMFLOW_* variables",
    )
    parser.add_argument("--evaluate", metavar="RUN_DIR", help="score this run's checkpoint")
    parser.add_argument("--checkpoint", help="with --evaluate: a checkpoint directory")
    parser.add_argument("--data", help="with --evaluate: the dataset URL")
    parser.add_argument("--max-rows", type=int, help="with --evaluate: rows to score at most")
    parser.add_argument("--batch-size", type=int, help="with --evaluate: each rank's batch")
    parser.add_argument("--eval-days", help="with --evaluate: the days, as data.eval_days")
    parser.add_argument("--device", default="auto", help="with --evaluate: auto, cpu or cuda")
    parser.add_argument("--kernels", default="auto", help="with --evaluate: as model.kernels")
    parser.add_argument(
        "--recalibrate", type=float, help="with --evaluate: fit a recalibration on this share"
    )
    parser.add_argument(
        "--recalibrate-rows", default="spread", help="with --recalibrate: which rows fit it"
    )
    args = parser.parse_args(argv)
    try:
        tune_allocator()
    except ValueError as e:
        _print_error(e)
        return 1
    if args.evaluate is not None:
        return _run(
            lambda: evaluate(
                args.evaluate,
                data_url=args.data,
                checkpoint=args.checkpoint,
                max_rows=args.max_rows,
                batch_size=args.batch_size,
                eval_days=args.eval_days,
                device=args.device,
                kernels=args.kernels,
                recalibrate=args.recalibrate,
                recalibrate_rows=args.recalibrate_rows,
            )
        )
    try:
        config = load_config(args.config, args.overrides, env=not args.resolved)
    except ConfigError as e:
        _print_error(e)
        return 1

    def show(record: dict) -> None:
        print("metrics " + json.dumps(record), flush=True)

    return _run(lambda: train(config, progress=show).to_dict())


def _print_error(error: BaseException) -> None:
    """One line naming the rank and the cause, which the launcher reports (``error: rank N:
    Type: message``, the message's lines joined)."""
    rank = os.environ.get("RANK", "0")
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    print(f"error: rank {rank}: {type(error).__name__}: {text}", file=sys.stderr, flush=True)


def _run(stage) -> int:
    """Run a stage; rank 0 prints its result as one ``result`` line for the launcher."""
    try:
        result = stage()
    except Exception as e:
        # The traceback only with DLRMFLOW_DEBUG=1.
        if os.environ.get("DLRMFLOW_DEBUG"):
            raise
        _print_error(e)
        return 1
    if os.environ.get("RANK", "0") == "0":
        print("result " + json.dumps(result), flush=True)
    return 0


def _main_of_rank() -> NoReturn:
    """``main`` on a rank of a multi-rank job, which ends without Python's teardown (see
    ``exit_without_teardown``), whatever ``main`` raised (with ``DLRMFLOW_DEBUG``)."""
    from dlrmflow.runtime.teardown import exit_without_teardown

    try:
        code = main()
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)


if __name__ == "__main__":
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _main_of_rank()
    sys.exit(main())

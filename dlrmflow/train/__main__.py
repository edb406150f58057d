"""``python -m dlrmflow.train --config FILE [--set KEY=VALUE ...]``: one rank of a job.

torchrun starts this on every rank (``dlrmflow train --nproc N`` does it for one host; the
README shows ``torchrun --nnodes ...`` for many). Rank 0 prints the metrics records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dlrmflow.config import ConfigError, load_config
from dlrmflow.train.trainer import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrmflow.train", description=__doc__)
    parser.add_argument("--config", help="run configuration file (YAML, JSON or TOML)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="KEY=VALUE override"
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def show(record: dict) -> None:
        print("metrics " + json.dumps(record), flush=True)

    rank = os.environ.get("RANK", "0")
    try:
        result = train(config, progress=show)
    except Exception as e:
        # One line naming the rank and the cause, which the launcher reports; the traceback
        # only with DLRMFLOW_DEBUG=1.
        if os.environ.get("DLRMFLOW_DEBUG"):
            raise
        print(f"error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    if rank == "0":
        print("result " + json.dumps(result.to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m dlrmflow.train.launch.agent TORCHRUN-ARGS``: torchrun (``torch.distributed.run``),
the agent process of a job on one host, whose failures come out as one line each.

``dlrmflow.train.launch.job`` starts it. When ranks fail, it prints one ``failures`` JSON line
in place of torchrun's report and traceback; when a job of several hosts cannot start, one
``startup-failed`` line (``multihost.StartupFailed``). It imports torch's launcher alone,
not the trainer its ranks run: an agent starts in a second where the trainer takes several,
once per host and job.

It dies with the launcher: the kernel sends it SIGTERM when the launcher dies, even by
SIGKILL, and torchrun then stops its ranks and waits for them before it exits; each rank
in turn dies with it (``dlrmflow.supervise``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback

FAILURES = "failures "  # the prefix of the agent's line about failed ranks
STARTUP_FAILED = "startup-failed "  # the prefix of the agent's line when a job cannot start


class _StoppedRanks(logging.Filter):
    """Notes the ranks torchrun stops itself once another failed (and keeps torchrun's
    lines about them out of the output unless ``DLRMFLOW_DEBUG`` is set).

    torchrun's agent logs "Sending process PID closing signal SIG" for each one; its
    failure records alone cannot tell them from a rank killed by someone else.
    """

    STOPPING = "Sending process %s closing signal %s"
    FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"

    def __init__(self) -> None:
        super().__init__()
        self.pids: set[int] = set()
        self.quiet = not os.environ.get("DLRMFLOW_DEBUG")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == self.STOPPING and record.args:
            self.pids.add(int(record.args[0]))  # type: ignore[index]
            return not self.quiet
        return not (self.quiet and record.msg == self.FAILED)


def torchrun_main(argv: list[str]) -> int:
    """torchrun (``torch.distributed.run``) with ``argv``. When ranks fail, it prints one
    ``failures`` JSON line instead of torchrun's report and traceback: each failed rank's
    exit code, signal name (killed by one) and whether torchrun stopped it because another
    rank had failed; when a job of several hosts cannot start, one ``startup-failed`` line.
    Returns the exit code: 0, or 1 when ranks failed or the job could not start."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from dlrmflow.train.launch.multihost import (
        BACKEND,
        StartupFailed,
        job_identity,
        register_rendezvous,
    )

    stopped = _StoppedRanks()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(stopped)
    args = parse_args(argv)
    if args.rdzv_backend == BACKEND:  # c10d with the start-up checks, for this job
        register_rendezvous(job_identity(args.training_script_args))
    try:
        run(args)
    except StartupFailed as e:
        if os.environ.get("DLRMFLOW_DEBUG"):
            traceback.print_exc()
        print(STARTUP_FAILED + " ".join(str(e).split()), flush=True)
        return 1
    except ChildFailedError as e:
        failures = {
            rank: {
                "exitcode": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "stopped": f.pid in stopped.pids,
            }
            for rank, f in e.failures.items()  # the ranks torchrun saw fail first come first
        }
        print(FAILURES + json.dumps(failures), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    import signal

    from dlrmflow.supervise import PARENT_ENV, die_with_parent

    die_with_parent(signal.SIGTERM)
    os.environ[PARENT_ENV] = str(os.getpid())  # the parent the ranks must not outlive
    sys.exit(torchrun_main(sys.argv[1:]))

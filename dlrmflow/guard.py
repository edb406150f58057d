"""Nothing a command started outlives it, even when it is killed with SIGKILL.

A command starts processes it does not control: Prefect's local API server (uvicorn),
Dask's scheduler and workers, Prefect's flow-run subprocesses. They stop when the command
exits normally (their owners' ``atexit`` hooks and ``finally`` blocks), but a command
killed by SIGKILL, or by a signal it does not handle, runs none of that, and they are
left running, holding ports, databases and memory.

So every ``dlrmflow`` command marks its environment with a token of its own
(``COMMAND_ENV``, inherited by everything it starts, however deep) and starts a guard:
a small process in a session of its own that waits for the command to end (on a pidfd)
and then stops every process still carrying the token (SIGTERM, and SIGKILL after
``GRACE_S``). A normal exit ends the same way, after the
command's own clean-up has run, so the guard only ever finds what was left behind.
The job's own agent and ranks die with their parent by themselves (``train.supervise``);
the guard is for everything else.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

# The token every process started by a command carries in its environment.
COMMAND_ENV = "DLRMFLOW_COMMAND"
GRACE_S = 5.0  # from SIGTERM to SIGKILL for what a dead command left
LATE_S = 10.0  # how long SIGKILL keeps going for what was started while the rest stopped

# How long a command stopped by a signal may take to unwind before it is ended outright.
UNWIND_S = 10.0

_guard: subprocess.Popen | None = None
_token: str | None = None


def guard_descendants() -> None:
    """Mark this process's environment with a new token and start its guard (once per
    process: a second call while the guard runs does nothing)."""
    global _guard, _token
    if _guard is not None and _guard.poll() is None:
        return
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if k != COMMAND_ENV}
    try:
        _guard = subprocess.Popen(
            [sys.executable, "-m", "dlrmflow.guard", token, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C is the command's, not the guard's
        )
    except OSError:
        return  # no guard: the command still runs, as it did before there was one
    os.environ[COMMAND_ENV] = _token = token


def carrying(token: str) -> list[int]:
    """The live processes (other than this one) whose environment carries ``token``."""
    marker = f"{COMMAND_ENV}={token}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes():
                state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
                if state not in ("Z", "X"):
                    found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def sweep(token: str, grace_s: float = GRACE_S) -> list[int]:
    """Stop every process carrying ``token``: SIGCONT and SIGTERM, then SIGKILL what is
    left after ``grace_s``, and then whatever was started meanwhile (a rank an agent
    restarted as the others stopped), until none is left or ``LATE_S`` has passed.
    Returns the processes found first."""
    found = carrying(token)
    for pid in found:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    deadline = time.monotonic() + grace_s
    while (left := carrying(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    late_deadline = time.monotonic() + LATE_S
    while left:
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() >= late_deadline:
            break
        time.sleep(0.1)
        left = carrying(token)
    return found


class _Stop(BaseException):
    """Raised in the main thread by a stopping signal (a BaseException, as KeyboardInterrupt
    is: no ``except Exception`` on the way up takes it for an error)."""


@contextlib.contextmanager
def signals_end_the_command(command: str) -> Iterator[None]:
    """For the block (the whole command, in the main thread), SIGTERM, SIGINT and SIGHUP
    end the command in a bounded time, with one line and the shell's exit code for the
    signal (``JobStopped``).

    The signal first unwinds the block as Ctrl-C does, so that what the command started is
    stopped by its owners and its temporary files go. A library that catches such an
    interruption and goes on (a Prefect flow marks the task crashed and may run the next)
    cannot keep the command alive: after ``UNWIND_S``, or at a second signal, the command
    stops everything it started (``sweep``), says so in one line and exits. A job that
    handles the signals itself (``train.supervise``) does so inside the block. Outside the
    main thread, and for a signal this process ignores (``nohup``), nothing changes."""
    from dlrmflow.supervise import JobStopped, stop_on_signals

    got: list[int] = []

    def end_now(signum: int) -> None:
        print(f"error: {JobStopped(command, signum)}", file=sys.stderr, flush=True)
        if _token is not None:
            sweep(_token)
        os._exit(128 + signum)

    def on_signal(signum: int) -> None:
        if got:  # a second signal: no more waiting
            end_now(signum)
        got.append(signum)
        timer = threading.Timer(UNWIND_S, end_now, (signum,))
        timer.daemon = True
        timer.start()
        raise _Stop

    with stop_on_signals(on_signal):
        try:
            yield
        except BaseException:
            if got:  # whatever the interruption became on its way up
                raise JobStopped(command, got[0]) from None
            raise
    if got:  # caught on the way and the work went on to its end: still a stopped command
        raise JobStopped(command, got[0])


def _watch(token: str, parent: int) -> None:
    """The guard: wait for the ``parent`` process to end, then sweep what carries ``token``.

    It waits on a pidfd, which becomes readable when the whole process has exited: a
    parent-death signal would come when the thread that started the guard exits, and at
    a process's exit the guard can be handed to another of its dying threads first, so
    that the signal would arrive while the parent still looked alive."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is not for the guard
    try:
        watched: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):  # before Linux 5.3: poll the parent's pid
        watched = None
    if os.getppid() == parent:  # (else it died before it could be watched)
        if watched is not None:
            select.select([watched], [], [])
        else:
            while os.getppid() == parent:
                time.sleep(0.5)
    sweep(token)


if __name__ == "__main__":
    _watch(sys.argv[1], int(sys.argv[2]))

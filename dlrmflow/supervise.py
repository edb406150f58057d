"""Supervision of the processes a command starts: they die with it, and a stuck rank is found.

A ``--nproc`` job is a launcher agent (torchrun) and its ranks, each in a session of its
own so that the terminal's Ctrl-C reaches the command alone. Nothing of that ties them to
the command's life: killed, it would leave them training and writing into a run directory
whose lock it no longer holds. So:

- ``Job`` runs the agent and reads its output; a signal that stops the command (SIGTERM,
  SIGINT, SIGHUP, see ``stop_on_signals``) stops the job first: SIGTERM (and SIGCONT, for
  stopped processes) to the agent's and every rank's process group, SIGKILL after a grace
  period, and the command returns only once none of them is left. ``JobStopped`` then
  says which signal it was; the command exits 128 + its number.
- Each child asks the kernel to kill it when its parent dies (``die_with_parent``), even
  by SIGKILL: the agent gets SIGTERM (torchrun then stops its ranks and waits for them),
  a rank SIGKILL. The run directory's lock is inherited by the agent (see
  ``dlrmflow.train.run.rundir``), so a killed command's lock outlives it until the agent,
  which outlives its ranks, is gone.
- ``Watchdog`` finds a rank that makes no progress. The collective timeout
  (``distributed.timeout_s``) cannot be relied on: a rank blocked in a collective of a
  group created without it waits torch's default of 30 minutes, and a rank that is
  stopped (SIGSTOP), stuck in uninterruptible I/O or blocked outside any collective is
  timed out by nothing. A rank makes progress when its main thread fetches a training
  batch (``beat``, a counter in a file the launcher reads: never a thread that would
  beat on while the main thread is stuck), uses CPU (a tenth of a core or more) or reads
  or writes files; so start-up, planning, checkpoint writes and evaluation, which fetch
  no batch, count too. A rank stopped or in uninterruptible sleep without progress for
  ``timeout_s`` is stuck; so is the job once every rank has fetched a batch and none has
  made progress for ``timeout_s`` (a rank waiting for a busy peer is not stuck as long as
  the peer works). Polling every second, a stuck rank is named at most ``timeout_s`` +
  ``MARGIN_S`` seconds after its last progress, and the job is stopped.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from dlrmflow.errors import DlrmflowError
from dlrmflow.runtime.parent_death import signal_on_parent_death

# The pid of the process that started this one, which it must not outlive.
PARENT_ENV = "DLRMFLOW_SUPERVISOR_PID"
# The directory where each rank of a job keeps its heartbeat file ("rank-N").
HEARTBEAT_ENV = "DLRMFLOW_HEARTBEAT_DIR"

POLL_S = 1.0  # how often the watchdog looks at the ranks
# How late past ``timeout_s`` a stuck rank is named: two polls and the time a rank blocked
# behind the stuck one takes to stop (a step).
MARGIN_S = 5.0
GRACE_S = 10.0  # from SIGTERM to SIGKILL when a job is stopped
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_CPU_SHARE = 0.1  # of one core: less is a blocked rank's background threads polling
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible I/O",
    "T": "stopped",
    "t": "stopped by a debugger",
    "Z": "exited",
    "I": "idle",
}


class JobStopped(DlrmflowError):
    """The command was asked to stop by a signal and stopped its job; ``exit_code`` is the
    shell's for that signal (143 for SIGTERM, 130 for SIGINT)."""

    def __init__(self, what: str, signum: int) -> None:
        super().__init__(f"{what} stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


# --- in a child ---------------------------------------------------------------------------


def die_with_parent(sig: int, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies, as a child's
    first act. A parent that died before (its pid, ``parent`` or else ``PARENT_ENV``'s, is
    no longer the parent's) gets the same answer: the signal now. No-op where the kernel
    cannot be asked (``runtime.parent_death``). The kernel's "parent" is the thread that
    started this process: it must live as long as the child should."""
    if not signal_on_parent_death(sig):
        return
    expected = str(parent) if parent is not None else os.environ.get(PARENT_ENV, "")
    if expected.isdigit() and os.getppid() != int(expected):
        os.kill(os.getpid(), sig)
        os._exit(128 + int(sig))  # in case ``sig`` is handled or ignored


class _Heartbeat:
    """A rank's heartbeat file: its pid and how many batches its main thread fetched, in
    one fixed-size record rewritten in place (at most ten times a second)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.pid = os.getpid()
        self.count = 0
        self.written = 0.0
        self.write(time.monotonic())

    def write(self, now: float) -> None:
        os.pwrite(self.fd, f"{self.pid} {self.count}".ljust(47).encode() + b"\n", 0)
        self.written = now

    def beat(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.written >= 0.1 or self.count == 1:
            with contextlib.suppress(OSError):  # the launcher went away: nothing to tell
                self.write(now)


_heartbeat: _Heartbeat | None = None


def join_job(sig: int = signal.SIGKILL) -> None:
    """A rank's start: die with the agent (``sig`` when it dies), and start the heartbeat
    file the launcher watches (when it runs one, see ``HEARTBEAT_ENV``)."""
    global _heartbeat
    die_with_parent(sig)
    directory, rank = os.environ.get(HEARTBEAT_ENV), os.environ.get("RANK")
    if directory and rank is not None and _heartbeat is None:
        with contextlib.suppress(OSError):
            _heartbeat = _Heartbeat(Path(directory) / f"rank-{rank}")


def beat() -> None:
    """This rank's main thread made progress (it fetched a training batch)."""
    if _heartbeat is not None:
        _heartbeat.beat()


# --- in the launcher ----------------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    pid: int
    start: str  # the process's start time (/proc/PID/stat), against a reused pid
    count: int
    previous_count: int  # at the poll before
    cpu: int
    io: int
    polled: float
    progress: float  # when it last made progress (the launcher's monotonic clock)
    state: str = "R"
    previous_state: str = "R"
    alive: bool = True


def _proc_stat(pid: int) -> tuple[str, int, str] | None:
    """(state, CPU ticks, start time) of a process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], int(fields[11]) + int(fields[12]), fields[19]


_IO_FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes")


def _proc_io(pid: int) -> int:
    """Bytes a process read and wrote, through system calls and to storage (which moves
    during one long read or write too); 0 when unreadable."""
    try:
        lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(": ") for line in lines if ": " in line)
    return sum(int(values.get(field, 0)) for field in _IO_FIELDS)


def describe_state(state: str) -> str:
    return _STATES.get(state, state)


class Watchdog:
    """Watches a job's ranks through their heartbeat files in ``directory`` and /proc;
    ``poll()`` says when one is stuck (see the module's docstring)."""

    def __init__(
        self,
        directory: Path,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.timeout_s = timeout_s
        self.clock = clock
        self.ranks: dict[int, _Rank] = {}
        self.polled: float | None = None
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def pids(self) -> list[int]:
        return [r.pid for r in self.ranks.values() if r.alive]

    def _discover(self, now: float) -> None:
        for path in self.directory.glob("rank-*"):
            try:
                rank = int(path.name.removeprefix("rank-"))
                pid_text, count_text = path.read_text().split()[:2]
                pid, count = int(pid_text), int(count_text)
            except (OSError, ValueError):
                continue  # being written
            known = self.ranks.get(rank)
            if known is not None and known.pid == pid:
                known.previous_count, known.count = known.count, count
                continue
            stat = _proc_stat(pid)
            if stat is not None:
                state, cpu, start = stat
                self.ranks[rank] = _Rank(
                    rank, pid, start, count, count, cpu, _proc_io(pid), now, now, state, state
                )

    def poll(self) -> str | None:
        """Look at every rank; the message naming a stuck rank, else None."""
        now = self.clock()
        if self.polled is not None and now - self.polled > 3 * POLL_S + 2:
            # This process was not running (stopped, or starved): what happened meanwhile
            # was not watched, so nobody's progress is older than now.
            for r in self.ranks.values():
                r.progress = now
        self.polled = now
        self._discover(now)
        for r in self.ranks.values():
            if not r.alive:
                continue
            stat = _proc_stat(r.pid)
            if stat is None or stat[2] != r.start or stat[0] in "ZX":
                r.alive = False
                continue
            state, cpu, _ = stat
            io = _proc_io(r.pid)
            busy = (cpu - r.cpu) >= _CPU_SHARE * self.tick * max(now - r.polled, 1e-3)
            if busy or r.count != r.previous_count or io != r.io:
                r.progress = now
            r.cpu, r.io, r.polled = cpu, io, now
            r.previous_state, r.state = r.state, state
        return self._verdict(now)

    def _verdict(self, now: float) -> str | None:
        live = [r for r in self.ranks.values() if r.alive]
        for r in sorted(live, key=lambda r: r.rank):
            # Never a rank's ordinary state for long: stopped, or blocked in the kernel.
            odd = r.state in "TtD" and r.previous_state in "TtD"
            if odd and now - r.progress > self.timeout_s:
                return self._stuck(r, now)
        if not live or any(r.count == 0 for r in live):
            return None  # some rank is still starting: its peers may wait for it
        if all(now - r.progress > self.timeout_s for r in live):
            return self._stuck(self._culprit(live), now)
        return None

    @staticmethod
    def _culprit(ranks: Sequence[_Rank]) -> _Rank:
        """The rank the others wait for: a stopped one, else one blocked in the kernel,
        else the one that fetched the fewest batches, else the first to stop progressing."""
        return min(
            ranks,
            key=lambda r: (r.state not in "Tt", r.state != "D", r.count, r.progress, r.rank),
        )

    def _stuck(self, r: _Rank, now: float, waiter: int | None = None) -> str:
        idle = f"rank {r.rank} made no progress for {now - r.progress:.0f} s"
        state = f"state: {describe_state(r.state)}"
        limit = f"distributed.timeout_s is {self.timeout_s:g}"
        if waiter is None:
            return f"{idle} ({state}; {limit})"
        return f"{idle} ({state}) and rank {waiter} timed out waiting for it ({limit})"

    def blame(self, exclude: int) -> str | None:
        """When rank ``exclude`` reports a lost peer (its collective timed out): the other
        rank that has made no progress for about as long, if one has, else None."""
        now = self.clock()
        self.poll()
        waited = self.timeout_s - 2 * POLL_S
        stale = [
            r
            for r in self.ranks.values()
            if r.alive and r.rank != exclude and now - r.progress >= waited
        ]
        return self._stuck(self._culprit(stale), now, waiter=exclude) if stale else None


def children_of(pid: int) -> list[int]:
    """The child processes of ``pid`` (of all its threads); none once it is gone."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    return children


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)  # in case it left its group


class Job:
    """A launcher agent and its ranks, run in a session of their own with ``env``: their
    output line by line (``lines``), a stuck rank found (``verdict``), and a ``stop`` that
    leaves none of them behind.

    ``pass_fds`` stay open in the agent (the run directory's lock). The agent's ranks are
    whatever processes it starts; each runs in a session of its own (torchrun starts them
    so), so they are signalled one by one.
    """

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        *,
        heartbeats: Path,
        timeout_s: float,
        pass_fds: Sequence[int] = (),
        grace_s: float = GRACE_S,
    ) -> None:
        env = {**env, HEARTBEAT_ENV: str(heartbeats), PARENT_ENV: str(os.getpid())}
        self.watchdog = Watchdog(heartbeats, timeout_s)
        self.grace_s = grace_s
        self.verdict: str | None = None
        self.signum: int | None = None
        self._stopping_since: float | None = None
        self._killed = False
        self._known: dict[int, str] = {}  # pid -> start time, every process of the job seen
        self.proc = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
        self._remember([self.proc.pid])

    # Processes of the job --------------------------------------------------------------

    def _remember(self, pids: Sequence[int]) -> None:
        for pid in pids:
            if pid not in self._known:
                stat = _proc_stat(pid)
                if stat is not None:
                    self._known[pid] = stat[2]

    def _discover(self) -> None:
        agent = [self.proc.pid] if self.proc.poll() is None else []
        self._remember([*agent, *[c for a in agent for c in children_of(a)]])
        self._remember(self.watchdog.pids())

    def alive(self) -> list[int]:
        """The job's processes still running (zombies are gone)."""
        left = []
        for pid, start in self._known.items():
            stat = _proc_stat(pid)
            if stat is not None and stat[2] == start and stat[0] not in "ZX":
                left.append(pid)
        return left

    def _signal_all(self, sig: int) -> None:
        self._discover()
        for pid in self.alive():
            _signal_group(pid, sig)

    @property
    def stopping(self) -> bool:
        return self._stopping_since is not None

    def stop(self, signum: int | None = None) -> None:
        """Stop the job: SIGTERM now (with SIGCONT, so that a stopped process gets it),
        SIGKILL after the grace period (see ``lines``), or at once when asked twice.
        ``signum``: the signal the command got, if that is why."""
        # No lock: this runs in the thread that reads the output, or in a signal handler
        # that interrupts it.
        if signum is not None and self.signum is None:
            self.signum = signum
        if self._stopping_since is not None:
            if signum is not None:
                self.kill()
            return
        self._stopping_since = time.monotonic()
        self._signal_all(signal.SIGTERM)
        self._signal_all(signal.SIGCONT)

    def kill(self) -> None:
        self._killed = True
        self._signal_all(signal.SIGKILL)

    def _tend(self) -> None:
        """The periodic part of the loop: the watchdog, and SIGKILL once the grace is over."""
        self._discover()
        if not self.stopping and self.verdict is None:
            self.verdict = self.watchdog.poll()
            if self.verdict is not None:
                self.stop()
        since = self._stopping_since
        if since is not None and not self._killed and time.monotonic() - since > self.grace_s:
            self.kill()

    def blame(self, rank: int) -> None:
        """Rank ``rank`` lost a peer (its collective timed out): name the peer the watchdog
        saw stuck, if any, and stop the job (torchrun would give a stopped rank 30 s)."""
        if self.verdict is None and not self.stopping:
            self.verdict = self.watchdog.blame(rank)
            if self.verdict is not None:
                self.stop()

    # Output and end ----------------------------------------------------------------------

    def lines(self) -> Iterator[str]:
        """The job's output lines until every holder of its output is gone (or, once it is
        stopped and killed, a few seconds later: a process stuck in the kernel may not
        die), watching the ranks meanwhile."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pending = b""
        next_poll = time.monotonic() + POLL_S
        while True:
            now = time.monotonic()
            if now >= next_poll:
                self._tend()
                next_poll = now + POLL_S
            since = self._stopping_since
            if since is not None and now - since > self.grace_s + 5:
                break  # killed and still holding the output: stuck in the kernel
            ready, _, _ = select.select([fd], [], [], min(0.25, max(next_poll - now, 0)))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                yield raw.decode(errors="replace")
        if pending:
            yield pending.decode(errors="replace")

    def wait(self) -> int:
        """The agent's exit code, once no process of the job is left (bounded once the job
        is stopped: processes that outlive SIGKILL are left to the kernel)."""
        while self.proc.poll() is None:
            since = self._stopping_since
            if since is not None and time.monotonic() - since > self.grace_s + 5:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.25)
            self._tend()
        self.reap()
        code = self.proc.poll()
        return -signal.SIGKILL if code is None else code

    def reap(self) -> None:
        """Make sure no process of the job is left: those still there after the agent are
        stopped (SIGTERM, SIGKILL after the grace period)."""
        self._discover()
        if self.proc.poll() is None or self.alive():
            self.stop()
        deadline = time.monotonic() + self.grace_s + 5
        while time.monotonic() < deadline:
            if self.proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.1)
            if self.proc.poll() is not None and not self.alive():
                return
            since = self._stopping_since
            if since is not None and not self._killed and time.monotonic() - since > self.grace_s:
                self.kill()
            time.sleep(0.05)


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[int], None]) -> Iterator[None]:
    """For the block, SIGTERM, SIGINT and SIGHUP call ``stop(signum)`` instead of ending
    this process (in the main thread only: elsewhere signals cannot be handled). A signal
    this process ignores stays ignored (``nohup``, a background job's SIGINT)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        stop(signum)

    previous = {
        sig: signal.signal(sig, handler)
        for sig in STOP_SIGNALS
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class _Interrupted(BaseException):
    """Raised in the main thread by a stopping signal (a BaseException, like
    KeyboardInterrupt: no ``except Exception`` in between takes it for an error)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# Signals whose interruption waits for the end of a ``signals_deferred`` block (see there).
_deferred: list[int] = []
_deferring = [0]


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """For the block, a stopping signal's interruption (``interrupt_on_signals``) waits
    until the block ends, then is raised there. For C++ code that calls back into Python,
    such as ``torch.distributed.checkpoint`` writing through Python file objects: an
    exception raised by the handler inside such a callback cannot cross the C++ frames,
    and the process aborts (SIGABRT) instead of stopping in one line."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
        pending = _deferred[:] if not _deferring[0] else []
        if pending:
            _deferred.clear()  # raised once, here; the block's own error goes up instead
    if pending:
        raise _Interrupted(pending[0])


@contextlib.contextmanager
def interrupt_on_signals(what: str) -> Iterator[None]:
    """For the block (run in this process), SIGTERM, SIGINT and SIGHUP interrupt it as
    Ctrl-C does, and it ends in ``JobStopped``: one line, and the signal's exit code.
    Inside ``signals_deferred`` the interruption waits for that block's end."""
    raised: list[int] = []

    def stop(signum: int) -> None:
        if not raised:  # once: cleaning up is not interrupted again
            raised.append(signum)
            if _deferring[0]:
                _deferred.append(signum)
                return
            raise _Interrupted(signum)

    try:
        with stop_on_signals(stop):
            yield
    except BaseException:
        if raised:  # whatever the interruption became on its way up (a failed checkpoint)
            raise JobStopped(what, raised[0]) from None
        raise

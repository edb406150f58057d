"""Every process a command starts dies with it: SIGTERM and SIGINT stop a job in bounded
time with one line and the shell's exit code, SIGKILL to the command or to its launcher
agent leaves no rank behind (and the run directory locked until none is left), and a rank
that makes no progress is named within ``distributed.timeout_s`` plus a margin."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrmflow.supervise import MARGIN_S, Watchdog
from dlrmflow.train.run.rundir import LOCK_FILE
from tests.train.launch.processes import cmdline, job_processes

# It times waits and signals: run alone, after the rest of the suite (make test).
pytestmark = pytest.mark.serial

SETS = [
    "model.embedding_dim=8",
    "model.bottom_mlp=[16,8]",
    "model.top_mlp=[32]",
    "train.batch_size=512",
    "train.num_workers=0",
    "train.log_every=1",
    "train.checkpoint_every=4",
    "train.epochs=1000",
]


def _start(data: str, run_dir: Path, nproc: int, *extra: str) -> subprocess.Popen:
    """``dlrmflow train`` training for a long time, as a user would start it."""
    env = {k: v for k, v in os.environ.items() if k != "DLRMFLOW_HELD_RUN_DIRS"}
    sets = [*SETS, f"distributed.nproc={nproc}", *extra]
    args = ["train", "--data", data, "--run-dir", str(run_dir)]
    args += [a for s in sets for a in ("--set", s)]
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "dlrmflow"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # As from a terminal, even where the tests run in the background (SIGINT ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _ranks(run_dir: Path) -> dict[int, int]:
    """RANK -> pid of the job's ranks."""
    ranks = {}
    for pid in job_processes(run_dir):
        with contextlib.suppress(OSError):
            entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            env = dict(e.decode().partition("=")[::2] for e in entries if b"=" in e)
            if "RANK" in env:
                ranks[int(env["RANK"])] = pid
    return ranks


def _wait_for_training(cli: subprocess.Popen, run_dir: Path, nproc: int) -> None:
    """Until rank 0 has logged a step (with every rank started)."""
    deadline = time.monotonic() + 180
    while not ((run_dir / "metrics.jsonl").is_file() and len(_ranks(run_dir)) >= (nproc > 1) * 2):
        assert cli.poll() is None, cli.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.1)


def _cleanup(cli: subprocess.Popen, run_dir: Path) -> None:
    """Kill whatever a failed test left."""
    for pid in job_processes(run_dir):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if cli.poll() is None:
        cli.kill()
    cli.communicate()


def _lock_is_free(run_dir: Path) -> bool:
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _stop(cli: subprocess.Popen, run_dir: Path, how: signal.Signals, what: str) -> None:
    """Send ``how`` to the command: within a bounded time, it exits with the shell's code
    for the signal and one line saying so, and no process of the job is left."""
    job = job_processes(run_dir)
    sent = time.monotonic()
    cli.send_signal(how)
    _, err = cli.communicate(timeout=60)
    took = time.monotonic() - sent
    left = [pid for pid in job if pid in job_processes(run_dir)]
    assert cli.returncode == 128 + how, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == f"error: {what} stopped by {how.name}", err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert took < 30, took
    assert not left, f"processes of the job left behind: {left}"
    assert _lock_is_free(run_dir)


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_one_rank_run_with_one_line(
    tiny_dataset: str, tmp_path: Path, how: signal.Signals
) -> None:
    run_dir = tmp_path / "run"
    cli = _start(tiny_dataset, run_dir, 1)
    try:
        _wait_for_training(cli, run_dir, 1)
        _stop(cli, run_dir, how, "training")
    finally:
        _cleanup(cli, run_dir)


def test_sigterm_stops_a_job_and_a_rerun_resumes_at_once(tiny_dataset: str, tmp_path: Path):
    """Stopped, the job leaves nothing running and its checkpoints in place; the same
    command right away is accepted (no old writer is left) and continues from the newest
    one. (SIGINT reaches the same handler: the one-rank test sends both.)"""
    how = signal.SIGTERM
    run_dir = tmp_path / "run"
    cli = _start(tiny_dataset, run_dir, 2)
    try:
        deadline = time.monotonic() + 180
        while not list((run_dir / "checkpoints").glob("step_*")):
            assert cli.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.1)
        _stop(cli, run_dir, how, "training with 2 ranks")
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
        saved = max(int(p.name.removeprefix("step_")) for p in run_dir.glob("checkpoints/step_*"))
        again = _start(tiny_dataset, run_dir, 2, f"train.max_steps={steps[-1] + 2}")
        out, err = again.communicate(timeout=240)
    finally:
        _cleanup(cli, run_dir)
    assert again.returncode == 0, err[-3000:]
    result = json.loads(out)
    assert result["steps"] == steps[-1] + 2
    assert result["trained_steps"] == steps[-1] + 2 - saved
    assert not job_processes(run_dir)


def test_sigkill_to_the_command_leaves_no_rank_and_the_lock_held_until_none_is_left(
    tiny_dataset: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    cli = _start(tiny_dataset, run_dir, 2)
    try:
        _wait_for_training(cli, run_dir, 2)
        job = job_processes(run_dir)
        assert len(job) == 4  # the command, the agent, two ranks
        cli.kill()
        cli.wait()
        killed = time.monotonic()
        # Whenever the directory can be locked again, no process of the job is left.
        while not _lock_is_free(run_dir):
            assert time.monotonic() - killed < 45, "the job's processes outlived the command"
            time.sleep(0.02)
        left = job_processes(run_dir)
    finally:
        _cleanup(cli, run_dir)
    assert not left, f"the lock was released while {left} still ran"


def test_sigkill_to_the_agent_takes_the_ranks_down(tiny_dataset: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cli = _start(tiny_dataset, run_dir, 2)
    try:
        _wait_for_training(cli, run_dir, 2)
        [agent] = [p for p in job_processes(run_dir) if b"train.launch.agent" in cmdline(p)]
        os.kill(agent, signal.SIGKILL)
        _, err = cli.communicate(timeout=60)
        left = job_processes(run_dir)
    finally:
        _cleanup(cli, run_dir)
    assert cli.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == (
        "error: training with 2 ranks failed: the launcher agent was killed by SIGKILL"
    ), err[-3000:]
    assert not left


def test_a_stopped_rank_is_named_within_the_timeout(tiny_dataset: str, tmp_path: Path) -> None:
    """A rank stopped by SIGSTOP neither fails nor lets a collective time out (a group that
    waits 30 minutes, or a peer that waits outside any collective): the watchdog names it."""
    timeout_s = 5
    run_dir = tmp_path / "run"
    cli = _start(tiny_dataset, run_dir, 2, f"distributed.timeout_s={timeout_s}")
    try:
        _wait_for_training(cli, run_dir, 2)
        rank1 = _ranks(run_dir)[1]
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        # The bound: the timeout and the stated margin, and the grace a stopped job gets
        # to end (SIGTERM, then SIGKILL), with room for a loaded machine.
        _, err = cli.communicate(timeout=timeout_s + MARGIN_S + 45)
        took = time.monotonic() - stopped
        left = job_processes(run_dir)
    finally:
        _cleanup(cli, run_dir)
    assert cli.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith(
        "error: training with 2 ranks failed: rank 1 made no progress for "
    ), err[-3000:]
    # Named by the watchdog, or when rank 0's collective timed out waiting for it.
    assert "(state: stopped" in lines[-1] and "distributed.timeout_s is 5)" in lines[-1]
    assert "Traceback" not in err
    assert took < timeout_s + MARGIN_S + 30, took
    assert not left


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_watchdog_names_the_rank_the_others_wait_for(tmp_path: Path) -> None:
    """Two idle processes with heartbeat files, watched on a clock the test moves."""
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    sleepers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        deadline = time.monotonic() + 30
        while any(_proc_state(p.pid) != "S" for p in sleepers):  # started, and asleep
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for rank, (proc, count) in enumerate(zip(sleepers, (7, 6), strict=True)):
            (tmp_path / f"rank-{rank}").write_text(f"{proc.pid} {count}\n")
        clock = _Clock()
        watchdog = Watchdog(tmp_path, timeout_s=20, clock=clock)
        for _ in range(21):  # idle, but not for longer than the timeout
            assert watchdog.poll() is None
            clock.now += 1
        # Both idle for more than the timeout: rank 1 fetched fewer batches.
        clock.now += 1
        assert watchdog.poll() == (
            "rank 1 made no progress for 22 s (state: sleeping; distributed.timeout_s is 20)"
        )
        # A rank that fetches a batch is making progress; the job is not stuck.
        (tmp_path / "rank-1").write_text(f"{sleepers[1].pid} 8\n")
        clock.now += 1
        assert watchdog.poll() is None
        # A stopped rank is stuck by itself, whatever the others do.
        os.kill(sleepers[0].pid, signal.SIGSTOP)
        time.sleep(0.2)
        clock.now += 1
        assert watchdog.poll() is None  # (not stopped at two polls yet)
        clock.now += 1
        assert watchdog.poll() == (
            "rank 0 made no progress for 25 s (state: stopped; distributed.timeout_s is 20)"
        )
        # Time this process itself was not running for is not held against the ranks.
        clock.now += 600
        assert watchdog.poll() is None
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()


def test_a_signal_inside_a_checkpoint_write_stops_the_run_after_it() -> None:
    """torch's checkpoint writer calls back into Python from C++, where an exception
    raised by the handler aborts the process (SIGABRT, found when SIGTERM landed inside a
    write): inside ``signals_deferred`` the interruption waits for the block's end."""
    from dlrmflow.supervise import JobStopped, interrupt_on_signals, signals_deferred

    finished = []
    with pytest.raises(JobStopped) as stopped, interrupt_on_signals("training"):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here, and must not raise
            finished.append(True)
        finished.append(False)  # not reached: the interruption is raised at the end
    assert finished == [True]
    assert stopped.value.signum == signal.SIGTERM
    # Nothing is left pending for the next block.
    with signals_deferred():
        pass

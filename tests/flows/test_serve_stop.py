"""``dlrmflow serve`` stopped by a signal, as a terminal's Ctrl-C or a service manager stops
it: one line and the shell's exit code, whatever the runner is doing, and nothing it
started left running.

Prefect's runner replaces the command's SIGTERM handler when it starts; the command then
exited 0 in silence (or, as reported, with a traceback and 1). Each test runs
the command against the session's Prefect server and signals it once the runner polls for
runs: idle, or while a run it started is in flight (which the runner must cancel).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import pytest
from prefect.client.schemas.objects import Deployment, FlowRun
from prefect.exceptions import ObjectNotFound

from dlrmflow.config import build_config
from tests.conftest import TINY_DATA
from tests.flows.records import call_client
from tests.prefect_server import server_env, stop_process_group

# It times waits and signals: run alone, after the rest of the suite (make test).
pytestmark = pytest.mark.serial

WAIT_S = 180  # for serving to start, and for a run to start
STOP_S = 90  # for the command to end once signalled (the runner cancels its runs first)
MARK = "SERVE_STOP_TEST_MARK"  # inherited by everything the command starts

T = TypeVar("T")


class Serving:
    """``dlrmflow serve`` in a process of its own, with its output in files."""

    def __init__(self, root: Path, prefect_server: str) -> None:
        self.root, self.mark = root, uuid.uuid4().hex
        self.started = datetime.now(UTC)
        self.guard: set[int] = set()
        env = server_env(root / "prefect-home")
        env.update(PREFECT_API_URL=prefect_server, PREFECT_RUNNER_POLL_FREQUENCY="1")
        env[MARK] = self.mark
        with (root / "stdout").open("w") as out, (root / "stderr").open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dlrmflow", "serve"],
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
                # As from a terminal, even where the tests run in the background (SIGINT
                # ignored, which serve keeps ignored, as under nohup).
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )

    def wait(self, what: str, check: Callable[[], T | None]) -> T:
        """Poll ``check()`` until it returns something; fail if serving ended first."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            found = check()
            if found is not None:
                return found
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited with {self.proc.returncode} before {what}: {self.log}")
            time.sleep(0.3)
        pytest.fail(f"timed out waiting for {what}: {self.log}")

    def polling(self) -> Deployment:
        """The end_to_end deployment once this runner has started and polled for its runs
        (the UI's "Ready"): from then on Prefect's runner handles SIGTERM."""

        def polled() -> Deployment | None:
            try:
                deployment = call_client("read_deployment_by_name", "end_to_end/dlrmflow")
            except ObjectNotFound:
                return None
            last = deployment.last_polled
            return deployment if last is not None and last > self.started else None

        return self.wait("the runner to poll", polled)

    def stop(self, sig: signal.Signals) -> tuple[int, str]:
        """Send ``sig`` to the command alone; its exit code and stderr."""
        # Its guard (dlrmflow.guard) ends just after it, by design.
        self.guard = {pid for pid, command in self.left().items() if "dlrmflow.guard" in command}
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still running {STOP_S} s after {sig.name}: {self.log}")
        return code, (self.root / "stderr").read_text()

    def left(self) -> dict[int, str]:
        """The live processes the command started (its guard included): their command
        lines, by pid."""
        marker = f"{MARK}={self.mark}".encode() + b"\0"
        found = {}
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and marker in (entry / "environ").read_bytes():
                    state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
                    if state not in ("Z", "X"):
                        command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                        found[int(entry.name)] = command.decode(errors="replace")
            except (OSError, IndexError):
                continue
        return found

    def assert_nothing_left(self) -> None:
        """No process the command started outlives it, but for its guard, which ends
        right after it."""
        assert {pid: c for pid, c in self.left().items() if pid not in self.guard} == {}
        deadline = time.monotonic() + 15
        while self.left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.left() == {}

    @property
    def log(self) -> str:
        return "\n".join((self.root / name).read_text()[-3000:] for name in ("stdout", "stderr"))


@pytest.fixture
def serving(prefect_api: str, tmp_path: Path):
    serving = Serving(tmp_path, prefect_api)
    try:
        yield serving
    finally:
        stop_process_group(serving.proc)


def test_sigint_while_serving_ends_serve_in_one_line(serving):
    """Ctrl-C with no run in flight. (SIGTERM takes the same way, the runner stopped and
    the signal handed on, in the test below, with a run to cancel on the way.)"""
    serving.polling()
    assert serving.stop(signal.SIGINT) == (130, "error: dlrmflow serve stopped by SIGINT\n")
    serving.assert_nothing_left()


def test_sigterm_during_a_run_cancels_it_and_ends_serve_in_one_line(serving, tmp_path):
    deployment = serving.polling()
    config = build_config(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"url": str(tmp_path / "data"), **TINY_DATA, "rows_per_day": 2000},
            "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32]},
            "train": {"batch_size": 512, "num_workers": 0, "max_steps": 6},
        }
    )
    run = call_client(
        "create_flow_run_from_deployment",
        deployment.id,
        parameters={"config": config.model_dump(mode="json")},
    )

    def running() -> FlowRun | None:
        found = call_client("read_flow_run", run.id)
        assert not found.state.is_final(), found.state
        return found if found.state.is_running() else None

    serving.wait("the run to start", running)
    assert serving.stop(signal.SIGTERM) == (143, "error: dlrmflow serve stopped by SIGTERM\n")
    serving.assert_nothing_left()
    state = call_client("read_flow_run", run.id).state
    assert state.is_cancelled(), state  # stopped by the runner, not left to the guard

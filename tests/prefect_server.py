"""One real Prefect server for the tests (a plugin of tests/conftest.py): started once on a
free port with its own PREFECT_HOME, and always stopped, also when a test fails or the
session is interrupted.

A real server rather than Prefect's test harness: the served-deployment tests need one that
another process (the runner) can reach, and starting one costs no more than the harness.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrmflow.supervise import die_with_parent

SERVER_START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(home: Path) -> dict[str, str]:
    """The environment of a server (and of processes it should not share settings with)."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Schedule runs within a second of a deployment's creation (default: every 60 s).
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
    }
    env.pop("PREFECT_API_URL", None)
    return env


def dies_with_this_process() -> object:
    """A ``preexec_fn`` that has the kernel stop the child (SIGTERM) when the test process
    dies, so a server outlives no pytest, even one killed with SIGKILL."""
    parent = os.getpid()
    return lambda: die_with_parent(signal.SIGTERM, parent)


def stop_process_group(
    proc: subprocess.Popen,
    timeout: float = 15,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL),
) -> None:
    """Signal the process group ``proc`` leads (it and every child) with each of ``signals``
    in turn, waiting ``timeout`` seconds after each: SIGTERM, then SIGKILL if it lingers.
    A Prefect worker wants SIGTERM then SIGINT."""
    if proc.poll() is not None:
        return
    for sig in signals:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:]
            pytest.fail(f"prefect server exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    tail = log.read_text()[-3000:]
    pytest.fail(f"prefect server not healthy after {SERVER_START_TIMEOUT_S} s:\n{tail}")


def migrated_database(cache_dir: Path) -> Path:
    """An empty Prefect database with every migration applied, made once per Prefect
    version and copied for each session: migrations are most of a cold server start (8 of
    12 s here). Made in a scratch folder and renamed, so concurrent sessions never share a
    half-migrated file."""
    import prefect

    template = cache_dir / f"prefect-{prefect.__version__}.db"
    if not template.is_file():
        scratch = Path(tempfile.mkdtemp(dir=cache_dir))
        try:
            subprocess.run(
                [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                env=server_env(scratch),
                check=True,
                capture_output=True,
                timeout=SERVER_START_TIMEOUT_S,
            )
            os.replace(scratch / "prefect.db", template)
        finally:
            shutil.rmtree(scratch)
    return template


def new_prefect_home(path: Path, config: pytest.Config) -> Path:
    """A PREFECT_HOME at ``path`` whose database is already migrated."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(migrated_database(config.cache.mkdir("prefect-server")), path / "prefect.db")
    return path


@pytest.fixture(scope="session")
def prefect_server(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[str]:
    """The API URL of a Prefect server running for this test session."""
    home = new_prefect_home(tmp_path_factory.mktemp("prefect-server"), pytestconfig)
    port = free_port()
    log = home / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(port), "--analytics-off"],
            env=server_env(home),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=dies_with_this_process(),
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/api"
        _wait_healthy(url, proc, log)
        yield url
    finally:
        stop_process_group(proc)


@pytest.fixture
def prefect_api(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Flows called in this process report to the session's server; cached task results
    go to a session folder rather than the shared PREFECT_HOME."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    storage = tmp_path_factory.getbasetemp() / "prefect-results"
    with temporary_settings({PREFECT_API_URL: prefect_server, PREFECT_LOCAL_STORAGE_PATH: storage}):
        yield prefect_server
        # Send the buffered run logs and events while the server is up; left for exit,
        # they would retry against a stopped server for over a minute.
        APILogWorker.drain_all()
        EventsWorker.drain_all()
